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
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mesh import constants as c
from mesh.errors import (
    LocalProtocolError,
    PublishNacked,
    PublishUnroutable,
    TopologyMismatch,
    TopologyMissing,
    TransportError,
)
from mesh.topology.specs import (
    BindingSpec,
    Declarations,
    ExchangeSpec,
    ExchangeType,
    QueueSpec,
    reply_queue,
)
from mesh.transport import dead_letters
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery, Handler
from mesh.transport.ports import ClientTransport, ManagerTransport
from mesh.wire.codec import encode
from mesh.wire.models import Message

log = logging.getLogger(__name__)

DeadLetterReason = Literal["rejected", "expired", "maxlen", "delivery_limit"]
RawCallback = Callable[[bytes, str | None], None]  # body, user_id
_Spec = ExchangeSpec | QueueSpec | BindingSpec
_ConnectionState = Literal["open", "disconnected", "closed"]


# ---- errors -------------------------------------------------------------------------------
class BrokerRefused(TransportError):
    """The in-memory broker refused an operation where RabbitMQ would close the channel."""


class PreconditionFailed(BrokerRefused):
    """406: a redeclaration with other properties, or ``delete_queue(if_empty=True)`` of a
    queue that holds messages."""


class NotFound(BrokerRefused, TopologyMissing):
    """404: the exchange or queue does not exist."""


class ResourceLocked(BrokerRefused):
    """405: the queue is exclusive to another connection."""


class AccessRefused(BrokerRefused):
    """403: the default exchange and ``amq.*`` names cannot be declared or bound."""


class TransportClosed(TransportError):
    """The transport is closed or disconnected."""


class DeliverySettleError(LocalProtocolError):
    """A delivery was acked or rejected twice, or settled although consumed with ``no_ack``."""


# ---- what a test can inspect --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class QueuedMessage:
    """A ready message, as :meth:`InMemoryBroker.messages` shows it."""

    body: bytes
    exchange: str
    routing_key: str
    headers: Mapping[str, Any]
    reply_to: str | None
    correlation_id: str | None
    message_id: str | None
    redelivered: bool


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's counts, as the management UI shows them."""

    name: str
    spec: QueueSpec
    ready: int
    unacked: int
    consumers: int


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """RabbitMQ's topic rule: words split on ``.``; ``*`` is exactly one word, ``#`` zero or
    more. An empty key has no words."""
    pattern = binding_key.split(".") if binding_key else []
    words = routing_key.split(".") if routing_key else []
    # reach[j]: the pattern so far matches the first j words.
    reach = [True] + [False] * len(words)
    for token in pattern:
        if token == "#":
            reach = list(itertools.accumulate(reach, lambda seen, here: seen or here))
        else:
            reach = [False] + [
                reach[j] and (token == "*" or token == word) for j, word in enumerate(words)
            ]
    return reach[-1]


def _ready_bytes(queue: _Queue) -> int:
    """The bodies' bytes of the ready messages: what ``x-max-length-bytes`` counts."""
    return sum(len(m.body) for m in queue.ready)


def _binding_matches(kind: ExchangeType, binding_key: str, routing_key: str) -> bool:
    if kind == "topic":
        return topic_matches(binding_key, routing_key)
    if kind == "direct":
        return binding_key == routing_key
    return kind == "fanout"


# ---- the broker's state -------------------------------------------------------------------
@dataclass(slots=True)
class _Message:
    body: bytes
    exchange: str
    routing_key: str
    headers: dict[str, Any] = field(default_factory=dict)
    reply_to: str | None = None
    correlation_id: str | None = None
    message_id: str | None = None
    redelivered: bool = False
    expires_at: float | None = None
    returns: int = 0  # times handed back to its queue (for x-delivery-limit)
    user_id: str | None = None  # as the publisher claimed it (no users to validate against)

    def copy(self) -> _Message:
        return _Message(
            self.body,
            self.exchange,
            self.routing_key,
            copy.deepcopy(self.headers),
            self.reply_to,
            self.correlation_id,
            self.message_id,
            user_id=self.user_id,
        )

    def delivery(self, settlement: _Settlement | _NoAck) -> Delivery:
        """What a consumer (or ``get_one``) receives for this message."""
        return Delivery(
            body=self.body,
            routing_key=self.routing_key,
            exchange=self.exchange,
            headers=copy.deepcopy(self.headers),
            reply_to=self.reply_to,
            correlation_id=self.correlation_id,
            message_id=self.message_id,
            user_id=self.user_id,
            redelivered=self.redelivered,
            _raw=settlement,
        )

    def snapshot(self) -> QueuedMessage:
        return QueuedMessage(
            self.body,
            self.exchange,
            self.routing_key,
            copy.deepcopy(self.headers),
            self.reply_to,
            self.correlation_id,
            self.message_id,
            self.redelivered,
        )


class _Queue:
    def __init__(self, spec: QueueSpec, owner: InMemoryTransport, now: float) -> None:
        self.spec = spec
        self.owner = owner  # matters only for exclusive queues
        self.ready: deque[_Message] = deque()
        self.consumers: list[_Consumer] = []
        self.last_used = now
        self.deleted = False
        self._turn = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def next_consumer(self) -> _Consumer | None:
        """Round-robin over the consumers that have room under their prefetch."""
        count = len(self.consumers)
        for step in range(count):
            consumer = self.consumers[(self._turn + step) % count]
            if consumer.has_room():
                self._turn = (self._turn + step + 1) % count
                return consumer
        return None

    def locked_for(self, transport: InMemoryTransport) -> bool:
        return self.spec.exclusive and self.owner is not transport


class _Consumer:
    def __init__(
        self,
        transport: InMemoryTransport,
        queue: _Queue,
        *,
        handler: Handler | None,
        raw: RawCallback | None,
        prefetch: int,
        no_ack: bool,
    ) -> None:
        self.transport = transport
        self.queue = queue
        self.handler = handler
        self.raw = raw
        self.no_ack = no_ack or raw is not None
        self.limit = None if self.no_ack or prefetch <= 0 else prefetch
        self.unacked: dict[int, _Message] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.epoch = 0  # bumped when the connection drops: older deliveries cannot settle
        self.cancelled = False
        self.on_broker_cancel: Callable[[], None] | None = None  # its queue was deleted

    def has_room(self) -> bool:
        return self.limit is None or len(self.unacked) < self.limit

    @property
    def idle(self) -> bool:
        return self.cancelled and not self.unacked and not self.tasks


class _NoAck:
    """The settlement of a delivery consumed with ``no_ack`` (or fetched with ``get_one``)."""

    async def ack(self) -> None:
        raise DeliverySettleError("this delivery was consumed with no_ack: nothing to ack")

    async def reject(self, requeue: bool = False) -> None:
        raise DeliverySettleError("this delivery was consumed with no_ack: nothing to reject")

    def held(self) -> bool:
        return True


_NO_ACK = _NoAck()


class _Settlement:
    """What :class:`~mesh.transport.Delivery` acks and rejects through."""

    __slots__ = ("_broker", "_consumer", "_epoch", "_settled", "_tag")

    def __init__(self, broker: InMemoryBroker, consumer: _Consumer, tag: int) -> None:
        self._broker = broker
        self._consumer = consumer
        self._tag = tag
        self._epoch = consumer.epoch
        self._settled = False

    def _take(self) -> _Message | None:
        if self._settled:
            raise DeliverySettleError("this delivery was already acked or rejected")
        if self._consumer.epoch != self._epoch:
            raise TransportClosed(
                "the connection this delivery came on was closed; the broker requeued it"
            )
        self._settled = True
        return self._consumer.unacked.pop(self._tag, None)

    def held(self) -> bool:
        return self._consumer.epoch == self._epoch

    async def ack(self) -> None:
        self._take()
        self._broker._dispatch(self._consumer.queue)

    async def reject(self, requeue: bool = False) -> None:
        message = self._take()
        queue = self._consumer.queue
        if message is not None and not queue.deleted:
            if requeue:
                self._broker._return(queue, message)
            else:
                self._broker._dead_letter(queue, message, "rejected")
        self._broker._dispatch(queue)


class InMemoryConsumer:
    """A running consumer; ``cancel()`` stops new deliveries (in-flight ones stay unacked)."""

    def __init__(self, broker: InMemoryBroker, consumer: _Consumer) -> None:
        self.queue_name = consumer.queue.name
        self._broker = broker
        self._consumer = consumer

    @property
    def cancelled(self) -> bool:
        return self._consumer.cancelled

    @property
    def on_broker_cancel(self) -> Callable[[], None] | None:
        """Called once if the broker cancels this consumer (its queue was deleted)."""
        return self._consumer.on_broker_cancel

    @on_broker_cancel.setter
    def on_broker_cancel(self, callback: Callable[[], None] | None) -> None:
        self._consumer.on_broker_cancel = callback

    async def cancel(self) -> None:
        self._broker._cancel(self._consumer)
        await asyncio.sleep(0)


class InMemoryBroker:
    """Exchanges, queues and bindings for one test; connect to it with
    :class:`InMemoryTransport`. See the module documentation for what it does and does not do.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._exchanges: dict[str, ExchangeSpec] = {}
        self._bindings: dict[str, dict[tuple[str, str], None]] = {}  # exchange -> (queue, key)
        self._queues: dict[str, _Queue] = {}
        self._transports: list[InMemoryTransport] = []
        self._tags = itertools.count(1)

    # ---- inspection -----------------------------------------------------------------------
    def queue_names(self) -> list[str]:
        return sorted(self._queues)

    def exchange_names(self) -> list[str]:
        return sorted(self._exchanges)

    def has_queue(self, name: str) -> bool:
        return name in self._queues

    def bindings(self, exchange: str) -> list[tuple[str, str]]:
        """``(queue, binding key)`` pairs of ``exchange``, in the order they were made."""
        return list(self._bindings.get(exchange, {}))

    def queue_info(self, name: str) -> QueueInfo:
        queue = self._queue(name)
        unacked = sum(
            len(consumer.unacked)
            for transport in self._transports
            for consumer in transport._consumers
            if consumer.queue is queue
        )
        return QueueInfo(name, queue.spec, len(queue.ready), unacked, len(queue.consumers))

    def messages(self, name: str) -> list[QueuedMessage]:
        """The ready messages of queue ``name``, oldest first (unacked ones are not listed)."""
        return [message.snapshot() for message in self._queue(name).ready]

    # ---- time -----------------------------------------------------------------------------
    def expire(self) -> None:
        """Apply message TTLs and queue ``x-expires`` now (transports do it on every call)."""
        now = self.clock()
        for queue in list(self._queues.values()):
            expires_ms = queue.spec.arguments.expires_ms
            unused_s = now - queue.last_used
            if expires_ms is not None and not queue.consumers and unused_s >= expires_ms / 1000:
                self._delete_queue(queue)
            elif not queue.deleted:
                self._purge_expired(queue, now)

    # ---- faults ---------------------------------------------------------------------------
    async def disconnect(self, transport: InMemoryTransport) -> None:
        """Cut ``transport``'s connection: its unacked deliveries are requeued, its handler
        tasks cancelled, its exclusive queues (and auto-delete queues left without consumers)
        deleted, and its ``on_disconnect`` callbacks called. Calls on it raise
        :class:`TransportClosed` until :meth:`reconnect`."""
        if transport._state != "open":
            return
        transport._state = "disconnected"
        self._drop_connection(transport, forget_consumers=False)
        for callback in list(transport._disconnect_callbacks):
            try:
                callback()
            except Exception:
                log.exception("disconnect callback failed", extra={"transport": transport.name})
        await asyncio.sleep(0)

    async def reconnect(self, transport: InMemoryTransport) -> None:
        """Restore a disconnected ``transport`` as aio-pika's robust connection does: what it
        declared is declared again, its consumers resume, then its ``on_reconnect`` callbacks
        run (failures are logged, not raised)."""
        if transport._state != "disconnected":
            raise LocalProtocolError(f"{transport.name} is {transport._state}, not disconnected")
        transport._state = "open"
        transport._declared.clear()
        self._restore(transport)
        for callback in list(transport._reconnect_callbacks):
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback failed", extra={"transport": transport.name})

    async def close(self) -> None:
        """Close every transport, last connected first."""
        for transport in reversed(list(self._transports)):
            await transport.close()

    # ---- declarations ---------------------------------------------------------------------
    def _declare_exchange(self, spec: ExchangeSpec) -> None:
        if spec.name == DEFAULT_EXCHANGE or spec.name.startswith("amq."):
            raise AccessRefused(f"exchange name {spec.name!r} is reserved")
        if spec.type == "headers":
            raise NotImplementedError("the in-memory broker has no headers exchanges")
        current = self._exchanges.get(spec.name)
        if current is None:
            self._exchanges[spec.name] = spec
            self._bindings[spec.name] = {}
        elif current != spec:
            raise PreconditionFailed(
                f"inequivalent arguments for exchange {spec.name!r}: "
                f"received {_describe(spec)}, current is {_describe(current)}"
            )

    def _declare_queue(self, spec: QueueSpec, owner: InMemoryTransport) -> None:
        _check_queue(spec)
        current = self._queues.get(spec.name)
        if current is None:
            self._queues[spec.name] = _Queue(spec, owner, self.clock())
            return
        if current.locked_for(owner):
            raise ResourceLocked(f"queue {spec.name!r} is exclusive to another connection")
        if current.spec != spec:
            raise PreconditionFailed(
                f"inequivalent arguments for queue {spec.name!r}: "
                f"received {_describe(spec)}, current is {_describe(current.spec)}"
            )
        current.last_used = self.clock()

    def _bind(self, spec: BindingSpec, owner: InMemoryTransport) -> None:
        if spec.exchange == DEFAULT_EXCHANGE:
            raise AccessRefused("queues cannot be bound to the default exchange")
        if spec.exchange not in self._exchanges:
            raise NotFound(f"no exchange {spec.exchange!r}")
        queue = self._queue(spec.queue)
        if queue.locked_for(owner):
            raise ResourceLocked(f"queue {spec.queue!r} is exclusive to another connection")
        self._bindings[spec.exchange][(spec.queue, spec.routing_key)] = None

    def _queue(self, name: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise NotFound(f"no queue {name!r}")
        return queue

    def _delete_queue(self, queue: _Queue) -> None:
        if queue.deleted:
            return
        queue.deleted = True
        del self._queues[queue.name]
        for bindings in self._bindings.values():
            for pair in [pair for pair in bindings if pair[0] == queue.name]:
                del bindings[pair]
        for consumer in list(queue.consumers):
            consumer.cancelled = True  # RabbitMQ cancels the consumers of a deleted queue
            if consumer.on_broker_cancel is not None:
                consumer.on_broker_cancel()
        queue.consumers.clear()
        queue.ready.clear()

    # ---- publishing -----------------------------------------------------------------------
    def _route(self, exchange: str, routing_key: str) -> list[_Queue]:
        if exchange == DEFAULT_EXCHANGE:
            queue = self._queues.get(routing_key)
            return [] if queue is None else [queue]
        spec = self._exchanges.get(exchange)
        if spec is None:
            raise NotFound(f"no exchange {exchange!r}")
        names = [
            queue
            for queue, key in self._bindings[exchange]
            if _binding_matches(spec.type, key, routing_key)
        ]
        return [self._queues[name] for name in dict.fromkeys(names)]

    def _publish(
        self, message: _Message, *, mandatory: bool
    ) -> Literal["ok", "unroutable", "nacked"]:
        queues = self._route(message.exchange, message.routing_key)
        if not queues:
            return "unroutable" if mandatory else "ok"
        accepted = [self._enqueue(queue, message.copy()) for queue in queues]
        return "ok" if all(accepted) else "nacked"

    def _enqueue(self, queue: _Queue, message: _Message) -> bool:
        """Append ``message`` to ``queue`` under its bound; ``False`` if the queue refused it."""
        now = self.clock()
        self._purge_expired(queue, now)
        args = queue.spec.arguments
        full = (args.max_length is not None and len(queue.ready) >= args.max_length) or (
            args.max_length_bytes is not None
            and _ready_bytes(queue) + len(message.body) > args.max_length_bytes
        )
        if full and args.overflow in ("reject-publish", "reject-publish-dlx"):
            if args.overflow == "reject-publish-dlx":
                self._dead_letter(queue, message, "maxlen")
            return False
        if args.message_ttl_ms is not None:
            message.expires_at = now + args.message_ttl_ms / 1000
        queue.ready.append(message)
        while queue.ready and (
            (args.max_length is not None and len(queue.ready) > args.max_length)
            or (args.max_length_bytes is not None and _ready_bytes(queue) > args.max_length_bytes)
        ):
            self._dead_letter(queue, queue.ready.popleft(), "maxlen")  # drop-head
        self._dispatch(queue, purge=False)  # a TTL of 0 still reaches a waiting consumer
        self._purge_expired(queue, now)
        return True

    def _purge_expired(self, queue: _Queue, now: float) -> None:
        while queue.ready:
            expires_at = queue.ready[0].expires_at
            if expires_at is None or expires_at > now:
                return
            self._dead_letter(queue, queue.ready.popleft(), "expired")

    def _return(self, queue: _Queue, message: _Message) -> None:
        """Hand an unsettled message back to the head of its queue, marked redelivered."""
        message.redelivered = True
        message.returns += 1
        args = queue.spec.arguments
        if args.queue_type == "quorum":
            message.headers["x-delivery-count"] = message.returns
            if args.delivery_limit is not None and message.returns > args.delivery_limit:
                self._dead_letter(queue, message, "delivery_limit")
                return
        queue.ready.appendleft(message)

    def _dead_letter(self, queue: _Queue, message: _Message, reason: DeadLetterReason) -> None:
        """Republish to the queue's dead-letter exchange (if it has one), as RabbitMQ does."""
        args = queue.spec.arguments
        if args.dead_letter_exchange is None:
            return
        key = args.dead_letter_routing_key or message.routing_key
        headers = _with_death(message, queue.name, reason)
        dead = _Message(
            message.body,
            args.dead_letter_exchange,
            key,
            headers,
            message.reply_to,
            message.correlation_id,
            message.message_id,
        )
        try:
            targets = self._route(dead.exchange, key)
        except NotFound:
            log.debug("dead-letter exchange missing; message dropped", extra={"queue": queue.name})
            return
        deaths = headers["x-death"]
        if not any(death["reason"] == "rejected" for death in deaths):
            seen = {death["queue"] for death in deaths}
            targets = [target for target in targets if target.name not in seen]  # a cycle
        for target in targets:
            self._enqueue(target, dead.copy())

    # ---- consuming ------------------------------------------------------------------------
    def _consume(
        self,
        transport: InMemoryTransport,
        name: str,
        *,
        handler: Handler | None = None,
        raw: RawCallback | None = None,
        prefetch: int = 1,
        no_ack: bool = False,
    ) -> _Consumer:
        queue = self._queue(name)
        if queue.locked_for(transport):
            raise ResourceLocked(f"queue {name!r} is exclusive to another connection")
        consumer = _Consumer(
            transport, queue, handler=handler, raw=raw, prefetch=prefetch, no_ack=no_ack
        )
        transport._consumers = [c for c in transport._consumers if not c.idle]
        transport._consumers.append(consumer)
        queue.consumers.append(consumer)
        self._dispatch(queue)
        return consumer

    def _dispatch(self, queue: _Queue, *, purge: bool = True) -> None:
        """Hand ready messages to consumers with room, one task per delivery."""
        if queue.deleted:
            return
        if purge:
            self._purge_expired(queue, self.clock())
        while queue.ready:
            consumer = queue.next_consumer()
            if consumer is None:
                return
            self._deliver(consumer, queue.ready.popleft())

    def _deliver(self, consumer: _Consumer, message: _Message) -> None:
        loop = asyncio.get_running_loop()
        if consumer.raw is not None:
            loop.call_soon(self._call_raw, consumer, consumer.epoch, message.body, message.user_id)
            return
        settlement: _Settlement | _NoAck = _NO_ACK
        if not consumer.no_ack:
            tag = next(self._tags)
            consumer.unacked[tag] = message
            settlement = _Settlement(self, consumer, tag)
        delivery = message.delivery(settlement)
        task = loop.create_task(
            _run_handler(consumer, delivery),
            name=f"memory:{consumer.transport.name}:{consumer.queue.name}",
        )
        consumer.tasks.add(task)
        task.add_done_callback(consumer.tasks.discard)

    def _call_raw(self, consumer: _Consumer, epoch: int, body: bytes, user_id: str | None) -> None:
        if consumer.cancelled or consumer.epoch != epoch or consumer.raw is None:
            return
        try:
            consumer.raw(body, user_id)
        except Exception:
            log.exception("raw consumer callback failed", extra={"queue": consumer.queue.name})

    def _cancel(self, consumer: _Consumer) -> None:
        if consumer.cancelled:
            return
        consumer.cancelled = True
        self._detach(consumer)

    def _detach(self, consumer: _Consumer) -> None:
        """Take ``consumer`` off its queue; an auto-delete queue left without any goes."""
        queue = consumer.queue
        if consumer not in queue.consumers:
            return
        queue.consumers.remove(consumer)
        if not queue.consumers:
            queue.last_used = self.clock()
            if queue.spec.auto_delete:
                self._delete_queue(queue)

    # ---- connections ----------------------------------------------------------------------
    def _drop_connection(self, transport: InMemoryTransport, *, forget_consumers: bool) -> None:
        """What the broker does when a connection goes: requeue, cancel, delete exclusives."""
        try:
            current = asyncio.current_task()
        except RuntimeError:
            current = None
        touched: list[_Queue] = []
        for consumer in transport._consumers:
            consumer.epoch += 1
            for task in consumer.tasks:
                if task is not current:
                    task.cancel()
            if consumer.unacked and not consumer.queue.deleted:
                touched.append(consumer.queue)
            for tag in sorted(consumer.unacked, reverse=True):
                message = consumer.unacked.pop(tag)
                if not consumer.queue.deleted:
                    self._return(consumer.queue, message)
            consumer.unacked.clear()
            self._detach(consumer)
            if forget_consumers:
                consumer.cancelled = True
        for queue in list(self._queues.values()):
            if queue.spec.exclusive and queue.owner is transport:
                self._delete_queue(queue)
        for queue in touched:
            self._dispatch(queue)

    def _restore(self, transport: InMemoryTransport) -> None:
        ordered = sorted(transport._topology, key=_declaration_order)
        for spec in ordered:
            try:
                self._redeclare(spec, transport)
            except BrokerRefused as exc:
                log.warning("not restored", extra={"transport": transport.name, "error": str(exc)})
        for consumer in transport._consumers:
            queue = self._queues.get(consumer.queue.name)
            if consumer.cancelled:
                continue
            if queue is None:
                consumer.cancelled = True
                log.warning("consumer not restored", extra={"queue": consumer.queue.name})
                continue
            consumer.queue = queue
            queue.consumers.append(consumer)
        for consumer in transport._consumers:
            if not consumer.cancelled:
                self._dispatch(consumer.queue)

    def _redeclare(self, spec: _Spec, transport: InMemoryTransport) -> None:
        if isinstance(spec, ExchangeSpec):
            self._declare_exchange(spec)
        elif isinstance(spec, QueueSpec):
            self._declare_queue(spec, transport)
        else:
            self._bind(spec, transport)


async def _run_handler(consumer: _Consumer, delivery: Delivery) -> None:
    if consumer.handler is None:  # pragma: no cover - raw consumers never get here
        return
    try:
        await consumer.handler(delivery)
    except Exception:
        # aio-pika logs an exception escaping a consumer and leaves the message unacked.
        log.exception("consumer handler failed", extra={"queue": consumer.queue.name})


def _check_queue(spec: QueueSpec) -> None:
    """What RabbitMQ refuses whatever else exists."""
    if spec.name.startswith("amq."):
        raise AccessRefused(f"queue name {spec.name!r} is reserved")
    if spec.arguments.queue_type == "quorum":
        if not spec.durable or spec.exclusive or spec.auto_delete:
            raise PreconditionFailed(
                f"quorum queue {spec.name!r} must be durable, neither exclusive nor auto-delete"
            )
        if spec.arguments.overflow == "reject-publish-dlx":
            raise PreconditionFailed(f"quorum queue {spec.name!r}: no reject-publish-dlx")


def _describe(spec: ExchangeSpec | QueueSpec) -> str:
    if isinstance(spec, ExchangeSpec):
        return f"type={spec.type} durable={spec.durable}"
    return (
        f"durable={spec.durable} exclusive={spec.exclusive} auto_delete={spec.auto_delete} "
        f"arguments={spec.arguments.to_amqp()}"
    )


def _declaration_order(spec: _Spec) -> int:
    return 0 if isinstance(spec, ExchangeSpec) else 1 if isinstance(spec, QueueSpec) else 2


def _with_death(message: _Message, queue: str, reason: DeadLetterReason) -> dict[str, Any]:
    """The message's headers with RabbitMQ's ``x-death`` record of this dead-lettering."""
    headers = copy.deepcopy(message.headers)
    deaths: list[dict[str, Any]] = list(headers.get("x-death") or [])
    entry: dict[str, Any] = {
        "count": 1,
        "reason": reason,
        "queue": queue,
        "exchange": message.exchange,
        "routing-keys": [message.routing_key],
    }
    for index, death in enumerate(deaths):
        if death.get("queue") == queue and death.get("reason") == reason:
            entry = {**death, "count": int(death.get("count", 0)) + 1}
            del deaths[index]
            break
    headers["x-death"] = [entry, *deaths]
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-queue", queue)
    headers.setdefault("x-first-death-exchange", message.exchange)
    return headers


# ---- the transport ------------------------------------------------------------------------
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
        self._state: _ConnectionState = "open"
        self._consumers: list[_Consumer] = []
        self._declared: dict[_Spec, None] = {}  # the declare cache, as AmqpTransport keeps one
        self._topology: dict[_Spec, None] = {}  # what a reconnect declares again
        self._queue_specs: dict[str, QueueSpec] = {}
        self._reconnect_callbacks: list[Callable[[], Awaitable[None]]] = []
        self._disconnect_callbacks: list[Callable[[], None]] = []
        broker._transports.append(self)

    def __repr__(self) -> str:
        return f"InMemoryTransport({self.name!r}, {self._state})"

    @property
    def is_closed(self) -> bool:
        return self._state != "open"

    def _open(self) -> InMemoryBroker:
        if self._state != "open":
            raise TransportClosed(f"transport {self.name!r} is {self._state}")
        self.broker.expire()
        return self.broker

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when :meth:`InMemoryBroker.disconnect` cuts this transport."""
        self._disconnect_callbacks.append(callback)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after :meth:`InMemoryBroker.reconnect` restored this transport."""
        self._reconnect_callbacks.append(callback)

    async def close(self) -> None:
        """Close: consumers stop, their handler tasks are cancelled and what they held is
        requeued; exclusive queues go. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        self.broker._drop_connection(self, forget_consumers=True)
        self._consumers.clear()
        if self in self.broker._transports:
            self.broker._transports.remove(self)
        await asyncio.sleep(0)

    # ---- declaration ----------------------------------------------------------------------
    async def declare(self, declarations: Declarations) -> None:
        """Declare exchanges, queues and bindings; specs already declared are skipped."""
        broker = self._open()
        specs: tuple[_Spec, ...] = (
            *declarations.exchanges,
            *declarations.queues,
            *declarations.bindings,
        )
        for spec in specs:
            if spec in self._declared:
                continue
            current = broker._queues.get(spec.name) if isinstance(spec, QueueSpec) else None
            try:
                broker._redeclare(spec, self)
            except PreconditionFailed as exc:
                if current is None or not isinstance(spec, QueueSpec) or current.spec == spec:
                    raise  # not an existing queue with other arguments
                raise TopologyMismatch.for_queue(spec.name, _describe(spec), str(exc)) from None
            if isinstance(spec, QueueSpec):
                self._queue_specs[spec.name] = spec
            self._declared[spec] = None
            self._topology[spec] = None
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
        broker._declare_queue(spec, self)
        self._queue_specs[name] = spec
        self._topology[spec] = None
        await asyncio.sleep(0)
        return name

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None:
        broker = self._open()
        queue = broker._queues.get(name)
        if queue is not None:
            if queue.locked_for(self):
                raise ResourceLocked(f"queue {name!r} is exclusive to another connection")
            if if_empty and queue.ready:
                raise PreconditionFailed(f"queue {name!r} is not empty")
            broker._delete_queue(queue)
        self._queue_specs.pop(name, None)
        # As AmqpTransport: forget the queue's own spec (bindings stay in the declare cache).
        self._declared = {s: None for s in self._declared if getattr(s, "name", None) != name}
        self._topology = {
            s: None
            for s in self._topology
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
            _Message(
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
        message = _Message(body, exchange, routing_key, message_id=None, user_id=user_id)
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
        consumer = broker._consume(self, queue, handler=handler, prefetch=prefetch, no_ack=no_ack)
        await asyncio.sleep(0)
        return InMemoryConsumer(broker, consumer)

    async def consume_raw(self, queue: str, callback: RawCallback) -> InMemoryConsumer:
        """No acks; only the body and ``user_id``, handed to a synchronous callback soon after
        delivery."""
        broker = self._open()
        self._redeclare_own(queue)
        consumer = broker._consume(self, queue, raw=callback)
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
            self.broker._declare_queue(spec, self)

    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None:
        """Take the oldest ready message (basic.get without acks); ``None`` if empty."""
        broker = self._open()
        found = broker._queue(queue)
        if found.locked_for(self):
            raise ResourceLocked(f"queue {queue!r} is exclusive to another connection")
        found.last_used = broker.clock()
        await asyncio.sleep(0)
        if not found.ready:
            return None
        message = found.ready.popleft()
        return message.delivery(_NO_ACK)

    async def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (unacked ones are not counted, as on RabbitMQ)."""
        broker = self._open()
        found = broker._queue(queue)
        if found.locked_for(self):
            raise ResourceLocked(f"queue {queue!r} is exclusive to another connection")
        await asyncio.sleep(0)
        return len(found.ready)


if TYPE_CHECKING:

    def _meets_the_ports(transport: InMemoryTransport) -> tuple[ManagerTransport, ClientTransport]:
        return transport, transport
