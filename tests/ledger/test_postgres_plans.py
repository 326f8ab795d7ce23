"""The PostgreSQL ledger's hot-path lookups stay index lookups under a cached generic plan.

psycopg prepares a statement after its first executions and PostgreSQL then keeps one
generic plan for it, chosen from what the tables looked like at that moment. On a fresh
ledger they are small, so a lookup written as ``admission_id = ANY(array)`` is planned as a
sequential scan, and keeps that plan while the table grows — every batch reading every
reservation. These tests plan the statements as a long-running manager's connection would
(``plan_cache_mode = force_generic_plan``) while the tables are small, and read the plan.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from mesh.ledger import PostgresLedger

from .conftest import schema_name
from .helpers import prepare

pytestmark = pytest.mark.integration


@pytest.fixture
def small_ledger(postgres_dsn: str, request: pytest.FixtureRequest) -> Iterator[PostgresLedger]:
    schema = schema_name(request.node.name)
    ledger = PostgresLedger(postgres_dsn, schema=schema)
    try:
        ledger.set_capacity("pool-a", "model_slots", 100)
        for n in range(20):  # a few rows: what the tables hold when plans get cached
            prepared = prepare(ledger, f"adm-{n}", "d", [("pool-a", "model_slots", 1)], 60, 1.0)
            if n % 2:
                ledger.release(f"adm-{n}", prepared.reservation.fence, 2.0)  # type: ignore[union-attr]
        yield ledger
    finally:
        ledger.close()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def generic_plan(dsn: str, sql: str, literals: tuple[str, ...]) -> str:
    """The plan PostgreSQL caches for ``sql`` (``?`` placeholders) once it settles on a
    generic one, EXPLAINed for ``literals`` (SQL literals, one per placeholder)."""
    parts = sql.split("?")
    numbered = parts[0] + "".join(f"${n}{part}" for n, part in enumerate(parts[1:], 1))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE hot AS {numbered}")
        rows = conn.execute(f"EXPLAIN EXECUTE hot({', '.join(literals)})").fetchall()
    return "\n".join(str(row[0]) for row in rows)


def test_the_view_looks_admission_ids_up_by_index_however_small_the_tables(
    small_ledger: PostgresLedger, postgres_dsn: str
) -> None:
    ids = [uuid.uuid4().hex for _ in range(16)]
    array = "'{" + ",".join(ids) + "}'"
    plan = generic_plan(postgres_dsn, small_ledger._view_sql, (array, array, "16"))

    assert "ledger_reservation_pkey" in plan, plan
    assert "ledger_decision_pkey" in plan, plan
    assert "Seq Scan on ledger_reservation" not in plan, plan
    assert "Seq Scan on ledger_decision" not in plan, plan
    # And it still answers: the IDs it knows, none it does not.
    view = small_ledger.read_for_decision(["adm-1", "adm-2", ids[0]], 2)
    assert set(view.reservations) == {"adm-1", "adm-2"}
    assert len(view.fences) == 2
