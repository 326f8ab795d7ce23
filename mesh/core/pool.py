"""The agent pool manager's brain: events in, commands out, no I/O.

Theory of operation
-------------------
:class:`PoolCore` owns the registry (agent records), the capability index and
the leases. The asyncio shell (``mesh.manager``) decodes a delivery, calls
``handle(event, now)``, carries out the returned commands (journal append,
publishes, replies) and only then acks. Queries (``find_by_capability``,
``status``) are plain method calls that change nothing.

* Registration: a record starts in Spawning, moves to Registering when its
  registration arrives and to Ready once accepted; the agent gets a
  ``RegistrationAccepted`` (or ``RegistrationRefused`` with a reason).
* One count of work: each agent's in-flight count per capability is its leased
  slots plus the tasks of its pool's shared queue (the admission path) that it
  reported running (``pool_in_flight`` in every heartbeat, which an SDK agent
  also sends as soon as that count changes: a full count each time, so a lost
  report is corrected by the next one). ``find_by_capability``'s free slots, the
  Busy label, drain completion and scale-down idleness all read this count.
* Leases: ``acquire`` takes one slot of one capability on one agent, gated on
  that count against ``max_concurrency``; ``release`` gives it back. Leases
  expire after their TTL so a crashed producer cannot pin an agent forever. An
  agent that lists ``lease-notices`` is told of each lease on it (issued, before
  the producer hears of it; ended) and runs a lease-path task only under one.
* Live capacity (:mod:`mesh.core.capacity`): per pool, capability and version,
  the Ready and Busy agents and their concurrency not held by leases, kept as a
  running aggregate; admission grants at most that (``live_capacity``).
* Drain: Draining at once (no new leases), Terminated once nothing is in flight
  on either path; the agent is then told it may exit. An agent that reports its
  pool work (feature ``work-reports``) must also have confirmed the drain — a
  heartbeat saying ``draining`` is sent only once it stopped taking pool tasks —
  so a pool task it claimed just before the drain is never missed.
* Liveness: receiver-side monotonic time. An agent not heard from for
  ``3 x heartbeat_interval_s`` is lost: Terminated and removed, its leases
  dropped. If the core itself was not ticked for a long while (the manager
  process stalled), or the manager lost the broker (``ConnectionLost`` until
  ``ConnectionRestored``), it hears nobody, so it evicts nobody for that
  silence: everyone gets a fresh window instead of a mass eviction.
* Every removal path goes through :meth:`PoolCore._remove`, which prunes the
  index, so ``find_by_capability`` never returns a ghost.

Nothing here raises for an expected outcome: refusals are ``Refusal`` values
with a :class:`~mesh.wire.reasons.Reason`.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet

from mesh import constants as c
from mesh.core.capacity import LiveCapacity, LiveOffer
from mesh.core.events import (
    AcceptanceUndelivered,
    AcquireRequested,
    Announce,
    AppendLog,
    CapacityMissed,
    Command,
    ConnectionLost,
    ConnectionRestored,
    DeletePod,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FenceAgent,
    FindRequested,
    HeartbeatReceived,
    Instant,
    LogEntry,
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    ScaleObserved,
    ScaleTo,
    SendToAgent,
    Tick,
)
from mesh.core.index import (
    Candidate,
    CapabilityIndex,
    InvalidVersionSpec,
    Slot,
    parse_spec,
    parse_version,
)
from mesh.core.lifecycle import ACQUIRABLE, AgentState, Trigger, next_state
from mesh.core.scaling import IdleAgent, ScalePlanner, ScalingPolicy
from mesh.core.tally import FleetTally
from mesh.wire.models import (
    AcquireRequest,
    AgentRegistration,
    AgentSummary,
    DrainAccepted,
    DrainComplete,
    DrainNotice,
    FindReply,
    Heartbeat,
    Lease,
    LeaseGranted,
    LeaseNotice,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    Released,
    ReRegisterRequest,
)
from mesh.wire.reasons import Reason
from mesh.wire.status import AgentStatus, CapabilityStatus

log = logging.getLogger(__name__)

_RECENTLY_TERMINATED_MAX = 10_000
_CAPACITY_MISSES = frozenset({Reason.NO_AGENT_AVAILABLE, Reason.UNKNOWN_CAPABILITY})
_FINISHED_LEASES_MAX = 100_000
NO_AGENT_RETRY_MS = 1_000
"""The retry hint of a lease refused for want of a free agent, without a scaling policy."""


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


@dataclass(slots=True)
class AgentRecord:
    agent_id: str
    incarnation: str
    deployment: str
    heartbeat_interval_s: float
    registered_at: float
    last_seen: float
    state: AgentState = AgentState.SPAWNING
    slots: dict[str, Slot] = field(default_factory=dict)
    in_flight: int = 0  # the one count of work: leased slots + reported pool tasks
    leases: set[str] = field(default_factory=set)
    pool_work: dict[str, int] = field(default_factory=dict)  # reported pool tasks, by capability
    reports_work: bool = False  # it reports pool work and confirms drains (work-reports)
    hears_leases: bool = False  # it is told of each lease on it (lease-notices)
    takes_pool_epoch: bool = False  # its acceptance may carry its pool's epoch (pool-epoch)
    takes_shard: bool = False  # its acceptance may carry its shard (shards)
    keeps_leases: bool = False  # asked to register elsewhere, it keeps its leases (hand-over)
    reported_draining: bool = False  # its last heartbeat said it takes no more pool tasks
    drain_confirmed: bool = False  # the manager has journaled that, for this drain
    last_heartbeat_seq: int = -1
    last_heartbeat_at: float | None = None
    reported_in_flight: dict[str, int] = field(default_factory=dict)  # the heartbeat's in_flight
    idle_since: float = 0.0  # monotonic time its in-flight count last fell to 0


@dataclass(slots=True)
class LeaseRecord:
    lease_id: str
    agent_id: str
    capability: str
    expires_at: float
    holder: str | None = None  # the broker user that acquired it: only it may release it


class PoolCore:
    """Registry, capability index, lifecycle and leases. Single caller, no locks, no I/O."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self.index = CapabilityIndex()
        self.agents: dict[str, AgentRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self.counters: Counter[str] = Counter()
        self.scaling = ScalePlanner(self.settings.scaling)
        self._deployments_by_capability: dict[str, Counter[str]] = {}
        self._expiry_heap: list[tuple[float, str]] = []
        # Liveness deadlines, (when, agent ID), each as of when it was queued; the current one
        # of each agent is the one in _liveness_due (older entries are skipped): _evict_silent
        self._liveness: list[tuple[float, str]] = []
        self._liveness_due: dict[str, float] = {}
        self._recently_terminated: OrderedDict[str, str] = OrderedDict()  # id -> incarnation
        self._finished_leases: OrderedDict[str, None] = OrderedDict()
        self._reregister_asked: dict[str, float] = {}
        self._last_tick: float | None = None
        # (pool, capability) -> (version, cost class) -> [live agents, free concurrency]
        self._live: dict[tuple[str, str], dict[tuple[str, str], list[int]]] = {}
        self._live_version = 0
        self._live_snapshot = LiveCapacity()
        self._handlers: dict[type[Any], Callable[[Any, Instant], list[Command]]] = {
            HeartbeatReceived: self._on_heartbeat,
            RegistrationReceived: self._on_registration,
            DeregistrationReceived: self._on_deregistration,
            FindRequested: self._on_find,
            AcquireRequested: self._on_acquire,
            ReleaseRequested: self._on_release,
            DrainRequested: self._on_drain,
            AcceptanceUndelivered: self._on_acceptance_undelivered,
            Tick: self._on_tick,
            ConnectionLost: self._on_connection_lost,
            ConnectionRestored: self._on_connection_restored,
            ScaleObserved: self._on_scale_observed,
            CapacityMissed: self._on_capacity_missed,
        }
        self._deaf_since: float | None = None
        # Agents by pool and state, load by capability: moved with every change, read by the
        # metrics and the status summary without a walk over the agents.
        self.tally = FleetTally()
        self._sorted_ids: list[str] | None = None  # agent IDs in order, for paged rows

    # ---- the one entry point for changes ---------------------------------------------------
    def handle(self, event: Event, now: Instant) -> list[Command]:
        """Apply one event; return the commands the shell must carry out, in order."""
        return self._handlers[type(event)](event, now)

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
        snapshot = self._live_snapshot
        retry = {
            deployment: eta
            for deployment in self.scaling.deployments
            if (eta := self.scaling.capacity_expected_in_s(deployment, now.mono)) is not None
        }
        if snapshot.version == self._live_version and snapshot.retry_s == retry:
            return snapshot  # unchanged: the same object, and what it has worked out so far
        offers = snapshot.offers
        if snapshot.version != self._live_version:
            offers = {
                key: tuple(
                    LiveOffer(version, agents, free, cost)
                    for (version, cost), (agents, free) in versions.items()
                )
                for key, versions in self._live.items()
            }
        self._live_snapshot = LiveCapacity(offers, retry, self._live_version)
        return self._live_snapshot

    def status(self, now: Instant, offset: int = 0, limit: int | None = None) -> list[AgentStatus]:
        """Agent rows in agent-ID order: all of them, or the page ``[offset, offset+limit)``.
        The order is sorted once per change of the agent set, not per page."""
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self.agents)
        end = None if limit is None else offset + limit
        out = []
        for agent_id in self._sorted_ids[offset:end]:
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

    # ---- registration ------------------------------------------------------------------------
    def _on_registration(self, event: RegistrationReceived, now: Instant) -> list[Command]:
        reg = event.registration
        out: list[Command] = []
        existing = self.agents.get(reg.agent_id)
        if existing is not None:
            if existing.incarnation == reg.incarnation:
                # The agent retried (our acceptance was lost, or slow): answer the same way.
                self.counters["registration_duplicate"] += 1
                return [SendToAgent(reg.agent_id, _accepted(reg))]
            if not event.identity_verified:
                # Without broker identities anyone may claim any agent ID: a live agent is
                # never displaced by a registration that cannot prove it is that agent.
                return self._refuse_while_live(existing, reg, now)
            out += self._remove(existing, Trigger.DEREGISTER, now, "replaced by a new incarnation")
        agent = AgentRecord(
            agent_id=reg.agent_id,
            incarnation=reg.incarnation,
            deployment=reg.deployment,
            heartbeat_interval_s=reg.heartbeat_interval_s,
            registered_at=now.mono,
            last_seen=now.mono,
            idle_since=now.mono,
            reports_work=c.FEATURE_WORK_REPORTS in reg.features,
            hears_leases=c.FEATURE_LEASE_NOTICES in reg.features,
            takes_pool_epoch=c.FEATURE_POOL_EPOCH in reg.features,
            takes_shard=c.FEATURE_SHARDS in reg.features,
            keeps_leases=c.FEATURE_HAND_OVER in reg.features,
        )
        out += self._transition(agent, Trigger.REGISTER, now, "registration received")
        if reg.heartbeat_interval_s < self.settings.min_heartbeat_interval_s:
            return out + self._refuse_registration(agent, reg, now)
        self.agents[agent.agent_id] = agent
        self._watch_liveness(agent)
        self._recently_terminated.pop(agent.agent_id, None)
        self._reregister_asked.pop(agent.agent_id, None)
        for cap in reg.capabilities:
            slot = Slot(agent.agent_id, cap.name, cap.version, cap.cost_class, cap.max_concurrency)
            agent.slots[cap.name] = slot
            self._deployments_by_capability.setdefault(cap.name, Counter())[agent.deployment] += 1
            if self.index.add(slot):
                out += self._version_drift(cap.name, now)
        self._tally(agent, +1)
        self._sorted_ids = None
        out += self._transition(agent, Trigger.ACCEPT, now, "registration accepted")
        self._refresh_availability(agent, agent.in_flight, agent.in_flight)
        self._count_live(agent)
        self.counters["registered"] += 1
        out.append(SendToAgent(agent.agent_id, _accepted(reg)))
        for cap in reg.capabilities:
            entry = LogEntry(
                at=now.wall,
                kind="capability_available",
                agent_id=agent.agent_id,
                capability=cap.name,
                detail={"version": cap.version, "cost_class": cap.cost_class},
            )
            out.append(Announce(cap.name, agent.agent_id, entry))
        return out

    def _refuse_registration(
        self, agent: AgentRecord, reg: AgentRegistration, now: Instant
    ) -> list[Command]:
        """Registering -> Terminated through the table; the record is never kept."""
        minimum = self.settings.min_heartbeat_interval_s
        detail = (
            f"heartbeat_interval_s={reg.heartbeat_interval_s:g} is below the minimum of "
            f"{minimum:g} s: with the {self.settings.missed_heartbeats_before_lost}-miss rule "
            "such a short interval evicts healthy agents during GC pauses"
        )
        self.counters["registration_refused"] += 1
        out = self._transition(
            agent, Trigger.REFUSE, now, Reason.HEARTBEAT_INTERVAL_TOO_SHORT.value, detail=detail
        )
        refusal = RegistrationRefused(
            agent_id=reg.agent_id,
            incarnation=reg.incarnation,
            reason=Reason.HEARTBEAT_INTERVAL_TOO_SHORT,
            detail=detail,
        )
        return [*out, SendToAgent(reg.agent_id, refusal)]

    def _refuse_while_live(
        self, existing: AgentRecord, reg: AgentRegistration, now: Instant
    ) -> list[Command]:
        """A second incarnation of a live agent, with identities off: refused with the time
        until the live one would be declared lost, journaled and counted. A restarted agent
        (kill -9, then the same ID) retries and is accepted once the old incarnation
        deregisters or is declared lost; the registered one keeps running meanwhile."""
        window = self._silence_allowed_s(existing)
        wait_s = max(1.0, existing.last_seen + window - now.mono)
        detail = (
            f"agent {reg.agent_id!r} is live as another incarnation (last "
            f"heard {now.mono - existing.last_seen:.1f} s ago); a new incarnation is accepted "
            f"once that one deregisters or is declared lost (within {wait_s:.0f} s) — or at "
            "once with --agent-identity on, where the broker vouches for the agent"
        )
        self.counters["registration_refused"] += 1
        self.counters["registration_incarnation_live"] += 1
        entry = LogEntry(
            at=now.wall,
            kind="registration_refused",
            agent_id=reg.agent_id,
            reason=Reason.AGENT_ID_IN_USE.value,
            detail={
                "incarnation": fingerprint(reg.incarnation),
                "live_incarnation": fingerprint(existing.incarnation),
            },
        )
        refusal = RegistrationRefused(
            agent_id=reg.agent_id,
            incarnation=reg.incarnation,
            reason=Reason.AGENT_ID_IN_USE,
            detail=detail,
            retry_after_ms=int(wait_s * 1000),
        )
        # Sent to the agent ID's control queue, which the live one consumes too: each
        # incarnation ignores answers that do not carry its own incarnation.
        return [AppendLog(entry), SendToAgent(reg.agent_id, refusal)]

    def _on_acceptance_undelivered(
        self, event: AcceptanceUndelivered, now: Instant
    ) -> list[Command]:
        """An agent is Ready only once its acceptance reached it: one returned for want of a
        control queue (a registration published by something that does not listen, or whose
        queue is gone) takes the registration back, with what was leased on it."""
        agent = self.agents.get(event.agent_id)
        if agent is None or agent.incarnation != event.incarnation:
            return []
        self.counters["acceptance_undelivered"] += 1
        return self._remove(
            agent, Trigger.LOSE, now, "its acceptance could not be delivered: no control queue"
        )

    def _on_deregistration(self, event: DeregistrationReceived, now: Instant) -> list[Command]:
        msg = event.deregistration
        agent = self.agents.get(msg.agent_id)
        if agent is None or agent.incarnation != msg.incarnation:
            self.counters["deregistration_ignored"] += 1
            return []
        return self._remove(agent, Trigger.DEREGISTER, now, msg.reason or "deregistered")

    # ---- heartbeats --------------------------------------------------------------------------
    def _on_heartbeat(self, event: HeartbeatReceived, now: Instant) -> list[Command]:
        return self.heartbeat(event.heartbeat, now)

    def heartbeat(self, hb: Heartbeat, now: Instant) -> list[Command]:
        """``handle(HeartbeatReceived(hb), now)``, without the event's allocation and
        dispatch: the door of the manager's hottest path (:mod:`mesh.manager.heartbeats`)."""
        agent = self.agents.get(hb.agent_id)
        if agent is None:
            return self._ask_to_reregister(hb.agent_id, now)
        if agent.incarnation != hb.incarnation:
            # An older process still beating (a zombie), or a newer one whose registration is
            # on its way. Either way it must not displace the registered one: ignore it.
            self.counters["heartbeat_other_incarnation"] += 1
            return []
        if hb.seq <= agent.last_heartbeat_seq:
            self.counters["heartbeat_stale"] += 1
            return []
        if agent.last_heartbeat_seq >= 0 and self._seq_leaps(agent, hb.seq, now):
            self.counters["heartbeat_seq_leap"] += 1
            return []
        agent.last_heartbeat_seq = hb.seq
        agent.last_seen = now.mono
        agent.last_heartbeat_at = now.mono
        agent.reported_in_flight = hb.in_flight
        agent.reported_draining = hb.draining
        if hb.pool_in_flight == agent.pool_work and agent.state is not AgentState.DRAINING:
            return []  # the common case: nothing changed
        return self._take_work_report(agent, hb.pool_in_flight, now)

    def _seq_leaps(self, agent: AgentRecord, seq: int, now: Instant) -> bool:
        """Whether ``seq`` is further ahead of the last accepted one than an honest agent's
        heartbeats can get since then (see ``heartbeat_seq_slack``). Such a heartbeat is
        ignored, as a stale one is: a real agent that did leap (it is not the SDK) is declared
        lost and registers again, and a new record accepts any ``seq``."""
        since = agent.last_heartbeat_at if agent.last_heartbeat_at is not None else agent.last_seen
        allowed = self.settings.heartbeat_seq_slack + self.settings.heartbeat_seq_per_s * max(
            0.0, now.mono - since
        )
        return seq - agent.last_heartbeat_seq > allowed

    def _take_work_report(
        self, agent: AgentRecord, reported: dict[str, int], now: Instant
    ) -> list[Command]:
        """The agent's pool tasks (a full count per capability) into its one count of work:
        free slots, the Busy label, idleness and drain completion follow."""
        before = agent.in_flight
        work = {cap: n for cap, n in reported.items() if n > 0 and cap in agent.slots}
        if work != agent.pool_work:
            self._tally(agent, -1)
            for cap, slot in agent.slots.items():
                delta = work.get(cap, 0) - agent.pool_work.get(cap, 0)
                slot.in_flight += delta
                agent.in_flight += delta
            agent.pool_work = work
            self._tally(agent, +1)
            self._refresh_availability(agent, before, agent.in_flight)
        out: list[Command] = []
        if before == 0 and agent.in_flight > 0 and agent.state is AgentState.READY:
            out += self._transition(agent, Trigger.WORK, now, "pool work started")
        elif before > 0 and agent.in_flight == 0:
            agent.idle_since = now.mono
            if agent.state is AgentState.BUSY:
                out += self._transition(agent, Trigger.IDLE, now, "pool work finished")
        if agent.state is AgentState.DRAINING:
            if agent.reported_draining and not agent.drain_confirmed:
                out.append(self._drain_confirmed(agent, now))
            if self._drained(agent):
                out += self._finish_drain(agent, now)
        return out

    @staticmethod
    def _drain_confirmed(agent: AgentRecord, now: Instant) -> AppendLog:
        """The agent says it stopped taking pool tasks (and handed back those not started):
        one entry per drain, with what still runs there."""
        agent.drain_confirmed = True
        running = sum(agent.pool_work.values())
        return AppendLog(
            LogEntry(
                at=now.wall,
                kind="drain_confirmed",
                agent_id=agent.agent_id,
                reason=f"pool consumer stopped; {running} pool task(s) and "
                f"{len(agent.leases)} lease(s) still in flight",
                detail={"pool_in_flight": dict(agent.pool_work), "leases": len(agent.leases)},
            )
        )

    def _ask_to_reregister(self, agent_id: str, now: Instant) -> list[Command]:
        self.counters["heartbeat_unknown_agent"] += 1
        asked = self._reregister_asked.get(agent_id)
        if asked is not None and now.mono - asked < self.settings.reregister_backoff_s:
            return []
        self._reregister_asked[agent_id] = now.mono
        return [SendToAgent(agent_id, ReRegisterRequest(agent_id=agent_id, reason="unknown agent"))]

    # ---- find / acquire / release ------------------------------------------------------------
    def _on_find(self, event: FindRequested, now: Instant) -> list[Command]:
        req = event.request
        try:
            found = self.index.find(req.capability, req.version_spec, req.limit)
        except InvalidVersionSpec as exc:
            return [Reply(Refusal(reason=Reason.INVALID_VERSION_SPEC, detail=str(exc)))]
        return [Reply(FindReply(agents=[_summary(cand) for cand in found]))]

    def acquire(
        self, request: AcquireRequest, lease_id: str, now: Instant, holder: str | None = None
    ) -> tuple[Lease | Refusal, list[Command]]:
        """Lease one slot; returns the lease (or a refusal) and the log commands.

        Idempotent per ``lease_id``: a redelivered request gets the lease it already holds.
        """
        held = self.leases.get(lease_id)
        if held is not None:
            self.counters["acquire_duplicate"] += 1
            slot = self.agents[held.agent_id].slots[held.capability]
            return _lease(held, slot, now), []
        if lease_id in self._finished_leases:
            # A redelivered request whose lease is already over must not take a new slot.
            self.counters["acquire_duplicate"] += 1
            detail = f"lease {lease_id!r} was already granted and has ended"
            return Refusal(reason=Reason.UNKNOWN_LEASE, detail=detail), []
        slot_or_refusal = self._choose_slot(request)
        if isinstance(slot_or_refusal, Refusal):
            self.counters[f"acquire_refused.{slot_or_refusal.reason.value}"] += 1
            if request.agent_id is None and slot_or_refusal.reason in _CAPACITY_MISSES:
                offering = self._deployments_by_capability.get(request.capability, Counter())
                self.scaling.record_miss(request.capability, offering, now.mono)
                if slot_or_refusal.reason is Reason.NO_AGENT_AVAILABLE:
                    retry_ms = self._free_slot_expected_ms(offering, now)
                    slot_or_refusal = slot_or_refusal.model_copy(
                        update={"retry_after_ms": retry_ms}
                    )
            return slot_or_refusal, []
        slot = slot_or_refusal
        agent = self.agents[slot.agent_id]
        ttl = request.ttl_s or self.settings.default_lease_ttl_s
        lease = LeaseRecord(lease_id, agent.agent_id, slot.capability, now.mono + ttl, holder)
        self.leases[lease_id] = lease
        agent.leases.add(lease_id)
        heapq.heappush(self._expiry_heap, (lease.expires_at, lease_id))
        self._change_load(agent, slot, +1)
        self.counters["acquired"] += 1
        out = self._transition(
            agent, Trigger.ACQUIRE, now, "slot leased", capability=slot.capability, lease=lease_id
        )
        granted = _lease(lease, slot, now)
        if agent.hears_leases:  # before the producer has it: the agent runs only what it knows
            notice = LeaseNotice(
                agent_id=agent.agent_id,
                lease_id=lease_id,
                capability=slot.capability,
                expires_in_s=granted.expires_in_s,
            )
            out.append(SendToAgent(agent.agent_id, notice))
        return granted, out

    def release(
        self, lease_id: str, now: Instant, reason: str = "released", by: str | None = None
    ) -> list[Command]:
        """Give a leased slot back. Unknown leases are refused (as a Reply), never fatal.
        ``by``: who asks (``None``: the manager itself — expiry, an undeliverable grant); a
        lease bound to a holder is released only by that holder."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counters["release_unknown_lease"] += 1
            return [Reply(Refusal(reason=Reason.UNKNOWN_LEASE, detail=f"no lease {lease_id!r}"))]
        if by is not None and lease.holder is not None and by != lease.holder:
            self.counters["release_not_authorized"] += 1
            detail = f"lease {lease_id!r} is held by another broker user ({by!r} asked)"
            return [Reply(Refusal(reason=Reason.NOT_AUTHORIZED, detail=detail))]
        del self.leases[lease_id]
        self._remember_finished(lease_id)
        agent = self.agents[lease.agent_id]
        agent.leases.discard(lease_id)
        self._change_load(agent, agent.slots[lease.capability], -1)
        self.counters["released"] += 1
        out: list[Command] = [Reply(Released(lease_id=lease_id))]
        if agent.hears_leases:
            ended = LeaseNotice(
                agent_id=agent.agent_id,
                lease_id=lease_id,
                capability=lease.capability,
                expires_in_s=0.0,
                ended=True,
            )
            out.append(SendToAgent(agent.agent_id, ended))
        draining = agent.state is AgentState.DRAINING
        trigger = Trigger.RELEASE if agent.in_flight > 0 or draining else Trigger.IDLE
        if agent.in_flight == 0:
            agent.idle_since = now.mono
        out += self._transition(
            agent, trigger, now, reason, capability=lease.capability, lease=lease_id
        )
        if draining and self._drained(agent):
            out += self._finish_drain(agent, now)
        return out

    def _on_acquire(self, event: AcquireRequested, now: Instant) -> list[Command]:
        result, out = self.acquire(event.request, event.lease_id, now, event.holder)
        reply = LeaseGranted(lease=result) if isinstance(result, Lease) else result
        return [*out, Reply(reply)]

    def _on_release(self, event: ReleaseRequested, now: Instant) -> list[Command]:
        return self.release(event.lease_id, now, by=event.by)

    def _choose_slot(self, req: AcquireRequest) -> Slot | Refusal:
        try:
            if req.agent_id is None:
                found = self.index.find(req.capability, req.version_spec, limit=1)
                if found:
                    return self.agents[found[0].agent_id].slots[req.capability]
                return self._no_agent(req)
            spec = parse_spec(req.version_spec)
        except InvalidVersionSpec as exc:
            return Refusal(reason=Reason.INVALID_VERSION_SPEC, detail=str(exc))
        return self._check_named_agent(req, spec)

    def _check_named_agent(self, req: AcquireRequest, spec: SpecifierSet) -> Slot | Refusal:
        agent_id = req.agent_id or ""
        agent = self.agents.get(agent_id)
        if agent is None:
            if agent_id in self._recently_terminated:
                return Refusal(reason=Reason.AGENT_TERMINATED, detail=f"{agent_id} is terminated")
            return Refusal(reason=Reason.UNKNOWN_AGENT, detail=f"no agent {agent_id!r}")
        if agent.state is AgentState.DRAINING:
            return Refusal(reason=Reason.AGENT_DRAINING, detail=f"{agent_id} is draining")
        slot = agent.slots.get(req.capability)
        if slot is None or not spec.contains(parse_version(slot.version), prereleases=True):
            return Refusal(
                reason=Reason.CAPABILITY_NOT_OFFERED,
                detail=f"{agent_id} does not offer {req.capability} {req.version_spec}",
            )
        if agent.state not in ACQUIRABLE or not slot.has_room:
            return Refusal(
                reason=Reason.AGENT_AT_CAPACITY,
                detail=f"{agent_id} has {slot.in_flight}/{slot.max_concurrency} "
                f"{req.capability} tasks in flight",
            )
        return slot

    def _free_slot_expected_ms(self, offering: Iterable[str], now: Instant) -> int:
        """When to ask again for a capability whose agents are all full: the soonest a
        scaling policy of a deployment offering it expects a replica more, else
        :data:`NO_AGENT_RETRY_MS` (a lease ends, or is released, about that often)."""
        etas = [
            eta
            for deployment in offering
            if (eta := self.scaling.capacity_expected_in_s(deployment, now.mono)) is not None
        ]
        return max(1, round(1000 * min(etas))) if etas else NO_AGENT_RETRY_MS

    def _no_agent(self, req: AcquireRequest) -> Refusal:
        if req.capability not in self.index:
            return Refusal(
                reason=Reason.UNKNOWN_CAPABILITY, detail=f"no agent offers {req.capability}"
            )
        if not self.index.has_version_matching(req.capability, req.version_spec):
            versions = ", ".join(self.index.versions(req.capability))
            return Refusal(
                reason=Reason.CAPABILITY_NOT_OFFERED,
                detail=f"no agent offers {req.capability} {req.version_spec} "
                f"(offered versions: {versions})",
            )
        return Refusal(
            reason=Reason.NO_AGENT_AVAILABLE,
            detail=f"every agent offering {req.capability} {req.version_spec} is full or draining",
        )

    # ---- drain -------------------------------------------------------------------------------
    def _on_drain(self, event: DrainRequested, now: Instant) -> list[Command]:
        agent = self.agents.get(event.agent_id)
        if agent is None:
            reason = (
                Reason.AGENT_TERMINATED
                if event.agent_id in self._recently_terminated
                else Reason.UNKNOWN_AGENT
            )
            return [Reply(Refusal(reason=reason, detail=f"cannot drain {event.agent_id!r}"))]
        reply = Reply(DrainAccepted(agent_id=agent.agent_id, in_flight=agent.in_flight))
        if agent.state is AgentState.DRAINING:
            return [reply]
        return [*self._drain(agent, event.reason or "drain requested", now), reply]

    def _drain(self, agent: AgentRecord, reason: str, now: Instant) -> list[Command]:
        """Draining at once (out of the index); Terminated as soon as nothing is leased."""
        out = self._transition(agent, Trigger.DRAIN, now, reason)
        self._refresh_availability(agent, agent.in_flight, agent.in_flight)
        self._count_live(agent)
        self.counters["drained"] += 1
        out.append(SendToAgent(agent.agent_id, DrainNotice(agent_id=agent.agent_id, reason=reason)))
        if agent.reports_work and agent.reported_draining:  # it asked first (SIGTERM)
            out.append(self._drain_confirmed(agent, now))
        if self._drained(agent):
            out += self._finish_drain(agent, now)
        return out

    @staticmethod
    def _drained(agent: AgentRecord) -> bool:
        """Nothing in flight on either path — and, for an agent that reports its pool work,
        its report says it takes no more pool tasks (else one it claimed just before the
        drain could still be on its way)."""
        return agent.in_flight == 0 and (agent.reported_draining or not agent.reports_work)

    def _finish_drain(self, agent: AgentRecord, now: Instant) -> list[Command]:
        """Draining and nothing in flight: Terminated, removed, and told it may exit."""
        out = self._remove(agent, Trigger.DRAINED, now, "drained: nothing in flight")
        out.append(SendToAgent(agent.agent_id, DrainComplete(agent_id=agent.agent_id)))
        return out

    # ---- time --------------------------------------------------------------------------------
    def _on_tick(self, event: Tick, now: Instant) -> list[Command]:
        out: list[Command] = []
        last, self._last_tick = self._last_tick, now.mono
        if last is not None and now.mono - last > self.settings.stall_threshold_s:
            # We were not running: silence from agents says nothing about them.
            self.counters["manager_stalls"] += 1
            reason = f"no tick for {now.mono - last:.1f} s; liveness windows restarted"
            out += self._restart_liveness_windows(now, "manager_stalled", reason)
        out += self._expire_leases(now)
        if self._deaf_since is None:
            out += self._evict_silent(now)
        self._forget_old_reregister_asks(now)
        if self.scaling.deployments:
            out += self._scale(now)
        return out

    # ---- scaling -----------------------------------------------------------------------------
    def _on_scale_observed(self, event: ScaleObserved, now: Instant) -> list[Command]:
        self.scaling.observed(event.deployment, event.replicas)
        return []

    def _on_capacity_missed(self, event: CapacityMissed, now: Instant) -> list[Command]:
        if self.scaling.manages(event.pool_id):
            self.counters["admission_capacity_misses"] += 1
            self.scaling.record_pool_miss(event.pool_id, now.mono)
        return []

    def _scale(self, now: Instant) -> list[Command]:
        live: Counter[str] = Counter()
        idle: dict[str, list[IdleAgent]] = {}
        for agent in self.agents.values():
            if not self.scaling.manages(agent.deployment):
                continue
            if agent.state is not AgentState.DRAINING:
                live[agent.deployment] += 1
            if agent.state is AgentState.READY and agent.in_flight == 0:
                idle.setdefault(agent.deployment, []).append(
                    IdleAgent(agent.agent_id, agent.idle_since)
                )
        out: list[Command] = []
        for decision in self.scaling.plan(now.mono, live, idle):
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
                out += self._drain(victim, f"scale-down: {decision.reason}", now)
        return out

    def _forget_old_reregister_asks(self, now: Instant) -> None:
        horizon = now.mono - self.settings.reregister_backoff_s
        stale = [aid for aid, asked in self._reregister_asked.items() if asked < horizon]
        for agent_id in stale:
            del self._reregister_asked[agent_id]

    def _on_connection_lost(self, event: ConnectionLost, now: Instant) -> list[Command]:
        self._deaf_since = now.mono
        self.counters["connection_lost"] += 1
        return []

    def _on_connection_restored(self, event: ConnectionRestored, now: Instant) -> list[Command]:
        deaf = 0.0 if self._deaf_since is None else now.mono - self._deaf_since
        self._deaf_since = None
        reason = f"broker connection restored after {deaf:.1f} s; liveness windows restarted"
        return self._restart_liveness_windows(now, "connection_restored", reason)

    def _restart_liveness_windows(self, now: Instant, kind: str, reason: str) -> list[Command]:
        for agent in self.agents.values():
            agent.last_seen = max(agent.last_seen, now.mono)
        return [AppendLog(LogEntry(at=now.wall, kind=kind, reason=reason))]

    def _expire_leases(self, now: Instant) -> list[Command]:
        out: list[Command] = []
        heap = self._expiry_heap
        while heap and heap[0][0] <= now.mono:
            _, lease_id = heapq.heappop(heap)
            if lease_id in self.leases:
                self.counters["lease_expired"] += 1
                out += [
                    cmd
                    for cmd in self.release(lease_id, now, "lease expired")
                    if not isinstance(cmd, Reply)
                ]
        return out

    def _silence_allowed_s(self, agent: AgentRecord) -> float:
        """How long ``agent`` may be silent before it is lost."""
        return self.settings.missed_heartbeats_before_lost * agent.heartbeat_interval_s

    def _watch_liveness(self, agent: AgentRecord) -> None:
        """Queue ``agent``'s liveness deadline (when its silence would make it lost, as its
        last heartbeat says now) for :meth:`_evict_silent`."""
        deadline = agent.last_seen + self._silence_allowed_s(agent)
        self._liveness_due[agent.agent_id] = deadline
        heapq.heappush(self._liveness, (deadline, agent.agent_id))

    def _evict_silent(self, now: Instant) -> list[Command]:
        """Agents silent past their window are lost. The deadlines wait in a heap, each as
        of when it was queued: one that comes due is checked against the agent's last
        heartbeat, and queued again if it has beaten since — so a tick costs the agents
        whose (possibly old) deadline passed, about a window's share of the fleet, not a
        walk over every agent."""
        heap, due = self._liveness, self._liveness_due
        lost = []
        while heap and heap[0][0] < now.mono:
            deadline, agent_id = heapq.heappop(heap)
            if due.get(agent_id) != deadline:
                continue  # superseded by a later entry for this agent
            agent = self.agents.get(agent_id)
            if agent is None:
                del due[agent_id]  # it left
                continue
            if now.mono - agent.last_seen > self._silence_allowed_s(agent):
                del due[agent_id]
                lost.append(agent)
            else:
                self._watch_liveness(agent)
        out: list[Command] = []
        for agent in lost:
            silence = now.mono - agent.last_seen
            self.counters["lost"] += 1
            reason = f"no heartbeat for {silence:.1f} s"
            out += self._remove(agent, Trigger.LOSE, now, reason)
            out.append(FenceAgent(agent.agent_id, agent.incarnation, reason))
            if self.scaling.manages(agent.deployment):
                out.append(DeletePod(agent.deployment, agent.agent_id, reason))
        return out

    # ---- shared mechanics --------------------------------------------------------------------
    def _transition(
        self,
        agent: AgentRecord,
        trigger: Trigger,
        now: Instant,
        reason: str,
        *,
        capability: str | None = None,
        lease: str | None = None,
        detail: str | None = None,
    ) -> list[Command]:
        target = next_state(agent.state, trigger)
        if target is None:
            self.counters["illegal_transition"] += 1
            log.warning(
                "illegal lifecycle transition refused",
                extra={"agent_id": agent.agent_id, "state": agent.state, "trigger": trigger},
            )
            return [
                AppendLog(
                    LogEntry(
                        at=now.wall,
                        kind="illegal_transition",
                        agent_id=agent.agent_id,
                        from_state=agent.state.value,
                        reason=f"{trigger.value} is not allowed in {agent.state.value}",
                    )
                )
            ]
        tracked = self.agents.get(agent.agent_id) is agent
        if tracked:
            self._tally(agent, -1)
        source, agent.state = agent.state, target
        if tracked:
            self._tally(agent, +1)
        entry = LogEntry(
            at=now.wall,
            kind=_LOG_KIND[trigger],
            agent_id=agent.agent_id,
            from_state=source.value,
            to_state=target.value,
            capability=capability,
            reason=reason,
            detail={
                **({"lease_id": lease} if lease else {}),
                **({"detail": detail} if detail else {}),
            },
        )
        return [AppendLog(entry)]

    def _change_load(self, agent: AgentRecord, slot: Slot, delta: int) -> None:
        """A lease taken (+1) or given back (-1)."""
        before = agent.in_flight
        self._tally(agent, -1)
        slot.in_flight += delta
        slot.leased += delta
        agent.in_flight += delta
        self._tally(agent, +1)
        self._refresh_availability(agent, before, agent.in_flight)
        self._count_live_slot(agent, slot, agent.state in ACQUIRABLE)

    def _tally(self, agent: AgentRecord, sign: int) -> None:
        self.tally.count(agent.deployment, agent.state.value, agent.slots.values(), sign)

    def _refresh_availability(self, agent: AgentRecord, old_level: int, new_level: int) -> None:
        for slot in agent.slots.values():
            self.index.make_unavailable(slot, old_level)
        if agent.state in ACQUIRABLE:
            for slot in agent.slots.values():
                if slot.has_room:
                    self.index.make_available(slot, new_level)

    def _count_live(self, agent: AgentRecord) -> None:
        """Bring the agent's share of its pool's live capacity up to date: each slot adds one
        agent and its concurrency not held by leases while the agent takes work, else
        nothing. Only what changed is touched, so this costs O(the agent's capabilities)."""
        taking_work = agent.state in ACQUIRABLE
        for slot in agent.slots.values():
            self._count_live_slot(agent, slot, taking_work)

    def _count_live_slot(self, agent: AgentRecord, slot: Slot, taking_work: bool) -> None:
        share = max(0, slot.max_concurrency - slot.leased) if taking_work else None
        if share != slot.live:
            key = (agent.deployment, slot.capability)
            versions = self._live.setdefault(key, {})
            offer = (slot.version, slot.cost_class)
            entry = versions.setdefault(offer, [0, 0])
            if slot.live is not None:
                entry[0] -= 1
                entry[1] -= slot.live
            if share is not None:
                entry[0] += 1
                entry[1] += share
            slot.live = share
            if entry[0] == 0:
                del versions[offer]
                if not versions:
                    del self._live[key]
            self._live_version += 1

    def _remove(
        self, agent: AgentRecord, trigger: Trigger, now: Instant, reason: str
    ) -> list[Command]:
        """Take an agent out of everything. The single removal path: index pruned here."""
        out = self._transition(agent, trigger, now, reason)
        self._count_live(agent)  # Terminated: it adds nothing to its pool any more
        for slot in agent.slots.values():
            self.index.remove(slot, agent.in_flight)
            by_deployment = self._deployments_by_capability[slot.capability]
            by_deployment[agent.deployment] -= 1
            if by_deployment[agent.deployment] <= 0:
                del by_deployment[agent.deployment]
            entry = LogEntry(
                at=now.wall,
                kind="capability_withdrawn",
                agent_id=agent.agent_id,
                capability=slot.capability,
                reason=reason,
                detail={"version": slot.version},
            )
            out.append(Announce(slot.capability, agent.agent_id, entry))
        for lease_id in agent.leases:
            self.leases.pop(lease_id, None)
            self._remember_finished(lease_id)
        self._tally(agent, -1)
        del self.agents[agent.agent_id]
        self._sorted_ids = None
        self._recently_terminated[agent.agent_id] = agent.incarnation
        if len(self._recently_terminated) > _RECENTLY_TERMINATED_MAX:
            self._recently_terminated.popitem(last=False)
        self.counters["terminated"] += 1
        return out

    def hand_over(self, leaves: Callable[[str], bool]) -> list[AgentRecord]:
        """Forget every agent whose pool ``leaves`` (its shard is another manager's now):
        no lifecycle transition, no withdrawn capability, no fence — the agent is alive and
        registers with the new owner (the manager asks it to, at once where the agent keeps
        its leases meanwhile, else at its next heartbeat); this registry just stops counting
        it. Its leases are forgotten here (their holders' releases are answered as unknown).
        Returns the agents it forgot. O(agents): handovers are rare."""
        gone = [agent for agent in self.agents.values() if leaves(agent.deployment)]
        for agent in gone:
            for slot in agent.slots.values():
                self._count_live_slot(agent, slot, taking_work=False)
                self.index.remove(slot, agent.in_flight)
                by_deployment = self._deployments_by_capability[slot.capability]
                by_deployment[agent.deployment] -= 1
                if by_deployment[agent.deployment] <= 0:
                    del by_deployment[agent.deployment]
            for lease_id in agent.leases:
                self.leases.pop(lease_id, None)
                self._remember_finished(lease_id)
            self._tally(agent, -1)
            del self.agents[agent.agent_id]
            self._reregister_asked.pop(agent.agent_id, None)
        if gone:
            self._sorted_ids = None
            self.counters["handed_over"] += len(gone)
        return gone

    def _remember_finished(self, lease_id: str) -> None:
        self._finished_leases[lease_id] = None
        if len(self._finished_leases) > _FINISHED_LEASES_MAX:
            self._finished_leases.popitem(last=False)

    def _version_drift(self, name: str, now: Instant) -> list[Command]:
        versions = self.index.versions(name)
        if len(versions) < 2:
            return []
        self.counters["version_drift_warnings"] += 1
        log.warning(
            "capability has more than one active version",
            extra={"capability": name, "versions": versions},
        )
        entry = LogEntry(
            at=now.wall,
            kind="version_drift",
            capability=name,
            reason=f"{name} has {len(versions)} active versions: {', '.join(versions)}",
            detail={"versions": versions},
        )
        return [AppendLog(entry)]


_LOG_KIND = {
    Trigger.REGISTER: "registered",
    Trigger.ACCEPT: "ready",
    Trigger.REFUSE: "refused",
    Trigger.ACQUIRE: "acquired",
    Trigger.RELEASE: "released",
    Trigger.WORK: "busy",
    Trigger.IDLE: "released",
    Trigger.DRAIN: "draining",
    Trigger.DRAINED: "terminated",
    Trigger.LOSE: "lost",
    Trigger.DEREGISTER: "terminated",
}


def _lease(lease: LeaseRecord, slot: Slot, now: Instant) -> Lease:
    return Lease(
        lease_id=lease.lease_id,
        agent_id=lease.agent_id,
        capability=slot.capability,
        version=slot.version,
        cost_class=slot.cost_class,
        expires_in_s=max(0.0, lease.expires_at - now.mono),
    )


def fingerprint(incarnation: str) -> str:
    """What the journal and the events feed say of an incarnation: with identities off, the
    incarnation itself lets anyone speak for the agent (heartbeats, deregistration, a drain),
    so it is never published; operators match a fingerprint against an agent's logs."""
    return "sha256-" + hashlib.sha256(incarnation.encode()).hexdigest()[:12]


def _accepted(reg: AgentRegistration) -> RegistrationAccepted:
    return RegistrationAccepted(agent_id=reg.agent_id, incarnation=reg.incarnation)


def _summary(cand: Candidate) -> AgentSummary:
    return AgentSummary(
        agent_id=cand.agent_id,
        capability=cand.capability,
        version=cand.version,
        cost_class=cand.cost_class,
        in_flight=cand.in_flight,
        max_concurrency=cand.max_concurrency,
    )
