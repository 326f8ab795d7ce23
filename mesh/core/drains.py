"""Drains: an agent taking no new work, then leaving once nothing is in flight.

Draining happens at once (out of the index, no new leases); Terminated follows once nothing
is in flight on either path, and the agent is told it may exit. An agent that reports its
pool work (feature ``work-reports``) must also have confirmed the drain — a heartbeat saying
``draining`` is sent only once it stopped taking pool tasks — so a pool task it claimed just
before the drain is never missed. The heartbeat and lease rooms ask :meth:`Drains.drained`
whenever an agent's load falls, and finish the drain through :meth:`Drains.finish`.
"""

from __future__ import annotations

from mesh.core.events import (
    AppendLog,
    Command,
    DrainRequested,
    Instant,
    LogEntry,
    Reply,
    SendToAgent,
)
from mesh.core.lifecycle import AgentState, Trigger
from mesh.core.registry import AgentRecord, Registry
from mesh.wire.models import DrainAccepted, DrainComplete, DrainNotice, Refusal
from mesh.wire.reasons import Reason


class Drains:
    """Starts drains (asked for, or a scale-down's victim) and completes them."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def on_drain(self, event: DrainRequested, now: Instant) -> list[Command]:
        """A drain asked for by an operator or the agent: accepted (with what is in flight),
        or refused for an agent this registry does not hold."""
        registry = self.registry
        agent = registry.agents.get(event.agent_id)
        if agent is None:
            reason = (
                Reason.AGENT_TERMINATED
                if event.agent_id in registry.recently_terminated
                else Reason.UNKNOWN_AGENT
            )
            return [Reply(Refusal(reason=reason, detail=f"cannot drain {event.agent_id!r}"))]
        reply = Reply(DrainAccepted(agent_id=agent.agent_id, in_flight=agent.in_flight))
        if agent.state is AgentState.DRAINING:
            return [reply]
        return [*self.drain(agent, event.reason or "drain requested", now), reply]

    def drain(self, agent: AgentRecord, reason: str, now: Instant) -> list[Command]:
        """Draining at once (out of the index); Terminated as soon as nothing is leased."""
        registry = self.registry
        out = registry.transition(agent, Trigger.DRAIN, now, reason)
        registry.refresh_availability(agent, agent.in_flight, agent.in_flight)
        registry.count_live(agent)
        registry.counters["drained"] += 1
        out.append(SendToAgent(agent.agent_id, DrainNotice(agent_id=agent.agent_id, reason=reason)))
        if agent.reports_work and agent.reported_draining:  # it asked first (SIGTERM)
            out.append(self.confirmed(agent, now))
        if self.drained(agent):
            out += self.finish(agent, now)
        return out

    @staticmethod
    def drained(agent: AgentRecord) -> bool:
        """Nothing in flight on either path — and, for an agent that reports its pool work,
        its report says it takes no more pool tasks (else one it claimed just before the
        drain could still be on its way)."""
        return agent.in_flight == 0 and (agent.reported_draining or not agent.reports_work)

    @staticmethod
    def confirmed(agent: AgentRecord, now: Instant) -> AppendLog:
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

    def finish(self, agent: AgentRecord, now: Instant) -> list[Command]:
        """Draining and nothing in flight: Terminated, removed, and told it may exit."""
        out = self.registry.remove(agent, Trigger.DRAINED, now, "drained: nothing in flight")
        out.append(SendToAgent(agent.agent_id, DrainComplete(agent_id=agent.agent_id)))
        return out
