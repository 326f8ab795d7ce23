"""Shard leases in a real PostgreSQL (mesh.ledger.shard_leases): one owner per shard at a time,
fences that grow with every tenure, and writes of a lapsed owner refused by the store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from mesh.core.capacity import LiveOffer, PoolLive
from mesh.errors import LocalProtocolError
from mesh.ledger import PostgresLedger
from mesh.ledger.shard_leases import ShardLeases

from .conftest import schema_name

pytestmark = pytest.mark.integration

OpenLeases = Callable[..., ShardLeases]


@pytest.fixture
def open_leases(postgres_dsn: str, request: pytest.FixtureRequest) -> Iterator[OpenLeases]:
    """Opens lease tables on the test's own schema (each call: another manager's
    connection); everything is closed and the schema dropped afterwards."""
    schema = schema_name(request.node.name)
    opened: list[ShardLeases] = []

    def open_(shard_count: int = 4) -> ShardLeases:
        leases = ShardLeases(postgres_dsn, shard_count, schema=schema)
        opened.append(leases)
        return leases

    yield open_
    for leases in reversed(opened):
        leases.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def write_marker(cur: psycopg.Cursor[Any]) -> str:
    cur.execute("SELECT 'written'")
    row = cur.fetchone()
    assert row is not None
    return str(row[0])


def test_a_free_shard_is_taken_by_one_manager_and_refused_to_the_next(
    open_leases: OpenLeases,
) -> None:
    a, b = open_leases(), open_leases()
    assert a.take("m1", 2, ttl_s=30) == 1
    assert b.take("m2", 2, ttl_s=30) is None
    view = b.view()
    assert view.leases[2].owner == "m1" and view.leases[2].fence == 1
    assert set(view.leases) == {2}


def test_a_lapsed_lease_is_taken_with_a_larger_fence_and_the_old_owner_is_refused(
    open_leases: OpenLeases,
) -> None:
    a, b = open_leases(), open_leases()
    old = a.take("m1", 0, ttl_s=0.2)
    assert old == 1
    time.sleep(0.3)  # m1 was paused past its lease
    new = b.take("m2", 0, ttl_s=30)
    assert new == 2
    assert a.renew("m1", {0: old}, ttl_s=30) == {}  # waking up, m1 learns it lost the shard
    assert a.run_fenced(0, "m1", old, write_marker) is None  # and the store refuses its write
    assert b.run_fenced(0, "m2", new, write_marker) == "written"


def test_renewing_keeps_a_lease_past_its_first_expiry(open_leases: OpenLeases) -> None:
    a, b = open_leases(), open_leases()
    fence = a.take("m1", 1, ttl_s=0.4)
    assert fence is not None
    time.sleep(0.2)
    assert a.renew("m1", {1: fence}, ttl_s=0.6) == {1: fence}
    time.sleep(0.3)  # past the first expiry, within the renewed one
    assert b.take("m2", 1, ttl_s=30) is None


def test_a_renewal_with_a_stale_fence_renews_nothing(open_leases: OpenLeases) -> None:
    a = open_leases()
    fence = a.take("m1", 3, ttl_s=30)
    assert fence is not None
    assert a.give_back("m1", 3, fence)
    again = a.take("m1", 3, ttl_s=30)
    assert again == fence + 1
    assert a.renew("m1", {3: fence}, ttl_s=30) == {}
    assert a.renew("m1", {3: again}, ttl_s=30) == {3: again}


def test_a_shard_given_back_is_taken_at_once_by_another_with_the_next_fence(
    open_leases: OpenLeases,
) -> None:
    a, b = open_leases(), open_leases()
    fence = a.take("m1", 0, ttl_s=30)
    assert fence == 1
    assert not a.give_back("m1", 0, fence + 5)  # not its fence: nothing happens
    assert b.take("m2", 0, ttl_s=30) is None
    assert a.give_back("m1", 0, fence)
    assert b.take("m2", 0, ttl_s=30) == 2


def test_a_write_under_way_finishes_before_the_next_owner_can_take_the_shard(
    open_leases: OpenLeases,
) -> None:
    a, b = open_leases(), open_leases()
    fence = a.take("m1", 0, ttl_s=0.3)
    assert fence is not None
    events: list[tuple[str, float]] = []
    checked = threading.Event()

    def slow_write(cur: psycopg.Cursor[Any]) -> str:
        checked.set()
        time.sleep(0.6)  # the lease lapses while the write is under way
        events.append(("m1 committed", time.monotonic()))
        return write_marker(cur)

    writer = threading.Thread(target=lambda: a.run_fenced(0, "m1", fence, slow_write))
    writer.start()
    assert checked.wait(5)
    time.sleep(0.4)  # the lease has expired now; the write still holds the row for share
    taken = b.take("m2", 0, ttl_s=30)
    events.append(("m2 took", time.monotonic()))
    writer.join()
    assert taken == fence + 1
    assert [name for name, _ in sorted(events, key=lambda e: e[1])] == ["m1 committed", "m2 took"]


def test_of_many_managers_racing_for_a_free_shard_exactly_one_wins(
    open_leases: OpenLeases,
) -> None:
    stores = [open_leases() for _ in range(4)]
    for shard in range(4):
        assert sorted(w for w in race_for(stores, shard) if w is not None) == [1]


def race_for(stores: list[ShardLeases], shard: int) -> list[int | None]:
    """Every store's manager tries to take ``shard`` at the same moment; what each got."""
    start = threading.Barrier(len(stores))
    won: list[int | None] = [None] * len(stores)

    def race(n: int) -> None:
        start.wait()
        won[n] = stores[n].take(f"m{n}", shard, ttl_s=30)

    threads = [threading.Thread(target=race, args=(n,)) for n in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won


def test_presence_lists_live_managers_and_leaving_gives_every_shard_back(
    open_leases: OpenLeases,
) -> None:
    a, b = open_leases(), open_leases()
    a.announce("m1", ttl_s=30)
    b.announce("m2", ttl_s=0.2)
    for shard in (0, 1):
        assert a.take("m1", shard, ttl_s=30) is not None
    time.sleep(0.3)
    assert a.view().managers == ("m1",)  # m2's presence lapsed
    assert a.leave("m1") == 2
    view = b.view()
    assert view.managers == () and view.leases == {}
    assert b.take("m2", 0, ttl_s=30) == 2


def test_every_manager_of_a_namespace_must_use_the_same_shard_count(
    open_leases: OpenLeases,
) -> None:
    open_leases(8)
    with pytest.raises(LocalProtocolError, match=r"split into 8 shards.*started with 16"):
        open_leases(16)


def test_a_shard_out_of_range_is_a_clear_error(open_leases: OpenLeases) -> None:
    leases = open_leases(4)
    with pytest.raises(LocalProtocolError, match=r"shard must be 0\.\.3, got 4"):
        leases.take("m1", 4, ttl_s=30)


def test_live_offers_are_written_by_the_owner_only_and_a_lapsed_owner_is_refused(
    open_leases: OpenLeases, postgres_dsn: str
) -> None:
    """publish_live replaces a shard's rows and sets the ledger's live-slot capacities in one
    fenced transaction: the next owner's rows replace the old ones, the old owner's late
    write changes nothing."""
    a, b = open_leases(), open_leases()
    ledger = PostgresLedger(postgres_dsn, schema=a.schema)  # the ledger's own tables
    try:
        old = a.take("m1", 0, ttl_s=0.3)
        assert old is not None
        offer = LiveOffer("1.2.0", agents=2, free=5, cost_class="standard")
        rows = {"calc": PoolLive(0, old, (("math.add", offer),), retry_s=None)}
        assert a.publish_live(0, "m1", old, rows, {("calc", "live_slots:math.add"): 5})
        assert b.read_live() == rows
        assert ledger.usage()[("calc", "live_slots:math.add")] == (0, 5)

        time.sleep(0.4)  # m1 is paused past its lease; m2 takes the shard
        new = b.take("m2", 0, ttl_s=30)
        assert new == old + 1
        empty = {"calc": PoolLive(0, new, (), retry_s=2.5)}  # its agents are gone
        assert b.publish_live(0, "m2", new, empty, {("calc", "live_slots:math.add"): 0})
        # m1 wakes and writes what it knew: refused, nothing of it lands.
        assert not a.publish_live(0, "m1", old, rows, {("calc", "live_slots:math.add"): 5})
        assert a.read_live() == empty
        assert ledger.usage()[("calc", "live_slots:math.add")] == (0, 0)

        # A pool of the shard left out of a write has no row any more; other shards' stay.
        other = b.take("m2", 1, ttl_s=30)
        assert other is not None
        iota = {"iota": PoolLive(1, other, (("math.add", offer),))}
        assert b.publish_live(1, "m2", other, iota, {})
        assert b.publish_live(0, "m2", new, {}, {})
        assert b.read_live() == iota
    finally:
        ledger.close()
