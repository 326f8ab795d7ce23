"""Registration: agents joining the registry, being refused, and leaving on their own.

A record starts in Spawning, moves to Registering when its registration arrives and to Ready
once accepted; the agent gets a ``RegistrationAccepted``, or a ``RegistrationRefused`` with a
reason: a heartbeat interval too short for the liveness rule, or — with broker identities
off — an agent ID a live incarnation still holds. An agent is Ready only once its acceptance
reached it: one that could not be delivered takes the registration back. A capability
offered at a second version is journaled as ``version_drift``.
"""

from __future__ import annotations

import hashlib
import logging

from mesh import constants as c
from mesh.core.events import (
    AcceptanceUndelivered,
    Announce,
    AppendLog,
    Command,
    DeregistrationReceived,
    Instant,
    LogEntry,
    RegistrationReceived,
    SendToAgent,
)
from mesh.core.index import Slot
from mesh.core.lifecycle import Trigger
from mesh.core.liveness import Liveness
from mesh.core.registry import AgentRecord, Registry
from mesh.wire.models import AgentRegistration, RegistrationAccepted, RegistrationRefused
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)


class Registrations:
    """Accepts, refuses and takes back registrations; handles deregistrations."""

    def __init__(
        self, registry: Registry, liveness: Liveness, *, min_heartbeat_interval_s: float
    ) -> None:
        self.registry = registry
        self.liveness = liveness
        self.min_heartbeat_interval_s = min_heartbeat_interval_s

    def on_registration(self, event: RegistrationReceived, now: Instant) -> list[Command]:
        registry = self.registry
        reg = event.registration
        out: list[Command] = []
        existing = registry.agents.get(reg.agent_id)
        if existing is not None:
            if existing.incarnation == reg.incarnation:
                # The agent retried (our acceptance was lost, or slow): answer the same way.
                registry.counters["registration_duplicate"] += 1
                return [SendToAgent(reg.agent_id, _accepted(reg))]
            if not event.identity_verified:
                # Without broker identities anyone may claim any agent ID: a live agent is
                # never displaced by a registration that cannot prove it is that agent.
                return self._refuse_while_live(existing, reg, now)
            out += registry.remove(
                existing, Trigger.DEREGISTER, now, "replaced by a new incarnation"
            )
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
        out += registry.transition(agent, Trigger.REGISTER, now, "registration received")
        if reg.heartbeat_interval_s < self.min_heartbeat_interval_s:
            return out + self._refuse_registration(agent, reg, now)
        slots = [
            Slot(agent.agent_id, cap.name, cap.version, cap.cost_class, cap.max_concurrency)
            for cap in reg.capabilities
        ]
        for name in registry.add(agent, slots):
            out += self._version_drift(name, now)
        self.liveness.watch(agent)
        out += registry.transition(agent, Trigger.ACCEPT, now, "registration accepted")
        registry.refresh_availability(agent, agent.in_flight, agent.in_flight)
        registry.count_live(agent)
        registry.counters["registered"] += 1
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
        minimum = self.min_heartbeat_interval_s
        detail = (
            f"heartbeat_interval_s={reg.heartbeat_interval_s:g} is below the minimum of "
            f"{minimum:g} s: with the {self.liveness.missed_heartbeats_before_lost}-miss rule "
            "such a short interval evicts healthy agents during GC pauses"
        )
        self.registry.counters["registration_refused"] += 1
        out = self.registry.transition(
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
        window = self.liveness.silence_allowed_s(existing)
        wait_s = max(1.0, existing.last_seen + window - now.mono)
        detail = (
            f"agent {reg.agent_id!r} is live as another incarnation (last "
            f"heard {now.mono - existing.last_seen:.1f} s ago); a new incarnation is accepted "
            f"once that one deregisters or is declared lost (within {wait_s:.0f} s) — or at "
            "once with --agent-identity on, where the broker vouches for the agent"
        )
        self.registry.counters["registration_refused"] += 1
        self.registry.counters["registration_incarnation_live"] += 1
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

    def on_acceptance_undelivered(
        self, event: AcceptanceUndelivered, now: Instant
    ) -> list[Command]:
        """An agent is Ready only once its acceptance reached it: one returned for want of a
        control queue (a registration published by something that does not listen, or whose
        queue is gone) takes the registration back, with what was leased on it."""
        agent = self.registry.agents.get(event.agent_id)
        if agent is None or agent.incarnation != event.incarnation:
            return []
        self.registry.counters["acceptance_undelivered"] += 1
        return self.registry.remove(
            agent, Trigger.LOSE, now, "its acceptance could not be delivered: no control queue"
        )

    def on_deregistration(self, event: DeregistrationReceived, now: Instant) -> list[Command]:
        msg = event.deregistration
        agent = self.registry.agents.get(msg.agent_id)
        if agent is None or agent.incarnation != msg.incarnation:
            self.registry.counters["deregistration_ignored"] += 1
            return []
        return self.registry.remove(agent, Trigger.DEREGISTER, now, msg.reason or "deregistered")

    def _version_drift(self, name: str, now: Instant) -> list[Command]:
        versions = self.registry.index.versions(name)
        if len(versions) < 2:
            return []
        self.registry.counters["version_drift_warnings"] += 1
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


def fingerprint(incarnation: str) -> str:
    """What the journal and the events feed say of an incarnation: with identities off, the
    incarnation itself lets anyone speak for the agent (heartbeats, deregistration, a drain),
    so it is never published; operators match a fingerprint against an agent's logs."""
    return "sha256-" + hashlib.sha256(incarnation.encode()).hexdigest()[:12]


def _accepted(reg: AgentRegistration) -> RegistrationAccepted:
    return RegistrationAccepted(agent_id=reg.agent_id, incarnation=reg.incarnation)
