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

Fences come from a SEQUENCE: strictly increasing across all managers; a rolled-back
``prepare`` leaves a gap, which is harmless. Tables live in their own schema (``schema=``), so
tests and deployments can keep ledgers apart; it is created idempotently under an advisory
lock, so managers starting together do not trip over each other's DDL.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors

from mesh.errors import LocalProtocolError, StaleView, StoreError
from mesh.ledger.model import (
    TRANSITIONS,
    Activate,
    DecisionRow,
    LedgerEvent,
    LedgerOp,
    LedgerView,
    Refused,
    Release,
    Reservation,
    SetCapacity,
)
from mesh.ledger.pg_connection import PgConnection
from mesh.ledger.store import _HOLDING, Db, SqlLedger, Tables, _gather, _Plan

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SCHEMA: Final = "mesh_ledger"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
# Raised by the ledger's own functions (a class of SQLSTATE no PostgreSQL error uses):
_STALE_SQLSTATE: Final = "ML001"  # a batch's view no longer holds: StaleView
_SHORT_SQLSTATE: Final = "ML002"  # a counter holds less than is given back: StoreError


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
        # A restarted manager's admission lines are rebuilt from the recent deferrals.
        f"""CREATE INDEX IF NOT EXISTS ledger_decision_deferred
            ON "{s}".ledger_decision (decided_at) WHERE outcome = 'deferred'""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".ledger_eligibility (
            ref  TEXT PRIMARY KEY,
            body TEXT NOT NULL)""",
        *_functions(s),
    ]


# What a reservation row looks like when a function returns it: _RES_COLUMNS as a JSON array,
# with the items of a row written before the ``items`` column read from ledger_item.
def _row_json(s: str, r: str) -> str:
    return (
        f"jsonb_build_array({r}.admission_id, {r}.digest, {r}.pool_id, {r}.state, {r}.fence,"
        f" {r}.expires_at, {r}.created_at, {r}.updated_at, coalesce({r}.items,"
        f" (SELECT coalesce(jsonb_agg(jsonb_build_array(i.pool_id, i.resource, i.amount)"
        f" ORDER BY i.pool_id, i.resource), '[]')::text FROM \"{s}\".ledger_item i"
        f" WHERE i.admission_id = {r}.admission_id)), {r}.epoch)"
    )


def _functions(s: str) -> list[str]:
    """The server-side half of the hot paths, so that each is one statement (one round trip):
    a decided batch's writes, a release, the expiry sweep. Created with CREATE OR REPLACE on
    every open, so a schema of an earlier version gains them (and their newest body) the first
    time a manager of this version opens it; nothing else in the schema changes."""
    stale, short = _STALE_SQLSTATE, _SHORT_SQLSTATE
    released, expired = LedgerEvent.RELEASED, LedgerEvent.EXPIRED
    # Two parts of a decided batch's writes, shared by ledger_apply and ledger_release_apply:
    # the capacities it sets, then (after its counters) its fresh rows — reservations, log,
    # snapshots, decisions; a decision recorded meanwhile for another digest raises {stale}.
    caps_sql = f"""\
              FOR x IN SELECT e FROM jsonb_array_elements(p->'caps') WITH ORDINALITY AS t(e, n)
                        ORDER BY n LOOP
                INSERT INTO "{s}".ledger_capacity (pool_id, resource, capacity, used)
                VALUES (x->>0, x->>1, (x->>2)::bigint, 0)
                ON CONFLICT (pool_id, resource) DO UPDATE SET capacity = excluded.capacity;
              END LOOP;
"""
    rows_sql = f"""\
              INSERT INTO "{s}".ledger_reservation (admission_id, digest, pool_id, state, fence,
                  expires_at, created_at, updated_at, items, epoch)
              SELECT e->>0, e->>1, e->>2, e->>3, (e->>4)::bigint, (e->>5)::float8,
                     (e->>6)::float8, (e->>7)::float8, e->>8, (e->>9)::bigint
                FROM jsonb_array_elements(p->'res') WITH ORDINALITY AS t(e, n) ORDER BY n;
              INSERT INTO "{s}".ledger_log (at, admission_id, event, state, fence)
              SELECT (e->>0)::float8, e->>1, e->>2, e->>3, (e->>4)::bigint
                FROM jsonb_array_elements(p->'log') WITH ORDINALITY AS t(e, n) ORDER BY n;
              INSERT INTO "{s}".ledger_eligibility (ref, body)
              SELECT e->>0, e->>1
                FROM jsonb_array_elements(p->'snaps') WITH ORDINALITY AS t(e, n) ORDER BY n
              ON CONFLICT (ref) DO NOTHING;
              INSERT INTO "{s}".ledger_decision AS d
                  (admission_id, digest, outcome, decided_at, record)
              SELECT e->>0, e->>1, e->>2, (e->>3)::float8, e->>4
                FROM jsonb_array_elements(p->'decs') WITH ORDINALITY AS t(e, n) ORDER BY n
              ON CONFLICT (admission_id) DO UPDATE SET outcome = excluded.outcome,
                  decided_at = excluded.decided_at, record = excluded.record
               WHERE d.digest = excluded.digest;
              GET DIAGNOSTICS kept = ROW_COUNT;
              IF kept <> jsonb_array_length(p->'decs') THEN
                RAISE EXCEPTION USING ERRCODE = '{stale}', MESSAGE = 'a decision of this batch'
                  ' was recorded meanwhile for another digest (another manager); decide its'
                  ' calls again one by one';
              END IF;
"""

    def move_sql(moves: str) -> str:
        """Move the counters of ``moves`` (rows of pool, resource, take, give; a counter may
        come more than once): summed by counter and handed to ledger_move in the one global
        order. Needs ``v_pool text[]; v_res text[]; v_take bigint[]; v_give bigint[]``."""
        order = 'ORDER BY g.pool COLLATE "C", g.res COLLATE "C"'
        return f"""\
              SELECT array_agg(g.pool {order}), array_agg(g.res {order}),
                     array_agg(g.take {order}), array_agg(g.give {order})
                INTO v_pool, v_res, v_take, v_give
                FROM (SELECT k.pool, k.res, sum(k.take)::bigint AS take,
                             sum(k.give)::bigint AS give
                        FROM ({moves}) AS k(pool, res, take, give) GROUP BY 1, 2) AS g;
              PERFORM "{s}".ledger_move(v_pool, v_res, v_take, v_give);
"""

    takes = (  # a batch's takes, as move_sql reads them
        "SELECT e->>0, e->>1, (e->>2)::bigint, 0::bigint"
        " FROM jsonb_array_elements(p->'takes') AS t(e)"
    )
    return [
        # Every counter a write moves, as four arrays in the one global order — the
        # (pool_id, resource) order of Python's sorted(), which is byte order, COLLATE "C" —
        # with what each takes and gives back. Two statements however many there are (a loop
        # of one UPDATE each cost ~100 µs more for 16): the first locks them all in that
        # order (the LATERAL lookup runs row by row in ordinality order, FOR UPDATE each, so
        # two writers never lock two counters in opposite orders) and finds the first that
        # cannot move — {stale} if it takes (a counter moved under a batch), {short} if it
        # only gives back more than it holds; the second moves them all.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_move(p_pool text[], p_res text[],
                p_take bigint[], p_give bigint[]) RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE bad record;
            BEGIN
              IF coalesce(cardinality(p_pool), 0) = 0 THEN RETURN; END IF;
              SELECT k.pool, k.res, k.take, k.give INTO bad
                FROM unnest(p_pool, p_res, p_take, p_give) WITH ORDINALITY
                     AS k(pool, res, take, give, i)
                LEFT JOIN LATERAL (SELECT c.used, c.capacity FROM "{s}".ledger_capacity c
                                    WHERE c.pool_id = k.pool AND c.resource = k.res
                                   OFFSET 0 FOR UPDATE) AS l ON true
               WHERE NOT coalesce(l.used >= k.give AND l.used - k.give + k.take <= l.capacity,
                                  false)
               ORDER BY k.i LIMIT 1;
              IF FOUND AND bad.take > 0 THEN
                RAISE EXCEPTION USING ERRCODE = '{stale}', MESSAGE = 'a counter changed'
                  ' under a batch (another writer); decide its calls again one by one';
              ELSIF FOUND THEN
                RAISE EXCEPTION USING ERRCODE = '{short}',
                  MESSAGE = format('counter %s/%s holds less than %s', bad.pool, bad.res,
                                   bad.give);
              END IF;
              UPDATE "{s}".ledger_capacity AS c SET used = c.used + k.take - k.give
                FROM unnest(p_pool, p_res, p_take, p_give) AS k(pool, res, take, give)
               WHERE c.pool_id = k.pool AND c.resource = k.res;
            END $$""",
        # Give back items ([[pool, resource, amount], ...]): summed by counter, in the one
        # global order.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_give_back(p_items jsonb) RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE v_pool text[]; v_res text[]; v_take bigint[]; v_give bigint[];
            BEGIN
{
            move_sql(
                "SELECT e->>0, e->>1, 0::bigint, (e->>2)::bigint"
                " FROM jsonb_array_elements(p_items) AS t(e)"
            )
        }\
            END $$""",
        # Reservations just ended, as one tail of every set-based release and sweep: their
        # counters given back together, and one log row each, in the order of ``p_rows``
        # (the rows as JSON, their log event and the state it leads to).
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_settle(p_rows jsonb[], p_at float8,
                p_event text, p_state text) RETURNS void
            LANGUAGE plpgsql AS $$
            BEGIN
              PERFORM "{s}".ledger_give_back(coalesce(
                (SELECT jsonb_agg(i) FROM unnest(p_rows) AS t(e),
                   jsonb_array_elements((e->>8)::jsonb) AS x(i)), '[]'));
              INSERT INTO "{s}".ledger_log (at, admission_id, event, state, fence)
              SELECT p_at, e->>0, p_event, p_state, (e->>4)::bigint
                FROM unnest(p_rows) WITH ORDINALITY AS t(e, n) ORDER BY n;
            END $$""",
        # A decided batch's fresh rows (SqlLedger._flush_plan, as one call): capacities set,
        # counters taken by conditional increments in the given (global) order, reservations,
        # log, snapshots, decisions. A counter that moved, or a decision recorded meanwhile
        # for another digest, raises {stale}: the statement, hence the batch, keeps nothing.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_apply(p jsonb) RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE x jsonb; kept bigint;
                    v_pool text[]; v_res text[]; v_take bigint[]; v_give bigint[];
            BEGIN
{caps_sql}
{move_sql(takes)}\
{rows_sql}
            END $$""",
        # SqlLedger._release as one call: the row (JSON) if released, NULL if nothing matched.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_release(p_id text, p_fence bigint,
                p_at float8) RETURNS text
            LANGUAGE plpgsql AS $$
            DECLARE v_row jsonb;
            BEGIN
              UPDATE "{s}".ledger_reservation AS r SET state = 'RELEASED', updated_at = p_at
               WHERE r.admission_id = p_id AND r.fence = p_fence AND r.state IN {_HOLDING}
              RETURNING {_row_json(s, "r")} INTO v_row;
              IF NOT FOUND THEN RETURN NULL; END IF;
              PERFORM "{s}".ledger_give_back((v_row->>8)::jsonb);
              INSERT INTO "{s}".ledger_log (at, admission_id, event, state, fence)
              VALUES (p_at, p_id, '{released}', '{TRANSITIONS[released].target}', p_fence);
              RETURN v_row::text;
            END $$""",
        # The releasing half of SqlLedger._release_many: each (admission ID, fence) matched
        # while holding, one UPDATE per distinct pair in admission-ID order (a unique-index
        # lookup whatever the table's size; two calls lock the rows they share in the same
        # order); the rows it released, as JSON, in that order. Which of the asked releases
        # were refused, and why, the caller works out from what came back.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_release_rows(p_ids text[], p_fences bigint[],
                p_at float8) RETURNS jsonb[]
            LANGUAGE plpgsql AS $$
            DECLARE g record; v_row jsonb; v_rows jsonb[] := '{{}}';
            BEGIN
              FOR g IN SELECT DISTINCT t.id COLLATE "C" AS id, t.fence
                         FROM unnest(p_ids, p_fences) AS t(id, fence) ORDER BY 1, 2 LOOP
                UPDATE "{s}".ledger_reservation AS r SET state = 'RELEASED', updated_at = p_at
                 WHERE r.admission_id = g.id AND r.fence = g.fence AND r.state IN {_HOLDING}
                RETURNING {_row_json(s, "r")} INTO v_row;
                IF FOUND THEN v_rows := array_append(v_rows, v_row); END IF;
              END LOOP;
              RETURN v_rows;
            END $$""",
        # SqlLedger._release_many as one call: the rows it released (a JSON array), their
        # counters given back together (one update per counter, in the global order) and
        # their log in one insert.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_release_many(p_ids text[], p_fences bigint[],
                p_at float8) RETURNS text
            LANGUAGE plpgsql AS $$
            DECLARE v_rows jsonb[] := "{s}".ledger_release_rows(p_ids, p_fences, p_at);
            BEGIN
              PERFORM "{s}".ledger_settle(v_rows, p_at, '{released}',
                                          '{TRANSITIONS[released].target}');
              RETURN to_jsonb(v_rows)::text;
            END $$""",
        # A decided batch's writes and the releases that came with it, as one statement and
        # one commit (``PostgresLedger.release_many`` as a batch's last call). The one lock
        # order holds: the released reservation rows first, then each counter once, in the
        # global order, by what the batch takes less what the releases give back (so a
        # counter locked for a give-back is never followed by a lower one for a take). Its
        # StaleView keeps nothing of either half. Returns what ``ledger_release_many`` does.
        # (Its releases cannot name the batch's own grants: a holder learns its fence from
        # the batch's reply, sent after this commits.)
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_release_apply(p_ids text[],
                p_fences bigint[], p_at float8, p jsonb) RETURNS text
            LANGUAGE plpgsql AS $$
            DECLARE v_rows jsonb[] := "{s}".ledger_release_rows(p_ids, p_fences, p_at);
                    x jsonb; kept bigint;
                    v_pool text[]; v_res text[]; v_take bigint[]; v_give bigint[];
            BEGIN
{caps_sql}
{
            move_sql(
                takes + " UNION ALL SELECT i->>0, i->>1, 0::bigint, (i->>2)::bigint"
                " FROM unnest(v_rows) AS u(r), jsonb_array_elements((r->>8)::jsonb) AS y(i)"
            )
        }\
{rows_sql}
              INSERT INTO "{s}".ledger_log (at, admission_id, event, state, fence)
              SELECT p_at, e->>0, '{released}', '{TRANSITIONS[released].target}',
                     (e->>4)::bigint
                FROM unnest(v_rows) WITH ORDINALITY AS t(e, n) ORDER BY n;
              RETURN to_jsonb(v_rows)::text;
            END $$""",
        # SqlLedger._expire_due as one call: the expired rows (a JSON array, in fence order),
        # each under a new fence; due rows another transaction holds are skipped (it deals
        # with them). Set-based: the due rows are locked (FOR UPDATE SKIP LOCKED) and updated
        # by their ctid, which the lock keeps valid — a TID scan whatever the plan cache chose
        # while the table was small, and one statement for all of them (one UPDATE each
        # cost ~50 µs a row).
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_expire(p_at float8) RETURNS text
            LANGUAGE plpgsql AS $$
            DECLARE v_tids tid[]; v_rows jsonb[];
            BEGIN
              SELECT array_agg(d.ctid) INTO v_tids
                FROM (SELECT ctid FROM "{s}".ledger_reservation
                       WHERE state IN {_HOLDING} AND expires_at <= p_at
                       ORDER BY admission_id FOR UPDATE SKIP LOCKED) AS d;
              IF v_tids IS NULL THEN RETURN '[]'; END IF;
              WITH ended AS (
                UPDATE "{s}".ledger_reservation AS r
                   SET state = 'EXPIRED', fence = nextval('"{s}".ledger_fence'),
                       updated_at = p_at
                 WHERE r.ctid = ANY(v_tids) AND r.state IN {_HOLDING} AND r.expires_at <= p_at
                RETURNING {_row_json(s, "r")} AS j, r.fence AS f)
              SELECT coalesce(array_agg(j ORDER BY f), '{{}}') INTO v_rows FROM ended;
              PERFORM "{s}".ledger_settle(v_rows, p_at, '{expired}',
                                          '{TRANSITIONS[expired].target}');
              RETURN to_jsonb(v_rows)::text;
            END $$""",
    ]


def _text_array(values: Iterable[str]) -> str:
    """``values`` as a PostgreSQL ``text[]`` literal, every element double-quoted (inside,
    only ``"`` and ``\\`` are escaped). For the hot statements' ``?::text[]`` parameters:
    psycopg adapts a list element by element in Python (measured ~45 µs of CPU for 16 short
    IDs, most of a statement's own cost), this string in a few."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _int_array(values: Iterable[int]) -> str:
    """``values`` as a PostgreSQL ``bigint[]`` literal (see :func:`_text_array`)."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


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
        self._fence_sql = f"SELECT nextval('\"{schema}\".ledger_fence')"
        self._fences_sql = f"SELECT nextval('\"{schema}\".ledger_fence') FROM generate_series(1, ?)"
        self._pg = PgConnection(
            dsn, what=f"the ledger database (schema {schema})", on_open=_read_committed,
            **self._connect_kwargs,
        )  # fmt: skip
        self._lazy: _LazyBatch | None = None  # while an unplanned batch runs
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
    # A batch without a plan (the admitter's: read the view, decide, apply) starts no
    # transaction of its own until a call needs one. Its view is read by one statement on its
    # own: under READ COMMITTED every statement of a transaction reads a fresh snapshot, and
    # a transaction that has written nothing holds no lock, so that read sees exactly what it
    # would have seen inside. Its writes, when they are one ``apply`` of fresh rows, wait for
    # the end of the batch and go as one statement, which commits them (atomically) in the
    # same round trip. So a batch of decisions costs two round trips: the view it is decided
    # from, and everything it writes. Any other call inside the batch begins the transaction
    # (BEGIN, then the writes waiting, then the call), as before; a failure rolls back all of
    # it. The errors of a waiting ``apply`` (StaleView, StoreError) are raised by ``batch``.
    def batch(self, work: Callable[[], T], *, plan: Sequence[str] = ()) -> T:
        if self._in_a_batch():
            return work()  # already inside this thread's batch
        if plan:
            return super().batch(work, plan=plan)
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
        """This thread's unplanned batch, if it has not begun its transaction (it may have
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
            self._settle_plan(db, forget=fences > 0)
            view = self._in_batch(db, self._view_sql, params)
        else:
            with self._lock:
                view = self._one_statement(self._view_sql, params)
        counters, reservations, decisions, drawn, epochs = orjson.loads(view)
        return LedgerView(
            counters={(str(p), str(r)): (int(u), int(c)) for p, r, u, c in counters},
            reservations={r.admission_id: r for r in self._with_items(None, reservations)},
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
            self._settle_plan(db, forget=True)
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
                    lambda db: self._why_not(db, admission_id, fence, now, "release"), write=False
                )
        (released,) = self._with_items(None, [orjson.loads(row)])
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
            (r.admission_id, r.fence): r for r in self._with_items(None, orjson.loads(rows))
        }
        answers = [released.pop(pair, None) for pair in releases]
        return [
            self._refusal_of_release(a, f, now) if answer is None else answer
            for (a, f), answer in zip(releases, answers, strict=True)
        ]

    def _refusal_of_release(self, admission_id: str, fence: int, now: float) -> Refused:
        return self._transaction(
            lambda db: self._why_not(db, admission_id, fence, now, "release"), write=False
        )

    def _release(self, db: Db, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        ((row,),) = db.execute(self._release_sql, (admission_id, fence, now))
        if row is None:
            return self._why_not(db, admission_id, fence, now, "release")
        (released,) = self._with_items(None, [orjson.loads(row)])
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
        expired = self._with_items(None, rows)
        if expired:
            log.info("expired %d reservations", len(expired), extra={"now": now})
        return expired

    def _in_batch(self, db: Db, sql: str, params: Sequence[object]) -> Any:
        try:
            rows = db.execute(sql, params)
        except psycopg.Error as exc:
            raise self._error(exc) from exc
        return rows[0][0] if rows else None

    def _next_fence(self, db: Db) -> int:
        ((fence,),) = db.execute(self._fence_sql)
        return int(fence)

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
    """An unplanned batch of PostgresLedger (see ``PostgresLedger.batch``)."""

    thread: int
    transaction: contextlib.ExitStack | None = None  # once begun: exits with COMMIT/ROLLBACK
    deferred: str | None = None  # an ``apply`` waiting for the batch's end (its payload)
    closed: bool = False  # its releases committed it (``release_many``, the last call)


def _apply_payload(ops: Sequence[LedgerOp]) -> str:
    """What ``ledger_apply`` writes for ``ops`` (no release or activation among them): the
    rows ``SqlLedger._apply`` would write, in the order it would write them."""
    rows = _Plan(planned=0, known={}, decisions={})
    caps = []
    for op in ops:
        if not _gather(rows, op) and isinstance(op, SetCapacity):
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
