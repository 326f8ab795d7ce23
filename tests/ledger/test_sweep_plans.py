"""The expiry sweep reads the due index, not every reservation ever kept.

Ended reservations stay in the table (the log and replays need them), so a sweep that reads
the whole table costs more with every admission a ledger has seen: on SQLite 66 µs with
1,000 ended rows and 7.9 ms with 100,000, each tick, under the write lock. These tests read
the plan the store actually runs (SQLite: the statement as executed, from the trace
callback; PostgreSQL: the generic plan a long-running connection caches).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from mesh.ledger import PostgresLedger, SqliteLedger
from mesh.ledger.model import Prepared

from .conftest import schema_name
from .helpers import prepare
from .test_ledger_upgrade import EARLIER_ID_TABLES
from .test_postgres_plans import generic_plan

NOW = 1_000.0


def _fill(store: SqliteLedger | PostgresLedger) -> list[str]:
    """Twenty reservations, every other one released; the rest due at ``NOW + 30``."""
    store.set_capacity("pool-a", "model_slots", 100)
    holding = []
    for n in range(20):
        prepared = prepare(store, f"adm-{n:02d}", "d", [("pool-a", "model_slots", 1)], 30, NOW)
        assert isinstance(prepared, Prepared)
        if n % 2:
            store.release(f"adm-{n:02d}", prepared.reservation.fence, NOW + 1)
        else:
            holding.append(f"adm-{n:02d}")
    return holding


@pytest.mark.parametrize("layout", ["rowid", "earlier WITHOUT ROWID"])
def test_sqlite_sweep_searches_the_due_index(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "ledger.sqlite3"
    if layout != "rowid":
        conn = sqlite3.connect(path)
        conn.executescript(EARLIER_ID_TABLES)
        conn.close()
    with SqliteLedger(path) as store:
        holding = _fill(store)
        executed: list[str] = []
        store._conn.set_trace_callback(executed.append)
        expired = store.expire_due(NOW + 31)
        store._conn.set_trace_callback(None)

        assert sorted(r.admission_id for r in expired) == holding
        (sweep,) = [sql for sql in executed if sql.startswith("SELECT admission_id FROM")]
        plan = " / ".join(row[3] for row in store._conn.execute(f"EXPLAIN QUERY PLAN {sweep}"))
        assert "USING INDEX ledger_reservation_due" in plan, plan
        assert "SCAN ledger_reservation" not in plan, plan


@pytest.fixture
def pg_ledger(postgres_dsn: str, request: pytest.FixtureRequest) -> Iterator[PostgresLedger]:
    schema = schema_name(request.node.name)
    ledger = PostgresLedger(postgres_dsn, schema=schema)
    try:
        yield ledger
    finally:
        ledger.close()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.integration
def test_postgres_sweep_plans_the_due_index_however_small_the_table(
    pg_ledger: PostgresLedger, postgres_dsn: str
) -> None:
    holding = _fill(pg_ledger)
    plan = generic_plan(postgres_dsn, pg_ledger._transitions.due_sql, (str(NOW + 31),))

    assert "ledger_reservation_due" in plan, plan
    assert "Seq Scan on ledger_reservation" not in plan, plan
    assert sorted(r.admission_id for r in pg_ledger.expire_due(NOW + 31)) == holding
