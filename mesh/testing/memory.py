"""An in-memory broker that behaves like RabbitMQ as the mesh uses it, for tests without one.

Theory of operation
-------------------
One :class:`InMemoryBroker` per test holds the exchanges, queues and bindings. Several
:class:`InMemoryTransport` objects (one per role: a manager, an agent, a client) are its
connections; each meets the transport ports of :mod:`mesh.transport.ports`, so
``ManagerService(settings, transport=...)``, ``AgentRuntime(agent, settings, transport)`` and
``MeshClient.connect(transport=..., namespace=...)`` run together in one event loop.

Everything happens on that loop and every broker operation is synchronous, so the broker
needs no locks. A publish routes at once (topic with ``*`` and ``#`` on ``.``-separated
words, direct, fanout, and the default exchange where the routing key names the queue),
appends a copy of the message to each matched queue, and hands queued messages to consumers
that have room under their prefetch: each delivery runs the consumer's handler in its own
asyncio task, created in delivery order, as aio-pika does. The publish then yields to the
loop once and reports its outcome the way confirms do: nothing matched and ``mandatory`` ->
:class:`~mesh.errors.PublishUnroutable`; a bounded queue (``x-max-length``) with
``reject-publish`` or ``reject-publish-dlx`` refused it -> :class:`~mesh.errors.PublishNacked`
(the other matched queues keep their copy, as on RabbitMQ). ``drop-head``, the default
overflow, drops (and dead-letters) the oldest ready message instead.

Deliveries are the real :class:`mesh.transport.Delivery` objects. ``ack()`` settles;
``reject(requeue=True)`` puts the message back at the head of its queue marked redelivered;
``reject(requeue=False)`` dead-letters it. A queue with ``x-dead-letter-exchange``
republishes what it rejects, expires (``x-message-ttl``), drops at its bound or gives up
after ``x-delivery-limit`` returns (quorum queues) to that exchange, under
``x-dead-letter-routing-key`` or the original key, with RabbitMQ's ``x-death`` and
``x-first-death-*`` headers; a dead-letter cycle without a rejection in it is cut.

Queues declared ``auto_delete`` vanish when their last consumer goes; ``exclusive`` ones
belong to the transport that declared them and vanish when it closes. Closing a transport
cancels its consumers' running handler tasks and requeues what they had not settled.
``declare`` is idempotent; a redeclaration with other properties raises
:class:`PreconditionFailed`, as RabbitMQ's 406 does.

Time comes from the broker's ``clock`` (``time.monotonic`` unless a test passes
``FakeClock().monotonic``).

Differences from RabbitMQ
-------------------------
* Nothing is persisted and there is no broker restart: ``durable`` and ``persistent`` are
  accepted and ignored.
* Confirms are immediate: :class:`~mesh.errors.PublishTimeout` is never raised and
  ``timeout_s`` is ignored. There is no network, so no flow control and no frame limits.
* Expiry is lazy: message TTLs and queue ``x-expires`` are applied when any transport of the
  broker is next used, or when :meth:`InMemoryBroker.expire` is called, never by a timer. With
  a :class:`~mesh.testing.FakeClock` nothing expires until the test advances it. Expired
  messages are dropped from the head only, like a classic queue; there is no per-message
  ``expiration``.
* Exchange types: topic, direct, fanout and the default exchange. Headers exchanges raise
  :class:`NotImplementedError`; there are no exchange-to-exchange bindings, alternate
  exchanges, priorities, single-active-consumer, ``x-max-length-bytes`` or streams.
* Channel errors are the :class:`BrokerRefused` family (:class:`PreconditionFailed`,
  :class:`NotFound`, :class:`ResourceLocked`, :class:`AccessRefused`), all
  :class:`~mesh.errors.TransportError`; :class:`~mesh.transport.AmqpTransport` lets aiormq's
  channel exceptions through for declarations, deletions and passive declares. No channel is
  closed by them: the transport stays usable.
* Settling a delivery twice, or one consumed with ``no_ack``, raises
  :class:`DeliverySettleError` (aio-pika: ``MessageProcessError`` / ``TypeError``). Settling
  after its transport closed or was disconnected raises :class:`TransportClosed` (aio-pika:
  ``ChannelInvalidStateError``); the broker has already requeued the message.
* ``publish_fast`` to an exchange that does not exist is dropped silently; a real broker
  closes the channel, and a later call may fail.
* ``x-death`` entries carry ``count``, ``reason``, ``queue``, ``exchange`` and
  ``routing-keys``, not ``time``; there are no ``x-last-death-*`` headers (RabbitMQ 3.13+).
* Consumers with room are served round-robin; RabbitMQ's order can differ under credit flow.
* The connection never drops on its own: ``on_disconnect`` and ``on_reconnect`` callbacks
  fire only through :meth:`InMemoryBroker.disconnect` and :meth:`InMemoryBroker.reconnect`.
* Closing a transport from one of its own handlers does not cancel that handler's task.
* ``user_id`` is passed through as published: there are no users to validate it against
  (RabbitMQ refuses a ``user_id`` that is not the connection's user).

The pieces: :mod:`mesh.testing.broker` (the broker's state machine),
:mod:`mesh.testing.broker_state` (its records), :mod:`mesh.testing.amqp_rules` (RabbitMQ's
rules as pure functions), :mod:`mesh.testing.broker_errors` (what it raises) and this
module, the transport that connects to it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh.errors import (
    PublishNacked,
    PublishUnroutable,
    TopologyMismatch,
    TopologyMissing,
    TransportError,
)
from mesh.testing.amqp_rules import Spec, describe, topic_matches
from mesh.testing.broker import InMemoryBroker, InMemoryConsumer
from mesh.testing.broker_errors import (
    AccessRefused,
    BrokerRefused,
    DeliverySettleError,
    NotFound,
    PreconditionFailed,
    ResourceLocked,
    TransportClosed,
)
from mesh.testing.broker_state import (
    NO_ACK,
    Connection,
    QueuedMessage,
    QueueInfo,
    RawCallback,
    StoredMessage,
)
from mesh.topology.specs import BindingSpec, Declarations, QueueSpec, reply_queue
from mesh.transport import dead_letters
from mesh.transport.delivery import Delivery, Handler
from mesh.transport.ports import ClientTransport, ManagerTransport
from mesh.wire.codec import encode
from mesh.wire.models import Message

__all__ = [
    "AccessRefused",
    "BrokerRefused",
    "DeliverySettleError",
    "InMemoryBroker",
    "InMemoryConsumer",
    "InMemoryTransport",
    "NotFound",
    "PreconditionFailed",
    "QueueInfo",
    "QueuedMessage",
    "ResourceLocked",
    "TransportClosed",
    "topic_matches",
]

log = logging.getLogger(__name__)


class InMemoryTransport:
    """A connection to an :class:`InMemoryBroker`: meets :class:`~mesh.transport.ports.Transport`,
    :class:`~mesh.transport.ports.ManagerTransport` and
    :class:`~mesh.transport.ports.ClientTransport` the way :class:`~mesh.transport.AmqpTransport`
    does (same arguments, same :class:`~mesh.transport.Delivery`, same publish errors)."""

    def __init__(
        self,
        broker: InMemoryBroker,
        name: str = "memory",
        *,
        publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S,
    ) -> None:
        self.broker = broker
        self.name = name
        self.publish_timeout_s = publish_timeout_s
        # Its state, consumers, declare cache (as AmqpTransport keeps one) and callbacks: what
        # the broker reads and changes when it cuts or restores this connection.
        self._connection = broker._connect(name)
        self._queue_specs: dict[str, QueueSpec] = {}

    def __repr__(self) -> str:
        return f"InMemoryTransport({self.name!r}, {self._connection.state})"

    @property
    def connection(self) -> Connection:
        """The broker's record of this connection."""
        return self._connection

    @property
    def is_closed(self) -> bool:
        return self._connection.state != "open"

    def _open(self) -> InMemoryBroker:
        state = self._connection.state
        if state != "open":
            raise TransportClosed(f"transport {self.name!r} is {state}")
        self.broker.expire()
        return self.broker

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when :meth:`InMemoryBroker.disconnect` cuts this transport."""
        self._connection.disconnect_callbacks.append(callback)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after :meth:`InMemoryBroker.reconnect` restored this transport."""
        self._connection.reconnect_callbacks.append(callback)

    async def close(self) -> None:
        """Close: consumers stop, their handler tasks are cancelled and what they held is
        requeued; exclusive queues go. Idempotent."""
        await self.broker._close(self._connection)

    # ---- declaration ----------------------------------------------------------------------
    async def declare(self, declarations: Declarations) -> None:
        """Declare exchanges, queues and bindings; specs already declared are skipped."""
        broker = self._open()
        declared, topology = self._connection.declared, self._connection.topology
        specs: tuple[Spec, ...] = (
            *declarations.exchanges,
            *declarations.queues,
            *declarations.bindings,
        )
        for spec in specs:
            if spec in declared:
                continue
            current = broker._queues.get(spec.name) if isinstance(spec, QueueSpec) else None
            try:
                broker._redeclare(spec, self._connection)
            except PreconditionFailed as exc:
                if current is None or not isinstance(spec, QueueSpec) or current.spec == spec:
                    raise  # not an existing queue with other arguments
                raise TopologyMismatch.for_queue(spec.name, describe(spec), str(exc)) from None
            if isinstance(spec, QueueSpec):
                self._queue_specs[spec.name] = spec
            declared[spec] = None
            topology[spec] = None
        await asyncio.sleep(0)

    async def check_exchanges(self, names: Sequence[str]) -> None:
        """Raise :class:`mesh.errors.TopologyMissing` unless every exchange exists."""
        broker = self._open()
        missing = [name for name in names if name not in broker._exchanges]
        await asyncio.sleep(0)
        if missing:
            raise TopologyMissing(f"no exchange {missing[0]!r} (declared by the manager)")

    async def try_declare(self, declarations: Declarations) -> bool:
        """``declare``, but a queue that exists with other arguments answers ``False``."""
        try:
            await self.declare(declarations)
        except PreconditionFailed:
            return False
        return True

    async def empty_old_queue(self, name: str, bindings: Sequence[BindingSpec], into: str) -> int:
        """As :class:`~mesh.transport.amqp.AmqpTransport`: ``name``'s ready messages moved
        into ``into`` (under its bound), then ``name`` deleted; how many moved."""
        broker = self._open()
        old, new = broker._queues.get(name), broker._queues.get(into)
        if old is None or new is None:
            return 0
        moved = 0
        while old.ready:
            moved += broker._enqueue(new, old.ready.popleft())
        await self.delete_queue(name)
        return moved

    @property
    def blocked(self) -> bool:
        """Never: the in-memory broker raises no resource alarms."""
        return False

    async def declare_reply_queue(self, name: str) -> str:
        """An exclusive, auto-deleted queue for replies to this connection."""
        broker = self._open()
        spec = reply_queue(name)
        broker._declare_queue(spec, self._connection)
        self._queue_specs[name] = spec
        self._connection.topology[spec] = None
        await asyncio.sleep(0)
        return name

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None:
        broker = self._open()
        queue = broker._queues.get(name)
        if queue is not None:
            if queue.locked_for(self._connection):
                raise ResourceLocked(f"queue {name!r} is exclusive to another connection")
            if if_empty and queue.ready:
                raise PreconditionFailed(f"queue {name!r} is not empty")
            broker._delete_queue(queue)
        self._queue_specs.pop(name, None)
        # As AmqpTransport: forget the queue's own spec (bindings stay in the declare cache).
        connection = self._connection
        connection.declared = {
            s: None for s in connection.declared if getattr(s, "name", None) != name
        }
        connection.topology = {
            s: None
            for s in connection.topology
            if getattr(s, "name", None) != name and getattr(s, "queue", None) != name
        }
        await asyncio.sleep(0)

    # ---- publishing -----------------------------------------------------------------------
    async def publish(
        self,
        exchange: str,
        routing_key: str,
        message: Message | bytes,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        persistent: bool = False,
        mandatory: bool = True,
        timeout_s: float | None = None,
        user_id: str | None = None,
    ) -> None:
        """Publish; the outcome is known at once (see the module doc for the errors)."""
        broker = self._open()
        body = message if isinstance(message, bytes) else encode(message)
        outcome = broker._publish(
            StoredMessage(
                body,
                exchange,
                routing_key,
                dict(headers) if headers else {},
                reply_to,
                correlation_id,
                uuid.uuid4().hex,
                user_id=user_id,
            ),
            mandatory=mandatory,
        )
        await asyncio.sleep(0)
        where = f"{exchange or '<default>'}/{routing_key}"
        if outcome == "unroutable":
            raise PublishUnroutable(f"no queue bound for {where} (NO_ROUTE)")
        if outcome == "nacked":
            raise PublishNacked(f"broker refused publish to {where} (a bounded queue is full)")

    async def publish_fast(
        self, exchange: str, routing_key: str, body: bytes, *, user_id: str | None = None
    ) -> None:
        """Fire-and-forget: never returned, never nacked, dropped if the exchange is missing."""
        broker = self._open()
        message = StoredMessage(body, exchange, routing_key, message_id=None, user_id=user_id)
        try:
            broker._publish(message, mandatory=False)
        except NotFound:
            log.debug("fast publish to a missing exchange dropped", extra={"exchange": exchange})
        await asyncio.sleep(0)

    async def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, Message]],
        *,
        timeout_s: float | None = None,
    ) -> list[TransportError | None]:
        """:meth:`publish` (mandatory) of each ``(routing key, message)``; each outcome is
        ``None`` or the error it raised."""
        outcomes: list[TransportError | None] = []
        for routing_key, message in messages:
            try:
                await self.publish(exchange, routing_key, message, timeout_s=timeout_s)
                outcomes.append(None)
            except TransportError as exc:
                outcomes.append(exc)
        return outcomes

    async def publish_fast_many(self, exchange: str, messages: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`publish_fast` of each ``(routing key, body)``, in order."""
        for routing_key, body in messages:
            await self.publish_fast(exchange, routing_key, body)

    async def dead_letter(
        self,
        delivery: Delivery,
        *,
        dead_letter_exchange: str,
        source_queue: str,
        reason: str,
        detail: str,
    ) -> None:
        """Republish a refused message to the dead-letter exchange with its reason, confirmed
        (:func:`mesh.transport.dead_letters.republish`)."""
        await dead_letters.republish(
            self,
            delivery,
            dead_letter_exchange=dead_letter_exchange,
            source_queue=source_queue,
            reason=reason,
            detail=detail,
        )

    # ---- consuming ------------------------------------------------------------------------
    async def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, no_ack: bool = False
    ) -> InMemoryConsumer:
        """Consume ``queue``: each delivery runs ``handler`` in its own task, at most
        ``prefetch`` unsettled at a time (``no_ack``: no limit, nothing to settle)."""
        broker = self._open()
        self._redeclare_own(queue)
        consumer = broker._consume(
            self._connection, queue, handler=handler, prefetch=prefetch, no_ack=no_ack
        )
        await asyncio.sleep(0)
        return InMemoryConsumer(broker, consumer)

    async def consume_raw(self, queue: str, callback: RawCallback) -> InMemoryConsumer:
        """No acks; only the body and ``user_id``, handed to a synchronous callback soon after
        delivery."""
        broker = self._open()
        self._redeclare_own(queue)
        consumer = broker._consume(self._connection, queue, raw=callback)
        await asyncio.sleep(0)
        return InMemoryConsumer(broker, consumer)

    async def consume_acked(
        self, queue: str, on_deliveries: Callable[[list[Delivery]], None], *, prefetch: int
    ) -> InMemoryConsumer:
        """Each delivery handed to ``on_deliveries`` alone, to be settled later; at most
        ``prefetch`` unsettled."""

        async def hand_on(delivery: Delivery) -> None:
            on_deliveries([delivery])

        return await self.consume(queue, hand_on, prefetch=prefetch)

    async def consume_replies(
        self, name: str, on_deliveries: Callable[[list[Delivery]], None]
    ) -> InMemoryConsumer:
        """Declare the exclusive reply queue ``name`` and consume it without acks, each
        delivery handed to ``on_deliveries`` alone."""
        await self.declare_reply_queue(name)

        async def hand_on(delivery: Delivery) -> None:
            on_deliveries([delivery])

        return await self.consume(name, hand_on, no_ack=True)

    def _redeclare_own(self, name: str) -> None:
        # AmqpTransport declares a queue it knows the spec of again before consuming it.
        spec = self._queue_specs.get(name)
        if spec is not None:
            self.broker._declare_queue(spec, self._connection)

    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None:
        """Take the oldest ready message (basic.get without acks); ``None`` if empty."""
        broker = self._open()
        found = broker._queue(queue)
        if found.locked_for(self._connection):
            raise ResourceLocked(f"queue {queue!r} is exclusive to another connection")
        found.last_used = broker.clock()
        await asyncio.sleep(0)
        if not found.ready:
            return None
        message = found.ready.popleft()
        return message.delivery(NO_ACK)

    async def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (unacked ones are not counted, as on RabbitMQ)."""
        broker = self._open()
        found = broker._queue(queue)
        if found.locked_for(self._connection):
            raise ResourceLocked(f"queue {queue!r} is exclusive to another connection")
        await asyncio.sleep(0)
        return len(found.ready)


if TYPE_CHECKING:

    def _meets_the_ports(transport: InMemoryTransport) -> tuple[ManagerTransport, ClientTransport]:
        return transport, transport
