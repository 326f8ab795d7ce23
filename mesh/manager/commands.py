"""The command executor: what the pool core (and the admission path) decide, carried out.

Theory of operation
-------------------
The pool core answers each event with commands (:mod:`mesh.core.events`). The executor carries
them out in order: log entries are appended to the journal and then published on the events
exchange (the live feed); messages to agents go to the agent's control queue with confirms;
replies go to the requester; scaling and fencing go to the scaling room (``scale``,
``fence``). Several requests' commands are carried out together (:meth:`execute_many`): one
journal commit, one write of the feed's events, the rest side by side.

Every event reaches the core through :meth:`feed` (or :meth:`answer`), with no await between
the ``before_acting`` check (several managers: a manager paused past its shard leases learns
what it lost first) and the core's handling.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from pydantic import ValidationError

from mesh import tracing
from mesh.core.events import (
    AcceptanceUndelivered,
    Announce,
    AppendLog,
    Command,
    DeletePod,
    Event,
    FenceAgent,
    LogEntry,
    Reply,
    ScaleTo,
    SendToAgent,
)
from mesh.core.pool import PoolCore
from mesh.core.shards import shard_of
from mesh.errors import (
    LocalProtocolError,
    PublishNacked,
    PublishTimeout,
    PublishUnroutable,
    TransportError,
)
from mesh.manager.background import Background
from mesh.manager.clock import Clock
from mesh.manager.journal import Journal
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery
from mesh.transport.ports import ManagerTransport
from mesh.wire.codec import encode
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import LeaseGranted, Message, PoolEpoch, RegistrationAccepted

log = logging.getLogger(__name__)


class CommandExecutor:
    """Carries out the cores' commands on the broker, the journal and the scaler."""

    def __init__(
        self,
        *,
        core: PoolCore,
        clock: Clock,
        counters: Counter[str],
        topology: Topology,
        transport: Callable[[], ManagerTransport],
        journal: Callable[[], Journal | None],
        background: Background,
        shard_count: int | None,
        pool_epoch: Callable[[str], PoolEpoch | None],
        scale: Callable[[ScaleTo | DeletePod], Awaitable[None]],
        fence: Callable[[FenceAgent], Coroutine[Any, Any, None]],
        before_acting: Callable[[], Awaitable[None]],
        on_log: Callable[[OrchestrationEvent], None] | None = None,
    ) -> None:
        self._core = core
        self._clock = clock
        self._counters = counters
        self._topology = topology
        self._transport = transport
        self._journal = journal
        self._background = background
        self._shard_count = shard_count
        self._pool_epoch = pool_epoch
        self._scale = scale
        self._fence = fence
        self._before_acting = before_acting
        self._on_log = on_log
        self._unfit_seqs: set[int] = set()  # journaled entries kept off the feed (bugs)

    # ---- events into the core -------------------------------------------------------------
    async def feed(self, event: Event, request: Delivery | None = None) -> None:
        """``event`` handled by the core, its commands carried out (a reply to ``request``)."""
        # Checked right here, with no await before the core acts: a handler that was under
        # way when the process froze must not act with shards it lost meanwhile.
        await self._before_acting()
        await self.execute(self._core.handle(event, self._clock.now()), request)

    async def answer(self, event: Event) -> Message:
        """The core's answer to ``event``; its other commands carried out."""
        await self._before_acting()  # as in feed
        commands = self._core.handle(event, self._clock.now())
        await self.execute([cmd for cmd in commands if not isinstance(cmd, Reply)])
        (reply,) = [cmd.message for cmd in commands if isinstance(cmd, Reply)]
        return reply

    def spawn(self, commands: list[Command]) -> None:
        """Carry out commands from a synchronous path (the heartbeat sink) in the background."""
        self._background.spawn(self.execute(commands))

    # ---- carrying commands out ----------------------------------------------------------------
    async def execute(self, commands: Sequence[Command], request: Delivery | None = None) -> None:
        """Carry the commands out in order. A bug in one is logged and counted
        (``command_errors``) and the rest still run — above all the reply its requester
        waits for; a transport failure propagates (the delivery is redelivered, and the
        core's handling is idempotent)."""
        await self.execute_many([(commands, request)])

    async def execute_many(
        self, batches: Sequence[tuple[Sequence[Command], Delivery | None]]
    ) -> None:
        """Several requests' commands, as :meth:`execute` would carry out each: their log
        entries journaled in one commit (in order); the live feed's events (those entries,
        then the capability announcements) published in one write; then each request's other
        commands in order — the requests side by side, so their publishes wait for their
        confirms together. The first transport failure propagates once all have run."""
        logs = [
            cmd.entry for commands, _ in batches for cmd in commands if isinstance(cmd, AppendLog)
        ]
        stored = self.append(logs) if logs else []
        feed = [(names.log_key(event.agent_id, event.kind), event) for event in stored]
        for commands, _ in batches:
            for cmd in commands:
                if isinstance(cmd, Announce):
                    event, fits = self._wire_event(cmd.entry)
                    if fits:
                        feed.append((names.capability_key(cmd.capability, cmd.agent_id), event))
        await self.publish_events(feed)
        if len(batches) > 1 and all(
            isinstance(cmd, AppendLog | Announce | SendToAgent)
            for commands, _ in batches
            for cmd in commands
        ):
            # Only messages to agents are left (a batch of registrations: an acceptance each):
            # one write, their confirms awaited together.
            await self.send_to_agents(
                [
                    (cmd.agent_id, cmd.message)
                    for c, _ in batches
                    for cmd in c
                    if isinstance(cmd, SendToAgent)
                ]
            )
            return
        if len(batches) == 1:
            await self._carry_out_all(*batches[0])
            return
        outcomes = await asyncio.gather(
            *(self._carry_out_all(commands, request) for commands, request in batches),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _carry_out_all(self, commands: Sequence[Command], request: Delivery | None) -> None:
        for cmd in commands:
            try:
                await self._carry_out(cmd, request)
            except TransportError:
                raise
            except Exception:
                self._counters["command_errors"] += 1
                log.exception(
                    "bug while carrying out a command; the next ones still run",
                    extra={"command": type(cmd).__name__},
                )

    async def _carry_out(self, cmd: Command, request: Delivery | None) -> None:
        if isinstance(cmd, SendToAgent):
            await self.send_to_agent(cmd.agent_id, self._outgoing(cmd.message))
        elif isinstance(cmd, Reply):
            if request is not None:
                delivered = await self.reply(request, cmd.message)
                if not delivered and isinstance(cmd.message, LeaseGranted):
                    await self._release_unclaimed(cmd.message.lease.lease_id)
        elif isinstance(cmd, Announce):
            pass  # published with the feed's other events (execute_many)
        elif isinstance(cmd, ScaleTo | DeletePod):
            await self._scale(cmd)
        elif isinstance(cmd, FenceAgent):
            self._background.spawn(self._fence(cmd))  # it may retry: not inline

    async def _release_unclaimed(self, lease_id: str) -> None:
        """A lease whose grant never reached its requester would pin a slot until its TTL."""
        self._counters["leases_released_unclaimed"] += 1
        commands = self._core.release(lease_id, self._clock.now(), "requester gone")
        await self.execute([cmd for cmd in commands if not isinstance(cmd, Reply)])

    # ---- the journal and the live feed --------------------------------------------------------
    def append(self, entries: list[LogEntry]) -> list[OrchestrationEvent]:
        """``entries`` journaled (one commit), as the events the live feed carries."""
        journal = self._journal()
        if journal is None:
            raise LocalProtocolError("the manager is not started")
        made = [self._wire_event(e) for e in entries]
        stored = journal.append_many(event for event, _ in made)
        for (_, fits), event in zip(made, stored, strict=True):
            if not fits and event.seq is not None:
                self._unfit_seqs.add(event.seq)  # journaled, kept off the feed
        # The journal and the live feed are the record; a log line per event is for
        # debugging (at INFO, a fleet registering wrote a line per agent, at thousands a
        # second).
        debugging = log.isEnabledFor(logging.DEBUG)
        for event in stored:
            if debugging:
                log.debug(
                    "orchestration event",
                    extra={"kind": event.kind, "agent_id": event.agent_id, "seq": event.seq},
                )
            if self._on_log is not None:
                self._on_log(event)
        return stored

    def _wire_event(self, entry: LogEntry) -> tuple[OrchestrationEvent, bool]:
        """The entry as an event, and whether it fits its kind's schema. One that does not is
        a bug here: it is journaled as written (nothing is lost), counted and logged, and
        kept off the live feed, whose readers would refuse it — and the commands after it (a
        reply a requester waits for) still run."""
        try:
            return _to_wire(entry), True
        except ValidationError as exc:
            self._counters["events_unfit"] += 1
            log.error(
                "an orchestration entry does not fit its kind's schema; journaled, not published",
                extra={"kind": entry.kind, "error": str(exc)[:500]},
            )
            return OrchestrationEvent.as_stored(_wire_fields(entry)), False

    async def publish_event(self, routing_key: str, event: OrchestrationEvent) -> None:
        await self.publish_events([(routing_key, event)])

    async def publish_events(self, events: Sequence[tuple[str, OrchestrationEvent]]) -> None:
        """Put ``(routing key, event)`` pairs on the live feed, in order, in one write. The
        journal holds the durable copy; the events exchange is a live feed, and feed entries
        lost while the broker is away must not stop the commands after them (counted)."""
        wanted = []
        for routing_key, event in events:
            if event.seq is not None and event.seq in self._unfit_seqs:
                self._unfit_seqs.discard(event.seq)  # journaled only: see _wire_event
                continue
            wanted.append((routing_key, encode(event)))
        if not wanted:
            return
        try:
            await self._transport().publish_fast_many(self._topology.events_exchange, wanted)
        except TransportError:
            self._counters["events_unpublished"] += len(wanted)

    # ---- messages to agents and replies -------------------------------------------------------
    def _outgoing(self, message: Message) -> Message:
        """A core's message to an agent as sent: an acceptance carries the pool's epoch (for
        an agent that lists ``pool-epoch``) and, with several managers, the agent's shard
        (for one that lists ``shards``: the last word of its heartbeat and announce keys).
        The core that accepts it knows agents, not descriptors or shards."""
        if not isinstance(message, RegistrationAccepted):
            return message
        agent = self._core.agents.get(message.agent_id)
        if agent is None:
            return message
        update: dict[str, Any] = {}
        if message.pool_epoch is None and agent.takes_pool_epoch:
            epoch = self._pool_epoch(agent.deployment)
            if epoch is not None:
                update["pool_epoch"] = epoch
        if self._shard_count is not None and agent.takes_shard:
            update["shard"] = shard_of(agent.deployment, self._shard_count)
        return message.model_copy(update=update) if update else message

    async def send_to_agent(self, agent_id: str, message: Message) -> None:
        """``message`` on the agent's control queue, confirmed; not delivered: counted."""
        try:
            await self._transport().publish(self._topology.agents_exchange, agent_id, message)
        except (PublishNacked, PublishTimeout, PublishUnroutable) as exc:
            self._not_delivered(agent_id, message, exc)

    async def send_to_agents(self, messages: Sequence[tuple[str, Message]]) -> None:
        """:meth:`send_to_agent` for several, in one write (``publish_many``); a transport
        failure propagates once all are settled."""
        sent = [(agent_id, self._outgoing(message)) for agent_id, message in messages]
        outcomes = await self._transport().publish_many(self._topology.agents_exchange, sent)
        failed: TransportError | None = None
        for (agent_id, message), outcome in zip(sent, outcomes, strict=True):
            if isinstance(outcome, PublishNacked | PublishTimeout | PublishUnroutable):
                self._not_delivered(agent_id, message, outcome)
            elif outcome is not None:
                failed = outcome
        if failed is not None:
            raise failed

    def _not_delivered(self, agent_id: str, message: Message, error: TransportError) -> None:
        if isinstance(error, PublishUnroutable):
            self._counters["agent_unreachable"] += 1
            log.info(
                "agent has no control queue",
                extra={"agent_id": agent_id, "message_type": message.type},
            )
            if isinstance(message, RegistrationAccepted):
                # Not Ready until it heard so: take the registration back.
                undelivered = AcceptanceUndelivered(agent_id, message.incarnation)
                self.spawn(self._core.handle(undelivered, self._clock.now()))
            return
        self._counters["agent_message_failed"] += 1
        log.warning(
            "message to agent not confirmed",
            extra={"agent_id": agent_id, "message_type": message.type, "error": str(error)},
        )

    async def reply(self, request: Delivery, message: Message) -> bool:
        """Best-effort: a reply that cannot be delivered is counted, never retried forever.
        No reply for a request whose channel is gone since it arrived: the broker has given it
        back to the queue, and whoever takes it answers (two answers could disagree)."""
        if not request.reply_to:
            return False
        if not request.held():
            self._counters["replies_withheld_channel_gone"] += 1
            return False
        try:
            await self._transport().publish(
                DEFAULT_EXCHANGE,
                request.reply_to,
                message,
                correlation_id=request.correlation_id,
                headers=tracing.reply_headers(request.headers, message),  # the trace goes on
            )
        except PublishUnroutable:
            self._counters["requester_gone"] += 1
            return False
        except (PublishNacked, PublishTimeout):
            self._counters["reply_failed"] += 1
            return False
        return True


def _wire_fields(entry: LogEntry) -> dict[str, Any]:
    return {
        "at": entry.at,
        "kind": entry.kind,
        "agent_id": entry.agent_id,
        "from_state": entry.from_state,
        "to_state": entry.to_state,
        "capability": entry.capability,
        "reason": entry.reason,
        "detail": dict(entry.detail),
    }


def _to_wire(entry: LogEntry) -> OrchestrationEvent:
    """The entry as an event, its detail checked against its kind's schema."""
    return OrchestrationEvent(
        at=entry.at,
        kind=entry.kind,
        agent_id=entry.agent_id,
        from_state=entry.from_state,
        to_state=entry.to_state,
        capability=entry.capability,
        reason=entry.reason,
        detail=dict(entry.detail),
    )
