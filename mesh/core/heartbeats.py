"""Heartbeats: what an agent's periodic report changes in the registry.

A heartbeat is taken only from the registered incarnation, in ``seq`` order and within an
honest agent's reach of the last one (a forged huge ``seq`` would otherwise make every real
heartbeat after it stale). It renews the agent's liveness (``last_seen``, read by
:mod:`mesh.core.liveness`) and carries its pool work: each agent's in-flight count per
capability is its leased slots plus the pool tasks it reports running (``pool_in_flight``,
a full count each time, so a lost report is corrected by the next one). Free slots, the Busy
label, idleness and drain completion follow from that count. An unknown agent is asked to
register again, at most once per ``reregister_backoff_s``.
"""

from __future__ import annotations

from mesh.core.drains import Drains
from mesh.core.events import Command, Instant, SendToAgent
from mesh.core.lifecycle import AgentState, Trigger
from mesh.core.registry import AgentRecord, Registry
from mesh.wire.models import Heartbeat, ReRegisterRequest


class Heartbeats:
    """Takes heartbeats into the registry; asks unknown agents to register again."""

    def __init__(
        self,
        registry: Registry,
        drains: Drains,
        *,
        seq_slack: int,
        seq_per_s: float,
        reregister_backoff_s: float,
    ) -> None:
        self.registry = registry
        self.drains = drains
        self.seq_slack = seq_slack
        self.seq_per_s = seq_per_s
        self.reregister_backoff_s = reregister_backoff_s

    def heartbeat(self, hb: Heartbeat, now: Instant) -> list[Command]:
        """Apply one heartbeat; the common case (nothing changed) returns no command."""
        agent = self.registry.agents.get(hb.agent_id)
        if agent is None:
            return self._ask_to_reregister(hb.agent_id, now)
        if agent.incarnation != hb.incarnation:
            # An older process still beating (a zombie), or a newer one whose registration is
            # on its way. Either way it must not displace the registered one: ignore it.
            self.registry.counters["heartbeat_other_incarnation"] += 1
            return []
        if hb.seq <= agent.last_heartbeat_seq:
            self.registry.counters["heartbeat_stale"] += 1
            return []
        if agent.last_heartbeat_seq >= 0 and self._seq_leaps(agent, hb.seq, now):
            self.registry.counters["heartbeat_seq_leap"] += 1
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
        allowed = self.seq_slack + self.seq_per_s * max(0.0, now.mono - since)
        return seq - agent.last_heartbeat_seq > allowed

    def _take_work_report(
        self, agent: AgentRecord, reported: dict[str, int], now: Instant
    ) -> list[Command]:
        """The agent's pool tasks (a full count per capability) into its one count of work:
        free slots, the Busy label, idleness and drain completion follow."""
        registry, drains = self.registry, self.drains
        before = agent.in_flight
        work = {cap: n for cap, n in reported.items() if n > 0 and cap in agent.slots}
        if work != agent.pool_work:
            registry.take_pool_work(agent, work)
        out: list[Command] = []
        if before == 0 and agent.in_flight > 0 and agent.state is AgentState.READY:
            out += registry.transition(agent, Trigger.WORK, now, "pool work started")
        elif before > 0 and agent.in_flight == 0:
            agent.idle_since = now.mono
            if agent.state is AgentState.BUSY:
                out += registry.transition(agent, Trigger.IDLE, now, "pool work finished")
        if agent.state is AgentState.DRAINING:
            if agent.reported_draining and not agent.drain_confirmed:
                out.append(drains.confirmed(agent, now))
            if drains.drained(agent):
                out += drains.finish(agent, now)
        return out

    def _ask_to_reregister(self, agent_id: str, now: Instant) -> list[Command]:
        self.registry.counters["heartbeat_unknown_agent"] += 1
        asked = self.registry.reregister_asked.get(agent_id)
        if asked is not None and now.mono - asked < self.reregister_backoff_s:
            return []
        self.registry.reregister_asked[agent_id] = now.mono
        return [SendToAgent(agent_id, ReRegisterRequest(agent_id=agent_id, reason="unknown agent"))]

    def forget_old_asks(self, now: Instant) -> None:
        """Drop the asks older than the backoff: each agent may be asked again."""
        asked = self.registry.reregister_asked
        horizon = now.mono - self.reregister_backoff_s
        for agent_id in [aid for aid, at in asked.items() if at < horizon]:
            del asked[agent_id]
