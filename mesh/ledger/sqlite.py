"""The embedded ledger store: one SQLite file in WAL mode.

Each write runs in ``BEGIN IMMEDIATE``: SQLite takes the database's single write lock at the
start of the transaction, so writers — threads or other processes on the same file — are
serialised for the whole read-check-write, and the conditional counters of
:mod:`mesh.ledger.store` cannot interleave. Waiting writers retry for ``busy_timeout_s``.
Reads use a deferred ``BEGIN`` and, thanks to WAL, never block the writer.

Fences come from a one-row counter (``ledger_fence``) incremented inside the same
transaction, so a rolled-back ``prepare`` leaves no gap (a ``prepare`` of a known ID skips
one). ``ledger_log`` is made append-only by triggers. The WAL is checkpointed by ``maintain``
(the manager's tick), not on the commit path of a decision. ``synchronous=NORMAL`` (the
default, as for the journal) keeps every committed decision across a crash of the process;
``synchronous="FULL"`` also survives power loss, at one fsync per commit.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from mesh.errors import StoreError
from mesh.ledger.store import Db, SqlLedger, Tables

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_capacity (
    pool_id  TEXT    NOT NULL,
    resource TEXT    NOT NULL,
    capacity INTEGER NOT NULL CHECK (capacity >= 0),
    used     INTEGER NOT NULL DEFAULT 0 CHECK (used >= 0),
    PRIMARY KEY (pool_id, resource)
);
CREATE TABLE IF NOT EXISTS ledger_reservation (
    admission_id TEXT    PRIMARY KEY,
    digest       TEXT    NOT NULL,
    pool_id      TEXT    NOT NULL,
    state        TEXT    NOT NULL
                 CHECK (state IN ('PREPARING', 'ACTIVE', 'RELEASED', 'EXPIRED')),
    fence        INTEGER NOT NULL UNIQUE,
    expires_at   REAL    NOT NULL,
    created_at   REAL    NOT NULL,
    updated_at   REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_reservation_due ON ledger_reservation (expires_at)
    WHERE state IN ('PREPARING', 'ACTIVE');
CREATE TABLE IF NOT EXISTS ledger_item (
    admission_id TEXT    NOT NULL REFERENCES ledger_reservation (admission_id),
    pool_id      TEXT    NOT NULL,
    resource     TEXT    NOT NULL,
    amount       INTEGER NOT NULL CHECK (amount > 0),
    PRIMARY KEY (admission_id, pool_id, resource)
);
CREATE TABLE IF NOT EXISTS ledger_log (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
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
);
CREATE TABLE IF NOT EXISTS ledger_decision (
    admission_id TEXT PRIMARY KEY,
    digest       TEXT NOT NULL,
    outcome      TEXT NOT NULL,
    decided_at   REAL NOT NULL,
    record       TEXT NOT NULL
);
"""

# SQLite checkpoints the WAL into the database file when a commit finds it this many pages long,
# on that commit's path (an fsync the admission waits for). The manager checkpoints on its tick
# instead (``maintain``); this is the backstop if nobody does.
_WAL_AUTOCHECKPOINT_PAGES = 20_000


class _SqliteDb:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()


class SqliteLedger(SqlLedger):
    """The ledger in one SQLite file (WAL); safe for threads and for processes on one host."""

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
            )
        )
        self.path = Path(path)
        self._checkpointer: sqlite3.Connection | None = None  # maintain's own connection
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={synchronous}")
            self._conn.execute(f"PRAGMA wal_autocheckpoint={_WAL_AUTOCHECKPOINT_PAGES}")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("BEGIN IMMEDIATE")
            for statement in _statements(_SCHEMA):
                self._conn.execute(statement)
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

    def _next_fence(self, db: Db) -> int:
        ((fence,),) = db.execute("UPDATE ledger_fence SET last = last + 1 RETURNING last")
        return int(fence)

    def maintain(self) -> None:
        """Copy the WAL back into the database file as far as no reader needs it (PASSIVE:
        never waits for readers or writers), so commits never pay for it. It runs on a
        connection of its own, so decisions go on meanwhile — even from another thread."""
        if str(self.path) == ":memory:":
            return
        try:
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(
                    str(self.path), isolation_level=None, check_same_thread=False
                )
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"ledger checkpoint failed on {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            if self._checkpointer is not None:
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
