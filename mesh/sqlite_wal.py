"""SQLite in WAL mode, checkpointed off the commit path (the ledger's and the journal's).

By default SQLite copies the write-ahead log back into the database file when a commit finds
the WAL 1,000 pages long — on that commit's path, fsync included, so every few hundred writes
one of them (an admission, a journal entry) waits for a disk flush. Our stores raise that
threshold to a backstop (:data:`AUTOCHECKPOINT_PAGES`) and let the manager's tick call
:meth:`WalCheckpointer.run`: a PASSIVE checkpoint, which never waits for readers or writers,
on a connection of its own, so writes go on meanwhile — even from another thread.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mesh.errors import StoreError

AUTOCHECKPOINT_PAGES = 20_000
"""The backstop: a commit checkpoints itself only once the WAL is this long (~80 MB)."""
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024
"""After a checkpoint lets the WAL start over, its file is cut back to this size on disk."""


def configure(conn: sqlite3.Connection, synchronous: str = "NORMAL") -> None:
    """WAL, the given ``synchronous`` level, and checkpoints left to :class:`WalCheckpointer`."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")


class WalCheckpointer:
    """PASSIVE checkpoints of one database file, on a connection of their own."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._conn: sqlite3.Connection | None = None

    def run(self) -> None:
        if self.path == ":memory:":
            return
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False
                )
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"checkpoint of {self.path} failed: {exc}") from exc

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
