"""What reaches the manager on its queues, taken in and settled: announcements from agents and
requests from producers and operators.

Theory of operation
-------------------
``<ns>.manager.announce`` (and each held shard's announce queue) carries registrations,
deregistrations and drain requests from agents, and their questions (standing, a lease's or an
admission's state). What arrived together is handled as one batch (at most ``announce_batch``):
each decoded, its sender checked, fed to the core in order; the batch's commands carried out
together (one journal commit), and only then is each acked. ``<ns>.manager.rpc`` carries the
client API: each request handled on a task of its own, answered on its ``reply_to`` with its
``correlation_id``, then acked. Admission requests go to the admission service; find, acquire,
release and drain to the pool core, or — with several managers — across every owner
(:class:`~mesh.manager.forwarding.Forwarding`).

A message that cannot be decoded, or whose sender may not send it, is republished to the
dead-letter exchange with its reason code in ``x-mesh-reason``, counted, and acked; if it asked
for a reply, the requester also gets a ``Refusal`` with that reason. A transport failure hands
a delivery back (the core's handling is idempotent); a bug rejects it. Nothing a peer sends can
crash the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence

from mesh import constants as c
from mesh import tracing
from mesh.core.events import (
    AcquireRequested,
    Command,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FindRequested,
    RegistrationReceived,
    ReleaseRequested,
)
from mesh.core.pool import PoolCore
from mesh.core.shards import shard_of
from mesh.errors import MessageRejected, TransportError
from mesh.manager.admission_service import AdmissionService
from mesh.manager.agent_questions import AgentQuestions
from mesh.manager.background import Background
from mesh.manager.clock import Clock
from mesh.manager.commands import CommandExecutor
from mesh.manager.forwarding import Forwarding
from mesh.manager.settings import ManagerSettings
from mesh.manager.sharding import Sharding
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.delivery import Delivery
from mesh.transport.ports import ManagerTransport
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionRelease,
    AdmissionRequest,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorShadow,
    ExplainRequest,
)
from mesh.wire.codec import decode_as
from mesh.wire.models import (
    AcquireRequest,
    AdmissionStateRequest,
    AgentRegistration,
    Deregistration,
    DrainRequest,
    FindRequest,
    LeaseStateRequest,
    Message,
    Refusal,
    RegistrationRefused,
    Released,
    ReleaseRequest,
    StandingRequest,
)
from mesh.wire.reasons import Reason
from mesh.wire.status import StatusReply, StatusRequest

log = logging.getLogger(__name__)

_ANNOUNCE_TYPES = (
    AgentRegistration,
    Deregistration,
    DrainRequest,
    StandingRequest,
    AdmissionStateRequest,
    LeaseStateRequest,
)
_RPC_TYPES = (
    FindRequest,
    AcquireRequest,
    ReleaseRequest,
    DrainRequest,
    StatusRequest,
    AdmissionRequest,
    AdmissionRelease,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorShadow,
    ExplainRequest,
)


class Intake:
    """Takes the manager's queues' deliveries, handles each and settles it (ack, hand back,
    reject or dead-letter)."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        topology: Topology,
        core: PoolCore,
        clock: Clock,
        counters: Counter[str],
        transport: Callable[[], ManagerTransport],
        commands: CommandExecutor,
        admission: AdmissionService,
        sharding: Sharding,
        forwarding: Forwarding,
        status: Callable[[StatusRequest], StatusReply],
        dead_lettered: Callable[[str], None],
        background: Background,
        manager_user: str | None,
    ) -> None:
        self._settings = settings
        self._topology = topology
        self._rpc_queue = topology.rpc_queue  # named on a request's span
        self._core = core
        self._clock = clock
        self._counters = counters
        self._transport = transport
        self._commands = commands
        self._admission = admission
        self._sharding = sharding
        self._forwarding = forwarding
        self._status = status
        self._dead_lettered = dead_lettered
        self._background = background
        self._questions = AgentQuestions(
            core=core, clock=clock, counters=counters, reservation=admission.reservation
        )
        # The broker user managers publish as: a registration forwarded to its shard's owner
        # carries its agent's user in a header, trusted only from this user (validated).
        self._manager_user = manager_user
        # Announcements (registrations above all) that arrived together — in one read from
        # the socket, or while the batch before was being handled — handled as one batch (at
        # most ``announce_batch``): one journal commit, their answers and events published
        # together. Each is kept with the queue it came from.
        self._announcements: deque[tuple[Delivery, str]] = deque()
        self._announcing: asyncio.Task[None] | None = None

    async def finish_announcements(self) -> None:
        """Until the announcements taken are handled, kept and acked (on stopping)."""
        if self._announcing is not None:
            await asyncio.gather(self._announcing, return_exceptions=True)

    def announced(self, queue: str) -> Callable[[list[Delivery]], None]:
        """What takes ``queue``'s deliveries (those of one read from the socket): queued to
        be handled a batch at a time (at most ``announce_batch``), in order."""

        def take(deliveries: list[Delivery]) -> None:
            self._announcements.extend((delivery, queue) for delivery in deliveries)
            if self._announcing is None or self._announcing.done():
                self._announcing = asyncio.create_task(self._announce_all(), name="announce")

        return take

    async def _announce_all(self) -> None:
        pending, size = self._announcements, self._settings.announce_batch
        while pending:
            batch = [pending.popleft() for _ in range(min(size, len(pending)))]
            try:
                await self._settle_announcements(batch)
            except Exception:  # pragma: no cover - it settles everything itself
                log.exception("bug while handling announcements")

    def requested(self, queue: str) -> Callable[[list[Delivery]], None]:
        """What takes ``queue``'s requests (those of one read from the socket): each handled
        on a task of its own — requests wait on the ledger's group commit, side by side — and
        tracked, so that :meth:`stop` lets the ones taken finish (answered and acked)."""

        def take(deliveries: list[Delivery]) -> None:
            for delivery in deliveries:
                self._background.spawn(self._guarded(delivery, queue, self.handle_request))

        return take

    async def _settle_announcements(self, items: list[tuple[Delivery, str]]) -> None:
        """Announcements that arrived together, each handled as it would be alone, in
        order: decoded, its sender checked, fed to the core (or answered, forwarded or
        dead-lettered on its own). What the core returns for all of them is carried out
        together (:meth:`execute_many`: one journal commit, then the events and the answers
        published without waiting on each other); each delivery is acked only after that —
        after what it changed is kept. A transport failure hands the batch's deliveries back
        to be redelivered (the core's handling is idempotent); a bug rejects them. Never
        raises: every delivery is settled here."""
        self._counters["announce_batches"] += 1  # received.* over this: the mean batch
        await self._sharding.checked()  # a paused manager learns what it lost first
        fed: list[tuple[Sequence[Command], Delivery]] = []
        for delivery, queue in items:
            try:
                try:
                    event = await self._announce_event(delivery)
                except MessageRejected as exc:
                    await self._dead_letter(delivery, queue, exc)
                    event = None
                if event is not None:
                    await self._sharding.checked()  # no await between it and the core: _feed
                    fed.append((self._core.handle(event, self._clock.now()), delivery))
                    continue
            except TransportError as exc:
                await self._hand_back([delivery], queue, exc)
                continue
            except Exception:
                await self._reject_on_bug([delivery], queue)
                continue
            await delivery.ack()
        if not fed:
            return
        deliveries = [delivery for _, delivery in fed]
        try:
            await self._commands.execute_many(fed)
        except TransportError as exc:
            await self._hand_back(deliveries, items[0][1], exc)
            return
        except Exception:
            await self._reject_on_bug(deliveries, items[0][1])
            return
        await asyncio.gather(*(delivery.ack() for delivery in deliveries))

    async def _hand_back(self, deliveries: list[Delivery], queue: str, exc: Exception) -> None:
        """A transport failure while handling: replies and agent messages are best-effort
        (counted where they fail), so this is the channel or broker going away. The messages
        go back to be redelivered (the core's handling is idempotent); if even that fails
        the broker requeues them anyway."""
        log.warning("could not finish a delivery", extra={"queue": queue, "error": str(exc)})
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.reject(requeue=True)

    async def _reject_on_bug(self, deliveries: list[Delivery], queue: str) -> None:
        """A bug while handling (called from an ``except``): counted, logged, rejected."""
        self._counters["handler_errors"] += len(deliveries)
        log.exception("bug while handling a delivery", extra={"queue": queue})
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.reject(requeue=False)

    async def _announce_event(self, delivery: Delivery) -> Event | None:
        """What an announcement asks of the core, or ``None`` when it was answered here
        (a standing or admission-state request, a refused or forwarded registration).
        ``MessageRejected`` for bad input or a sender speaking for another agent."""
        message = decode_as(delivery.body, *_ANNOUNCE_TYPES)
        event: Event
        if isinstance(message, AgentRegistration):
            verified = self._settings.agent_identity  # checked just below, before handling
            event, claimed = RegistrationReceived(message, verified), message.agent_id
        elif isinstance(message, Deregistration):
            event, claimed = DeregistrationReceived(message), message.agent_id
        elif isinstance(message, DrainRequest):
            self._check_drain_names_incarnation(message)
            event, claimed = DrainRequested(message.agent_id, message.reason), message.agent_id
        elif isinstance(message, StandingRequest | AdmissionStateRequest | LeaseStateRequest):
            claimed = message.agent_id
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        publisher = self._publisher_of(delivery)
        if self._settings.agent_identity and claimed != publisher:
            # Someone speaking for another agent: dead-lettered (and refused if it asked),
            # never answered on the named agent's control queue — that agent did not ask.
            raise MessageRejected(
                Reason.NOT_AUTHORIZED,
                f"{message.type} for agent {claimed!r} published by broker user "
                f"{publisher!r}: agents speak only for themselves",
            )
        if isinstance(message, AgentRegistration) and self._sharding.shards is not None:
            if not await self._registration_is_mine(message, delivery, publisher):
                return None
        self._counters[f"received.{message.type}"] += 1
        if isinstance(message, StandingRequest | AdmissionStateRequest | LeaseStateRequest):
            answer = await self._questions.answer(message)
            await self._commands.send_to_agent(message.agent_id, answer)
            return None
        if isinstance(message, AgentRegistration) and not self._admission.understands_epochs(
            message
        ):
            await self._refuse_registration(message, delivery)
            return None
        return event  # a drain request may carry reply_to: its delivery is the request

    def _check_drain_names_incarnation(self, message: DrainRequest) -> None:
        """A drain request on the announce exchange is the agent's own (SIGTERM): it names the
        registered incarnation, or anyone could drain any agent by its ID with identities off
        (and a restarted process could drain its successor). ``MessageRejected``
        (``NOT_AUTHORIZED``: dead-lettered, counted) otherwise. An agent this manager does
        not know is left to the core (``UNKNOWN_AGENT``)."""
        agent = self._core.agents.get(message.agent_id)
        if agent is None or message.incarnation == agent.incarnation:
            return
        self._counters["drain_incarnation_mismatch"] += 1
        named = "no incarnation" if message.incarnation is None else "another incarnation"
        raise MessageRejected(
            Reason.NOT_AUTHORIZED,
            f"drain request for agent {message.agent_id!r} names {named}: on the announce "
            "exchange only the agent itself drains, naming its registered incarnation "
            "(an operator drains through `mesh drain`)",
        )

    def _publisher_of(self, delivery: Delivery) -> str | None:
        """The broker user a message is from: its validated ``user_id``, or for a
        registration another manager forwarded, the agent's user it names — believed only
        from the managers' own user, which no agent can publish as."""
        if self._from_a_manager(delivery):
            forwarded = _header(delivery, c.H_FORWARDED_FOR)
            if forwarded is not None:
                return forwarded
        return delivery.user_id

    def _from_a_manager(self, delivery: Delivery) -> bool:
        """Forwarded by another manager of this namespace: marked so, and published as the
        managers' broker user (validated by RabbitMQ: no agent or producer can)."""
        return (
            _header(delivery, c.H_FORWARDED_BY) is not None
            and self._manager_user is not None
            and delivery.user_id == self._manager_user
        )

    async def _registration_is_mine(
        self, registration: AgentRegistration, delivery: Delivery, publisher: str | None
    ) -> bool:
        """Several managers: a registration is handled by its pool's shard's owner. Any
        manager takes it from the shared announce queue and forwards it to the shard's queue
        when the shard is not its own (the shard's queue keeps it until an owner consumes
        it). An agent that cannot route by shard is refused: its heartbeats would reach a
        manager that does not know it."""
        assert self._sharding.shards is not None and self._settings.shard_count is not None
        if c.FEATURE_SHARDS not in registration.features:
            await self._refuse_unsharded(registration)
            return False
        shard = shard_of(registration.deployment, self._settings.shard_count)
        if self._sharding.shards.holds(shard):
            return True
        headers = {c.H_FORWARDED_BY: self._settings.manager_id}
        if publisher is not None:
            headers[c.H_FORWARDED_FOR] = publisher
        await self._transport().publish(
            self._topology.announce_exchange,
            names.agent_announce_key(registration.agent_id, "register", shard),
            delivery.body,
            headers=headers,
            persistent=True,
            user_id=self._manager_user,
        )  # confirmed: the delivery is acked only after the shard's queue has it
        self._counters["registrations_forwarded"] += 1
        return False

    async def _refuse_unsharded(self, registration: AgentRegistration) -> None:
        detail = (
            f"this namespace runs several managers, each owning shards of the registry; an "
            f"agent must list the {c.FEATURE_SHARDS!r} feature (route its heartbeats to its "
            "shard's owner): upgrade its SDK"
        )
        await self._refuse_for(registration, Reason.SHARDS_UNSUPPORTED, detail)

    async def _refuse_for(
        self, registration: AgentRegistration, reason: Reason, detail: str
    ) -> None:
        """A final refusal of ``registration`` (it lacks a feature it needs), counted."""
        self._counters[f"registration_refused.{reason}"] += 1
        log.warning(
            "registration refused",
            extra={"agent_id": registration.agent_id, "reason": reason.value},
        )
        refusal = RegistrationRefused(
            agent_id=registration.agent_id,
            incarnation=registration.incarnation,
            reason=reason,
            detail=detail,
        )
        await self._commands.send_to_agent(registration.agent_id, refusal)

    async def _refuse_registration(
        self, registration: AgentRegistration, delivery: Delivery
    ) -> None:
        detail = (
            f"pool {registration.deployment!r} has a capability descriptor, so its tasks carry "
            f"grants bound to a descriptor epoch; this agent does not list the "
            f"{c.FEATURE_DESCRIPTOR_EPOCHS!r} feature (an SDK older than epochs?) and would run "
            "tasks of a retired epoch"
        )
        await self._refuse_for(registration, Reason.EPOCHS_UNSUPPORTED, detail)

    async def handle_request(self, delivery: Delivery) -> None:
        """A request from the RPC queue, handled and answered (not acked: see _guarded); one
        of a task's life in a span of its own, from now to its reply (:mod:`mesh.tracing`)."""
        message = decode_as(delivery.body, *_RPC_TYPES)
        self._counters[f"received.{message.type}"] += 1
        with tracing.serving(message, delivery.headers, self._rpc_queue) as span:
            await self._handle_request(message, delivery, span)

    async def _handle_request(
        self, message: Message, delivery: Delivery, span: tracing.Traced
    ) -> None:
        if isinstance(message, StatusRequest):
            await self._sharding.checked()
            if self._sharding.peers is not None and not self._from_a_manager(delivery):
                merged = await self._forwarding.status_everywhere(
                    message, _knows_unanswered(delivery), _knows(delivery, c.FEATURE_SETTLING)
                )
                await self._commands.reply(delivery, _signals_if_known(delivery, merged))
            else:
                reply = _signals_if_known(delivery, self._status(message))
                await self._commands.reply(delivery, reply)
            return
        if isinstance(
            message,
            AdmissionRequest
            | AdmissionRelease
            | AdmissionRevoke
            | CapabilityDescriptor
            | DescriptorShadow
            | ExplainRequest,
        ):
            answer = await self._admission.handle(message, delivery)
            if span.recording and isinstance(answer, AdmissionDecision) and answer.grant:
                span.note("mesh.shedding.stage", self._admission.stage_of(answer.grant.pool_id))
            await self._commands.reply(delivery, answer)
            return
        await self._lease_path(message, delivery)

    async def _lease_path(self, message: Message, delivery: Delivery) -> None:
        """find, acquire, release, drain: the registry's requests."""
        await self._sharding.checked()
        event: Event
        publisher = self._publisher_of(delivery)
        # Several managers: a lease-path request taken from the shared queue may concern
        # agents another manager holds; one another manager forwarded is answered from here.
        everywhere = self._sharding.peers is not None and not self._from_a_manager(delivery)
        if isinstance(message, FindRequest):
            if everywhere:
                found = await self._forwarding.find_everywhere(message, _knows_unanswered(delivery))
                await self._commands.reply(delivery, found)
                return
            event = FindRequested(message)
        elif isinstance(message, AcquireRequest):
            acquire = await self._acquire(message, delivery, publisher, everywhere)
            if acquire is None:  # answered
                return
            event = acquire
        elif isinstance(message, ReleaseRequest):
            release = await self._release(message, delivery, publisher, everywhere)
            if release is None:  # answered
                return
            event = release
        elif isinstance(message, DrainRequest):
            if publisher != self._settings.operator_user:
                # Draining stops an agent: an operator's act (or the agent's own, on the
                # announce exchange), never a producer's.
                await self._refuse_not_operator(delivery, message.type, message.agent_id)
                return
            if everywhere and message.agent_id not in self._core.agents:
                await self._commands.reply(
                    delivery, await self._forwarding.elsewhere(message, publisher)
                )
                return
            event = DrainRequested(message.agent_id, message.reason)
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        await self._commands.feed(event, delivery)

    async def _acquire(
        self, message: AcquireRequest, delivery: Delivery, publisher: str | None, everywhere: bool
    ) -> AcquireRequested | None:
        """An acquire: the event for this registry's core, or ``None`` once answered here —
        across shards (a redelivered request first gets the lease its ID already holds,
        :meth:`_lease_granted_before`), or a forwarded "held only" query for a lease not
        held here."""
        lease_id = self._lease_id_of(delivery)
        if everywhere:
            before = None
            if delivery.redelivered:
                before = await self._forwarding.lease_granted_before(message, lease_id, publisher)
            if before is not None:
                self._counters["acquires_redelivered_answered_again"] += 1
                await self._commands.reply(delivery, before)
            else:
                await self._forwarding.acquire_everywhere(message, lease_id, publisher, delivery)
            return None
        if _header(delivery, c.H_HELD_ONLY) is not None and lease_id not in self._core.leases:
            detail = f"lease {lease_id!r} is not held here"
            await self._commands.reply(
                delivery, Refusal(reason=Reason.UNKNOWN_LEASE, detail=detail)
            )
            return None
        return AcquireRequested(message, lease_id, holder=publisher)

    async def _release(
        self, message: ReleaseRequest, delivery: Delivery, publisher: str | None, everywhere: bool
    ) -> ReleaseRequested | None:
        """A release: the event for this registry's core, or ``None`` once answered here —
        by another owner, or, for a redelivered request (the manager it went to stopped
        before acking it, maybe after answering ``released``), as ``released`` when no
        registry holds the lease any more: it was released, by this request's first handling
        or since (its registry may have died with the record of it). Otherwise the request
        would be answered twice, differently (``released``, then ``UNKNOWN_LEASE``)."""
        here = message.lease_id in self._core.leases
        if not delivery.redelivered:
            if everywhere and not here:
                await self._commands.reply(
                    delivery, await self._forwarding.elsewhere(message, publisher)
                )
                return None
            return ReleaseRequested(message.lease_id, by=publisher or "")
        if everywhere and not here:
            answer = await self._forwarding.elsewhere(message, publisher)
        else:
            answer = await self._commands.answer(
                ReleaseRequested(message.lease_id, by=publisher or "")
            )
        if isinstance(answer, Refusal) and answer.reason is Reason.UNKNOWN_LEASE:
            self._counters["releases_redelivered_answered_again"] += 1
            answer = Released(lease_id=message.lease_id)
        await self._commands.reply(delivery, answer)
        return None

    def _lease_id_of(self, delivery: Delivery) -> str:
        """The request's lease ID: a forwarded acquire carries the one its first manager
        derived (so every owner leases under the same ID), any other is derived here."""
        if self._from_a_manager(delivery):
            forwarded = _header(delivery, c.H_LEASE_ID)
            if forwarded is not None:
                return forwarded
        return _lease_id(delivery)

    async def _refuse_not_operator(self, delivery: Delivery, what: str, subject: str) -> None:
        self._counters[f"not_authorized.{what}"] += 1
        log.warning(
            "request refused: only the operator may send it",
            extra={"message_type": what, "subject": subject, "user_id": delivery.user_id},
        )
        detail = (
            f"{what} is accepted only from the operator user {self._settings.operator_user!r}; "
            f"this came from {delivery.user_id!r}"
        )
        await self._commands.reply(delivery, Refusal(reason=Reason.NOT_AUTHORIZED, detail=detail))

    async def _guarded(
        self, delivery: Delivery, queue: str, handle: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        """Handle, then ack. Bad input is dead-lettered with its reason; nothing escapes —
        not even a failure to dead-letter it (the message then goes back to the queue). A
        delivery whose channel is gone before it is handled (this process was frozen, and the
        broker gave it to another manager) is left alone: nothing decided, journaled or
        answered for it here."""
        if not delivery.held():
            self._counters["deliveries_dropped_channel_gone"] += 1
            return
        try:
            try:
                await handle(delivery)
            except MessageRejected as exc:
                await self._dead_letter(delivery, queue, exc)
        except TransportError as exc:
            await self._hand_back([delivery], queue, exc)
            return
        except Exception:
            await self._reject_on_bug([delivery], queue)
            return
        await delivery.ack()

    async def _dead_letter(self, delivery: Delivery, queue: str, exc: MessageRejected) -> None:
        self._counters["dead_lettered"] += 1
        self._dead_lettered(exc.reason)
        self._counters[f"dead_lettered.{exc.reason}"] += 1
        log.warning(
            "message dead-lettered",
            extra={"queue": queue, "reason": exc.reason, "detail": exc.detail},
        )
        await self._transport().dead_letter(
            delivery,
            dead_letter_exchange=self._topology.dead_letter_exchange,
            source_queue=queue,
            reason=exc.reason,
            detail=exc.detail,
        )
        if delivery.reply_to:
            await self._commands.reply(
                delivery, Refusal(reason=Reason(exc.reason), detail=exc.detail)
            )


def _signals_if_known(delivery: Delivery, reply: StatusReply) -> StatusReply:
    """The reply's pool signals only for a client that lists ``pool-signals``."""
    if reply.pool_signals is None or _knows(delivery, c.FEATURE_POOL_SIGNALS):
        return reply
    return reply.model_copy(update={"pool_signals": None})


def _knows_unanswered(delivery: Delivery) -> bool:
    """The client lists ``unanswered-shards`` in its request's features
    (``x-mesh-features``)."""
    return _knows(delivery, c.FEATURE_UNANSWERED)


def _knows(delivery: Delivery, feature: str) -> bool:
    """The client lists ``feature`` in its request's features (``x-mesh-features``)."""
    features = _header(delivery, c.H_FEATURES) or ""
    return feature in (f.strip() for f in features.split(","))


def _header(delivery: Delivery, name: str) -> str | None:
    value = delivery.headers.get(name)
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _lease_id(request: Delivery) -> str:
    """Stable per request, so a redelivered acquire gets the same lease (the core is
    idempotent per lease ID); scoped by reply queue, so two clients can never collide."""
    if not request.correlation_id:
        return uuid.uuid4().hex
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{request.reply_to}|{request.correlation_id}").hex
