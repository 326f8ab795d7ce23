"""Managers holding shards through the real PostgreSQL lease table (mesh.manager.shards):
an even split, a clean hand-over, a takeover after a crash, and a paused manager that wakes up
to find it lost its shards before it acts on them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

from mesh.core.events import LogEntry
from mesh.ledger.shard_leases import ShardLeases
from mesh.manager.shards import ShardOwnership

from .conftest import schema_name

pytestmark = pytest.mark.integration

SHARDS = 6
LEASE_S = 0.6

MakeManager = Callable[[str], ShardOwnership]


@pytest.fixture
async def make_manager(
    postgres_dsn: str, request: pytest.FixtureRequest
) -> AsyncIterator[MakeManager]:
    schema = schema_name(request.node.name)
    made: list[ShardOwnership] = []

    def make(manager_id: str) -> ShardOwnership:
        log: list[LogEntry] = []

        async def journal(entries: list[LogEntry]) -> None:
            log.extend(entries)

        ownership = ShardOwnership(
            ShardLeases(postgres_dsn, SHARDS, schema=schema),
            manager_id,
            lease_s=LEASE_S,
            run_blocking=asyncio.to_thread,
            wall_clock=time.time,
            on_change=journal,
            counters=Counter(),
        )
        ownership.journaled = log  # type: ignore[attr-defined]
        made.append(ownership)
        return ownership

    yield make
    for ownership in reversed(made):
        await ownership.stop(give_back=False)
        ownership.leases.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def settle(*managers: ShardOwnership, rounds: int = 3) -> None:
    for _ in range(rounds):
        for manager in managers:
            await manager.step()


def changes(manager: ShardOwnership) -> list[tuple[str, int]]:
    journaled: list[LogEntry] = manager.journaled  # type: ignore[attr-defined]
    return [(e.reason, int(e.detail["shard"])) for e in journaled]


def assert_partition(*managers: ShardOwnership) -> dict[str, set[int]]:
    owned = {m.manager_id: set(m.owned()) for m in managers}
    everything = [s for shards in owned.values() for s in shards]
    assert sorted(everything) == list(range(SHARDS)), owned  # every shard, none twice
    return owned


async def test_three_managers_split_the_shards_evenly(make_manager: MakeManager) -> None:
    managers = [make_manager(f"m{n}") for n in range(3)]
    await settle(*managers)
    owned = assert_partition(*managers)
    assert sorted(len(s) for s in owned.values()) == [2, 2, 2]
    for manager in managers:  # the orchestration log tells the same story
        held: set[int] = set()
        for change, shard in changes(manager):
            (held.add if change == "taken" else held.discard)(shard)
        assert held == set(manager.owned())


async def test_a_manager_stopping_cleanly_hands_its_shards_over_at_once(
    make_manager: MakeManager,
) -> None:
    m1, m2, m3 = (make_manager(f"m{n}") for n in (1, 2, 3))
    await settle(m1, m2, m3)
    leaving = set(m2.owned())
    await m2.stop(give_back=True)
    assert {s for change, s in changes(m2) if change == "given_back"} >= leaving
    await settle(m1, m3, rounds=1)  # no lease to wait out
    owned = assert_partition(m1, m3)
    assert sorted(len(s) for s in owned.values()) == [3, 3]


async def test_the_shards_of_a_crashed_manager_are_taken_within_the_lease_and_a_step(
    make_manager: MakeManager,
) -> None:
    m1, m2 = make_manager("m1"), make_manager("m2")
    await settle(m1, m2)
    crashed = set(m2.owned())
    assert crashed
    died = time.monotonic()  # m2 stops renewing: no give-back, as after kill -9
    while not crashed <= set(m1.owned()):
        await m1.step()
        await asyncio.sleep(LEASE_S / 3)
        assert time.monotonic() - died < 5 * LEASE_S, "the shards were never taken over"
    takeover = time.monotonic() - died
    assert takeover <= LEASE_S + 2 * LEASE_S / 3  # the lease, then at most a step's period
    assert set(m1.owned()) == set(range(SHARDS))


async def test_a_manager_paused_past_its_lease_learns_it_lost_its_shards_before_acting(
    make_manager: MakeManager,
) -> None:
    m1, m2 = make_manager("m1"), make_manager("m2")
    await settle(m1, m2)
    before = m2.owned()
    assert all(m2.holds(shard) for shard in before)
    await asyncio.sleep(LEASE_S * 1.5)  # m2 is stopped (SIGSTOP); m1 carries on
    # On waking, before its next step: its own clock already says the leases ran out.
    assert before and not any(m2.holds(shard) for shard in before)
    await settle(m1, rounds=1)
    assert set(m1.owned()) == set(range(SHARDS))

    def write(cur: psycopg.Cursor[Any]) -> int:
        return 1

    for shard, fence in before.items():  # what m2 would write with what it held: refused
        assert m2.leases.run_fenced(shard, "m2", fence, write) is None
    await m2.step()  # SIGCONT: the first thing it does is renew
    lost = [s for change, s in changes(m2) if change == "lost"]
    assert sorted(lost) == sorted(before)
    assert m2.counters["shards_lost"] == len(before)
    assert not set(m2.owned()) & set(before) or all(
        m2.owned()[s] > before[s] for s in set(m2.owned()) & set(before)
    )  # anything it holds again, it holds under a new fence
    await settle(m1, m2)
    owned = assert_partition(m1, m2)
    assert sorted(len(s) for s in owned.values()) == [3, 3]


async def test_shards_are_moving_while_a_dead_owners_leases_run_out_and_one_lease_after(
    make_manager: MakeManager,
) -> None:
    # What the lease path holds an acquire on (a capability nobody offers while shards move:
    # its agents may be registering again with a new owner) — and only then.
    m1, m2 = make_manager("m1"), make_manager("m2")
    await settle(m1, m2)
    for _ in range(4):  # both renewing, nothing moves for longer than a lease
        await asyncio.sleep(LEASE_S / 3)
        await settle(m1, m2, rounds=1)
    assert not m1.moving()

    await m2.stop(give_back=False)  # a crash: its leases run out, nobody gives them back
    await asyncio.sleep(LEASE_S * 1.2)
    await m1.step()  # the view lacks live leases for m2's shards; m1 takes them
    assert m1.moving() and len(m1.owned()) == SHARDS
    await m1.step()  # every lease live again, but held by a new owner a moment ago
    assert m1.last_view is not None and len(m1.last_view.leases) == SHARDS
    assert m1.moving()
    for _ in range(4):  # the same owners, step after step, for longer than a lease
        await asyncio.sleep(LEASE_S / 3)
        await m1.step()
    assert not m1.moving()
    # Settling over a longer window (a heartbeat interval: the agents' way back) still is.
    assert m1.settling(LEASE_S * 10) and not m1.settling(LEASE_S)
