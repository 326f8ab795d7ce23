"""The PostgreSQL ledger's schema and server-side functions, as SQL text: the tables (DDL,
created idempotently), and ``ledger_apply`` / ``ledger_release`` / ``ledger_release_many`` /
``ledger_expire``, which make the hot paths one statement each (see :mod:`mesh.ledger.postgres`
for why). Pure functions of the schema's name; nothing here connects."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Final

from mesh.ledger.model import TRANSITIONS, LedgerEvent
from mesh.ledger.sql_rows import HOLDING_SQL

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


# What a reservation row looks like when a function returns it: RES_COLUMNS as a JSON array,
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
        # A decided batch's fresh rows (BatchWriter.flush, as one call): capacities set,
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
        # Transitions.release as one call: the row (JSON) if released, NULL if nothing matched.
        f"""CREATE OR REPLACE FUNCTION "{s}".ledger_release(p_id text, p_fence bigint,
                p_at float8) RETURNS text
            LANGUAGE plpgsql AS $$
            DECLARE v_row jsonb;
            BEGIN
              UPDATE "{s}".ledger_reservation AS r SET state = 'RELEASED', updated_at = p_at
               WHERE r.admission_id = p_id AND r.fence = p_fence AND r.state IN {HOLDING_SQL}
              RETURNING {_row_json(s, "r")} INTO v_row;
              IF NOT FOUND THEN RETURN NULL; END IF;
              PERFORM "{s}".ledger_give_back((v_row->>8)::jsonb);
              INSERT INTO "{s}".ledger_log (at, admission_id, event, state, fence)
              VALUES (p_at, p_id, '{released}', '{TRANSITIONS[released].target}', p_fence);
              RETURN v_row::text;
            END $$""",
        # The releasing half of Transitions.release_many: each (admission ID, fence) matched
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
                 WHERE r.admission_id = g.id AND r.fence = g.fence AND r.state IN {HOLDING_SQL}
                RETURNING {_row_json(s, "r")} INTO v_row;
                IF FOUND THEN v_rows := array_append(v_rows, v_row); END IF;
              END LOOP;
              RETURN v_rows;
            END $$""",
        # Transitions.release_many as one call: the rows it released (a JSON array), their
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
        # Transitions.expire_due as one call: the expired rows (a JSON array, in fence order),
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
                       WHERE state IN {HOLDING_SQL} AND expires_at <= p_at
                       ORDER BY admission_id FOR UPDATE SKIP LOCKED) AS d;
              IF v_tids IS NULL THEN RETURN '[]'; END IF;
              WITH ended AS (
                UPDATE "{s}".ledger_reservation AS r
                   SET state = 'EXPIRED', fence = nextval('"{s}".ledger_fence'),
                       updated_at = p_at
                 WHERE r.ctid = ANY(v_tids) AND r.state IN {HOLDING_SQL} AND r.expires_at <= p_at
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
