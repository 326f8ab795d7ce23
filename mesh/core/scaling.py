"""Scaling decisions: when to ask for more replicas of a deployment, and which idle one to remove.

Theory of operation
-------------------
The planner is pure and lives inside the core; a scaler (Kubernetes, local
processes) only carries its decisions out. Each managed deployment has a
:class:`ScalingPolicy`; the core tells the planner about three things:

* **capacity misses** — on the lease path, an acquire by capability found no
  agent with a free slot (``NO_AGENT_AVAILABLE``), or none at all
  (``UNKNOWN_CAPABILITY``) for a capability the policy lists; on the admission
  path, a request deferred because the pool was full (``CAPACITY``) or had no
  live agent for the capability (``NO_LIVE_AGENT``). The first miss opens a
  window of ``window_s``; the misses in it are *coalesced*, whichever path
  they came from.
* **observed replicas** — what the scaler reports (at start, and after each
  change it applied), so the planner knows the desired count.
* **the registry** — on every tick, how many agents of the deployment are live
  (registered and not draining) and which of them are idle.

At the end of a window the planner asks for ``scale_up_step`` more replicas, up
to ``max_replicas``, but only if nothing is *pending*: ``desired - live``
replicas were requested and have not registered yet (pods starting). A burst of
a hundred misses therefore becomes one scale patch, and a second burst while
the new pod boots becomes none — no scale-up storm.

Scale-down removes one replica at a time, never more often than one change per
window, and only an agent that holds no work and has been idle for
``scale_down_idle_s`` (the longest idle first): it is drained first, and named
to the scaler as the one to remove. Below ``min_replicas`` the planner scales
up without waiting for misses.

Scale to zero
-------------
With ``min_replicas: 0`` the way down is n → 1 by the rules above, then 1 → 0 as
a step of its own: only when the pool's demand (:mod:`mesh.core.demand`: tasks
queued, in flight, grants held, requests deferred in its line, and capacity misses
until their requesters are due back) has been nil, and its agents idle, for
``scale_to_zero_after_s``. A pool with work running or a request waiting never goes
to zero, however long it waits.

A pool at zero replicas (desired 0, observed from a scaler) is brought back at the
first tick after a miss, without waiting for a window: one scale-up to 1 replica,
however many requests asked meanwhile, and none more while it starts. Its requests
are told to come back after the pool's *measured* start time
(:class:`~mesh.core.demand.StartEstimate`: from a scale-up to the pool's next
registration, smoothed; ``start_s`` until measured).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mesh.core.demand import PoolDemand, StartEstimate


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """How one deployment (agent pool) may scale."""

    deployment: str
    capabilities: tuple[str, ...] = ()
    min_replicas: int = 1
    max_replicas: int = 10
    scale_up_step: int = 1
    window_s: float = 5.0
    scale_down_idle_s: float = 300.0
    # How long a new replica takes to register (the retry hint meanwhile), until measured.
    start_s: float = 5.0
    # With min_replicas 0: how long nothing may wait, run or ask before the last replica goes.
    scale_to_zero_after_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"{self.deployment}: need 0 <= min_replicas ({self.min_replicas}) "
                f"<= max_replicas ({self.max_replicas})"
            )
        if (
            self.scale_up_step < 1
            or self.window_s <= 0
            or self.scale_down_idle_s <= 0
            or self.start_s <= 0
            or self.scale_to_zero_after_s <= 0
        ):
            raise ValueError(f"{self.deployment}: step >= 1 and positive durations required")


@dataclass(frozen=True, slots=True)
class IdleAgent:
    agent_id: str
    idle_since: float


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """Set ``deployment`` to ``replicas``; when shrinking, ``remove_first`` is the one to go."""

    deployment: str
    replicas: int
    reason: str
    remove_first: str | None = None


@dataclass(slots=True)
class _Pool:
    policy: ScalingPolicy
    desired: int | None = None
    misses: int = 0
    window_opened_at: float | None = None
    last_change_at: float | None = None
    short_since: float | None = None  # replicas were pending (desired > live) from then on
    pending_in_window: bool = False  # some were pending while the open window coalesced
    start: StartEstimate = field(default_factory=lambda: StartEstimate(0.0))
    demand: PoolDemand = field(default_factory=PoolDemand)  # admission's, as last observed
    # The last time the pool was asked for or worked (a miss: when its requester is due
    # back); the step to zero waits ``scale_to_zero_after_s`` past it.
    active_until: float | None = None

    def active(self, until: float) -> None:
        if self.active_until is None or until > self.active_until:
            self.active_until = until


class ScalePlanner:
    """Coalesces capacity misses into scale decisions per deployment. Pure: time is a parameter."""

    def __init__(self, policies: Iterable[ScalingPolicy]) -> None:
        self._pools = {p.deployment: _Pool(p, start=StartEstimate(p.start_s)) for p in policies}
        self._by_capability: dict[str, list[str]] = {}
        for pool in self._pools.values():
            for capability in pool.policy.capabilities:
                self._by_capability.setdefault(capability, []).append(pool.policy.deployment)

    def manages(self, deployment: str) -> bool:
        return deployment in self._pools

    @property
    def deployments(self) -> list[str]:
        return sorted(self._pools)

    def deployments_for(self, capability: str) -> list[str]:
        """The deployments whose policy lists ``capability``."""
        return list(self._by_capability.get(capability, ()))

    def desired(self, deployment: str) -> int | None:
        pool = self._pools.get(deployment)
        return None if pool is None else pool.desired

    def record_miss(self, capability: str, deployments: Iterable[str], now: float) -> None:
        """A capacity miss for ``capability``; ``deployments`` are those whose agents offer it
        now (the policy's own capability list is added)."""
        targets = set(self._by_capability.get(capability, ())) | {
            d for d in deployments if d in self._pools
        }
        for deployment in targets:
            self._missed(self._pools[deployment], now)

    def record_pool_miss(self, deployment: str, now: float) -> None:
        """A capacity miss of one pool (an admission deferred for its capacity or for want of
        a live agent); ignored for a deployment without a policy."""
        pool = self._pools.get(deployment)
        if pool is not None:
            self._missed(pool, now)

    def _missed(self, pool: _Pool, now: float) -> None:
        """One miss: coalesced in the window; its requester is due back after the retry hint
        it was given (up to a fifth later) and counts as demand until then, and a window more."""
        due_back = self._expected_in_s(pool, now) * 1.2 + pool.policy.window_s
        pool.misses += 1
        if pool.window_opened_at is None and pool.desired != 0:
            pool.window_opened_at = now  # at zero, the next tick scales up: no window
        pool.active(now + due_back)

    def observe_demand(self, demand: Mapping[str, PoolDemand], now: float) -> None:
        """Admission's figures of every pool (:func:`mesh.core.demand.admission_demand`); a
        managed pool it does not name has none."""
        for deployment, pool in self._pools.items():
            pool.demand = demand.get(deployment, PoolDemand())
            if pool.demand.total() > 0:
                pool.active(now)

    def registered(self, deployment: str, now: float) -> float | None:
        """An agent of ``deployment`` was accepted at ``now``: the start it measured, if a
        scale-up was waiting for it."""
        pool = self._pools.get(deployment)
        return None if pool is None else pool.start.registered(now)

    def start_estimate_s(self, deployment: str) -> float | None:
        """How long a new replica of ``deployment`` is expected to take to register."""
        pool = self._pools.get(deployment)
        return None if pool is None else pool.start.estimate_s

    def capacity_expected_in_s(self, deployment: str, now: float) -> float | None:
        """When more capacity may arrive for ``deployment`` (the retry hint of a refusal for
        its capacity); ``None`` without a policy. An estimate from the pool's measured start
        time (``start_s`` until measured): at zero replicas, a start (the next tick scales
        up); the rest of an open window plus a start; a replica asked for lately, the rest
        of its start; else a window (the miss being refused opens one) and a start. Replicas
        pending (fewer live than desired: starting, or replacing one that left) are expected
        a start after the planner first saw them missing."""
        pool = self._pools.get(deployment)
        return None if pool is None else self._expected_in_s(pool, now)

    @staticmethod
    def _expected_in_s(pool: _Pool, now: float) -> float:
        policy, start_s = pool.policy, pool.start.estimate_s
        if pool.short_since is not None:  # replicas asked for (or replacing one) are starting
            return max(0.5, pool.short_since + start_s - now)
        if pool.desired == 0 and policy.max_replicas >= 1:
            return max(0.5, start_s)  # at zero: scaled up at the next tick, no window
        if pool.window_opened_at is not None:
            return max(0.0, pool.window_opened_at + policy.window_s - now) + start_s
        return policy.window_s + start_s

    def observed(self, deployment: str, replicas: int | None, now: float | None = None) -> None:
        """The scaler says ``deployment`` has ``replicas`` (``now``: when; the step to zero
        never comes sooner than ``scale_to_zero_after_s`` after the first observation)."""
        pool = self._pools.get(deployment)
        if pool is not None and replicas is not None:
            pool.desired = replicas
            if now is not None and pool.active_until is None:
                pool.active(now)

    def plan(
        self,
        now: float,
        live: Mapping[str, int],
        idle: Mapping[str, Sequence[IdleAgent]],
        busy: Mapping[str, int] | None = None,
    ) -> list[ScaleDecision]:
        """Decisions due at ``now``. ``live``: registered, non-draining agents per deployment;
        ``idle``: those among them with nothing in flight; ``busy``: agents with work in
        flight, draining ones included."""
        decisions = []
        for deployment, pool in self._pools.items():
            if pool.desired is None:
                continue  # not observed yet: never guess a replica count
            if busy is not None and busy.get(deployment, 0) > 0:
                pool.active(now)
            self._note_pending(pool, now, pool.desired - live.get(deployment, 0))
            decision = self._plan_one(pool, now, live.get(deployment, 0), idle.get(deployment, ()))
            if decision is not None:
                if decision.replicas > pool.desired:
                    pool.start.asked(now)
                else:
                    pool.start.cancelled()
                pool.desired = decision.replicas
                pool.last_change_at = now
                decisions.append(decision)
        return decisions

    def _plan_one(
        self, pool: _Pool, now: float, live: int, idle: Sequence[IdleAgent]
    ) -> ScaleDecision | None:
        policy, desired = pool.policy, pool.desired or 0
        if desired < policy.min_replicas:
            return ScaleDecision(
                policy.deployment, policy.min_replicas, f"below min_replicas={policy.min_replicas}"
            )
        if desired == 0 and policy.max_replicas >= 1:
            return self._wake(pool)
        if pool.window_opened_at is not None:
            if now - pool.window_opened_at < policy.window_s:
                return None  # still coalescing
            return self._close_window(pool, desired, live)
        if desired == 1 and policy.min_replicas == 0:
            return self._maybe_scale_to_zero(pool, now, live, idle)
        return self._maybe_scale_down(pool, now, desired, idle)

    @staticmethod
    def _wake(pool: _Pool) -> ScaleDecision | None:
        """A pool at zero replicas: one replica as soon as anything asks for it, whatever
        number of requests did."""
        asked, waiting = pool.misses, pool.demand.total()
        if not asked and not waiting:
            return None
        pool.misses, pool.window_opened_at, pool.pending_in_window = 0, None, False
        return ScaleDecision(
            pool.policy.deployment,
            1,
            f"at zero replicas: {asked} request(s) deferred, {waiting} waiting",
        )

    @staticmethod
    def _maybe_scale_to_zero(
        pool: _Pool, now: float, live: int, idle: Sequence[IdleAgent]
    ) -> ScaleDecision | None:
        """The last replica goes only when nothing waits, nothing runs and nothing asked for
        the pool for ``scale_to_zero_after_s``: every live agent idle that long, no demand."""
        policy = pool.policy
        if pool.misses or pool.demand.total() or len(idle) < live:
            return None
        quiet_since = max(
            [pool.active_until or 0.0, pool.last_change_at or 0.0, *(a.idle_since for a in idle)]
        )
        if now - quiet_since < policy.scale_to_zero_after_s:
            return None
        victim = min(idle, key=lambda a: (a.idle_since, a.agent_id)) if idle else None
        return ScaleDecision(
            policy.deployment,
            0,
            f"nothing waiting, running or asked for {now - quiet_since:.0f} s",
            remove_first=victim.agent_id if victim is not None else None,
        )

    @staticmethod
    def _note_pending(pool: _Pool, now: float, pending: int) -> None:
        if pending <= 0:
            pool.short_since = None
            return
        if pool.short_since is None:
            pool.short_since = now
        if pool.window_opened_at is not None:
            pool.pending_in_window = True

    def _close_window(self, pool: _Pool, desired: int, live: int) -> ScaleDecision | None:
        policy, misses = pool.policy, pool.misses
        waited = pool.pending_in_window
        pool.misses, pool.window_opened_at, pool.pending_in_window = 0, None, False
        pending = max(0, desired - live)
        if pending > 0 or waited or desired >= policy.max_replicas:
            # Capacity is on its way, or came during the window (its misses were waiting
            # for it: the next window tells whether it is enough), or we may not grow.
            return None
        target = min(policy.max_replicas, desired + policy.scale_up_step)
        return ScaleDecision(
            policy.deployment,
            target,
            f"{misses} capacity miss(es) in {policy.window_s:g} s; {live} live, none pending",
        )

    def _maybe_scale_down(
        self, pool: _Pool, now: float, desired: int, idle: Sequence[IdleAgent]
    ) -> ScaleDecision | None:
        policy = pool.policy
        if desired <= policy.min_replicas:
            return None
        if pool.last_change_at is not None and now - pool.last_change_at < policy.window_s:
            return None
        quiet = [a for a in idle if now - a.idle_since >= policy.scale_down_idle_s]
        if not quiet:
            return None
        victim = min(quiet, key=lambda a: (a.idle_since, a.agent_id))
        return ScaleDecision(
            policy.deployment,
            desired - 1,
            f"{victim.agent_id} idle for {now - victim.idle_since:.0f} s",
            remove_first=victim.agent_id,
        )
