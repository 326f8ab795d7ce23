"""Scale to zero without killing work, with the clock controlled: the pool core (registry and
scale planner) and the admission core (a real SQLite ledger) driven together as the manager
drives them — admission's misses and demand go to the pool core, the pool core's live
capacity and retry hints go to admission."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh.core import (
    CapacityMissed,
    DemandObserved,
    PoolDemand,
    PoolSettings,
    ScaleObserved,
    ScaleTo,
    ScalingPolicy,
    admission_demand,
)
from mesh.core.events import Command
from mesh.core.lifecycle import AgentState
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.wire import AdmissionDecision, AdmissionReason, AdmissionRequest, Reason

from .builders import Pool
from .samples import DESCRIPTOR, REQUIREMENTS
from .test_one_count import WORKS, search

POOL = DESCRIPTOR.pool_id
POLICY = ScalingPolicy(
    POOL, min_replicas=0, max_replicas=3, window_s=5, scale_down_idle_s=30, start_s=7,
    scale_to_zero_after_s=60,
)  # fmt: skip


@dataclass
class Mesh:
    """A pool core and an admitter, wired as the manager wires them."""

    pool: Pool
    admitter: Admitter
    scaled: list[ScaleTo] = field(default_factory=list)
    ids: Iterator[int] = field(default_factory=lambda: iter(range(1_000_000)))

    @property
    def wall(self) -> float:
        return self.pool.clock.now().wall

    def submit(
        self, admission_id: str | None = None, *, deadline: bool = False
    ) -> AdmissionDecision:
        """One admission request, decided against the registry's live capacity; its misses
        go to the pool core, as the admission service sends them."""
        reqs = REQUIREMENTS.model_copy(
            update={
                "needs_sandbox": False, "required_tools": [], "allowed_fallbacks": [],
                "deadline": REQUIREMENTS.deadline if deadline else None,
            }
        )  # fmt: skip
        request = AdmissionRequest(
            admission_id=admission_id or f"adm-{next(self.ids)}", requirements=reqs
        )
        live = self.pool.core.live_capacity(self.pool.clock.now())
        decision = self.admitter.admit(request, "tenant-a", self.wall, live)
        for pool_id, reason in self.admitter.drain_misses():
            self.keep(self.pool.core.handle(CapacityMissed(pool_id, reason), self.pool.clock.now()))
        return decision

    def release(self, decision: AdmissionDecision) -> None:
        assert decision.grant is not None
        self.admitter.ledger.release(decision.admission_id, decision.grant.fence, self.wall)
        self.admitter.core.ended(decision.admission_id, self.wall, completed=True)

    def run_for(
        self,
        seconds: float,
        heartbeats: tuple[str, ...] = (),
        pool_in_flight: dict[str, int] | None = None,
    ) -> list[ScaleTo]:
        """Tick once a second as the manager does: the pool core, then admission's figures
        (the ledger's usage, each pool's line) as demand, each of ``heartbeats`` reporting
        ``pool_in_flight`` before. The scale commands of the run."""
        before = len(self.scaled)
        for _ in range(round(seconds)):
            self.pool.clock.advance(1)
            for agent_id in heartbeats:
                self.pool.heartbeat(agent_id, pool_in_flight=pool_in_flight)
            self.keep(self.pool.tick())
            self.admitter.observe(self.wall)
            demand = admission_demand(self.admitter.core, self.wall)
            self.keep(self.pool.core.handle(DemandObserved(demand), self.pool.clock.now()))
        return self.scaled[before:]

    def keep(self, commands: list[Command]) -> None:
        self.scaled += [c for c in commands if isinstance(c, ScaleTo)]

    def register(self, agent_id: str, max_concurrency: int = 4) -> None:
        self.pool.register(agent_id, search(max_concurrency), deployment=POOL, features=WORKS)


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=600)
    admitter = Admitter(ledger, policy, rand=lambda: 0.0)  # no jitter: exact retry times
    pool = Pool(settings=PoolSettings(scaling=(POLICY,)))
    assert admitter.publish_descriptor(DESCRIPTOR, pool.clock.now().wall) is None
    pool.core.handle(ScaleObserved(POOL, 0), pool.clock.now())  # the scaler: at zero
    yield Mesh(pool, admitter)
    ledger.close()


def test_a_request_for_a_pool_at_zero_is_deferred_scales_up_once_and_is_served(
    mesh: Mesh,
) -> None:
    decision = mesh.submit("adm-1")
    # Deferred, never rejected: the retry time is the pool's start estimate (start_s until
    # a start is measured; no jitter here), not the default of a pool nobody can scale.
    assert (decision.outcome, decision.reason) == ("deferred", AdmissionReason.NO_LIVE_AGENT)
    assert decision.retry_after_ms == 7_000
    assert decision.retry_after_ms != mesh.admitter.policy.pressure.retry_default_ms

    for _ in range(20):  # a crowd asks meanwhile
        assert mesh.submit().outcome == "deferred"
    [up] = mesh.run_for(1)  # at zero: the next tick, no window
    assert (up.deployment, up.replicas) == (POOL, 1)
    for _ in range(3):  # more ask while the replica starts: still that one scale-up
        assert mesh.submit().outcome == "deferred"
        assert mesh.run_for(1) == []
    mesh.register("rag-1")

    again = mesh.submit("adm-1")  # the producer comes back with the same ID
    assert again.outcome == "admitted" and again.grant is not None
    assert mesh.run_for(30, heartbeats=("rag-1",)) == []  # and nothing more is asked for
    assert [s.replicas for s in mesh.scaled] == [1]


def test_the_retry_time_is_the_start_measured_for_that_pool(mesh: Mesh) -> None:
    mesh.submit()
    mesh.run_for(1)  # scaled up to 1
    mesh.run_for(4)
    mesh.register("rag-1")  # 4 s after the scale-up (the guess was 7 s)
    assert mesh.pool.core.scaling.start_estimate_s(POOL) == pytest.approx(4.0)

    # Idle long enough: back to zero; the next request waits for the measured start.
    assert [s.replicas for s in mesh.run_for(70, heartbeats=("rag-1",))] == [0]
    mesh.pool.heartbeat("rag-1", draining=True)  # drained, gone
    decision = mesh.submit()
    assert (decision.outcome, decision.retry_after_ms) == ("deferred", 4_000)

    # A second start, of 10 s, moves the estimate towards it (smoothed, not replaced).
    mesh.run_for(1)
    mesh.run_for(9)
    mesh.register("rag-2")
    assert 4.0 < mesh.pool.core.scaling.start_estimate_s(POOL) < 10.0  # type: ignore[operator]


def test_an_idle_pool_goes_from_one_to_zero_only_after_its_own_delay(mesh: Mesh) -> None:
    mesh.submit()
    mesh.run_for(1)
    mesh.register("rag-1")
    granted = mesh.submit()
    assert granted.outcome == "admitted"
    mesh.run_for(100, heartbeats=("rag-1",))  # the grant is held: no step down
    assert [s.replicas for s in mesh.scaled] == [1]

    mesh.release(granted)  # the work is done
    quiet = mesh.run_for(59, heartbeats=("rag-1",))
    assert quiet == []  # scale_down_idle_s (30) is not the last step's delay
    [down] = mesh.run_for(2, heartbeats=("rag-1",))
    assert (down.replicas, down.remove_first) == (0, "rag-1")
    assert mesh.pool.state("rag-1") is AgentState.DRAINING  # drained first, then removed


def test_the_way_down_is_n_to_one_then_zero(mesh: Mesh) -> None:
    mesh.pool.core.handle(ScaleObserved(POOL, 3), mesh.pool.clock.now())
    for i in (1, 2, 3):
        mesh.register(f"rag-{i}")
    steps = []
    alive = ["rag-1", "rag-2", "rag-3"]
    for _ in range(120):
        for s in mesh.run_for(1, heartbeats=tuple(alive)):
            steps.append((round(mesh.pool.clock.mono - 1000), s.replicas))
            if s.remove_first in alive:  # it drains and leaves
                mesh.pool.heartbeat(s.remove_first, draining=True)
                alive.remove(s.remove_first)
    # Two steps by the idle rule (30 s idle, then a window apart), the last after 60 s quiet.
    assert [r for _, r in steps] == [2, 1, 0]
    (t2, _), (t1, _), (t0, _) = steps
    assert t2 == 30 and t1 == 35
    assert t0 - t1 >= POLICY.scale_to_zero_after_s


def test_a_pool_with_a_task_running_never_goes_to_zero(mesh: Mesh) -> None:
    mesh.submit()
    mesh.run_for(1)
    mesh.register("rag-1")
    running = {"rag.search": 1}  # a pool task runs, the whole time
    assert mesh.run_for(10_000, heartbeats=("rag-1",), pool_in_flight=running) == []
    assert mesh.pool.state("rag-1") is AgentState.BUSY
    assert [s.replicas for s in mesh.scaled] == [1]
    # The same pool, once the task is done, goes to zero after the delay: the test above
    # fails because of the running task, not for another reason.
    assert [s.replicas for s in mesh.run_for(61, heartbeats=("rag-1",))] == [0]


def test_a_pool_with_a_lease_held_never_goes_to_zero(mesh: Mesh) -> None:
    mesh.submit()
    mesh.run_for(1)
    mesh.register("rag-1")
    lease = mesh.pool.lease("rag.search", ttl_s=86_400)
    assert mesh.run_for(5_000, heartbeats=("rag-1",)) == []
    mesh.pool.release(lease.lease_id)
    assert [s.replicas for s in mesh.run_for(61, heartbeats=("rag-1",))] == [0]


def test_a_pool_with_a_request_deferred_in_its_line_never_goes_to_zero(mesh: Mesh) -> None:
    mesh.submit()
    mesh.run_for(1)
    mesh.register("rag-1", max_concurrency=1)
    held = mesh.submit()
    waiting = mesh.submit("adm-waiting")
    assert (held.outcome, waiting.outcome, waiting.reason) == (
        "admitted", "deferred", AdmissionReason.CAPACITY,
    )  # fmt: skip
    assert admission_demand(mesh.admitter.core, mesh.wall)[POOL] == PoolDemand(
        queued=0, deferred=1, granted=1
    )
    mesh.release(held)
    # The grant is over; the deferred request keeps its place for as long as it keeps
    # coming back (admission's figures say so each tick).
    still_waiting = DemandObserved({POOL: PoolDemand(deferred=1)})
    for _ in range(5_000):
        mesh.pool.clock.advance(1)
        mesh.pool.heartbeat("rag-1")
        mesh.keep(mesh.pool.tick())
        mesh.keep(mesh.pool.core.handle(still_waiting, mesh.pool.clock.now()))
    assert 0 not in [s.replicas for s in mesh.scaled]
    assert mesh.pool.core.scaling.desired(POOL) == 1
    # Once it is gone (admitted elsewhere, or given up), the pool goes to zero.
    assert [s.replicas for s in mesh.run_for(61, heartbeats=("rag-1",))] == [0]


def test_without_a_scaler_a_pool_with_no_agent_is_deferred_as_before(tmp_path: Path) -> None:
    """No replica count observed (no scaler), or no policy: nothing is scaled, and the
    deferral's retry time is not a start estimate of a replica that will never come."""
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation)
    admitter = Admitter(ledger, policy, rand=lambda: 0.0)
    pool = Pool()  # no scaling policy
    assert admitter.publish_descriptor(DESCRIPTOR, pool.clock.now().wall) is None
    m = Mesh(pool, admitter)
    decision = m.submit()
    assert (decision.outcome, decision.reason) == ("deferred", AdmissionReason.NO_LIVE_AGENT)
    assert decision.retry_after_ms == policy.pressure.retry_default_ms
    assert m.run_for(30) == []
    ledger.close()


def test_scale_to_zero_after_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match=POOL):
        ScalingPolicy(POOL, min_replicas=0, scale_to_zero_after_s=0)


def test_a_lease_for_a_capability_of_a_pool_at_zero_says_when_its_replica_is_expected() -> None:
    policy = ScalingPolicy(POOL, capabilities=("rag.search",), min_replicas=0, start_s=7)
    pool = Pool(settings=PoolSettings(scaling=(policy,)))
    pool.core.handle(ScaleObserved(POOL, 0), pool.clock.now())

    refusals = [pool.acquire("rag.search") for _ in range(5)]

    assert {(r.reason, r.retry_after_ms) for r in refusals} == {  # type: ignore[union-attr]
        (Reason.UNKNOWN_CAPABILITY, 7_000)
    }
    ups = [c for c in pool.run_for(10) if isinstance(c, ScaleTo)]
    assert [(c.deployment, c.replicas) for c in ups] == [(POOL, 1)]
