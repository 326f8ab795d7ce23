"""The orchestration log's durable copy: an append-only SQLite table.

Every entry the core emits is appended here before it is published, with a
sequence number the database assigns. Triggers make the table append-only:
an UPDATE or DELETE aborts. WAL mode lets ``mesh log`` read while the
manager writes. PostgreSQL takes this role when several managers share a
ledger (see the admission issue).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Protocol

import orjson

from mesh import sqlite_wal
from mesh.errors import StoreError
from mesh.wire.events import OrchestrationEvent

_SCHEMA = """
CREATE TABLE IF NOT EXISTS orchestration_log (
    seq        INTEGER PRIMARY KEY, -- never reused: rows are never deleted (the triggers)
    at         REAL    NOT NULL,
    kind       TEXT    NOT NULL,
    agent_id   TEXT    NOT NULL DEFAULT '',
    from_state TEXT,
    to_state   TEXT,
    capability TEXT,
    reason     TEXT    NOT NULL DEFAULT '',
    detail     TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS orchestration_log_agent ON orchestration_log (agent_id, seq);
CREATE TRIGGER IF NOT EXISTS orchestration_log_no_update BEFORE UPDATE ON orchestration_log
BEGIN SELECT RAISE(ABORT, 'the orchestration log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS orchestration_log_no_delete BEFORE DELETE ON orchestration_log
BEGIN SELECT RAISE(ABORT, 'the orchestration log is append-only'); END;
"""

_COLUMNS = "seq, at, kind, agent_id, from_state, to_state, capability, reason, detail"


class Journal(Protocol):
    def append_many(self, events: Iterable[OrchestrationEvent]) -> list[OrchestrationEvent]: ...
    def tail(self, limit: int = 50, *, agent_id: str | None = None) -> list[OrchestrationEvent]: ...
    def maintain(self) -> None: ...
    def close(self) -> None: ...


class SqliteJournal:
    """Append-only orchestration log in one SQLite file (WAL)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            sqlite_wal.configure(self._db)
            self._db.executescript(_SCHEMA)
            self._checkpointer = sqlite_wal.WalCheckpointer(path)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the journal at {path}: {exc}") from exc

    def append_many(self, events: Iterable[OrchestrationEvent]) -> list[OrchestrationEvent]:
        """Append in one transaction; returns the events with their sequence numbers."""
        stored = []
        try:
            with self._transaction():
                for ev in events:
                    cur = self._db.execute(
                        "INSERT INTO orchestration_log (at, kind, agent_id, from_state, to_state,"
                        " capability, reason, detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            ev.at,
                            ev.kind,
                            ev.agent_id,
                            ev.from_state,
                            ev.to_state,
                            ev.capability,
                            ev.reason,
                            orjson.dumps(ev.detail).decode(),
                        ),
                    )
                    stored.append(ev.model_copy(update={"seq": cur.lastrowid}))
        except sqlite3.Error as exc:
            raise StoreError(f"journal append failed: {exc}") from exc
        return stored

    def tail(self, limit: int = 50, *, agent_id: str | None = None) -> list[OrchestrationEvent]:
        """The last ``limit`` entries, oldest first."""
        return self.query(agent_id=agent_id or None, limit=limit)

    def query(
        self,
        *,
        agent_id: str | None = None,
        capability: str | None = None,
        kinds: Collection[str] = (),
        since: float | None = None,
        until: float | None = None,
        limit: int | None = 50,
    ) -> list[OrchestrationEvent]:
        """The last ``limit`` entries (``None``: all) that match every filter given, oldest
        first. ``agent_id=""`` selects the entries about no agent; ``kinds`` matches any of
        them; the time window is ``since <= at < until``.

        Parameterised SQL only. Newest first by ``seq`` with a ``LIMIT``, so SQLite walks the
        primary key (or ``orchestration_log_agent`` when ``agent_id`` is given) backwards and
        stops at the ``limit``-th match.
        """
        clauses: list[str] = []
        params: list[object] = []
        for clause, value in (
            ("agent_id = ?", agent_id),
            ("capability = ?", capability),
            ("at >= ?", since),
            ("at < ?", until),
        ):
            if value is not None:
                clauses.append(clause)
                params.append(value)
        if kinds:
            wanted = sorted(set(kinds))
            clauses.append(f"kind IN ({', '.join('?' * len(wanted))})")
            params += wanted
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT {_COLUMNS} FROM orchestration_log {where} ORDER BY seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        try:
            rows = self._db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"journal query failed: {exc}") from exc
        return [_row_to_event(row) for row in reversed(rows)]

    def count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM orchestration_log").fetchone()[0])

    def kinds_present(self, kinds: Collection[str]) -> set[str]:
        """Which of ``kinds`` the journal holds at least one entry of."""
        present = set()
        for kind in set(kinds):
            row = self._db.execute(
                "SELECT 1 FROM orchestration_log WHERE kind = ? LIMIT 1", (kind,)
            ).fetchone()
            if row is not None:
                present.add(kind)
        return present

    def maintain(self) -> None:
        """A PASSIVE WAL checkpoint off the commit path (:mod:`mesh.sqlite_wal`)."""
        self._checkpointer.run()

    def close(self) -> None:
        self._db.close()
        self._checkpointer.close()

    def _transaction(self) -> _Tx:
        return _Tx(self._db)


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _row_to_event(row: tuple[object, ...]) -> OrchestrationEvent:
    # As stored: a row another version of the manager wrote, whose kind or detail keys this
    # version does not know, is still read back (and shown by `mesh log`).
    fields = dict(zip(_COLUMNS.split(", "), row, strict=True))
    fields["detail"] = orjson.loads(str(fields["detail"]))
    return OrchestrationEvent.as_stored(fields)
