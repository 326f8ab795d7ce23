"""Consuming on the transport's connection and on its consume-only one.

:class:`Consumers` is the transport's consuming room: a queue consumed on a channel of its
own (:class:`Consumer`: each delivery straight from aiormq into a :class:`Delivery`, and the
consumer subscribed again whenever its channel reopens), the cheap paths on the consume-only
connection (:mod:`mesh.transport.amqp091`: heartbeats, acked batches, a client's replies),
and one-off reads (``basic.get``, a queue's counts).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import aiormq
import pamqp.commands
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection, AbstractRobustQueue

from mesh.errors import TopologyMissing, TransportError
from mesh.topology.specs import reply_queue
from mesh.transport import moves
from mesh.transport.amqp091 import (
    DeliveriesCallback,
    LeanConnection,
    LeanConsumer,
    RawCallback,
)
from mesh.transport.delivery import NO_SETTLE, Delivery, Handler, Settlement

log = logging.getLogger(__name__)


async def _resubscribe(consumer: Consumer) -> None:
    """After its channel reopened (a reconnect, or the channel alone): consume again.
    aio-pika swallows exceptions from reopen callbacks: every failure is logged here."""
    if consumer.cancelled:
        return
    try:
        await consumer.subscribe()
    except Exception:
        log.exception("consumer not restored", extra={"queue": consumer.queue_name})


class _Settle:
    """Ack or reject one delivery on the channel it came on. On a channel closed since (the
    connection dropped), there is nothing to settle: the broker has requeued the message."""

    __slots__ = ("_channel", "_tag")

    def __init__(self, channel: aiormq.abc.AbstractChannel, tag: int) -> None:
        self._channel = channel
        self._tag = tag

    async def ack(self) -> None:
        await self._settle(self._channel.basic_ack(self._tag), "ack")

    async def reject(self, requeue: bool = False) -> None:
        await self._settle(self._channel.basic_reject(self._tag, requeue=requeue), "reject")

    def held(self) -> bool:
        return not self._channel.is_closed

    async def _settle(self, operation: Awaitable[Any], what: str) -> None:
        try:
            await operation
        except (aiormq.exceptions.AMQPError, RuntimeError) as exc:
            log.debug("delivery not settled: its channel is gone", extra={"op": what, "err": exc})


def _raw_delivery(message: aiormq.abc.DeliveredMessage, settle: Settlement) -> Delivery:
    props = message.header.properties
    return Delivery(
        body=message.body,
        routing_key=message.routing_key or "",
        exchange=message.exchange or "",
        headers=props.headers or {},
        reply_to=props.reply_to,
        correlation_id=props.correlation_id,
        message_id=props.message_id,
        user_id=props.user_id,
        redelivered=bool(message.redelivered),
        _raw=settle,
    )


class Consumer:
    """A running consumer, registered on aiormq's channel under a robust aio-pika channel;
    ``cancel()`` stops new deliveries (in-flight ones stay unacked, and can still be acked:
    the channel stays open)."""

    def __init__(
        self,
        channel: AbstractRobustChannel,
        queue: str,
        handler: Handler,
        *,
        prefetch: int,
        no_ack: bool,
        restoring: Callable[[], bool],
        control_timeout_s: float,
    ) -> None:
        self.queue_name = queue
        self.cancelled = False
        # True while the whole connection is being restored: then the transport subscribes
        # again once every channel is back (resubscribe_deferred), not this channel alone.
        self._restoring = restoring
        self.deferred = False
        self._channel = channel
        self._handler = handler
        self._prefetch = prefetch
        self._no_ack = no_ack
        self._control_timeout_s = control_timeout_s
        self._underlay: aiormq.abc.AbstractChannel | None = None
        self._tag: str | None = None
        # Called once if the broker cancels this consumer (its queue was deleted).
        self.on_broker_cancel: Callable[[], None] | None = None
        channel.reopen_callbacks.add(self._reopened)

    async def _reopened(self, *_: Any) -> None:
        """Its channel reopened. After a reconnect, aio-pika restores the channels one by one
        in no fixed order: a consumer subscribed now could take tasks while the publishing
        channel (and the declarations on it) is still closed, fail to answer them and requeue
        them at once, burning their delivery limit. So it waits for the whole connection; a
        channel reopened on its own subscribes at once."""
        if self._restoring():
            self.deferred = True
            return
        await _resubscribe(self)

    async def resubscribe_deferred(self) -> None:
        if self.deferred:
            self.deferred = False
            await _resubscribe(self)

    async def subscribe(self) -> None:
        """Start (or, after a reconnect, restart) deliveries on the current channel."""
        handler, no_ack = self._handler, self._no_ack
        underlay = await self._channel.get_underlay_channel()

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            tag = message.delivery_tag
            settle = NO_SETTLE if no_ack or tag is None else _Settle(underlay, tag)
            await handler(_raw_delivery(message, settle))

        await underlay.basic_qos(prefetch_count=0 if no_ack else self._prefetch)
        ok = await underlay.basic_consume(self.queue_name, on_message, no_ack=no_ack)
        if underlay is not self._underlay:
            underlay.on_consumer_cancel_callbacks.add(self._cancelled_by_broker)
        self._underlay, self._tag = underlay, ok.consumer_tag

    def _cancelled_by_broker(self, frame: aiormq.spec.Basic.Cancel) -> None:
        """The broker ended this consumer (``basic.cancel``: its queue was deleted): it is
        cancelled — nothing comes any more, a reopened channel does not consume again — and
        ``on_broker_cancel`` says so, so the owner can subscribe again once the queue is
        back."""
        if frame.consumer_tag != self._tag or self.cancelled:
            return
        self.cancelled = True
        self._tag = None  # the broker forgot it: nothing to cancel
        log.warning("consumer cancelled by the broker", extra={"queue": self.queue_name})
        if self.on_broker_cancel is not None:
            self.on_broker_cancel()

    async def cancel(self) -> None:
        """Stop deliveries. Bounded: with the broker unreachable it gives up after a while
        (the broker forgets the consumer with the connection anyway)."""
        self.cancelled = True
        if self._underlay is None or self._tag is None:
            return
        try:
            async with asyncio.timeout(self._control_timeout_s):
                await self._underlay.basic_cancel(self._tag)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            log.debug("consumer cancel incomplete", extra={"queue": self.queue_name, "err": exc})


class Consumers:
    """Every consumer of one transport: on channels of the transport's robust connection
    (restored with it) and on the consume-only connection, opened on first use at the
    broker address ``consume_only_url()`` names then."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        *,
        queue_on: Callable[[AbstractRobustChannel, str], Awaitable[AbstractRobustQueue]],
        restoring: Callable[[], bool],
        consume_only_url: Callable[[], str],
        name: str,
        control_timeout_s: float,
    ) -> None:
        self._connection = connection
        self._queue_on = queue_on
        self._restoring = restoring
        self._consume_only_url = consume_only_url
        self._name = name
        self._control_timeout_s = control_timeout_s
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        self._lean: LeanConnection | None = None  # the consume-only connection

    async def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, no_ack: bool = False
    ) -> Consumer:
        """See :meth:`mesh.transport.AmqpTransport.consume`."""
        channel = await self._connection.channel()
        try:
            await self._queue_on(channel, queue)  # it exists (and aio-pika restores it)
            consumer = Consumer(
                channel,
                queue,
                handler,
                prefetch=prefetch,
                no_ack=no_ack,
                restoring=self._restoring,
                control_timeout_s=self._control_timeout_s,
            )
            await consumer.subscribe()
            self._consumers.add(consumer)
        except BaseException as exc:
            if not channel.is_closed:
                await channel.close()
            if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
                raise TopologyMissing(
                    f"queue {queue!r} does not exist: declare the topology first ({exc})"
                ) from None
            if isinstance(exc, aiormq.exceptions.ChannelLockedResource):
                raise TransportError(
                    f"queue {queue!r} is exclusive to another connection: only the "
                    f"connection that declared it may consume it ({exc})"
                ) from None
            raise
        return consumer

    async def consume_raw(self, queue: str, callback: RawCallback) -> LeanConsumer:
        return await self._consume_only().consume(queue, callback)

    async def consume_acked(
        self, queue: str, on_deliveries: DeliveriesCallback, *, prefetch: int
    ) -> LeanConsumer:
        return await self._consume_only().consume_acked(queue, on_deliveries, prefetch=prefetch)

    async def consume_replies(self, name: str, on_deliveries: DeliveriesCallback) -> LeanConsumer:
        spec = reply_queue(name)
        declare = pamqp.commands.Queue.Declare(
            queue=spec.name,
            durable=spec.durable,
            exclusive=spec.exclusive,
            auto_delete=spec.auto_delete,
            arguments=spec.arguments.to_amqp(),
        )
        return await self._consume_only().consume_replies(declare, on_deliveries)

    def _consume_only(self) -> LeanConnection:
        if self._lean is None:
            # From the node this connection reached, then in this process's order.
            self._lean = LeanConnection(self._consume_only_url(), name=f"{self._name}:consume")
        return self._lean

    # ---- with the connection's life --------------------------------------------------------
    def dropped(self) -> None:
        """The transport's connection dropped: the consume-only connection is dropped too,
        whether or not it has noticed yet, so the two come back together."""
        if self._lean is not None:
            self._lean.reset()

    async def restore(self) -> None:
        """Every channel of the transport's connection is back: the consumers deferred
        meanwhile subscribe again, and the consume-only connection is waited for (bounded)."""
        for consumer in list(self._consumers):
            await consumer.resubscribe_deferred()
        if self._lean is not None and not await self._lean.restored(self._control_timeout_s):
            log.warning("the consume-only connection is not back yet; it keeps trying")

    async def close(self) -> None:
        """Close the consume-only connection (the others close with the transport's)."""
        if self._lean is not None:
            await self._lean.close()

    # ---- one-off reads ---------------------------------------------------------------------
    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None:
        """Fetch one message with basic.get (for tools and tests); ``None`` if empty."""
        async with asyncio.timeout(timeout_s + self._control_timeout_s):
            channel = await self._connection.channel()
            try:
                underlay = await channel.get_underlay_channel()
                msg = await underlay.basic_get(queue, no_ack=True, timeout=timeout_s)
                if isinstance(msg.delivery, aiormq.spec.Basic.GetEmpty):
                    return None
                return _raw_delivery(msg, NO_SETTLE)
            finally:
                await channel.close()

    async def queue_counts(self, queue: str) -> tuple[int, int]:
        """``(ready, consumers)`` of ``queue``; :class:`TopologyMissing` if it does not
        exist (not declared yet, or deleted)."""
        async with asyncio.timeout(self._control_timeout_s):
            counts = await moves.queue_counts(self._connection, queue)
        if counts is None:
            raise TopologyMissing(f"no queue {queue!r} (not declared yet, or deleted)")
        return counts
