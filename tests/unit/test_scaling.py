"""Scaling decisions, driven through the core with events and a fake clock."""

from __future__ import annotations

import pytest

from mesh.core import DeletePod, PoolSettings, ScaleObserved, ScaleTo, ScalingPolicy
from mesh.wire import DrainComplete, Lease, Reason, Refusal

from .builders import Command, Pool, capability, log_entries, sent

POLICY = ScalingPolicy(
    deployment="pool",
    capabilities=("calc.add",),
    min_replicas=1,
    max_replicas=4,
    window_s=5.0,
    scale_down_idle_s=60.0,
)


def scaled(commands: list[Command]) -> list[ScaleTo]:
    return [cmd for cmd in commands if isinstance(cmd, ScaleTo)]


@pytest.fixture
def pool() -> Pool:
    p = Pool(settings=PoolSettings(scaling=(POLICY,)))
    p.core.handle(ScaleObserved("pool", 1), p.clock.now())
    p.register("calc-1", capability(max_concurrency=1))
    return p


def miss(pool: Pool) -> None:
    refusal = pool.acquire()
    assert isinstance(refusal, Refusal) and refusal.reason is Reason.NO_AGENT_AVAILABLE


def test_a_burst_of_misses_inside_the_window_becomes_one_scale_up(pool: Pool) -> None:
    assert isinstance(pool.acquire(), Lease)  # the only slot is taken
    for _ in range(100):
        miss(pool)

    out = pool.run_for(4)
    assert scaled(out) == []  # still coalescing
    out = pool.run_for(2)

    [decision] = scaled(out)
    assert (decision.deployment, decision.replicas, decision.remove_first) == ("pool", 2, None)
    assert "100 capacity miss(es)" in decision.reason
    assert [e.kind for e in log_entries(out, "scale")] == ["scale"]


def test_replicas_that_started_but_have_not_registered_stop_a_second_scale_up(
    pool: Pool,
) -> None:
    assert isinstance(pool.acquire(), Lease)
    miss(pool)
    assert len(scaled(pool.run_for(6))) == 1  # desired 2, one registered: one pending

    for _ in range(50):
        miss(pool)
    assert scaled(pool.run_for(6, heartbeats=["calc-1"])) == []  # the pod is still booting

    pool.register("calc-2", capability(max_concurrency=1))
    assert isinstance(pool.acquire(), Lease)  # the new capacity is used at once
    miss(pool)
    [decision] = scaled(pool.run_for(6, heartbeats=["calc-1", "calc-2"]))
    assert decision.replicas == 3


def test_scaling_up_stops_at_max_replicas(pool: Pool) -> None:
    pool.core.handle(ScaleObserved("pool", 4), pool.clock.now())
    for agent_id in ("calc-2", "calc-3", "calc-4"):
        pool.register(agent_id, capability(max_concurrency=1))
    for _ in range(4):
        assert isinstance(pool.acquire(), Lease)
    miss(pool)

    assert scaled(pool.run_for(6)) == []


def test_misses_for_a_capability_nobody_offers_yet_scale_the_policy_deployment() -> None:
    pool = Pool(settings=PoolSettings(scaling=(POLICY,)))
    pool.core.handle(ScaleObserved("pool", 1), pool.clock.now())
    pool.register("calc-1", capability(max_concurrency=1))
    pool.deregister("calc-1")  # the deployment's only agent left; desired is still 1

    refusal = pool.acquire()
    assert isinstance(refusal, Refusal) and refusal.reason is Reason.UNKNOWN_CAPABILITY
    # One replica is still pending (desired 1, none live): no storm while it restarts.
    assert scaled(pool.run_for(6)) == []


def test_below_min_replicas_scales_up_without_waiting_for_misses() -> None:
    pool = Pool(settings=PoolSettings(scaling=(POLICY,)))
    pool.core.handle(ScaleObserved("pool", 0), pool.clock.now())

    [decision] = scaled(pool.tick())

    assert (decision.replicas, decision.reason) == (1, "below min_replicas=1")


def test_an_unobserved_deployment_is_never_scaled() -> None:
    pool = Pool(settings=PoolSettings(scaling=(POLICY,)))
    assert scaled(pool.run_for(10)) == []


def test_scale_down_picks_only_an_idle_agent_and_drains_it_first(pool: Pool) -> None:
    pool.core.handle(ScaleObserved("pool", 3), pool.clock.now())
    pool.register("calc-2", capability(max_concurrency=1))
    pool.register("calc-3", capability(max_concurrency=1))
    held = pool.lease(agent_id="calc-1")  # calc-1 holds work for the whole test
    pool.lease(agent_id="calc-3")
    beating = ["calc-1", "calc-2", "calc-3"]

    out = pool.run_for(59, heartbeats=beating)
    assert scaled(out) == []  # nobody idle for 60 s yet

    out = pool.run_for(2, heartbeats=beating)
    [decision] = scaled(out)
    assert (decision.replicas, decision.remove_first) == (2, "calc-2")
    # Drained before it goes: out of the index, terminated, told it may exit.
    assert sent(out, DrainComplete) == [("calc-2", DrainComplete(agent_id="calc-2"))]
    assert "calc-2" not in pool.core.agents
    assert held.agent_id in pool.core.agents and pool.core.agents["calc-1"].in_flight == 1

    # calc-1 and calc-3 stay busy: nothing else may be removed, however long we wait.
    assert scaled(pool.run_for(120, heartbeats=["calc-1", "calc-3"])) == []


def test_a_lost_agent_of_a_managed_deployment_has_its_pod_deleted_once(pool: Pool) -> None:
    out = pool.run_for(40)

    deletes = [cmd for cmd in out if isinstance(cmd, DeletePod)]
    assert [(d.deployment, d.pod) for d in deletes] == [("pool", "calc-1")]
    assert "no heartbeat" in deletes[0].reason


def test_agents_of_unmanaged_deployments_are_never_scaled_or_deleted() -> None:
    pool = Pool()
    pool.register("calc-1", capability(max_concurrency=1))
    assert isinstance(pool.acquire(), Lease)
    for _ in range(10):
        miss(pool)

    out = pool.run_for(40)

    assert scaled(out) == []
    assert not any(isinstance(cmd, DeletePod) for cmd in out)


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_replicas", -1), ("max_replicas", 0), ("scale_up_step", 0), ("window_s", 0)],
)
def test_a_policy_that_makes_no_sense_is_refused(field: str, value: float) -> None:
    args = {"deployment": "pool", "min_replicas": 1, "max_replicas": 3, field: value}
    with pytest.raises(ValueError, match="pool"):
        ScalingPolicy(**args)  # type: ignore[arg-type]


def test_a_lease_refused_for_want_of_an_agent_says_when_to_ask_again(pool: Pool) -> None:
    assert isinstance(pool.acquire(), Lease)  # the only slot
    refusal = pool.acquire()
    assert isinstance(refusal, Refusal) and refusal.reason is Reason.NO_AGENT_AVAILABLE
    # The miss opened the policy's window: a replica may come at its end plus a start.
    expected_ms = round(1000 * (POLICY.window_s + POLICY.start_s))
    assert refusal.retry_after_ms == expected_ms


def test_without_a_scaling_policy_the_lease_retry_hint_is_the_default() -> None:
    from mesh.core.leases import NO_AGENT_RETRY_MS

    p = Pool()
    p.register("calc-1", capability(max_concurrency=1))
    assert isinstance(p.acquire(), Lease)
    refusal = p.acquire()
    assert isinstance(refusal, Refusal) and refusal.retry_after_ms == NO_AGENT_RETRY_MS
