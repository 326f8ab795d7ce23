"""One long-lived PostgreSQL connection that is opened again when the server went away.

The ledger, the shard leases and the effect log each keep one autocommit connection per
process. After PostgreSQL restarted or failed over, that connection is dead, but psycopg only
learns so when a statement on it fails — so the first statement after every restart would fail,
a write among them with an outcome the caller cannot know. :func:`usable` learns it *before*
sending anything: an idle connection receives nothing unasked (no LISTEN on these), so a socket
that is readable while idle holds the server's goodbye (a FATAL message, or EOF after a crash);
reading it (``consume_input``) marks the connection bad, and :class:`PgConnection` opens a new
one, through every host of a multi-host URL (libpq's ``target_session_attrs`` picks the
primary). It costs one ``select`` with a zero timeout per use.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq

log = logging.getLogger(__name__)

Connection = psycopg.Connection[tuple[Any, ...]]


def usable(conn: Connection) -> bool:
    """Whether ``conn`` is open and the server has not said goodbye on it while it was idle."""
    if conn.closed or conn.broken:
        return False
    if conn.info.transaction_status is not pq.TransactionStatus.IDLE:
        return True  # inside a transaction: its own statements tell
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    if not readable:
        return True
    try:
        conn.pgconn.consume_input()  # the goodbye: a FATAL message, or EOF
    except psycopg.OperationalError:
        return False
    return conn.pgconn.status is pq.ConnStatus.OK


class PgConnection:
    """The connection to ``dsn`` (autocommit), opened on first use and whenever the last one
    is no longer :func:`usable`. Not thread-safe: its owner serialises its use."""

    def __init__(
        self,
        dsn: str,
        *,
        what: str,
        on_open: Callable[[Connection], None] | None = None,
        **connect_kwargs: Any,
    ) -> None:
        self._dsn = dsn
        self._what = what  # for the log: "the ledger database", "the shard lease table"
        self._on_open = on_open
        self._kwargs = connect_kwargs
        self._conn: Connection | None = None

    def get(self) -> Connection:
        if self._conn is not None and usable(self._conn):
            return self._conn
        if self._conn is not None:
            log.warning("reconnecting to %s", self._what)
            self._conn.close()
        self._conn = psycopg.connect(self._dsn, autocommit=True, **self._kwargs)
        if self._on_open is not None:
            self._on_open(self._conn)
        return self._conn

    @property
    def current(self) -> Connection | None:
        """The connection as it is now, without checking or opening it."""
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
