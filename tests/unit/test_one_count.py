"""One count of work per agent, whichever path brought it, and the live capacity it gives
admission: the pool core driven with events, commands out."""

from __future__ import annotations

import pytest

from mesh import constants as c
from mesh.core import (
    AgentState,
    CapacityMissed,
    PoolSettings,
    Reply,
    ScaleObserved,
    ScaleTo,
    ScalingPolicy,
    SendToAgent,
)
from mesh.wire import Capability, DrainComplete, Lease, LeaseNotice

from .builders import Pool, capability, log_entries, sent, transitions

WORKS = (c.FEATURE_WORK_REPORTS,)


def search(max_concurrency: int = 4, version: str = "2.1.0") -> Capability:
    return capability("rag.search", version, max_concurrency=max_concurrency)


def offers(pool: Pool) -> dict[tuple[str, str], list[tuple[str, int, int]]]:
    live = pool.core.live_capacity(pool.clock.now())
    return {
        key: sorted((o.version, o.agents, o.free) for o in found)
        for key, found in live.offers.items()
    }


@pytest.fixture
def pool() -> Pool:
    return Pool()


def test_pool_work_an_agent_reports_takes_its_slots_from_find(pool: Pool) -> None:
    pool.register("a-1", search(2), deployment="rag", features=WORKS)

    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})
    assert pool.core.find_by_capability("rag.search")[0].in_flight == 1

    pool.heartbeat("a-1", pool_in_flight={"rag.search": 2})
    assert pool.found("rag.search") == []  # full: one count, both paths
    refused = pool.acquire("rag.search")
    assert not isinstance(refused, Lease)


def test_leases_and_pool_work_add_up_in_one_count(pool: Pool) -> None:
    pool.register("a-1", search(3), deployment="rag", features=WORKS)
    pool.lease("rag.search")
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 2})

    agent = pool.core.agents["a-1"]
    assert (agent.in_flight, agent.slots["rag.search"].leased) == (3, 1)
    assert pool.found("rag.search") == []


def test_the_busy_label_follows_pool_work_too(pool: Pool) -> None:
    pool.register("a-1", search(), deployment="rag", features=WORKS)

    started = pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})
    more = pool.heartbeat("a-1", pool_in_flight={"rag.search": 2})
    done = pool.heartbeat("a-1", pool_in_flight={})

    assert transitions(started) == [("Ready", "Busy", "busy")]
    assert transitions(more) == []  # the label did not change: nothing to log
    assert transitions(done) == [("Busy", "Ready", "released")]
    assert pool.state("a-1") is AgentState.READY


def test_a_report_is_a_full_count_so_a_lost_one_is_corrected_by_the_next(pool: Pool) -> None:
    pool.register("a-1", search(4), deployment="rag", features=WORKS)
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})
    # the report of 2 was lost; 3 arrives
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 3})
    assert pool.core.agents["a-1"].in_flight == 3
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 0, "not.offered": 7})
    assert pool.core.agents["a-1"].in_flight == 0


def test_live_capacity_counts_ready_agents_and_what_leases_leave_free(pool: Pool) -> None:
    pool.register("a-1", search(4), deployment="rag", features=WORKS)
    pool.register("a-2", search(2, "2.2.0"), deployment="rag", features=WORKS)
    assert offers(pool) == {("rag", "rag.search"): [("2.1.0", 1, 4), ("2.2.0", 1, 2)]}

    lease = pool.lease("rag.search")  # a-1: cost class and load tie, first registered
    assert offers(pool)[("rag", "rag.search")] == [("2.1.0", 1, 3), ("2.2.0", 1, 2)]

    pool.heartbeat("a-2", pool_in_flight={"rag.search": 2})  # covered by grants: unchanged
    assert offers(pool)[("rag", "rag.search")] == [("2.1.0", 1, 3), ("2.2.0", 1, 2)]

    pool.release(lease.lease_id)
    pool.drain("a-1")
    assert offers(pool) == {("rag", "rag.search"): [("2.2.0", 1, 2)]}


def test_a_lost_agent_takes_its_live_capacity_with_it(pool: Pool) -> None:
    pool.register("a-1", search(4), deployment="rag", heartbeat_interval_s=5)
    version = pool.core.live_capacity(pool.clock.now()).version

    pool.run_for(20)

    live = pool.core.live_capacity(pool.clock.now())
    assert pool.state("a-1") is None
    assert live.offers == {} and live.version != version
    assert live.free("rag", "rag.search") == 0


def test_the_live_snapshot_is_rebuilt_only_when_the_registry_changed(pool: Pool) -> None:
    pool.register("a-1", search(4), deployment="rag", features=WORKS)
    first = pool.core.live_capacity(pool.clock.now())
    pool.heartbeat("a-1")
    again = pool.core.live_capacity(pool.clock.now())

    assert again.offers is first.offers and again.version == first.version


def test_a_drain_waits_for_pool_work_on_an_agent_that_reports_it(pool: Pool) -> None:
    pool.register("a-1", search(2), deployment="rag", features=WORKS)
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})

    draining = pool.drain("a-1")
    assert pool.state("a-1") is AgentState.DRAINING
    assert sent(draining, DrainComplete) == []

    still = pool.heartbeat("a-1", pool_in_flight={"rag.search": 1}, draining=True)
    assert pool.state("a-1") is AgentState.DRAINING and sent(still, DrainComplete) == []
    (confirmed,) = log_entries(still, "drain_confirmed")  # once per drain, in the journal
    assert confirmed.detail == {"pool_in_flight": {"rag.search": 1}, "leases": 0}

    done = pool.heartbeat("a-1", pool_in_flight={}, draining=True)
    assert log_entries(done, "drain_confirmed") == []
    assert pool.state("a-1") is None
    assert [m.agent_id for _, m in sent(done, DrainComplete)] == ["a-1"]


def test_a_drain_waits_for_the_agent_to_confirm_it_took_no_pool_task_meanwhile(
    pool: Pool,
) -> None:
    """Nothing reported yet is not nothing running: a pool task claimed just before the
    drain may be in a report on its way. Only a heartbeat saying ``draining`` (sent once the
    agent stopped its pool consumer) settles it."""
    pool.register("a-1", search(2), deployment="rag", features=WORKS)

    pool.drain("a-1")
    assert pool.state("a-1") is AgentState.DRAINING

    late = pool.heartbeat("a-1", pool_in_flight={"rag.search": 1}, draining=True)
    assert pool.state("a-1") is AgentState.DRAINING and sent(late, DrainComplete) == []
    pool.heartbeat("a-1", pool_in_flight={}, draining=True)
    assert pool.state("a-1") is None


def test_an_agent_that_does_not_report_pool_work_drains_on_its_leases(pool: Pool) -> None:
    pool.register("a-1", search(2), deployment="rag")
    lease = pool.lease("rag.search")
    pool.drain("a-1")
    assert pool.state("a-1") is AgentState.DRAINING

    out = pool.release(lease.lease_id)

    assert pool.state("a-1") is None and sent(out, DrainComplete)


def test_a_lease_released_during_a_drain_waits_for_the_pool_work_too(pool: Pool) -> None:
    pool.register("a-1", search(3), deployment="rag", features=WORKS)
    lease = pool.lease("rag.search")
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})
    pool.drain("a-1")
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1}, draining=True)

    pool.release(lease.lease_id)
    assert pool.state("a-1") is AgentState.DRAINING
    pool.heartbeat("a-1", pool_in_flight={}, draining=True)
    assert pool.state("a-1") is None


def _scaled_pool(scale_down_idle_s: float = 300, start_s: float = 10) -> Pool:
    policy = ScalingPolicy(
        "rag", min_replicas=1, max_replicas=5, window_s=5,
        scale_down_idle_s=scale_down_idle_s, start_s=start_s,
    )  # fmt: skip
    settings = PoolSettings(scaling=(policy,))
    p = Pool(settings=settings)
    p.core.handle(ScaleObserved("rag", 1), p.clock.now())
    return p


def test_scale_down_never_picks_an_agent_busy_with_pool_work() -> None:
    pool = _scaled_pool(scale_down_idle_s=10)
    pool.core.handle(ScaleObserved("rag", 2), pool.clock.now())
    pool.register("a-1", search(), deployment="rag", features=WORKS)
    pool.register("a-2", search(), deployment="rag", features=WORKS)
    pool.heartbeat("a-1", pool_in_flight={"rag.search": 1})

    out = pool.run_for(30, heartbeats=["a-2"])

    scale = [cmd for cmd in out if isinstance(cmd, ScaleTo)]
    assert [s.remove_first for s in scale] == ["a-2"]
    assert pool.state("a-1") is AgentState.BUSY


def test_admission_misses_coalesce_into_one_scale_step_per_window() -> None:
    pool = _scaled_pool()
    pool.register("a-1", search(), deployment="rag", features=WORKS)
    for _ in range(500):
        pool.core.handle(CapacityMissed("rag", "CAPACITY"), pool.clock.now())
    first = pool.run_for(6, heartbeats=["a-1"])
    for _ in range(500):  # the new replica has not registered: it is pending
        pool.core.handle(CapacityMissed("rag", "CAPACITY"), pool.clock.now())
    second = pool.run_for(6, heartbeats=["a-1"])

    steps = [cmd for cmd in first + second if isinstance(cmd, ScaleTo)]
    assert [(s.deployment, s.replicas) for s in steps] == [("rag", 2)]
    assert pool.core.counters["admission_capacity_misses"] == 1000


def test_a_miss_for_a_pool_without_a_policy_scales_nothing(pool: Pool) -> None:
    pool.core.handle(CapacityMissed("rag", "NO_LIVE_AGENT"), pool.clock.now())
    assert pool.core.counters["admission_capacity_misses"] == 0
    assert pool.core.live_capacity(pool.clock.now()).retry_s == {}


def retry_s(pool: Pool) -> float:
    return pool.core.live_capacity(pool.clock.now()).retry_s["rag"]


def test_the_retry_hint_follows_the_pending_scale_up() -> None:
    pool = _scaled_pool(start_s=8)
    pool.register("a-1", search(), deployment="rag", features=WORKS)
    assert retry_s(pool) == 5 + 8  # nothing under way: a window, then a start

    pool.core.handle(CapacityMissed("rag", "CAPACITY"), pool.clock.now())
    pool.clock.advance(2)
    assert retry_s(pool) == pytest.approx(3 + 8)  # the rest of the window, then a start

    out = pool.run_for(4, heartbeats=["a-1"])  # the window closes: one more replica
    assert [(c.deployment, c.replicas) for c in out if isinstance(c, ScaleTo)] == [("rag", 2)]
    pool.run_for(3, heartbeats=["a-1"])
    assert retry_s(pool) == pytest.approx(8 - 3)  # it is starting since the planner saw it


def test_a_replica_replacing_a_drained_one_is_waited_for_not_scaled_past() -> None:
    """The only agent drains; its replacement (the controller's) arrives within the window in
    which producers were refused NO_LIVE_AGENT: no extra replica for that window."""
    pool = _scaled_pool()
    pool.register("a-1", search(), deployment="rag", features=WORKS)
    pool.drain("a-1")
    pool.heartbeat("a-1", draining=True)  # drained, gone
    pool.core.handle(CapacityMissed("rag", "NO_LIVE_AGENT"), pool.clock.now())
    out = pool.run_for(2)
    pool.register("a-2", search(), deployment="rag", features=WORKS)
    out += pool.run_for(6, heartbeats=["a-2"])

    assert [cmd for cmd in out if isinstance(cmd, ScaleTo)] == []


# ---- no credentials, no work: the agent is told of its leases ---------------------------------
def test_an_agent_that_hears_leases_is_told_of_one_before_the_producer_and_when_it_ends(
    pool: Pool,
) -> None:
    pool.register("a-1", search(2), deployment="rag", features=(c.FEATURE_LEASE_NOTICES,))

    out = pool.acquire_commands("rag.search", lease_id="lease-x")

    notices = sent(out, LeaseNotice)
    assert [(n.lease_id, n.capability, n.ended) for _, n in notices] == [
        ("lease-x", "rag.search", False)
    ]
    assert notices[0][1].expires_in_s == pytest.approx(pool.core.settings.default_lease_ttl_s)
    told = next(i for i, cmd in enumerate(out) if isinstance(cmd, SendToAgent))
    answered = next(i for i, cmd in enumerate(out) if isinstance(cmd, Reply))
    assert told < answered  # the shell carries commands out in order

    ended = sent(pool.release("lease-x"), LeaseNotice)
    assert [(n.lease_id, n.ended) for _, n in ended] == [("lease-x", True)]


def test_an_expired_lease_is_ended_at_the_agent_too(pool: Pool) -> None:
    pool.register("a-1", search(2), deployment="rag", features=(c.FEATURE_LEASE_NOTICES,))
    pool.lease("rag.search", ttl_s=5)

    out = pool.run_for(6, heartbeats=["a-1"])

    assert [n.ended for _, n in sent(out, LeaseNotice)] == [True]


def test_an_agent_without_the_feature_is_sent_no_lease_notices(pool: Pool) -> None:
    pool.register("a-1", search(2), deployment="rag")
    lease = pool.lease("rag.search")
    assert sent(pool.release(lease.lease_id), LeaseNotice) == []
