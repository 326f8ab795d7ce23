"""The agent pool manager's brain: events in, commands out, no I/O.

Theory of operation
-------------------
:class:`PoolCore` is the one entry point: the asyncio shell (``mesh.manager``) decodes a
delivery, calls ``handle(event, now)``, carries out the returned commands (journal append,
publishes, replies) and only then acks. Queries (``find_by_capability``, ``live_capacity``,
``status``) are plain method calls that change nothing.

Each kind of event is handled by one room, and every room changes agents only through the
shared :class:`~mesh.core.registry.Registry` (records, capability index, tally, live
capacity), which it receives explicitly:

* :mod:`mesh.core.registration` — registrations accepted or refused, deregistrations.
* :mod:`mesh.core.heartbeats` — heartbeats, and with them the one count of work: each
  agent's in-flight count per capability is its leased slots plus the pool tasks it reported
  running. ``find_by_capability``'s free slots, the Busy label, drain completion and
  scale-down idleness all read this count.
* :mod:`mesh.core.liveness` — eviction of silent agents, suspended while the manager itself
  stalled or lost the broker.
* :mod:`mesh.core.leases` — the direct lease path: find, acquire, release, expiry.
* :mod:`mesh.core.drains` — Draining at once, Terminated once nothing is in flight.
* Live capacity (:mod:`mesh.core.capacity`): per pool, capability and version, the Ready and
  Busy agents and their concurrency not held by leases, kept as a running aggregate;
  admission grants at most that (``live_capacity``).
* Scaling (:mod:`mesh.core.scaling`): capacity misses, observed replicas, admission's
  demand figures and accepted registrations (each a measured start) feed the scale planner;
  on each tick its decisions become scale commands and drains here.

Nothing here raises for an expected outcome: refusals are ``Refusal`` values
with a :class:`~mesh.wire.reasons.Reason`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh import constants as c
from mesh.core.capacity import LiveCapacity
from mesh.core.drains import Drains
from mesh.core.events import (
    AcceptanceUndelivered,
    AcquireRequested,
    AppendLog,
    CapacityMissed,
    Command,
    ConnectionLost,
    ConnectionRestored,
    DemandObserved,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FindRequested,
    HeartbeatReceived,
    Instant,
    LogEntry,
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    ScaleObserved,
    ScaleTo,
    Tick,
)
from mesh.core.heartbeats import Heartbeats
from mesh.core.index import Candidate, CapabilityIndex
from mesh.core.leases import Leases
from mesh.core.lifecycle import AgentState
from mesh.core.liveness import Liveness
from mesh.core.registration import Registrations
from mesh.core.registry import AgentRecord, LeaseRecord, Registry
from mesh.core.scaling import IdleAgent, ScalePlanner, ScalingPolicy
from mesh.core.tally import FleetTally
from mesh.wire.models import AcquireRequest, Heartbeat, Lease, LeaseGranted, Refusal
from mesh.wire.status import AgentStatus, CapabilityStatus


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Knobs of the core. Defaults are the production ones."""

    min_heartbeat_interval_s: float = c.MIN_HEARTBEAT_INTERVAL_S
    missed_heartbeats_before_lost: int = c.MISSED_HEARTBEATS_BEFORE_LOST
    default_lease_ttl_s: float = c.DEFAULT_LEASE_TTL_S
    stall_threshold_s: float = 3.0  # a gap between ticks longer than this is a manager stall
    reregister_backoff_s: float = 5.0  # ask an unknown agent to re-register at most this often
    # How far one heartbeat may move its agent's ``seq``: this many, plus this many a second
    # since the last one accepted (the SDK sends one at most every 20 ms: 50 a second). One
    # forged heartbeat with a huge ``seq`` would otherwise make every real one after it stale.
    heartbeat_seq_slack: int = 1_000
    heartbeat_seq_per_s: float = 100.0
    scaling: tuple[ScalingPolicy, ...] = ()  # deployments the manager may scale


class PoolCore:
    """Registry, capability index, lifecycle and leases. Single caller, no locks, no I/O."""

    heartbeat: Callable[[Heartbeat, Instant], list[Command]]
    """``handle(HeartbeatReceived(hb), now)``, without the event's allocation and dispatch:
    the door of the manager's hottest path (:mod:`mesh.manager.heartbeats`). The heartbeat
    room's own method, bound in ``__init__`` so that path pays no call of ours on the way."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings = settings or PoolSettings()
        self.counters: Counter[str] = Counter()
        self.registry = registry = Registry(self.counters)
        self.scaling = ScalePlanner(settings.scaling)
        self.drains = Drains(registry)
        self.liveness = Liveness(
            registry,
            self.scaling,
            missed_heartbeats_before_lost=settings.missed_heartbeats_before_lost,
            stall_threshold_s=settings.stall_threshold_s,
        )
        self.heartbeats = Heartbeats(
            registry,
            self.drains,
            seq_slack=settings.heartbeat_seq_slack,
            seq_per_s=settings.heartbeat_seq_per_s,
            reregister_backoff_s=settings.reregister_backoff_s,
        )
        self.heartbeat = self.heartbeats.heartbeat
        self.registrations = Registrations(
            registry, self.liveness, min_heartbeat_interval_s=settings.min_heartbeat_interval_s
        )
        self.lease_path = Leases(
            registry, self.drains, self.scaling, default_ttl_s=settings.default_lease_ttl_s
        )
        self._handlers: dict[type[Any], Callable[[Any, Instant], list[Command]]] = {
            HeartbeatReceived: self._on_heartbeat,
            RegistrationReceived: self._on_registration,
            DeregistrationReceived: self.registrations.on_deregistration,
            FindRequested: self._on_find,
            AcquireRequested: self._on_acquire,
            ReleaseRequested: self._on_release,
            DrainRequested: self.drains.on_drain,
            AcceptanceUndelivered: self.registrations.on_acceptance_undelivered,
            Tick: self._on_tick,
            ConnectionLost: self._on_connection_lost,
            ConnectionRestored: self._on_connection_restored,
            ScaleObserved: self._on_scale_observed,
            CapacityMissed: self._on_capacity_missed,
            DemandObserved: self._on_demand_observed,
        }

    # ---- the registry's tables, read by the manager, the metrics and the tests ----------------
    @property
    def agents(self) -> dict[str, AgentRecord]:
        return self.registry.agents

    @property
    def leases(self) -> dict[str, LeaseRecord]:
        return self.registry.leases

    @property
    def index(self) -> CapabilityIndex:
        return self.registry.index

    @property
    def tally(self) -> FleetTally:
        return self.registry.tally

    # ---- the one entry point for changes ---------------------------------------------------
    def handle(self, event: Event, now: Instant) -> list[Command]:
        """Apply one event; return the commands the shell must carry out, in order."""
        return self._handlers[type(event)](event, now)

    def acquire(
        self, request: AcquireRequest, lease_id: str, now: Instant, holder: str | None = None
    ) -> tuple[Lease | Refusal, list[Command]]:
        """Lease one slot; returns the lease (or a refusal) and the log commands.

        Idempotent per ``lease_id``: a redelivered request gets the lease it already holds.
        """
        return self.lease_path.acquire(request, lease_id, now, holder)

    def release(
        self, lease_id: str, now: Instant, reason: str = "released", by: str | None = None
    ) -> list[Command]:
        """Give a leased slot back. Unknown leases are refused (as a Reply), never fatal.
        ``by``: who asks (``None``: the manager itself — expiry, an undeliverable grant); a
        lease bound to a holder is released only by that holder."""
        return self.lease_path.release(lease_id, now, reason, by)

    def hand_over(self, leaves: Callable[[str], bool]) -> list[AgentRecord]:
        """Forget every agent whose pool ``leaves`` (its shard is another manager's now),
        without a lifecycle transition: see :meth:`Registry.hand_over`. Returns them."""
        return self.registry.hand_over(leaves)

    # ---- queries -----------------------------------------------------------------------------
    def find_by_capability(
        self, name: str, version_spec: str = ">=0", limit: int | None = None
    ) -> list[Candidate]:
        """Agents that can take work now, cheapest cost class first, then least loaded.

        An empty list is a normal answer. Raises :class:`InvalidVersionSpec` for a bad spec.
        """
        return self.index.find(name, version_spec, limit)

    def live_capacity(self, now: Instant) -> LiveCapacity:
        """What every pool can do now (:mod:`mesh.core.capacity`): an immutable snapshot,
        rebuilt only when the live aggregate or the scale planner's retry hints changed."""
        retry = {
            deployment: eta
            for deployment in self.scaling.deployments
            if (eta := self.scaling.capacity_expected_in_s(deployment, now.mono)) is not None
        }
        return self.registry.live.snapshot(retry)

    def status(self, now: Instant, offset: int = 0, limit: int | None = None) -> list[AgentStatus]:
        """Agent rows in agent-ID order: all of them, or the page ``[offset, offset+limit)``.
        The order is sorted once per change of the agent set, not per page."""
        end = None if limit is None else offset + limit
        out = []
        for agent_id in self.registry.sorted_ids()[offset:end]:
            agent = self.agents[agent_id]
            caps = [
                CapabilityStatus(
                    name=s.capability,
                    version=s.version,
                    cost_class=s.cost_class,
                    in_flight=s.in_flight,
                    max_concurrency=s.max_concurrency,
                )
                for s in agent.slots.values()
            ]
            hb_age = None if agent.last_heartbeat_at is None else now.mono - agent.last_heartbeat_at
            out.append(
                AgentStatus(
                    agent_id=agent.agent_id,
                    deployment=agent.deployment,
                    state=agent.state.value,
                    capabilities=caps,
                    in_flight=agent.in_flight,
                    last_heartbeat_age_s=hb_age,
                    registered_age_s=now.mono - agent.registered_at,
                )
            )
        return out

    # ---- events handed to the rooms ----------------------------------------------------------
    def _on_registration(self, event: RegistrationReceived, now: Instant) -> list[Command]:
        """The registration room decides; an agent it accepted is a start the scale planner
        measures (the time from the scale-up that asked for it)."""
        agent_id = event.registration.agent_id
        before = self.agents.get(agent_id)
        out = self.registrations.on_registration(event, now)
        after = self.agents.get(agent_id)
        if after is not None and after is not before and after.state is not AgentState.DRAINING:
            start_s = self.scaling.registered(after.deployment, now.mono)
            if start_s is not None:
                self.counters["starts_measured"] += 1
        return out

    def _on_heartbeat(self, event: HeartbeatReceived, now: Instant) -> list[Command]:
        return self.heartbeats.heartbeat(event.heartbeat, now)

    def _on_find(self, event: FindRequested, now: Instant) -> list[Command]:
        return self.lease_path.find(event)

    def _on_acquire(self, event: AcquireRequested, now: Instant) -> list[Command]:
        result, out = self.lease_path.acquire(event.request, event.lease_id, now, event.holder)
        reply = LeaseGranted(lease=result) if isinstance(result, Lease) else result
        return [*out, Reply(reply)]

    def _on_release(self, event: ReleaseRequested, now: Instant) -> list[Command]:
        return self.lease_path.release(event.lease_id, now, by=event.by)

    def _on_connection_lost(self, event: ConnectionLost, now: Instant) -> list[Command]:
        self.liveness.connection_lost(now)
        return []

    def _on_connection_restored(self, event: ConnectionRestored, now: Instant) -> list[Command]:
        return self.liveness.connection_restored(now)

    # ---- time --------------------------------------------------------------------------------
    def _on_tick(self, event: Tick, now: Instant) -> list[Command]:
        out = self.liveness.ticked(now)
        out += self.lease_path.expire(now)
        out += self.liveness.evict_silent(now)
        self.heartbeats.forget_old_asks(now)
        if self.scaling.deployments:
            out += self._scale(now)
        return out

    # ---- scaling -----------------------------------------------------------------------------
    def _on_scale_observed(self, event: ScaleObserved, now: Instant) -> list[Command]:
        self.scaling.observed(event.deployment, event.replicas, now.mono)
        return []

    def _on_demand_observed(self, event: DemandObserved, now: Instant) -> list[Command]:
        self.scaling.observe_demand(event.demand, now.mono)
        return []

    def _on_capacity_missed(self, event: CapacityMissed, now: Instant) -> list[Command]:
        if self.scaling.manages(event.pool_id):
            self.counters["admission_capacity_misses"] += 1
            self.scaling.record_pool_miss(event.pool_id, now.mono)
        return []

    def _scale(self, now: Instant) -> list[Command]:
        """The managed deployments' live and idle agents to the scale planner; each of its
        decisions becomes a scale command, and a scale-down's chosen agent is drained."""
        live: Counter[str] = Counter()
        busy: Counter[str] = Counter()  # with work in flight, draining or not
        idle: dict[str, list[IdleAgent]] = {}
        for agent in self.agents.values():
            if not self.scaling.manages(agent.deployment):
                continue
            if agent.in_flight:
                busy[agent.deployment] += 1
            if agent.state is not AgentState.DRAINING:
                live[agent.deployment] += 1
            if agent.state is AgentState.READY and agent.in_flight == 0:
                idle.setdefault(agent.deployment, []).append(
                    IdleAgent(agent.agent_id, agent.idle_since)
                )
        out: list[Command] = []
        for decision in self.scaling.plan(now.mono, live, idle, busy):
            self.counters["scale_decisions"] += 1
            entry = LogEntry(
                at=now.wall,
                kind="scale",
                agent_id=decision.remove_first or "",
                reason=decision.reason,
                detail={"deployment": decision.deployment, "replicas": decision.replicas},
            )
            out += [
                AppendLog(entry),
                ScaleTo(
                    decision.deployment, decision.replicas, decision.reason, decision.remove_first
                ),
            ]
            victim = self.agents.get(decision.remove_first or "")
            if victim is not None:
                out += self.drains.drain(victim, f"scale-down: {decision.reason}", now)
        return out
