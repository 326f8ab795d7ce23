"""The in-memory broker: exchanges, queues and bindings, routing, bounds, dead-lettering
and consumers, for one test (see :mod:`mesh.testing.memory` for how it behaves and where it
differs from RabbitMQ).

Its connections are :class:`~mesh.testing.InMemoryTransport` objects. The methods with a
leading underscore are a connection's side of the protocol, called by that transport only;
the rest is what a test calls: inspection, time, and faults (disconnect, reconnect).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Literal, Protocol

from mesh.errors import LocalProtocolError
from mesh.testing.amqp_rules import (
    DeadLetterReason,
    Spec,
    binding_matches,
    check_queue,
    declaration_order,
    describe,
    with_death,
)
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
    Consumer,
    Queue,
    QueuedMessage,
    QueueInfo,
    RawCallback,
    StoredMessage,
)
from mesh.topology.specs import BindingSpec, ExchangeSpec, QueueSpec
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery, Handler, Settlement

__all__ = ["Connected", "InMemoryBroker", "InMemoryConsumer"]

log = logging.getLogger(__name__)


class Connected(Protocol):
    """What :meth:`InMemoryBroker.disconnect` and :meth:`InMemoryBroker.reconnect` take: an
    :class:`~mesh.testing.InMemoryTransport`."""

    @property
    def connection(self) -> Connection: ...


class _Settlement:
    """What :class:`~mesh.transport.Delivery` acks and rejects through."""

    __slots__ = ("_broker", "_consumer", "_epoch", "_settled", "_tag")

    def __init__(self, broker: InMemoryBroker, consumer: Consumer, tag: int) -> None:
        self._broker = broker
        self._consumer = consumer
        self._tag = tag
        self._epoch = consumer.epoch
        self._settled = False

    def _take(self) -> StoredMessage | None:
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

    def __init__(self, broker: InMemoryBroker, consumer: Consumer) -> None:
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
        self._queues: dict[str, Queue] = {}
        self._connections: list[Connection] = []
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
            for connection in self._connections
            for consumer in connection.consumers
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
    async def disconnect(self, transport: Connected) -> None:
        """Cut ``transport``'s connection: its unacked deliveries are requeued, its handler
        tasks cancelled, its exclusive queues (and auto-delete queues left without consumers)
        deleted, and its ``on_disconnect`` callbacks called. Calls on it raise
        :class:`TransportClosed` until :meth:`reconnect`."""
        connection = transport.connection
        if connection.state != "open":
            return
        connection.state = "disconnected"
        self._drop_connection(connection, forget_consumers=False)
        for callback in list(connection.disconnect_callbacks):
            try:
                callback()
            except Exception:
                log.exception("disconnect callback failed", extra={"transport": connection.name})
        await asyncio.sleep(0)

    async def reconnect(self, transport: Connected) -> None:
        """Restore a disconnected ``transport`` as aio-pika's robust connection does: what it
        declared is declared again, its consumers resume, then its ``on_reconnect`` callbacks
        run (failures are logged, not raised)."""
        connection = transport.connection
        if connection.state != "disconnected":
            raise LocalProtocolError(f"{connection.name} is {connection.state}, not disconnected")
        connection.state = "open"
        connection.declared.clear()
        self._restore(connection)
        for callback in list(connection.reconnect_callbacks):
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback failed", extra={"transport": connection.name})

    async def close(self) -> None:
        """Close every transport, last connected first."""
        for connection in reversed(list(self._connections)):
            await self._close(connection)

    # ---- connections ----------------------------------------------------------------------
    def _connect(self, name: str) -> Connection:
        connection = Connection(name)
        self._connections.append(connection)
        return connection

    async def _close(self, connection: Connection) -> None:
        """Close: consumers stop, their handler tasks are cancelled and what they held is
        requeued; exclusive queues go. Idempotent."""
        if connection.state == "closed":
            return
        connection.state = "closed"
        self._drop_connection(connection, forget_consumers=True)
        connection.consumers.clear()
        if connection in self._connections:
            self._connections.remove(connection)
        await asyncio.sleep(0)

    def _drop_connection(self, connection: Connection, *, forget_consumers: bool) -> None:
        """What the broker does when a connection goes: requeue, cancel, delete exclusives."""
        try:
            current = asyncio.current_task()
        except RuntimeError:
            current = None
        touched: list[Queue] = []
        for consumer in connection.consumers:
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
            if queue.spec.exclusive and queue.owner is connection:
                self._delete_queue(queue)
        for queue in touched:
            self._dispatch(queue)

    def _restore(self, connection: Connection) -> None:
        ordered = sorted(connection.topology, key=declaration_order)
        for spec in ordered:
            try:
                self._redeclare(spec, connection)
            except BrokerRefused as exc:
                log.warning("not restored", extra={"transport": connection.name, "error": str(exc)})
        for consumer in connection.consumers:
            queue = self._queues.get(consumer.queue.name)
            if consumer.cancelled:
                continue
            if queue is None:
                consumer.cancelled = True
                log.warning("consumer not restored", extra={"queue": consumer.queue.name})
                continue
            consumer.queue = queue
            queue.consumers.append(consumer)
        for consumer in connection.consumers:
            if not consumer.cancelled:
                self._dispatch(consumer.queue)

    # ---- declarations ---------------------------------------------------------------------
    def _redeclare(self, spec: Spec, connection: Connection) -> None:
        if isinstance(spec, ExchangeSpec):
            self._declare_exchange(spec)
        elif isinstance(spec, QueueSpec):
            self._declare_queue(spec, connection)
        else:
            self._bind(spec, connection)

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
                f"received {describe(spec)}, current is {describe(current)}"
            )

    def _declare_queue(self, spec: QueueSpec, owner: Connection) -> None:
        check_queue(spec)
        current = self._queues.get(spec.name)
        if current is None:
            self._queues[spec.name] = Queue(spec, owner, self.clock())
            return
        if current.locked_for(owner):
            raise ResourceLocked(f"queue {spec.name!r} is exclusive to another connection")
        if current.spec != spec:
            raise PreconditionFailed(
                f"inequivalent arguments for queue {spec.name!r}: "
                f"received {describe(spec)}, current is {describe(current.spec)}"
            )
        current.last_used = self.clock()

    def _bind(self, spec: BindingSpec, owner: Connection) -> None:
        if spec.exchange == DEFAULT_EXCHANGE:
            raise AccessRefused("queues cannot be bound to the default exchange")
        if spec.exchange not in self._exchanges:
            raise NotFound(f"no exchange {spec.exchange!r}")
        queue = self._queue(spec.queue)
        if queue.locked_for(owner):
            raise ResourceLocked(f"queue {spec.queue!r} is exclusive to another connection")
        self._bindings[spec.exchange][(spec.queue, spec.routing_key)] = None

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise NotFound(f"no queue {name!r}")
        return queue

    def _delete_queue(self, queue: Queue) -> None:
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
    def _route(self, exchange: str, routing_key: str) -> list[Queue]:
        if exchange == DEFAULT_EXCHANGE:
            queue = self._queues.get(routing_key)
            return [] if queue is None else [queue]
        spec = self._exchanges.get(exchange)
        if spec is None:
            raise NotFound(f"no exchange {exchange!r}")
        names = [
            queue
            for queue, key in self._bindings[exchange]
            if binding_matches(spec.type, key, routing_key)
        ]
        return [self._queues[name] for name in dict.fromkeys(names)]

    def _publish(
        self, message: StoredMessage, *, mandatory: bool
    ) -> Literal["ok", "unroutable", "nacked"]:
        queues = self._route(message.exchange, message.routing_key)
        if not queues:
            return "unroutable" if mandatory else "ok"
        accepted = [self._enqueue(queue, message.copy()) for queue in queues]
        return "ok" if all(accepted) else "nacked"

    def _enqueue(self, queue: Queue, message: StoredMessage) -> bool:
        """Append ``message`` to ``queue`` under its bound; ``False`` if the queue refused it."""
        now = self.clock()
        self._purge_expired(queue, now)
        args = queue.spec.arguments
        full = (args.max_length is not None and len(queue.ready) >= args.max_length) or (
            args.max_length_bytes is not None
            and queue.ready_bytes() + len(message.body) > args.max_length_bytes
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
            or (args.max_length_bytes is not None and queue.ready_bytes() > args.max_length_bytes)
        ):
            self._dead_letter(queue, queue.ready.popleft(), "maxlen")  # drop-head
        self._dispatch(queue, purge=False)  # a TTL of 0 still reaches a waiting consumer
        self._purge_expired(queue, now)
        return True

    def _purge_expired(self, queue: Queue, now: float) -> None:
        while queue.ready:
            expires_at = queue.ready[0].expires_at
            if expires_at is None or expires_at > now:
                return
            self._dead_letter(queue, queue.ready.popleft(), "expired")

    def _return(self, queue: Queue, message: StoredMessage) -> None:
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

    def _dead_letter(self, queue: Queue, message: StoredMessage, reason: DeadLetterReason) -> None:
        """Republish to the queue's dead-letter exchange (if it has one), as RabbitMQ does."""
        args = queue.spec.arguments
        if args.dead_letter_exchange is None:
            return
        key = args.dead_letter_routing_key or message.routing_key
        headers = with_death(
            message.headers,
            exchange=message.exchange,
            routing_key=message.routing_key,
            queue=queue.name,
            reason=reason,
        )
        dead = StoredMessage(
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
        connection: Connection,
        name: str,
        *,
        handler: Handler | None = None,
        raw: RawCallback | None = None,
        prefetch: int = 1,
        no_ack: bool = False,
    ) -> Consumer:
        queue = self._queue(name)
        if queue.locked_for(connection):
            raise ResourceLocked(f"queue {name!r} is exclusive to another connection")
        consumer = Consumer(
            connection, queue, handler=handler, raw=raw, prefetch=prefetch, no_ack=no_ack
        )
        connection.consumers = [c for c in connection.consumers if not c.idle]
        connection.consumers.append(consumer)
        queue.consumers.append(consumer)
        self._dispatch(queue)
        return consumer

    def _dispatch(self, queue: Queue, *, purge: bool = True) -> None:
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

    def _deliver(self, consumer: Consumer, message: StoredMessage) -> None:
        loop = asyncio.get_running_loop()
        if consumer.raw is not None:
            loop.call_soon(self._call_raw, consumer, consumer.epoch, message.body, message.user_id)
            return
        settlement: Settlement = NO_ACK
        if not consumer.no_ack:
            tag = next(self._tags)
            consumer.unacked[tag] = message
            settlement = _Settlement(self, consumer, tag)
        delivery = message.delivery(settlement)
        task = loop.create_task(
            _run_handler(consumer, delivery),
            name=f"memory:{consumer.connection.name}:{consumer.queue.name}",
        )
        consumer.tasks.add(task)
        task.add_done_callback(consumer.tasks.discard)

    def _call_raw(self, consumer: Consumer, epoch: int, body: bytes, user_id: str | None) -> None:
        if consumer.cancelled or consumer.epoch != epoch or consumer.raw is None:
            return
        try:
            consumer.raw(body, user_id)
        except Exception:
            log.exception("raw consumer callback failed", extra={"queue": consumer.queue.name})

    def _cancel(self, consumer: Consumer) -> None:
        if consumer.cancelled:
            return
        consumer.cancelled = True
        self._detach(consumer)

    def _detach(self, consumer: Consumer) -> None:
        """Take ``consumer`` off its queue; an auto-delete queue left without any goes."""
        queue = consumer.queue
        if consumer not in queue.consumers:
            return
        queue.consumers.remove(consumer)
        if not queue.consumers:
            queue.last_used = self.clock()
            if queue.spec.auto_delete:
                self._delete_queue(queue)


async def _run_handler(consumer: Consumer, delivery: Delivery) -> None:
    if consumer.handler is None:  # pragma: no cover - raw consumers never get here
        return
    try:
        await consumer.handler(delivery)
    except Exception:
        # aio-pika logs an exception escaping a consumer and leaves the message unacked.
        log.exception("consumer handler failed", extra={"queue": consumer.queue.name})
