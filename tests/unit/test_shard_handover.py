"""Which shards are mid-handover, from the shared live rows (ShardOwnership.handing_over):
the fact that keeps a refusal from saying "nobody offers it" while a shard's agents register
again with its new owner — however long they take, where a time window can run out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mesh.core.capacity import LiveOffer, PoolLive
from mesh.ledger.shard_leases import ShardLease, ShardView
from mesh.manager.shards import ShardOwnership


async def _unused(*_: Any) -> Any:
    raise AssertionError("no I/O here")


def ownership(leases: dict[int, tuple[str, int]], mine: dict[int, int]) -> ShardOwnership:
    shards = ShardOwnership(
        SimpleNamespace(shard_count=4),  # type: ignore[arg-type]
        "m-b",
        lease_s=10.0,
        run_blocking=_unused,
        wall_clock=lambda: 0.0,
        on_change=_unused,
    )
    shards.last_view = ShardView(
        managers=("m-a", "m-b"),
        leases={s: ShardLease(owner, fence) for s, (owner, fence) in leases.items()},
        server_time=0.0,
    )
    for shard, fence in mine.items():
        shards.keeper.took(shard, fence)
    return shards


def row(shard: int, fence: int, capability: str = "math.evaluate", agents: int = 1) -> PoolLive:
    return PoolLive(shard, fence, ((capability, LiveOffer("1.0.0", agents, 4, "B")),))


def test_a_row_written_under_an_older_fence_than_the_lease_is_a_handover() -> None:
    # Shard 3 was m-a's under fence 7 (its row says one calc agent); m-b took it (fence 9)
    # and has not caught up: its agents are registering again with m-b.
    shards = ownership({0: ("m-a", 2), 1: ("m-a", 3), 2: ("m-a", 4)}, mine={3: 9})
    rows = [row(3, 7), row(0, 2, "test.echo")]

    assert shards.handing_over(rows) == {3}
    assert shards.handing_over(rows, "math.evaluate") == {3}
    assert shards.handing_over(rows, "test.echo") == set()  # shard 0's row is its owner's
    assert shards.settling_shards(0.0, handing_over={3}) == 1


def test_a_row_of_the_current_owner_or_without_agents_is_no_handover() -> None:
    shards = ownership({0: ("m-a", 2), 1: ("m-a", 3), 2: ("m-a", 4), 3: ("m-a", 8)}, mine={})
    assert shards.handing_over([row(3, 8)]) == set()  # written by the holder: caught up
    assert shards.handing_over([row(3, 7, agents=0)]) == set()  # it counted nobody
    assert shards.handing_over([row(3, 7)]) == {3}  # taken from another by m-a, as read
