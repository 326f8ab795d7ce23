"""The registry: the agent and lease records the pool core's rooms share, kept in step.

An agent's record is mirrored in four places — the capability index, the fleet tally, the
live capacity aggregate and the deployments offering each capability. Every room of the pool
core (registration, heartbeats, liveness, leases, drains) changes an agent's state, load or
presence only through :class:`Registry`'s methods, so each change moves all four at once and
:meth:`Registry.remove` is the single removal path: ``find_by_capability`` never returns a
ghost. Pure: no I/O, no clock (``now`` is an argument).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mesh.core.capacity import LiveTally
from mesh.core.events import Announce, AppendLog, Command, Instant, LogEntry
from mesh.core.index import CapabilityIndex, Slot
from mesh.core.lifecycle import ACQUIRABLE, AgentState, Trigger, next_state
from mesh.core.tally import FleetTally

log = logging.getLogger(__name__)

_RECENTLY_TERMINATED_MAX = 10_000
_FINISHED_LEASES_MAX = 100_000


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


class Registry:
    """Agents and leases, and the aggregates that mirror them. Single caller, no locks."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.agents: dict[str, AgentRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self.index = CapabilityIndex()
        # Agents by pool and state, load by capability: moved with every change, read by the
        # metrics and the status summary without a walk over the agents.
        self.tally = FleetTally()
        self.live = LiveTally()
        self.offering: dict[str, Counter[str]] = {}  # capability -> deployments -> agents
        self.recently_terminated: OrderedDict[str, str] = OrderedDict()  # id -> incarnation
        self.finished_leases: OrderedDict[str, None] = OrderedDict()
        self.reregister_asked: dict[str, float] = {}  # unknown agent ID -> when it was asked
        self._sorted_ids: list[str] | None = None  # agent IDs in order, for paged rows

    def sorted_ids(self) -> list[str]:
        """Agent IDs in order: sorted once per change of the agent set, not per page."""
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self.agents)
        return self._sorted_ids

    # ---- presence ----------------------------------------------------------------------------
    def add(self, agent: AgentRecord, slots: Iterable[Slot]) -> list[str]:
        """Track ``agent`` with ``slots`` (not yet available: it is still Registering).
        Returns the capabilities that now have a version more than before."""
        self.agents[agent.agent_id] = agent
        self.recently_terminated.pop(agent.agent_id, None)
        self.reregister_asked.pop(agent.agent_id, None)
        new_versions = []
        for slot in slots:
            agent.slots[slot.capability] = slot
            self.offering.setdefault(slot.capability, Counter())[agent.deployment] += 1
            if self.index.add(slot):
                new_versions.append(slot.capability)
        self.count(agent, +1)
        self._sorted_ids = None
        return new_versions

    def remove(
        self, agent: AgentRecord, trigger: Trigger, now: Instant, reason: str
    ) -> list[Command]:
        """Take an agent out of everything. The single removal path: index pruned here."""
        out = self.transition(agent, trigger, now, reason)
        self.count_live(agent)  # Terminated: it adds nothing to its pool any more
        for slot in agent.slots.values():
            self._withdraw(agent, slot)
            entry = LogEntry(
                at=now.wall,
                kind="capability_withdrawn",
                agent_id=agent.agent_id,
                capability=slot.capability,
                reason=reason,
                detail={"version": slot.version},
            )
            out.append(Announce(slot.capability, agent.agent_id, entry))
        self._forget(agent)
        self.recently_terminated[agent.agent_id] = agent.incarnation
        if len(self.recently_terminated) > _RECENTLY_TERMINATED_MAX:
            self.recently_terminated.popitem(last=False)
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
                self.live.count_slot(agent.deployment, slot, taking_work=False)
                self._withdraw(agent, slot)
            self._forget(agent)
            self.reregister_asked.pop(agent.agent_id, None)
        if gone:
            self.counters["handed_over"] += len(gone)
        return gone

    def _withdraw(self, agent: AgentRecord, slot: Slot) -> None:
        self.index.remove(slot, agent.in_flight)
        by_deployment = self.offering[slot.capability]
        by_deployment[agent.deployment] -= 1
        if by_deployment[agent.deployment] <= 0:
            del by_deployment[agent.deployment]

    def _forget(self, agent: AgentRecord) -> None:
        for lease_id in agent.leases:
            self.leases.pop(lease_id, None)
            self.remember_finished(lease_id)
        self.count(agent, -1)
        del self.agents[agent.agent_id]
        self._sorted_ids = None

    def remember_finished(self, lease_id: str) -> None:
        """A lease that ended: a redelivered acquire for it must not take a new slot."""
        self.finished_leases[lease_id] = None
        if len(self.finished_leases) > _FINISHED_LEASES_MAX:
            self.finished_leases.popitem(last=False)

    # ---- state and load ----------------------------------------------------------------------
    def transition(
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
        """Move ``agent`` by ``trigger`` through the lifecycle table and journal it; an illegal
        trigger changes nothing and is journaled as ``illegal_transition``."""
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
            self.count(agent, -1)
        source, agent.state = agent.state, target
        if tracked:
            self.count(agent, +1)
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

    def change_load(self, agent: AgentRecord, slot: Slot, delta: int) -> None:
        """A lease taken (+1) or given back (-1)."""
        before = agent.in_flight
        self.count(agent, -1)
        slot.in_flight += delta
        slot.leased += delta
        agent.in_flight += delta
        self.count(agent, +1)
        self.refresh_availability(agent, before, agent.in_flight)
        self.live.count_slot(agent.deployment, slot, agent.state in ACQUIRABLE)

    def take_pool_work(self, agent: AgentRecord, work: dict[str, int]) -> None:
        """The agent's reported pool tasks (per capability, already filtered to its slots)
        replace the previous report in its one count of work."""
        before = agent.in_flight
        self.count(agent, -1)
        for cap, slot in agent.slots.items():
            delta = work.get(cap, 0) - agent.pool_work.get(cap, 0)
            slot.in_flight += delta
            agent.in_flight += delta
        agent.pool_work = work
        self.count(agent, +1)
        self.refresh_availability(agent, before, agent.in_flight)

    def count(self, agent: AgentRecord, sign: int) -> None:
        """Add (+1) or take away (-1) the agent's share of the fleet tally as it stands."""
        self.tally.count(agent.deployment, agent.state.value, agent.slots.values(), sign)

    def refresh_availability(self, agent: AgentRecord, old_level: int, new_level: int) -> None:
        """Re-file the agent's slots in the index at its load level (none while it takes no
        work, and no full slot)."""
        for slot in agent.slots.values():
            self.index.make_unavailable(slot, old_level)
        if agent.state in ACQUIRABLE:
            for slot in agent.slots.values():
                if slot.has_room:
                    self.index.make_available(slot, new_level)

    def count_live(self, agent: AgentRecord) -> None:
        """Bring the agent's share of its pool's live capacity up to date: each slot adds one
        agent and its concurrency not held by leases while the agent takes work, else
        nothing. Only what changed is touched, so this costs O(the agent's capabilities)."""
        taking_work = agent.state in ACQUIRABLE
        for slot in agent.slots.values():
            self.live.count_slot(agent.deployment, slot, taking_work)


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
