"""The direct lease path: find an agent, lease one of its slots, give it back.

``acquire`` takes one slot of one capability on one agent — the least loaded of the cheapest
that can take work, or the one the producer named — gated on the agent's one count of work
against ``max_concurrency``; ``release`` gives it back. Leases expire after their TTL so a
crashed producer cannot pin an agent forever. An agent that lists ``lease-notices`` is told
of each lease on it (issued, before the producer hears of it; ended) and runs a lease-path
task only under one. A refusal for want of an agent is a capacity miss for the scale
planner, and carries a retry hint.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

from packaging.specifiers import SpecifierSet

from mesh.core.drains import Drains
from mesh.core.events import Command, FindRequested, Instant, Reply, SendToAgent
from mesh.core.index import Candidate, InvalidVersionSpec, Slot, parse_spec, parse_version
from mesh.core.lifecycle import ACQUIRABLE, AgentState, Trigger
from mesh.core.registry import LeaseRecord, Registry
from mesh.core.scaling import ScalePlanner
from mesh.wire.models import (
    AcquireRequest,
    AgentSummary,
    FindReply,
    Lease,
    LeaseNotice,
    Refusal,
    Released,
)
from mesh.wire.reasons import Reason

_CAPACITY_MISSES = frozenset({Reason.NO_AGENT_AVAILABLE, Reason.UNKNOWN_CAPABILITY})
NO_AGENT_RETRY_MS = 1_000
"""The retry hint of a lease refused for want of a free agent, without a scaling policy."""


class Leases:
    """Find, acquire, release and expire leases on the registry's agents."""

    def __init__(
        self, registry: Registry, drains: Drains, scaling: ScalePlanner, *, default_ttl_s: float
    ) -> None:
        self.registry = registry
        self.drains = drains
        self.scaling = scaling
        self.default_ttl_s = default_ttl_s
        self._expiry: list[tuple[float, str]] = []  # (expires_at, lease ID), soonest first

    def find(self, event: FindRequested) -> list[Command]:
        """Agents that can take work now, as the reply to a find request."""
        req = event.request
        try:
            found = self.registry.index.find(req.capability, req.version_spec, req.limit)
        except InvalidVersionSpec as exc:
            return [Reply(Refusal(reason=Reason.INVALID_VERSION_SPEC, detail=str(exc)))]
        return [Reply(FindReply(agents=[_summary(cand) for cand in found]))]

    def acquire(
        self, request: AcquireRequest, lease_id: str, now: Instant, holder: str | None = None
    ) -> tuple[Lease | Refusal, list[Command]]:
        """Lease one slot; returns the lease (or a refusal) and the log commands.

        Idempotent per ``lease_id``: a redelivered request gets the lease it already holds.
        """
        registry = self.registry
        held = registry.leases.get(lease_id)
        if held is not None:
            registry.counters["acquire_duplicate"] += 1
            slot = registry.agents[held.agent_id].slots[held.capability]
            return _lease(held, slot, now), []
        if lease_id in registry.finished_leases:
            # A redelivered request whose lease is already over must not take a new slot.
            registry.counters["acquire_duplicate"] += 1
            detail = f"lease {lease_id!r} was already granted and has ended"
            return Refusal(reason=Reason.UNKNOWN_LEASE, detail=detail), []
        slot_or_refusal = self._choose_slot(request)
        if isinstance(slot_or_refusal, Refusal):
            return self._refused(request, slot_or_refusal, now), []
        slot = slot_or_refusal
        agent = registry.agents[slot.agent_id]
        ttl = request.ttl_s or self.default_ttl_s
        lease = LeaseRecord(lease_id, agent.agent_id, slot.capability, now.mono + ttl, holder)
        registry.leases[lease_id] = lease
        agent.leases.add(lease_id)
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        registry.change_load(agent, slot, +1)
        registry.counters["acquired"] += 1
        out = registry.transition(
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

    def _refused(self, request: AcquireRequest, refusal: Refusal, now: Instant) -> Refusal:
        """Count a refusal; one for want of an agent is a capacity miss, with a retry hint."""
        self.registry.counters[f"acquire_refused.{refusal.reason.value}"] += 1
        if request.agent_id is None and refusal.reason in _CAPACITY_MISSES:
            offering = self.registry.offering.get(request.capability, Counter())
            self.scaling.record_miss(request.capability, offering, now.mono)
            if refusal.reason is Reason.NO_AGENT_AVAILABLE:
                retry_ms = self._free_slot_expected_ms(offering, now)
                refusal = refusal.model_copy(update={"retry_after_ms": retry_ms})
            elif scaled := self.scaling.deployments_for(request.capability):
                # Nobody offers it now, but a policy's pool does (one at zero replicas,
                # say): when its replica is expected.
                retry_ms = self._free_slot_expected_ms(scaled, now)
                refusal = refusal.model_copy(update={"retry_after_ms": retry_ms})
        return refusal

    def release(
        self, lease_id: str, now: Instant, reason: str = "released", by: str | None = None
    ) -> list[Command]:
        """Give a leased slot back. Unknown leases are refused (as a Reply), never fatal.
        ``by``: who asks (``None``: the manager itself — expiry, an undeliverable grant); a
        lease bound to a holder is released only by that holder."""
        registry = self.registry
        lease = registry.leases.get(lease_id)
        if lease is None:
            registry.counters["release_unknown_lease"] += 1
            return [Reply(Refusal(reason=Reason.UNKNOWN_LEASE, detail=f"no lease {lease_id!r}"))]
        if by is not None and lease.holder is not None and by != lease.holder:
            registry.counters["release_not_authorized"] += 1
            detail = f"lease {lease_id!r} is held by another broker user ({by!r} asked)"
            return [Reply(Refusal(reason=Reason.NOT_AUTHORIZED, detail=detail))]
        del registry.leases[lease_id]
        registry.remember_finished(lease_id)
        agent = registry.agents[lease.agent_id]
        agent.leases.discard(lease_id)
        registry.change_load(agent, agent.slots[lease.capability], -1)
        registry.counters["released"] += 1
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
        out += registry.transition(
            agent, trigger, now, reason, capability=lease.capability, lease=lease_id
        )
        if draining and self.drains.drained(agent):
            out += self.drains.finish(agent, now)
        return out

    def expire(self, now: Instant) -> list[Command]:
        """Release every lease whose TTL has passed (no reply: nobody asked)."""
        out: list[Command] = []
        heap = self._expiry
        while heap and heap[0][0] <= now.mono:
            _, lease_id = heapq.heappop(heap)
            if lease_id in self.registry.leases:
                self.registry.counters["lease_expired"] += 1
                out += [
                    cmd
                    for cmd in self.release(lease_id, now, "lease expired")
                    if not isinstance(cmd, Reply)
                ]
        return out

    def _choose_slot(self, req: AcquireRequest) -> Slot | Refusal:
        try:
            if req.agent_id is None:
                found = self.registry.index.find(req.capability, req.version_spec, limit=1)
                if found:
                    return self.registry.agents[found[0].agent_id].slots[req.capability]
                return self._no_agent(req)
            spec = parse_spec(req.version_spec)
        except InvalidVersionSpec as exc:
            return Refusal(reason=Reason.INVALID_VERSION_SPEC, detail=str(exc))
        return self._check_named_agent(req, spec)

    def _check_named_agent(self, req: AcquireRequest, spec: SpecifierSet) -> Slot | Refusal:
        agent_id = req.agent_id or ""
        agent = self.registry.agents.get(agent_id)
        if agent is None:
            if agent_id in self.registry.recently_terminated:
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
        index = self.registry.index
        if req.capability not in index:
            return Refusal(
                reason=Reason.UNKNOWN_CAPABILITY, detail=f"no agent offers {req.capability}"
            )
        if not index.has_version_matching(req.capability, req.version_spec):
            versions = ", ".join(index.versions(req.capability))
            return Refusal(
                reason=Reason.CAPABILITY_NOT_OFFERED,
                detail=f"no agent offers {req.capability} {req.version_spec} "
                f"(offered versions: {versions})",
            )
        return Refusal(
            reason=Reason.NO_AGENT_AVAILABLE,
            detail=f"every agent offering {req.capability} {req.version_spec} is full or draining",
        )


def _lease(lease: LeaseRecord, slot: Slot, now: Instant) -> Lease:
    return Lease(
        lease_id=lease.lease_id,
        agent_id=lease.agent_id,
        capability=slot.capability,
        version=slot.version,
        cost_class=slot.cost_class,
        expires_in_s=max(0.0, lease.expires_at - now.mono),
    )


def _summary(cand: Candidate) -> AgentSummary:
    return AgentSummary(
        agent_id=cand.agent_id,
        capability=cand.capability,
        version=cand.version,
        cost_class=cand.cost_class,
        in_flight=cand.in_flight,
        max_concurrency=cand.max_concurrency,
    )
