"""The embedded ledger store: one SQLite file in WAL mode.

Each write runs in ``BEGIN IMMEDIATE``: SQLite takes the database's single write lock at the
start of the transaction, so writers — threads or other processes on the same file — are
serialised for the whole read-check-write, and the conditional counters of
:mod:`mesh.ledger.store` cannot interleave. Waiting writers retry for ``busy_timeout_s``.
Reads use a deferred ``BEGIN`` and, thanks to WAL, never block the writer.

Fences come from a one-row counter (``ledger_fence``) incremented inside the same
transaction (a batch's view draws a block with one statement); a fence drawn but not used —
one drawn for a request the batch refused or replayed — is a harmless gap.
``ledger_log`` is made append-only by triggers. The WAL is checkpointed by ``maintain`` (the
manager's tick), not on the commit path of a decision. ``synchronous=NORMAL`` (the
default, as for the journal) keeps every committed decision across a crash of the process;
``synchronous="FULL"`` also survives power loss, at one fsync per commit.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from mesh import sqlite_wal
from mesh.errors import StoreError
from mesh.ledger.sql_rows import Db, Tables
from mesh.ledger.store import SqlLedger

T = TypeVar("T")

# Every write touches as few b-tree pages as it can: each page a commit dirties is one more
# WAL frame written (two writes each), and that is most of a commit's cost. So:
# - Reservations and decisions — one row per admission, keyed by a producer-chosen ID — are
#   rowid tables with the ID as a UNIQUE key. New rows go at the end of the table (a rowid
#   table appends into a fresh page; a WITHOUT ROWID table would insert where the ID sorts,
#   splitting and redistributing a leaf among its siblings), and only the small key lands in
#   the ID's index. A decision row is several hundred bytes; in a WITHOUT ROWID table past
#   ~1,000 bytes it also spills into an overflow page. Measured (``bench/ledger_layout.py``):
#   16 admissions with random IDs dirty ~103 pages per commit as WITHOUT ROWID tables, ~43
#   as rowid tables (half the time a decision); with time-ordered IDs (what the SDK makes)
#   ~24 and ~21, the same time.
# - The small tables keyed by text (capacity, item, descriptor, eligibility) are WITHOUT
#   ROWID: the key *is* the row, no second b-tree.
# - The log's seq is a plain INTEGER PRIMARY KEY — rows are never deleted (the triggers), so a
#   seq is never reused and AUTOINCREMENT's extra bookkeeping row would buy nothing; fences
#   need no UNIQUE index: they come from the one counter row, inside the single writer's
#   transaction.
# A reservation's items are JSON in its own row (``items``), not rows of ``ledger_item``: one
# b-tree page fewer per admission. Files created by an earlier version keep their tables as
# they are (the SQL works on both layouts), gain the ``items`` column, and keep their old
# reservations' items in ``ledger_item`` (read for those rows only).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_capacity (
    pool_id  TEXT    NOT NULL,
    resource TEXT    NOT NULL,
    capacity INTEGER NOT NULL CHECK (capacity >= 0),
    used     INTEGER NOT NULL DEFAULT 0 CHECK (used >= 0),
    PRIMARY KEY (pool_id, resource)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ledger_reservation (
    admission_id TEXT    PRIMARY KEY,
    digest       TEXT    NOT NULL,
    pool_id      TEXT    NOT NULL,
    state        TEXT    NOT NULL
                 CHECK (state IN ('PREPARING', 'ACTIVE', 'RELEASED', 'EXPIRED')),
    fence        INTEGER NOT NULL,
    expires_at   REAL    NOT NULL,
    created_at   REAL    NOT NULL,
    updated_at   REAL    NOT NULL,
    items        TEXT,
    epoch        INTEGER
);
CREATE INDEX IF NOT EXISTS ledger_reservation_due ON ledger_reservation (expires_at)
    WHERE state IN ('PREPARING', 'ACTIVE');
CREATE TABLE IF NOT EXISTS ledger_item (
    admission_id TEXT    NOT NULL REFERENCES ledger_reservation (admission_id),
    pool_id      TEXT    NOT NULL,
    resource     TEXT    NOT NULL,
    amount       INTEGER NOT NULL CHECK (amount > 0),
    PRIMARY KEY (admission_id, pool_id, resource)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ledger_log (
    seq          INTEGER PRIMARY KEY,
    at           REAL    NOT NULL,
    admission_id TEXT    NOT NULL,
    event        TEXT    NOT NULL,
    state        TEXT    NOT NULL,
    fence        INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS ledger_log_no_update BEFORE UPDATE ON ledger_log
BEGIN SELECT RAISE(ABORT, 'the ledger log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS ledger_log_no_delete BEFORE DELETE ON ledger_log
BEGIN SELECT RAISE(ABORT, 'the ledger log is append-only'); END;
CREATE TABLE IF NOT EXISTS ledger_fence (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
);
INSERT OR IGNORE INTO ledger_fence (id, last) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS ledger_descriptor (
    pool_id TEXT    PRIMARY KEY,
    epoch   INTEGER NOT NULL,
    body    TEXT    NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ledger_decision (
    admission_id TEXT PRIMARY KEY,
    digest       TEXT NOT NULL,
    outcome      TEXT NOT NULL,
    decided_at   REAL NOT NULL,
    record       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_decision_deferred ON ledger_decision (decided_at)
    WHERE outcome = 'deferred';
CREATE TABLE IF NOT EXISTS ledger_eligibility (
    ref  TEXT PRIMARY KEY,
    body TEXT NOT NULL
) WITHOUT ROWID;
"""

EARLIER_ID_TABLES = """
CREATE TABLE ledger_reservation (
    admission_id TEXT PRIMARY KEY, digest TEXT NOT NULL, pool_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('PREPARING', 'ACTIVE', 'RELEASED', 'EXPIRED')),
    fence INTEGER NOT NULL, expires_at REAL NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, items TEXT
) WITHOUT ROWID;
CREATE TABLE ledger_decision (
    admission_id TEXT PRIMARY KEY, digest TEXT NOT NULL, outcome TEXT NOT NULL,
    decided_at REAL NOT NULL, record TEXT NOT NULL
) WITHOUT ROWID;
"""
"""The reservation and decision tables as files made before 2026-12-01 have them (WITHOUT
ROWID, keyed by the admission ID). Such files keep working as they are; this is kept to
make one, for the upgrade tests and ``bench/ledger_layout.py``."""


class _SqliteDb:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def changed(self, sql: str, params: Sequence[object] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def changed_many(self, sql: str, rows: Sequence[Sequence[object]]) -> int:
        return self._conn.executemany(sql, rows).rowcount if rows else 0


class SqliteLedger(SqlLedger):
    """The ledger in one SQLite file (WAL); safe for threads and for processes on one host."""

    _due_index_clause = " INDEXED BY ledger_reservation_due"

    def __init__(
        self,
        path: Path | str,
        *,
        busy_timeout_s: float = 30.0,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    ) -> None:
        super().__init__(
            Tables(
                "ledger_capacity",
                "ledger_reservation",
                "ledger_item",
                "ledger_log",
                "ledger_descriptor",
                "ledger_decision",
                "ledger_eligibility",
            )
        )
        self.path = Path(path)
        self._checkpointer = sqlite_wal.WalCheckpointer(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            sqlite_wal.configure(self._conn, synchronous)
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("BEGIN IMMEDIATE")
            for statement in _statements(_SCHEMA):
                self._conn.execute(statement)
            rows = self._conn.execute("PRAGMA table_info(ledger_reservation)").fetchall()
            columns = {row[1] for row in rows}
            if "items" not in columns:  # a file of an earlier version
                self._conn.execute("ALTER TABLE ledger_reservation ADD COLUMN items TEXT")
            if "epoch" not in columns:  # its rows keep a NULL epoch: "not recorded"
                self._conn.execute("ALTER TABLE ledger_reservation ADD COLUMN epoch INTEGER")
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the ledger at {path}: {exc}") from exc

    def _transaction(self, work: Callable[[Db], T], *, write: bool, retry: bool = True) -> T:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = work(_SqliteDb(conn))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise StoreError(f"ledger transaction failed on {self.path}: {exc}") from exc

    def _next_fences(self, db: Db, count: int) -> list[int]:
        # Two statements rather than one with RETURNING: measured no dearer, often cheaper.
        db.changed("UPDATE ledger_fence SET last = last + ?", (count,))
        ((last,),) = db.execute("SELECT last FROM ledger_fence")
        return list(range(int(last) - count + 1, int(last) + 1))

    def maintain(self) -> None:
        """A PASSIVE WAL checkpoint on a connection of its own (:mod:`mesh.sqlite_wal`)."""
        self._checkpointer.run()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            self._checkpointer.close()


def _statements(script: str) -> list[str]:
    """Split a DDL script into statements (triggers keep their ``BEGIN … END;`` bodies)."""
    statements, current = [], ""
    for line in script.strip().splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    return statements
