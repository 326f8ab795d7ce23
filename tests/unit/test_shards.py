"""The shard of a pool, and the balanced target of shard ownership (mesh.core.shards)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.core.shards import MAX_SHARDS, balanced_owners, moves_for, shard_of
from mesh.errors import LocalProtocolError
from mesh.manager.service import _connection_url
from mesh.manager.settings import ManagerSettings

managers_st = st.lists(st.sampled_from([f"m{i}" for i in range(8)]), min_size=1, unique=True)


def test_a_pools_shard_is_crc32_of_its_name_so_any_language_can_compute_it() -> None:
    # The same figures as a hand-written CRC-32 in JavaScript (examples/node-agent style).
    assert shard_of("rag-eu", 16) == 4_261_106_636 % 16 == 12
    assert shard_of("echo", 16) == 2
    assert shard_of("primes", 16) == 3
    assert shard_of("anything", 1) == 0


@pytest.mark.parametrize("count", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_a_clear_error(count: int) -> None:
    with pytest.raises(LocalProtocolError, match="shard_count must be"):
        shard_of("rag-eu", count)


@given(st.integers(1, 64), managers_st)
def test_every_shard_has_one_owner_and_shares_differ_by_at_most_one(
    shards: int, managers: list[str]
) -> None:
    target = balanced_owners(shards, managers, {})
    assert sorted(target) == list(range(shards))
    counts = Counter(target.values())
    assert set(counts) <= set(managers)
    loads = [counts.get(m, 0) for m in managers]
    assert max(loads) - min(loads) <= 1


@given(st.integers(1, 64), managers_st, st.data())
def test_the_target_is_the_same_whatever_order_the_managers_are_listed_in(
    shards: int, managers: list[str], data: st.DataObject
) -> None:
    owners = {s: data.draw(st.sampled_from([None, *managers])) for s in range(shards)}
    shuffled = data.draw(st.permutations(managers))
    assert balanced_owners(shards, managers, owners) == balanced_owners(shards, shuffled, owners)


@given(st.integers(1, 64), managers_st)
def test_a_balanced_assignment_is_kept_as_it_is(shards: int, managers: list[str]) -> None:
    target = balanced_owners(shards, managers, {})
    assert balanced_owners(shards, managers, dict(target)) == target


def test_a_manager_joining_takes_only_its_share_from_the_others() -> None:
    before = balanced_owners(12, ["m1", "m2"], {})
    after = balanced_owners(12, ["m1", "m2", "m3"], dict(before))
    moved = [s for s in range(12) if before[s] != after[s]]
    assert len(moved) == 4  # exactly m3's share changes hands
    assert all(after[s] == "m3" for s in moved)


def test_the_shards_of_a_manager_that_left_go_to_the_others_and_nothing_else_moves() -> None:
    before = balanced_owners(12, ["m1", "m2", "m3"], {})
    after = balanced_owners(12, ["m1", "m3"], dict(before))
    assert {s for s in range(12) if before[s] != after[s]} == {
        s for s in range(12) if before[s] == "m2"
    }
    assert Counter(after.values()) == {"m1": 6, "m3": 6}


def test_no_live_manager_means_no_target() -> None:
    assert balanced_owners(8, [], {0: "gone"}) == {}


def test_moves_take_free_shards_give_back_surplus_and_wait_for_held_ones() -> None:
    # m1 holds everything; m2 arrives: m2 waits for its half, m1 gives that half back.
    owners: dict[int, str | None] = dict.fromkeys(range(4), "m1")
    m2 = moves_for("m2", 4, ["m1", "m2"], owners)
    m1 = moves_for("m1", 4, ["m1", "m2"], owners)
    assert m2.take == () and m1.take == ()
    assert m1.give_back == m2.wait_for and len(m1.give_back) == 2
    # Once m1 has given them back, m2 takes them.
    for shard in m1.give_back:
        owners[shard] = None
    assert moves_for("m2", 4, ["m1", "m2"], owners).take == m1.give_back


def test_a_lone_manager_takes_every_free_shard() -> None:
    moves = moves_for("m1", 8, [], {3: None})
    assert moves.take == tuple(range(8)) and moves.give_back == () and moves.wait_for == ()


def test_a_sharded_manager_asks_the_broker_for_a_heartbeat_of_half_its_lease() -> None:
    # So the broker closes a frozen owner's connection within about a lease and the shard
    # queues' single-active-consumer moves on (tests/faults/test_shard_failover_load.py).
    url = "amqp://guest:guest@rabbit:5672/vh?reconnect_interval=1"
    assert _connection_url(ManagerSettings(amqp_url=url)) == url  # one manager: as given
    sharded = ManagerSettings(amqp_url=url, shard_count=8, shard_lease_s=10.0)
    assert _connection_url(sharded) == f"{url}&heartbeat=5"
    short = ManagerSettings(amqp_url="amqp://rabbit/", shard_count=8, shard_lease_s=1.5)
    assert _connection_url(short) == "amqp://rabbit/?heartbeat=1"
    chosen = ManagerSettings(amqp_url="amqp://rabbit/?heartbeat=30", shard_count=8)
    assert _connection_url(chosen) == "amqp://rabbit/?heartbeat=30"  # the operator's wins
