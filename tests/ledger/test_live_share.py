"""Live capacity shared by managers through the real PostgreSQL tables (mesh.manager.live_share):
the owner's figures reach the other manager, and a new owner keeps the previous owner's figures
until the shard's agents have registered with it again (or the handover time has passed)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import psycopg
import pytest
from integration.harness import eventually

from mesh.core.capacity import LiveCapacity, LiveOffer
from mesh.core.shards import shard_of
from mesh.ledger import PostgresLedger
from mesh.ledger.shard_leases import ShardLeases
from mesh.manager.live_share import SharedLive
from mesh.manager.shards import ShardOwnership

from .conftest import schema_name

pytestmark = pytest.mark.integration

SHARDS = 2
LEASE_S = 0.6
POOL = "calc"


def registry(agents: int) -> LiveCapacity:
    """A registry snapshot holding ``agents`` live agents of ``POOL``, 4 free slots each."""
    if not agents:
        return LiveCapacity({}, {}, 0)
    return LiveCapacity(
        {(POOL, "math.add"): (LiveOffer("1.0.0", agents, 4 * agents, "A"),)}, {}, agents
    )


class Manager:
    """One manager's shard ownership and live share, its registry set by the test."""

    def __init__(self, dsn: str, schema: str, manager_id: str, handover_s: float) -> None:
        self.own = registry(0)
        self.counters: Counter[str] = Counter()

        async def journal(entries: object) -> None:
            return None

        self.shards = ShardOwnership(
            ShardLeases(dsn, SHARDS, schema=schema),
            manager_id,
            lease_s=LEASE_S,
            run_blocking=asyncio.to_thread,
            wall_clock=time.time,
            on_change=journal,
            counters=self.counters,
        )
        self.live = SharedLive(
            self.shards,
            run_blocking=asyncio.to_thread,
            own=lambda: self.own,
            descriptors=dict,
            interval_s=0.1,
            handover_s=handover_s,
            counters=self.counters,
        )

    def free(self) -> int:
        return self.live.view().free(POOL, "math.add")


def written_by(manager: Manager) -> str:
    """Who wrote the pool's row: the manager whose lease its fence is (m1 took first)."""
    fence = manager.shards.leases.read_live()[POOL].fence
    return "m1" if fence == 1 else "m2"


@pytest.fixture
async def make_manager(
    postgres_dsn: str, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., Manager]]:
    schema = schema_name(request.node.name)
    PostgresLedger(postgres_dsn, schema=schema).close()  # the ledger's tables
    made: list[Manager] = []

    def make(manager_id: str, handover_s: float = 30.0) -> Manager:
        made.append(Manager(postgres_dsn, schema, manager_id, handover_s))
        return made[-1]

    yield make
    for manager in reversed(made):
        await manager.shards.stop(give_back=False)
        manager.shards.leases.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_new_owner_keeps_the_old_figures_until_the_agents_are_back(
    make_manager: Callable[..., Manager],
) -> None:
    m1 = make_manager("m1")
    await m1.shards.step()  # alone: it takes both shards
    assert shard_of(POOL, SHARDS) in m1.shards.owned()
    m1.own = registry(3)
    await m1.live.step()
    assert m1.free() == 12 and written_by(m1) == "m1"

    m2 = make_manager("m2")
    await m2.live.step()
    assert m2.free() == 12  # another manager admits with the owner's figure
    await asyncio.sleep(LEASE_S + 0.1)  # m1 dies: its leases lapse, m2 takes both shards
    await m2.shards.step()
    assert shard_of(POOL, SHARDS) in m2.shards.owned()

    # m2 knows none of the pool's agents yet: the previous owner's row still speaks for it,
    # and m2 writes nothing for the shard (it would tell everyone the pool is empty).
    await m2.live.step()
    assert m2.free() == 12 and written_by(m2) == "m1"
    m2.own = registry(2)  # two of the three have registered again
    await m2.live.step()
    assert m2.free() == 12 and written_by(m2) == "m1"
    m2.own = registry(3)  # all back: m2's own registry speaks, and it writes
    await m2.live.step()
    assert m2.free() == 12 and written_by(m2) == "m2"
    m2.own = registry(1)
    await m2.live.step()
    assert m2.free() == 4
    # m1 wakes, still counting the shards as its own, with its old figures: by its own clock
    # its leases may have lapsed, so it writes nothing (a write that got past this check is
    # refused by the store: test_shard_leases), and reads m2's figure.
    m1.own = registry(3)
    writes = m1.counters["live_writes"]
    await m1.live.step()
    assert m1.counters["live_writes"] == writes and written_by(m2) == "m2"
    assert m1.free() == 4


async def test_a_new_owner_takes_over_the_figures_after_the_handover_time(
    make_manager: Callable[..., Manager],
) -> None:
    m1 = make_manager("m1")
    await m1.shards.step()
    m1.own = registry(3)
    await m1.live.step()
    m2 = make_manager("m2", handover_s=0.5)
    await asyncio.sleep(LEASE_S + 0.1)
    await m2.shards.step()
    await m2.live.step()
    assert m2.free() == 12  # the old row, within the handover time
    await asyncio.sleep(0.5)
    await m2.live.step()  # the agents never came back: the pool is empty
    assert m2.free() == 0 and POOL not in m2.shards.leases.read_live()
    await m1.live.step()
    assert m1.free() == 0  # m1 reads what m2 wrote, since it lost the shard


async def test_a_manager_reads_the_rows_again_only_when_a_write_was_signalled(
    make_manager: Callable[..., Manager],
) -> None:
    m1 = make_manager("m1")
    await m1.shards.step()  # alone: it takes both shards
    m1.shards.start()  # and keeps them (m2 takes no part in ownership here)
    m1.own = registry(3)
    m2 = make_manager("m2")
    for manager in (m1, m2):
        manager.live.start()
    try:
        await eventually(lambda: m2.free() == 12, what="m1's figure at m2")
        await asyncio.sleep(0.5)  # the last signalled write read
        reads = m2.counters["live_reads"]
        await asyncio.sleep(1.0)  # ten steps with nothing written
        assert m2.counters["live_reads"] == reads
        m1.own = registry(1)  # m1 writes, PostgreSQL signals, m2 reads
        await eventually(lambda: m2.free() == 4, timeout_s=3.0, what="the new figure at m2")
        assert m2.counters["live_reads"] > reads
    finally:
        for manager in (m1, m2):
            await manager.live.stop()
