"""The shared ledger store: PostgreSQL, for several managers on one ledger.

Concurrency decision: **READ COMMITTED with row-level conditional writes**, not SERIALIZABLE.
Every decision in :mod:`mesh.ledger.store` is made by a single-row ``UPDATE … WHERE <condition>``
(or an ``INSERT … ON CONFLICT DO NOTHING``). Under READ COMMITTED, PostgreSQL locks the row,
and when another transaction changed it first, *re-evaluates the WHERE clause against the
committed new version* before writing. So of two managers racing for the last unit, the second
finds ``used + n <= capacity`` false and takes nothing; of a release and an expiry racing for
one reservation, the second finds the state or fence changed and does nothing. No read
outside such a statement feeds a decision, which is exactly the case where READ COMMITTED is
enough — and it needs no retry loop for serialization failures under contention.

Deadlocks are avoided by lock order: counters are always locked in the global
``(pool_id, resource)`` order; a transaction locks its reservation row before any counter;
the expiry sweep takes the due rows with ``FOR UPDATE SKIP LOCKED``, so it never waits on a
reservation a release (or another manager's sweep) is holding. Should PostgreSQL still report
a deadlock or a serialization failure (e.g. a server configured with another default
isolation), the transaction is retried from the start, at most ``max_attempts`` times in all.
A batch (group commit, ``SqlLedger.batch``) holds the counters of many admissions, taken in
arrival order, so two managers' batches *can* deadlock; PostgreSQL then aborts one of them,
which is not retried as a whole: it fails, and the admitter decides its requests again one
transaction each — where the lock order above holds.

Fences come from a SEQUENCE: strictly increasing across all managers; a rolled-back
``prepare`` leaves a gap, which is harmless. Tables live in their own schema (``schema=``), so
tests and deployments can keep ledgers apart; it is created idempotently under an advisory
lock, so managers starting together do not trip over each other's DDL.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Final, TypeVar

import psycopg
from psycopg import errors as pg_errors

from mesh.errors import LocalProtocolError, StoreError
from mesh.ledger.store import Db, SqlLedger, Tables

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SCHEMA: Final = "mesh_ledger"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)


def _ddl(s: str) -> list[str]:
    return [
        f'CREATE SCHEMA IF NOT EXISTS "{s}"',
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_capacity (
            pool_id  TEXT   NOT NULL,
            resource TEXT   NOT NULL,
            capacity BIGINT NOT NULL CHECK (capacity >= 0),
            used     BIGINT NOT NULL DEFAULT 0 CHECK (used >= 0),
            PRIMARY KEY (pool_id, resource))""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_reservation (
            admission_id TEXT   PRIMARY KEY,
            digest       TEXT   NOT NULL,
            pool_id      TEXT   NOT NULL,
            state        TEXT   NOT NULL
                         CHECK (state IN ('PREPARING', 'ACTIVE', 'RELEASED', 'EXPIRED')),
            fence        BIGINT NOT NULL UNIQUE,
            expires_at   DOUBLE PRECISION NOT NULL,
            created_at   DOUBLE PRECISION NOT NULL,
            updated_at   DOUBLE PRECISION NOT NULL,
            items        TEXT,
            epoch        BIGINT)""",
        # Schemas of an earlier version: their old reservations' items stay in ledger_item,
        # and their rows keep a NULL epoch ("not recorded").
        f'ALTER TABLE "{s}".ledger_reservation ADD COLUMN IF NOT EXISTS items TEXT',
        f'ALTER TABLE "{s}".ledger_reservation ADD COLUMN IF NOT EXISTS epoch BIGINT',
        f"""CREATE INDEX IF NOT EXISTS ledger_reservation_due
            ON "{s}".ledger_reservation (expires_at) WHERE state IN ('PREPARING', 'ACTIVE')""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_item (
            admission_id TEXT   NOT NULL REFERENCES "{s}".ledger_reservation (admission_id),
            pool_id      TEXT   NOT NULL,
            resource     TEXT   NOT NULL,
            amount       BIGINT NOT NULL CHECK (amount > 0),
            PRIMARY KEY (admission_id, pool_id, resource))""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_log (
            seq          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            at           DOUBLE PRECISION NOT NULL,
            admission_id TEXT   NOT NULL,
            event        TEXT   NOT NULL,
            state        TEXT   NOT NULL,
            fence        BIGINT NOT NULL)""",
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_log_append_only() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'the ledger log is append-only'; END $$""",
        f"""CREATE OR REPLACE TRIGGER ledger_log_append_only
            BEFORE UPDATE OR DELETE OR TRUNCATE ON "{s}".ledger_log
            FOR EACH STATEMENT EXECUTE FUNCTION "{s}".ledger_log_append_only()""",
        f'CREATE SEQUENCE IF NOT EXISTS "{s}".ledger_fence AS BIGINT',
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_descriptor (
            pool_id TEXT   PRIMARY KEY,
            epoch   BIGINT NOT NULL,
            body    TEXT   NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_decision (
            admission_id TEXT PRIMARY KEY,
            digest       TEXT NOT NULL,
            outcome      TEXT NOT NULL,
            decided_at   DOUBLE PRECISION NOT NULL,
            record       TEXT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_eligibility (
            ref  TEXT PRIMARY KEY,
            body TEXT NOT NULL)""",
    ]


@lru_cache(maxsize=256)
def _pyformat(sql: str) -> str:
    """The shared SQL's ``?`` placeholders as psycopg's ``%s``."""
    return sql.replace("?", "%s")


class _PgDb:
    def __init__(self, cur: psycopg.Cursor[tuple[Any, ...]]) -> None:
        self._cur = cur

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        self._cur.execute(_pyformat(sql), params or None)
        return self._cur.fetchall() if self._cur.description is not None else []

    def changed(self, sql: str, params: Sequence[object] = ()) -> int:
        self._cur.execute(_pyformat(sql), params or None)
        return self._cur.rowcount


class PostgresLedger(SqlLedger):
    """The ledger in PostgreSQL schema ``schema``; many processes may share it."""

    _due_lock_clause = " FOR UPDATE SKIP LOCKED"

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        application_name: str = "mesh-ledger",
        connect_timeout_s: int = 10,
        max_attempts: int = 3,
    ) -> None:
        if not _SCHEMA_NAME.fullmatch(schema):
            raise LocalProtocolError(f"schema must match {_SCHEMA_NAME.pattern}, got {schema!r}")
        if max_attempts < 1:
            raise LocalProtocolError(f"max_attempts must be at least 1, got {max_attempts}")
        super().__init__(
            Tables(
                capacity=f'"{schema}".ledger_capacity',
                reservation=f'"{schema}".ledger_reservation',
                item=f'"{schema}".ledger_item',
                log=f'"{schema}".ledger_log',
                descriptor=f'"{schema}".ledger_descriptor',
                decision=f'"{schema}".ledger_decision',
                eligibility=f'"{schema}".ledger_eligibility',
            )
        )
        self.schema = schema
        self._dsn = dsn
        self._connect_kwargs: dict[str, Any] = {
            "application_name": application_name,
            "connect_timeout": connect_timeout_s,
        }
        self._max_attempts = max_attempts
        self._fence_sql = f"SELECT nextval('\"{schema}\".ledger_fence')"
        self._fences_sql = f"SELECT nextval('\"{schema}\".ledger_fence') FROM generate_series(1, ?)"
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        with self._lock:
            self._transaction(self._create_schema, write=True)

    def _create_schema(self, db: Db) -> None:
        # Serialise concurrent first opens: CREATE … IF NOT EXISTS is not race-free.
        db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"mesh-ledger:{self.schema}",))
        for statement in _ddl(self.schema):
            db.execute(statement)

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                log.warning("reconnecting to the ledger database", extra={"schema": self.schema})
            self._conn = psycopg.connect(self._dsn, autocommit=True, **self._connect_kwargs)
            self._conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        return self._conn

    def _transaction(self, work: Callable[[Db], T], *, write: bool, retry: bool = True) -> T:
        attempts = self._max_attempts if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    return work(_PgDb(cur))
            except _RETRYABLE as exc:
                if attempt == attempts:
                    raise StoreError(
                        f"ledger transaction failed {attempt} times in schema {self.schema}: {exc}"
                    ) from exc
                log.info("retrying a ledger transaction: %s", exc, extra={"attempt": attempt})
            except psycopg.Error as exc:
                raise StoreError(
                    f"ledger transaction failed in schema {self.schema}: {exc}"
                ) from exc
        raise AssertionError("unreachable")

    def _next_fence(self, db: Db) -> int:
        ((fence,),) = db.execute(self._fence_sql)
        return int(fence)

    def _next_fences(self, db: Db, count: int) -> list[int]:
        rows = db.execute(self._fences_sql, (count,))
        return sorted(int(fence) for (fence,) in rows)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
