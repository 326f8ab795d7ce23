"""Liveness: evicting agents that fell silent, and never for the manager's own deafness.

Receiver-side monotonic time: an agent not heard from for ``missed_heartbeats_before_lost x
heartbeat_interval_s`` is lost — Terminated and removed, its leases dropped, fenced, and its
pod deleted where a scaling policy manages its deployment. If the core itself was not ticked
for a long while (the manager process stalled), or the manager lost the broker
(``ConnectionLost`` until ``ConnectionRestored``), it heard nobody, so it evicts nobody for
that silence: everyone gets a fresh window instead of a mass eviction.
"""

from __future__ import annotations

import heapq

from mesh.core.events import AppendLog, Command, DeletePod, FenceAgent, Instant, LogEntry
from mesh.core.lifecycle import Trigger
from mesh.core.registry import AgentRecord, Registry
from mesh.core.scaling import ScalePlanner


class Liveness:
    """Each agent's liveness deadline, and the stalls and broker outages that suspend them."""

    def __init__(
        self,
        registry: Registry,
        scaling: ScalePlanner,
        *,
        missed_heartbeats_before_lost: int,
        stall_threshold_s: float,
    ) -> None:
        self.registry = registry
        self.scaling = scaling
        self.missed_heartbeats_before_lost = missed_heartbeats_before_lost
        self.stall_threshold_s = stall_threshold_s  # a longer gap between ticks is a stall
        # Liveness deadlines, (when, agent ID), each as of when it was queued; the current one
        # of each agent is the one in _due (older entries are skipped): evict_silent
        self._deadlines: list[tuple[float, str]] = []
        self._due: dict[str, float] = {}
        self._last_tick: float | None = None
        self._deaf_since: float | None = None

    def silence_allowed_s(self, agent: AgentRecord) -> float:
        """How long ``agent`` may be silent before it is lost."""
        return self.missed_heartbeats_before_lost * agent.heartbeat_interval_s

    def watch(self, agent: AgentRecord) -> None:
        """Queue ``agent``'s liveness deadline (when its silence would make it lost, as its
        last heartbeat says now) for :meth:`evict_silent`."""
        deadline = agent.last_seen + self.silence_allowed_s(agent)
        self._due[agent.agent_id] = deadline
        heapq.heappush(self._deadlines, (deadline, agent.agent_id))

    def ticked(self, now: Instant) -> list[Command]:
        """Note a tick; after a gap longer than the stall threshold, restart every window."""
        last, self._last_tick = self._last_tick, now.mono
        if last is None or now.mono - last <= self.stall_threshold_s:
            return []
        # We were not running: silence from agents says nothing about them.
        self.registry.counters["manager_stalls"] += 1
        reason = f"no tick for {now.mono - last:.1f} s; liveness windows restarted"
        return self._restart_windows(now, "manager_stalled", reason)

    def connection_lost(self, now: Instant) -> None:
        """Deaf from now on: nobody is evicted until the connection is back."""
        self._deaf_since = now.mono
        self.registry.counters["connection_lost"] += 1

    def connection_restored(self, now: Instant) -> list[Command]:
        """Hearing again: every agent gets a fresh window."""
        deaf = 0.0 if self._deaf_since is None else now.mono - self._deaf_since
        self._deaf_since = None
        reason = f"broker connection restored after {deaf:.1f} s; liveness windows restarted"
        return self._restart_windows(now, "connection_restored", reason)

    def _restart_windows(self, now: Instant, kind: str, reason: str) -> list[Command]:
        for agent in self.registry.agents.values():
            agent.last_seen = max(agent.last_seen, now.mono)
        return [AppendLog(LogEntry(at=now.wall, kind=kind, reason=reason))]

    def evict_silent(self, now: Instant) -> list[Command]:
        """Agents silent past their window are lost (none while the broker is away). The
        deadlines wait in a heap, each as of when it was queued: one that comes due is
        checked against the agent's last heartbeat, and queued again if it has beaten since
        — so a tick costs the agents whose (possibly old) deadline passed, about a window's
        share of the fleet, not a walk over every agent."""
        if self._deaf_since is not None:
            return []
        heap, due, agents = self._deadlines, self._due, self.registry.agents
        lost = []
        while heap and heap[0][0] < now.mono:
            deadline, agent_id = heapq.heappop(heap)
            if due.get(agent_id) != deadline:
                continue  # superseded by a later entry for this agent
            agent = agents.get(agent_id)
            if agent is None:
                del due[agent_id]  # it left
                continue
            if now.mono - agent.last_seen > self.silence_allowed_s(agent):
                del due[agent_id]
                lost.append(agent)
            else:
                self.watch(agent)
        out: list[Command] = []
        for agent in lost:
            silence = now.mono - agent.last_seen
            self.registry.counters["lost"] += 1
            reason = f"no heartbeat for {silence:.1f} s"
            out += self.registry.remove(agent, Trigger.LOSE, now, reason)
            out.append(FenceAgent(agent.agent_id, agent.incarnation, reason))
            if self.scaling.manages(agent.deployment):
                out.append(DeletePod(agent.deployment, agent.agent_id, reason))
        return out
