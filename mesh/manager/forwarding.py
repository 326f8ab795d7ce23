"""Several managers: the lease path and status across shards.

Theory of operation
-------------------
Each manager holds the agents of its shards only, so a lease-path request taken from the shared
RPC queue may concern agents another manager holds. The manager that took it asks the others
(:class:`~mesh.manager.peers.Peers`, one RPC queue per other owner as it last read the lease
table) and merges: ``find`` and ``status`` over every registry; an acquire by capability asks
the candidates of every owner in rank order, by name, until one is leased, under one lease ID
on every owner (so a redelivered request gets the lease it already holds); a release or drain
for an agent or lease not held here goes to whoever holds it. An owner that does not answer in
time is left out and counted; while shards change hands, "nobody offers it" is only one
registry's word, so it becomes ``NO_AGENT_AVAILABLE`` with a retry hint.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mesh import constants as c
from mesh.core.events import (
    AcquireRequested,
    DrainRequested,
    Event,
    FindRequested,
    ReleaseRequested,
)
from mesh.core.pool import PoolCore
from mesh.core.ranking import rank
from mesh.manager.commands import CommandExecutor
from mesh.manager.settings import ManagerSettings
from mesh.manager.sharding import Sharding
from mesh.topology.specs import Topology
from mesh.transport.delivery import Delivery
from mesh.wire.models import (
    AcquireRequest,
    AgentSummary,
    DrainRequest,
    FindReply,
    FindRequest,
    LeaseGranted,
    Message,
    Refusal,
    ReleaseRequest,
)
from mesh.wire.reasons import Reason
from mesh.wire.status import (
    MAX_STATUS_AGENTS,
    AgentStatus,
    CapabilityLoadStatus,
    PoolStates,
    ShardOwner,
    StatusReply,
    StatusRequest,
)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Agents that may take an acquire, each with the owner's queue (``None``: this
    registry), in rank order; ``silent``: owners asked that did not answer in time, and
    ``unanswered_shards`` the shards they answer for."""

    found: list[tuple[AgentSummary, str | None]]
    silent: int
    unanswered_shards: int = 0


# An acquire for a capability nobody offers while shards change hands is asked again every
# SETTLING_RETRY_S for at most a lease period, capped here below producers' usual timeouts.
SETTLING_RETRY_S = 0.1
MAX_SETTLING_HOLD_S = 5.0
# A redelivered acquire looks for the lease its ID holds this often while shards move.
_HELD_LOOK_S = 0.25
# Refusals that say nobody offers a capability: with several managers, only one registry's
# word (``_refusal_everywhere``).
_NOBODY_OFFERS = frozenset({Reason.UNKNOWN_CAPABILITY, Reason.CAPABILITY_NOT_OFFERED})
_NOT_HELD_HERE = frozenset({Reason.UNKNOWN_AGENT, Reason.UNKNOWN_LEASE})
"""Refusals that mean "another manager may hold it" when asked of every owner."""


class Forwarding:
    """The lease path and status across every owner's registry (only with shards)."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        topology: Topology,
        core: PoolCore,
        counters: Counter[str],
        commands: CommandExecutor,
        sharding: Sharding,
        status: Callable[[StatusRequest], StatusReply],
    ) -> None:
        self._settings = settings
        self._topology = topology
        self._core = core
        self._counters = counters
        self._commands = commands
        self._sharding = sharding
        self._status = status

    def _peer_queues(self) -> list[str]:
        """RPC queues that reach every shard this manager does not hold: one of each other
        owner's as it last read the lease table (an owner answers for all its shards), and
        the shard's own for a shard that table says nobody else holds — a view a step old
        may still name this manager, or nobody, for a shard another has taken since. An
        owner reached twice answers twice: the callers merge by agent."""
        return list(self._peer_routes())

    def _peer_routes(self) -> dict[str, list[int]]:
        """:meth:`_peer_queues`, each with the shards it answers for (as last read)."""
        assert self._sharding.shards is not None and self._settings.shard_count is not None
        me, held = self._settings.manager_id, self._sharding.shards.owned()
        view = self._sharding.shards.last_view
        owners = {} if view is None else view.owners()
        by_owner: dict[str, list[int]] = {}
        routes: dict[int, list[int]] = {}  # by the shard whose queue reaches them
        for shard in range(self._settings.shard_count):
            owner = owners.get(shard)
            if shard in held:
                continue
            if owner is None or owner == me:
                routes[shard] = [shard]
            else:
                by_owner.setdefault(owner, []).append(shard)
        for shards in by_owner.values():
            routes[min(shards)] = shards
        return {self._topology.shard_rpc_queue(s): routes[s] for s in sorted(routes)}

    def _forward_headers(self, publisher: str | None, **extra: str) -> dict[str, str]:
        headers = {c.H_FORWARDED_BY: self._settings.manager_id, **extra}
        if publisher is not None:
            headers[c.H_FORWARDED_FOR] = publisher
        return headers

    async def find_everywhere(self, request: FindRequest, say_unanswered: bool = False) -> Message:
        """This registry's candidates and every other owner's, in the one order (cheapest
        cost class, then least loaded), cut at ``limit``. An owner that does not answer in
        time is left out (counted: ``find_shards_unanswered``; find is a view, acquire
        re-checks); with ``say_unanswered`` (the client knows the field) the reply says how
        many shards' agents are missing (``unanswered_shards``)."""
        candidates = await self._candidates(request)
        if isinstance(candidates, Refusal):
            return candidates
        if candidates.unanswered_shards:
            self._counters["find_shards_unanswered"] += candidates.unanswered_shards
        extra = {"unanswered_shards": candidates.unanswered_shards} if say_unanswered else {}
        agents = [agent for agent, _ in candidates.found]
        return FindReply(
            agents=agents if request.limit is None else agents[: request.limit], **extra
        )

    async def _candidates(self, request: FindRequest) -> _Candidates | Refusal:
        """Candidates from here (queue ``None``) and from each other owner (its queue), and
        how many owners did not answer."""
        assert self._sharding.peers is not None
        here = await self._commands.answer(FindRequested(request))
        if not isinstance(here, FindReply):
            return here if isinstance(here, Refusal) else Refusal(reason=Reason.NOT_FOUND)
        found: list[tuple[AgentSummary, str | None]] = [(a, None) for a in here.agents]
        routes = self._peer_routes()
        queues = list(routes)
        answers = await self._sharding.peers.ask_all(
            queues,
            request,
            headers=self._forward_headers(None),
            timeout_s=self._settings.peer_timeout_s,
        )
        for queue, answer in answers:
            if isinstance(answer, FindReply):
                found += [(agent, queue) for agent in answer.agents]
        found.sort(key=lambda pair: rank(pair[0].cost_class, pair[0].in_flight))
        seen: set[str] = set()  # an owner reached through two queues answers twice
        unique: list[tuple[AgentSummary, str | None]] = []
        for agent, via in found:
            if agent.agent_id not in seen:
                seen.add(agent.agent_id)
                unique.append((agent, via))
        silent, unanswered = _unanswered(routes, answers)
        return _Candidates(unique, silent, unanswered)

    async def acquire_everywhere(
        self, request: AcquireRequest, lease_id: str, holder: str | None, delivery: Delivery
    ) -> None:
        """A slot on the best agent of any owner: named, the agent's owner leases it (the one
        that knows it); by capability, the candidates of every owner in order, each asked
        for by name until one is leased. The lease ID is this request's, on every owner, so
        a redelivered request gets the lease it already holds."""
        assert self._sharding.peers is not None
        if request.agent_id is not None:
            if request.agent_id in self._core.agents:
                await self._commands.feed(
                    AcquireRequested(request, lease_id, holder=holder), delivery
                )
            else:
                await self._commands.reply(
                    delivery, await self.elsewhere(request, holder, lease_id)
                )
            return
        limit = self._settings.peer_acquire_candidates
        find = FindRequest(
            capability=request.capability, version_spec=request.version_spec, limit=limit
        )
        answer: Message | None = None
        hold_until = time.monotonic() + self._settling_hold_s()
        held = False
        silent = 0
        while True:
            candidates = await self._candidates(find)
            if not isinstance(candidates, Refusal):
                silent = candidates.silent
                for agent, queue in candidates.found[:limit]:
                    named = request.model_copy(update={"agent_id": agent.agent_id})
                    if queue is None:
                        answer = await self._commands.answer(
                            AcquireRequested(named, lease_id, holder)
                        )
                    else:
                        answer = await self._sharding.peers.ask(
                            queue,
                            named,
                            headers=self._forward_headers(holder, **{c.H_LEASE_ID: lease_id}),
                            timeout_s=self._settings.peer_timeout_s,
                        )
                    if isinstance(answer, LeaseGranted):
                        break
            nobody_offers = not isinstance(candidates, Refusal) and not candidates.found
            if (
                isinstance(answer, LeaseGranted)
                or not nobody_offers
                or not await self._moving_for(request.capability, hold_until, look=not held)
            ):
                break
            # Nobody offers it while shards change hands: its agents may be registering
            # again with a new owner. Ask again shortly rather than answer that nobody does.
            if not held:
                held = True
                self._counters["acquires_held_while_shards_move"] += 1
            await asyncio.sleep(SETTLING_RETRY_S)
        if not isinstance(answer, LeaseGranted):
            # Nobody had room: the refusal this registry gives (it records the miss for the
            # scale planner and says when to retry), as the namespace's answer.
            answer = self._refusal_everywhere(
                await self._commands.answer(AcquireRequested(request, lease_id, holder)),
                silent,
                request.capability,
            )
        delivered = await self._commands.reply(delivery, answer)
        if not delivered and isinstance(answer, LeaseGranted):
            self._counters["leases_released_unclaimed"] += 1
            await self.elsewhere(ReleaseRequest(lease_id=answer.lease.lease_id), holder)

    async def lease_granted_before(
        self, request: AcquireRequest, lease_id: str, holder: str | None
    ) -> Message | None:
        """For a redelivered acquire (the manager it went to stopped before acking it, maybe
        after answering): the lease its ID already holds, wherever it is, so the request is
        answered the same again rather than decided anew (a grant, then "no agent available").
        While an owner is silent or shards are changing hands, that lease may be on its way
        to a new owner (its agents register again with the leases they hold): it is looked
        for again every ``_HELD_LOOK_S`` for up to a lease and a hand-over. ``None``: held
        nowhere (no grant was given, or it has ended) — decide it as any request."""
        assert self._sharding.peers is not None and self._sharding.shards is not None
        give_up_at = (
            time.monotonic() + self._settings.shard_lease_s + self._settings.live_handover_s
        )
        headers = self._forward_headers(holder, **{c.H_LEASE_ID: lease_id, c.H_HELD_ONLY: "1"})
        while True:
            if lease_id in self._core.leases:
                return await self._commands.answer(AcquireRequested(request, lease_id, holder))
            routes = self._peer_routes()
            answers = await self._sharding.peers.ask_all(
                list(routes), request, headers=headers, timeout_s=self._settings.peer_timeout_s
            )
            for _, answer in answers:
                if isinstance(answer, LeaseGranted):
                    return answer
            silent, _ = _unanswered(routes, answers)
            moving = (
                silent or self._sharding.shards.moving() or self._handing_over(request.capability)
            )
            if not moving or time.monotonic() >= give_up_at:
                return None
            await asyncio.sleep(_HELD_LOOK_S)
            await self._sharding.shards.look()

    def _refusal_everywhere(self, answer: Message, silent: int, capability: str) -> Message:
        """This registry's refusal as every manager's. "Nobody offers it"
        (``_NOBODY_OFFERS``) is only this registry's word, so it is said only when no other
        owner may hold such an agent: when an owner did not answer (dead or frozen, its
        lease not yet run out), shards changed hands within a (default) heartbeat interval,
        or the shared live rows still count agents of the capability in a shard whose new
        owner has not caught up (their agents are registering again with it), the answer is
        ``NO_AGENT_AVAILABLE`` with a retry hint instead — a producer retries rather than
        gives up on a capability that is there. Counted: ``acquires_refused_for_now.<reason>``."""
        assert self._sharding.shards is not None
        if not isinstance(answer, Refusal) or answer.reason not in _NOBODY_OFFERS:
            return answer
        if silent:
            why = f"{silent} other manager(s) did not answer"
        elif self._sharding.shards.settling(c.DEFAULT_HEARTBEAT_INTERVAL_S) or self._handing_over(
            capability
        ):
            why = "shards changed hands just now and their agents are registering again"
        else:
            return answer
        self._counters[f"acquires_refused_for_now.{answer.reason.value}"] += 1
        return Refusal(
            reason=Reason.NO_AGENT_AVAILABLE,
            detail=f"{answer.detail} here, for now: {why}",
            retry_after_ms=max(1, round(1000 * self._settling_hold_s())),
        )

    async def _partial(
        self,
        unanswered: int,
        say_unanswered: bool,
        say_settling: bool,
        theirs: list[ShardOwner],
    ) -> dict[str, Any]:
        """What a merged status says of its own completeness, in the fields the client knows:
        shards whose owners did not answer, shards whose agents may be registering again
        (``theirs``: the other owners' holdings as their replies say)."""
        extra: dict[str, Any] = {"unanswered_shards": unanswered} if say_unanswered else {}
        if say_settling:
            assert self._sharding.shards is not None
            await self._sharding.shards.look()  # moves since its last step count too (one read)
            extra["settling_shards"] = self._sharding.shards.settling_shards(
                c.DEFAULT_HEARTBEAT_INTERVAL_S, theirs, self._shards_handing_over()
            )
        return extra

    def _shards_handing_over(self, capability: str | None = None) -> set[int]:
        """The shards (with agents of ``capability``, if named) whose new owner has not yet
        caught up with the agents the shared live rows count (ShardOwnership.handing_over);
        none without shared live capacity."""
        if self._sharding.shards is None or self._sharding.shared_live is None:
            return set()
        return self._sharding.shards.handing_over(
            self._sharding.shared_live.shared.values(), capability
        )

    def _handing_over(self, capability: str) -> bool:
        return bool(self._shards_handing_over(capability))

    def _settling_hold_s(self) -> float:
        """How long an acquire for a capability nobody offers is held while shards move:
        a lease period (a dead owner's shards are taken within it, and their agents asked to
        register again), at most ``MAX_SETTLING_HOLD_S`` (producers' own timeouts)."""
        return min(self._settings.shard_lease_s, MAX_SETTLING_HOLD_S)

    async def _moving_for(self, capability: str, hold_until: float, *, look: bool) -> bool:
        """:meth:`_unknown_while_moving`; with ``look``, after reading the lease table (about
        to say nobody offers it: a shard may have moved since this manager's last step)."""
        if look:
            assert self._sharding.shards is not None
            await self._sharding.shards.look()
        return self._unknown_while_moving(capability, hold_until)

    def _unknown_while_moving(self, capability: str, hold_until: float) -> bool:
        """Whether no registry offers ``capability`` only because shards are moving (and the
        request may still be held)."""
        assert self._sharding.shards is not None
        return (
            capability not in self._core.index
            and (self._sharding.shards.moving() or self._handing_over(capability))
            and time.monotonic() < hold_until
        )

    async def elsewhere(
        self, request: Message, publisher: str | None, lease_id: str | None = None
    ) -> Message:
        """A request about one agent or lease that this registry does not hold, asked of
        every other owner: the one that holds it answers; if none does, this registry's
        own answer (unknown agent or lease)."""
        assert self._sharding.peers is not None
        extra = {} if lease_id is None else {c.H_LEASE_ID: lease_id}
        answers = await self._sharding.peers.ask_all(
            self._peer_queues(),
            request,
            headers=self._forward_headers(publisher, **extra),
            timeout_s=self._settings.peer_timeout_s,
        )
        for _, answer in answers:
            if not isinstance(answer, Refusal) or answer.reason not in _NOT_HELD_HERE:
                return answer
        event: Event
        if isinstance(request, ReleaseRequest):
            event = ReleaseRequested(request.lease_id, by=publisher or "")
        elif isinstance(request, DrainRequest):
            event = DrainRequested(request.agent_id, request.reason)
        else:
            assert isinstance(request, AcquireRequest)
            event = AcquireRequested(request, lease_id or uuid.uuid4().hex, holder=publisher)
        return await self._commands.answer(event)

    async def status_everywhere(
        self, request: StatusRequest, say_unanswered: bool = False, say_settling: bool = False
    ) -> StatusReply:
        """Several managers: the fleet over every owner's registry. The summaries (totals,
        pools by state, capabilities) are added up — each a running tally, so this stays
        cheap at any fleet size; the page of agent rows is the slice of all owners' rows in
        agent-ID order (each owner sends its first ``offset + limit``), the pools' live
        figures added up too. Counters are this manager's. An owner that does not answer in
        time is left out (counted: ``status_shards_unanswered``); with ``say_unanswered``
        (the client knows the field) the reply says how many shards' agents are missing
        (``unanswered_shards``)."""
        assert self._sharding.peers is not None
        mine = self._status(_first_rows(request))
        replies = [mine]
        routes = self._peer_routes()
        answers = await self._sharding.peers.ask_all(
            list(routes),
            _first_rows(request),
            headers=self._forward_headers(None),
            timeout_s=self._settings.peer_timeout_s,
        )
        _, unanswered = _unanswered(routes, answers)
        if unanswered:
            self._counters["status_shards_unanswered"] += unanswered
        for _, answer in answers:
            # An owner reached through two of its queues answers twice: counted once.
            if isinstance(answer, StatusReply) and all(
                answer.manager_id != r.manager_id for r in replies
            ):
                replies.append(answer)
        theirs = [
            row for r in replies[1:] for row in r.shards or [] if row.owner == r.manager_id
        ]  # fmt: skip
        extra = await self._partial(unanswered, say_unanswered, say_settling, theirs)
        offset = request.agents_offset or 0
        rows = sorted((row for reply in replies for row in reply.agents), key=_agent_key)
        if request.agents_limit is None:  # an older client: every row, no summary
            return mine.model_copy(update={"agents": rows, **extra})
        states: dict[str, Counter[str]] = {}
        loads: dict[str, list[int]] = {}
        for reply in replies:
            for pool in reply.pool_states or []:
                states.setdefault(pool.pool_id, Counter()).update(pool.states)
            for load in reply.capability_loads or []:
                summed = loads.setdefault(load.name, [0, 0, 0, 0])
                for i, n in enumerate(
                    (load.agents, load.taking_work, load.in_flight, load.capacity)
                ):
                    summed[i] += n
        # Each pool's live figures come from its owner's registry (the others count none of
        # its agents): added up; the ledger's figures (granted, model slots) are shared.
        live: dict[tuple[str, str], tuple[int, int]] = {}
        for reply in replies:
            for figure in reply.pools:
                agents, slots = live.get((figure.pool_id, figure.capability), (0, 0))
                live[figure.pool_id, figure.capability] = (
                    agents + figure.live_agents,
                    slots + figure.live_slots,
                )
        pools = []
        for figure in mine.pools:
            agents, slots = live[figure.pool_id, figure.capability]
            pools.append(figure.model_copy(update={"live_agents": agents, "live_slots": slots}))
        return mine.model_copy(
            update={
                "pools": pools,
                "agents": rows[offset : offset + request.agents_limit],
                "agents_offset": offset,
                "agents_total": sum(reply.agents_total or 0 for reply in replies),
                "pool_states": [
                    PoolStates(pool_id=p, states=dict(sorted(c.items())))
                    for p, c in sorted(states.items())
                ],
                "capability_loads": [
                    CapabilityLoadStatus(
                        name=name, agents=n[0], taking_work=n[1], in_flight=n[2], capacity=n[3]
                    )
                    for name, n in sorted(loads.items())
                ],
                **extra,
            }
        )


def _first_rows(request: StatusRequest) -> StatusRequest:
    """What to ask each owner for a merged page: its first ``offset + limit`` rows (at most
    a page's worth: deeper pages than that over several managers are cut)."""
    if request.agents_limit is None:
        return request
    wanted = (request.agents_offset or 0) + request.agents_limit
    return StatusRequest(agents_offset=0, agents_limit=min(wanted, MAX_STATUS_AGENTS))


def _agent_key(row: AgentStatus) -> str:
    return row.agent_id


def _unanswered(
    routes: Mapping[str, list[int]], answers: Sequence[tuple[str, object]]
) -> tuple[int, int]:
    """Of the peer queues asked (``routes``: each with the shards it answers for), how many
    did not answer, and how many shards those answer for."""
    answered = {queue for queue, _ in answers}
    silent = [shards for queue, shards in routes.items() if queue not in answered]
    return len(silent), sum(len(shards) for shards in silent)
