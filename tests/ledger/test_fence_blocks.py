"""PostgreSQL hands out fences from blocks a view draws ahead (``FENCE_BLOCK``), so a view
rarely calls ``nextval`` (which takes a transaction ID and flushes WAL at its commit). What
fences promise must hold all the same, across managers sharing the ledger."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from mesh.ledger import Item, PostgresLedger, Reservation, ReservationState
from mesh.ledger.model import Reserve
from mesh.ledger.postgres import FENCE_BLOCK

from .conftest import schema_name

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


@pytest.fixture
def two_managers(
    postgres_dsn: str, request: pytest.FixtureRequest
) -> Iterator[tuple[PostgresLedger, PostgresLedger]]:
    """Two stores on one fresh schema, as two managers sharing a ledger."""
    schema = schema_name(request.node.name)
    first = PostgresLedger(postgres_dsn, schema=schema)
    second = PostgresLedger(postgres_dsn, schema=schema)
    yield first, second
    second.close()
    first.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def granted(admission_id: str, fence: int) -> Reservation:
    return Reservation(
        admission_id, f"d-{admission_id}", "pool-a", ReservationState.ACTIVE, fence,
        (Item("pool-a", "model_slots", 1),), T0 + 60, T0, T0, 1,
    )  # fmt: skip


def test_fences_come_from_a_block_and_a_superseding_fence_is_higher(
    two_managers: tuple[PostgresLedger, PostgresLedger],
) -> None:
    # The next batches take their fences from the block the first view drew; the other
    # manager draws past it, so fences of different admissions interleave between managers.
    # Each is handed out once, a batch's ascend, and the fence an expiry gives a grant is
    # drawn later from the sequence: higher than any handed out before.
    a, other = two_managers
    first = a.read_for_decision(["x-1", "x-2"], fences=2).fences
    theirs = other.read_for_decision(["y-1"], fences=1).fences
    second = a.batch(lambda: a.read_for_decision(["x-3", "x-4"], fences=2)).fences

    assert list(first) == sorted(first) and list(second) == sorted(second)
    assert second[0] == first[-1] + 1  # from the block: no draw in between
    assert theirs[0] > first[0] + FENCE_BLOCK - 1  # the other manager drew past the block
    assert not set(first) & set(second) and not set(first + second) & set(theirs)
    a.set_capacity("pool-a", "model_slots", 1)
    grant = granted("x-3", second[0])
    a.apply([Reserve(grant)])
    (expired,) = a.expire_due(grant.expires_at)
    assert expired.fence > max(theirs)  # a superseding fence comes later from the sequence


def test_a_batch_wanting_more_than_the_block_holds_takes_the_rest_then_a_new_block(
    two_managers: tuple[PostgresLedger, PostgresLedger],
) -> None:
    a, other = two_managers
    first = a.read_for_decision(["x-1"], fences=FENCE_BLOCK - 2).fences  # two left over
    theirs = other.read_for_decision(["y-1"], fences=1).fences
    more = a.read_for_decision(["x-2"], fences=3).fences

    assert first[0] + FENCE_BLOCK - 1 < theirs[0]  # the block was drawn whole
    assert more[:2] == (first[-1] + 1, first[-1] + 2)  # its rest first, still ascending,
    assert more[2] > theirs[0]  # then a new block drawn after the other manager's fence
