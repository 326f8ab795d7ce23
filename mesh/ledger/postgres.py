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

Round trips. On one host a round trip to PostgreSQL costs more than most statements do, so
the hot paths are one statement each: the admitter's batch reads its view with one statement
and sends all its writes as one call of the server-side function ``ledger_apply`` (which
takes the counters in the global order, raises a StaleView SQLSTATE if one moved, and
commits with the statement, so the batch needs no BEGIN or COMMIT: two round trips in all,
where it used to take about 24); the releases that come with a batch go in its write
statement instead (``ledger_release_apply``: one commit for both, where they used to cost a
statement and a commit of their own); a release is one call of ``ledger_release``, the
releases settled together without a batch one of ``ledger_release_many`` and an expiry sweep
one of ``ledger_expire``, each its own transaction.
See ``PostgresLedger.batch`` for why reading the view outside the transaction changes
nothing under READ COMMITTED. The
functions are created with CREATE OR REPLACE each time the store opens, so a schema made by
an earlier version gains them on its first open; tables and rows stay as they are.

Fences come from a SEQUENCE: strictly increasing across all managers; a fence drawn for a
view and not used, or rolled back, leaves a gap, which is harmless. Tables live in their own
schema (``schema=``), so tests and deployments can keep ledgers apart; it is created
idempotently under an advisory lock, so managers starting together do not trip over each
other's DDL.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors

from mesh.errors import LocalProtocolError, StaleView, StoreError
from mesh.ledger.model import (
    Activate,
    DecisionRow,
    LedgerOp,
    LedgerView,
    Refused,
    Release,
    Reservation,
    SetCapacity,
)
from mesh.ledger.pg_connection import PgConnection
from mesh.ledger.pg_schema import (
    _STALE_SQLSTATE,
    _ddl,
    _int_array,
    _pyformat,
    _row_json,
    _text_array,
)
from mesh.ledger.sql_apply import PendingRows, gather
from mesh.ledger.sql_rows import Db, Tables
from mesh.ledger.store import SqlLedger

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SCHEMA: Final = "mesh_ledger"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)


class _PgDb:
    def __init__(self, cur: psycopg.Cursor[tuple[Any, ...]]) -> None:
        self._cur = cur

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        self._cur.execute(_pyformat(sql), params or None)
        return self._cur.fetchall() if self._cur.description is not None else []

    def changed(self, sql: str, params: Sequence[object] = ()) -> int:
        self._cur.execute(_pyformat(sql), params or None)
        return self._cur.rowcount

    def changed_many(self, sql: str, rows: Sequence[Sequence[object]]) -> int:
        return sum(self.changed(sql, row) for row in rows)


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
        self._fences_sql = f"SELECT nextval('\"{schema}\".ledger_fence') FROM generate_series(1, ?)"
        self._pg = PgConnection(
            dsn, what=f"the ledger database (schema {schema})", on_open=_read_committed,
            **self._connect_kwargs,
        )  # fmt: skip
        self._lazy: _LazyBatch | None = None  # while a batch runs
        q = f'"{schema}"'
        self._apply_sql = f"SELECT {q}.ledger_apply(?::jsonb)"
        self._release_sql = f"SELECT {q}.ledger_release(?, ?, ?)"
        self._release_many_sql = f"SELECT {q}.ledger_release_many(?::text[], ?::bigint[], ?)"
        self._release_apply_sql = (
            f"SELECT {q}.ledger_release_apply(?::text[], ?::bigint[], ?, ?::jsonb)"
        )
        self._expire_sql = f"SELECT {q}.ledger_expire(?)"
        # LedgerView as one JSON array: [counters, reservations, decisions, fences, epochs]
        # (epochs as an object, pool → epoch). Each ID is looked up by a LATERAL subquery that
        # OFFSET 0 keeps from being flattened into a join: a cached generic plan is chosen
        # after a statement's first executions, and for ``admission_id = ANY(array)`` (or a
        # join) on a table still small then — a fresh ledger, before any ANALYZE — that plan
        # is a sequential scan, kept while the table grows (measured: 0.9 ms a batch at 1,800
        # reservations, and rising). A lookup per ID on the primary key is planned as an
        # index lookup whatever the table's size.
        self._view_sql = (
            "SELECT jsonb_build_array("
            f"(SELECT coalesce(jsonb_agg(jsonb_build_array(pool_id, resource, used, capacity)),"
            f" '[]') FROM {q}.ledger_capacity),"
            " (SELECT coalesce(jsonb_agg(r.j), '[]') FROM unnest(?::text[]) AS k(id),"
            f" LATERAL (SELECT {_row_json(schema, 'v')} AS j FROM {q}.ledger_reservation v"
            " WHERE v.admission_id = k.id OFFSET 0) AS r),"
            " (SELECT coalesce(jsonb_agg(d.j), '[]') FROM unnest(?::text[]) AS k(id),"
            " LATERAL (SELECT jsonb_build_array(admission_id, digest, outcome, decided_at,"
            f" record) AS j FROM {q}.ledger_decision WHERE admission_id = k.id OFFSET 0) AS d),"
            f" (SELECT coalesce(jsonb_agg(nextval('{q}.ledger_fence')), '[]')"
            " FROM generate_series(1, ?)),"
            " (SELECT coalesce(jsonb_object_agg(pool_id, epoch), '{}')"
            f" FROM {q}.ledger_descriptor))::text"
        )
        with self._lock:
            self._transaction(self._create_schema, write=True)

    def _create_schema(self, db: Db) -> None:
        # Serialise concurrent first opens: CREATE … IF NOT EXISTS is not race-free.
        db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"mesh-ledger:{self.schema}",))
        for statement in _ddl(self.schema):
            db.execute(statement)

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        return self._pg.get()

    def _transaction(self, work: Callable[[Db], T], *, write: bool, retry: bool = True) -> T:
        attempts = self._max_attempts if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    return work(_PgDb(cur))
            except _RETRYABLE as exc:
                self._failed(exc, attempt, attempts)
            except psycopg.Error as exc:
                raise self._error(exc) from exc
        raise AssertionError("unreachable")

    def _one_statement(self, sql: str, params: Sequence[object], *, retry: bool = True) -> Any:
        """Run one statement as a transaction of its own (autocommit: one round trip, no
        BEGIN or COMMIT; PostgreSQL runs a lone statement atomically) and return the first
        column of its one row. The caller holds ``self._lock``."""
        attempts = self._max_attempts if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                row = self._connection().execute(_pyformat(sql), params).fetchone()
            except _RETRYABLE as exc:
                self._failed(exc, attempt, attempts)
            except psycopg.Error as exc:
                raise self._error(exc) from exc
            else:
                return None if row is None else row[0]
        raise AssertionError("unreachable")

    def _failed(self, exc: psycopg.Error, attempt: int, attempts: int) -> None:
        """A deadlock or serialization failure: raise if that was the last attempt."""
        if attempt == attempts:
            raise StoreError(
                f"ledger transaction failed {attempt} times in schema {self.schema}: {exc}"
            ) from exc
        log.info("retrying a ledger transaction: %s", exc, extra={"attempt": attempt})

    def _error(self, exc: psycopg.Error) -> StoreError:
        if exc.sqlstate == _STALE_SQLSTATE:
            return StaleView(exc.diag.message_primary or str(exc))
        return StoreError(f"ledger transaction failed in schema {self.schema}: {exc}")

    # ---- the hot paths in one round trip each ----------------------------------------------
    # A batch (the admitter's: read the view, decide, apply) starts no
    # transaction of its own until a call needs one. Its view is read by one statement on its
    # own: under READ COMMITTED every statement of a transaction reads a fresh snapshot, and
    # a transaction that has written nothing holds no lock, so that read sees exactly what it
    # would have seen inside. Its writes, when they are one ``apply`` of fresh rows, wait for
    # the end of the batch and go as one statement, which commits them (atomically) in the
    # same round trip. So a batch of decisions costs two round trips: the view it is decided
    # from, and everything it writes. Any other call inside the batch begins the transaction
    # (BEGIN, then the writes waiting, then the call), as before; a failure rolls back all of
    # it. The errors of a waiting ``apply`` (StaleView, StoreError) are raised by ``batch``.
    def batch(self, work: Callable[[], T]) -> T:
        if self._in_a_batch():
            return work()  # already inside this thread's batch
        with self._lock:
            lazy = self._lazy = _LazyBatch(threading.get_ident())
            try:
                result = work()
                if lazy.transaction is not None:
                    lazy.transaction.close()  # COMMIT
                elif lazy.deferred is not None:
                    self._one_statement(self._apply_sql, (lazy.deferred,), retry=False)
                return result
            except BaseException as exc:
                if lazy.transaction is not None:
                    with contextlib.suppress(psycopg.Error):  # the connection may be gone
                        lazy.transaction.__exit__(*sys.exc_info())  # ROLLBACK (if not ended)
                if isinstance(exc, psycopg.Error):  # as SqlLedger's transactions report it
                    raise self._error(exc) from exc
                raise
            finally:
                self._lazy = None
                self._batch_db = self._batch_thread = None

    def _open_batch(self) -> Db | None:
        lazy = self._lazy
        if lazy is None or lazy.thread != threading.get_ident():
            return super()._open_batch()
        if lazy.closed:
            raise LocalProtocolError(_BATCH_CLOSED)
        if lazy.transaction is None:  # the batch's first call that needs its transaction
            # Kept before it is entered: whatever fails from here on, ``batch`` rolls it back.
            stack = lazy.transaction = contextlib.ExitStack()
            try:
                conn = self._connection()
                stack.enter_context(conn.transaction())
                db = _PgDb(stack.enter_context(conn.cursor()))
                self._batch_db, self._batch_thread = db, lazy.thread
                if lazy.deferred is not None:
                    payload, lazy.deferred = lazy.deferred, None
                    db.execute(self._apply_sql, (payload,))
            except psycopg.Error as exc:
                raise self._error(exc) from exc
        if self._batch_db is None:
            raise StoreError(f"a ledger batch failed to begin its transaction in {self.schema}")
        return self._batch_db

    def _in_a_batch(self) -> bool:
        """Whether this thread runs a batch (begun or not)."""
        lazy = self._lazy
        if lazy is not None and lazy.thread == threading.get_ident():
            return True
        return super()._open_batch() is not None

    def _lazy_unbegun(self) -> _LazyBatch | None:
        """This thread's batch, if it has not begun its transaction (it may have
        writes waiting). A batch closed by its releases takes no more calls."""
        lazy = self._lazy
        if lazy is None or lazy.thread != threading.get_ident():
            return None
        if lazy.closed:
            raise LocalProtocolError(_BATCH_CLOSED)
        return lazy if lazy.transaction is None else None

    def _not_begun(self) -> _LazyBatch | None:
        """This thread's batch, if it has neither begun its transaction nor writes waiting."""
        lazy = self._lazy_unbegun()
        return lazy if lazy is not None and lazy.deferred is None else None

    def read_for_decision(self, admission_ids: Sequence[str], fences: int) -> LedgerView:
        ids = _text_array(dict.fromkeys(admission_ids))
        params = (ids, ids, fences)
        if self._not_begun() is not None:
            view = self._one_statement(self._view_sql, params, retry=False)
        elif (db := self._open_batch()) is not None:
            view = self._in_batch(db, self._view_sql, params)
        else:
            with self._lock:
                view = self._one_statement(self._view_sql, params)
        counters, reservations, decisions, drawn, epochs = orjson.loads(view)
        return LedgerView(
            counters={(str(p), str(r)): (int(u), int(c)) for p, r, u, c in counters},
            reservations={r.admission_id: r for r in self._rows.with_items(None, reservations)},
            decisions={
                str(a): DecisionRow(str(a), str(d), str(o), float(at), str(rec))
                for a, d, o, at, rec in decisions
            },
            fences=tuple(sorted(int(f) for f in drawn)),
            epochs={str(p): int(e) for p, e in epochs.items()},
        )

    def apply(self, ops: Sequence[LedgerOp]) -> None:
        if not ops:
            return
        if any(isinstance(op, Release | Activate) for op in ops):
            super().apply(ops)  # each in its place, as SqlLedger does (an eviction's batch)
            return
        payload = _apply_payload(ops)
        lazy = self._not_begun()
        if lazy is not None:
            lazy.deferred = payload
        elif (db := self._open_batch()) is not None:
            self._in_batch(db, self._apply_sql, (payload,))
        else:
            with self._lock:
                self._one_statement(self._apply_sql, (payload,))

    def release(self, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        if self._in_a_batch():
            return super().release(admission_id, fence, now)
        with self._lock:
            row = self._one_statement(self._release_sql, (admission_id, fence, now))
            if row is None:
                return self._transaction(
                    lambda db: self._transitions.why_not(db, admission_id, fence, now, "release"),
                    write=False,
                )
        (released,) = self._rows.with_items(None, [orjson.loads(row)])
        return released

    def release_many(
        self, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        """One statement for all of them (``ledger_release_many``: a transaction of its own,
        one round trip, one commit); the reason a release was refused is read afterwards, for
        those alone, and each answers as ``release`` would have in the given order (the first
        of two equal releases releases, the second is told it is already released).

        As the last call of a batch that has not begun its transaction (the admitter's: read,
        decide, apply, then the releases that came with the batch), the batch's waiting
        writes go in the same statement (``ledger_release_apply``): one round trip and one
        commit for all of it. The batch takes no call after it."""
        lazy = self._lazy_unbegun()
        if lazy is not None and releases:
            payload, lazy.deferred, lazy.closed = lazy.deferred, None, True
            ids, fences = _text_array(a for a, _ in releases), _int_array(f for _, f in releases)
            if payload is None:
                rows = self._one_statement(self._release_many_sql, (ids, fences, now), retry=False)
            else:
                rows = self._one_statement(
                    self._release_apply_sql, (ids, fences, now, payload), retry=False
                )
            return self._release_answers(releases, rows, now)
        if len(releases) <= 1 or self._in_a_batch():
            return super().release_many(releases, now)  # one: release()'s own single statement
        ids, fences = _text_array(a for a, _ in releases), _int_array(f for _, f in releases)
        with self._lock:
            rows = self._one_statement(self._release_many_sql, (ids, fences, now))
            return self._release_answers(releases, rows, now)

    def _release_answers(
        self, releases: Sequence[tuple[str, int]], rows: str, now: float
    ) -> list[Reservation | Refused]:
        """Each release's answer from the rows ``ledger_release_many`` returned; the reason
        of each refused one read now (the caller holds ``self._lock``)."""
        released = {
            (r.admission_id, r.fence): r for r in self._rows.with_items(None, orjson.loads(rows))
        }
        answers = [released.pop(pair, None) for pair in releases]
        return [
            self._refusal_of_release(a, f, now) if answer is None else answer
            for (a, f), answer in zip(releases, answers, strict=True)
        ]

    def _refusal_of_release(self, admission_id: str, fence: int, now: float) -> Refused:
        return self._transaction(
            lambda db: self._transitions.why_not(db, admission_id, fence, now, "release"),
            write=False,
        )

    def _release(self, db: Db, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        ((row,),) = db.execute(self._release_sql, (admission_id, fence, now))
        if row is None:
            return self._transitions.why_not(db, admission_id, fence, now, "release")
        (released,) = self._rows.with_items(None, [orjson.loads(row)])
        return released

    def expire_due(self, now: float) -> list[Reservation]:
        if self._in_a_batch():
            return super().expire_due(now)
        with self._lock:
            rows = self._one_statement(self._expire_sql, (now,))
        return self._expired(orjson.loads(rows), now)

    def _expire_due(self, db: Db, now: float) -> list[Reservation]:
        ((rows,),) = db.execute(self._expire_sql, (now,))
        return self._expired(orjson.loads(rows), now)

    def _expired(self, rows: list[list[Any]], now: float) -> list[Reservation]:
        expired = self._rows.with_items(None, rows)
        if expired:
            log.info("expired %d reservations", len(expired), extra={"now": now})
        return expired

    def _in_batch(self, db: Db, sql: str, params: Sequence[object]) -> Any:
        try:
            rows = db.execute(sql, params)
        except psycopg.Error as exc:
            raise self._error(exc) from exc
        return rows[0][0] if rows else None

    def _next_fences(self, db: Db, count: int) -> list[int]:
        rows = db.execute(self._fences_sql, (count,))
        return sorted(int(fence) for (fence,) in rows)

    def close(self) -> None:
        with self._lock:
            self._pg.close()


_BATCH_CLOSED = (
    "this ledger batch committed its writes with its releases: release_many must be a batch's"
    " last call"
)


def _read_committed(conn: psycopg.Connection[tuple[Any, ...]]) -> None:
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED


@dataclass(slots=True)
class _LazyBatch:
    """A batch of PostgresLedger (see ``PostgresLedger.batch``)."""

    thread: int
    transaction: contextlib.ExitStack | None = None  # once begun: exits with COMMIT/ROLLBACK
    deferred: str | None = None  # an ``apply`` waiting for the batch's end (its payload)
    closed: bool = False  # its releases committed it (``release_many``, the last call)


def _apply_payload(ops: Sequence[LedgerOp]) -> str:
    """What ``ledger_apply`` writes for ``ops`` (no release or activation among them): the
    rows ``SqlLedger.apply`` would write, in the order it would write them."""
    rows = PendingRows()
    caps = []
    for op in ops:
        if not gather(rows, op) and isinstance(op, SetCapacity):
            caps.append((op.pool_id, op.resource, op.capacity))
    return orjson.dumps(
        {
            "caps": caps,
            "takes": [(p, r, n) for (p, r), n in sorted(rows.taken.items())],
            "res": rows.reservations,
            "log": rows.log,
            "snaps": sorted(rows.snapshots.items()),
            "decs": list(rows.recorded.values()),
        }
    ).decode()
