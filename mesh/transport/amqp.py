"""The only module that talks to aio-pika.

It declares topology from :mod:`mesh.topology` specs (idempotently, cached per
spec), publishes with confirms, ``mandatory`` and a timeout, and consumes into
:class:`Delivery` objects so the rest of the mesh never sees aio-pika types.

Publish outcomes are exceptions from :mod:`mesh.errors`:

* :class:`~mesh.errors.PublishUnroutable` - no queue matched (returned);
* :class:`~mesh.errors.PublishNacked` - the broker refused it (a full bounded queue);
* :class:`~mesh.errors.PublishTimeout` - no confirm in time: the outcome is *unknown*
  and the message may still be enqueued later, so retry with the same business ID.

Each publish attempt gets a fresh ``message_id``: aiormq matches returned
messages to publishes by it, so reusing one could hand one publish another's
outcome. Business IDs travel in headers or ``correlation_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import aio_pika
import aiormq
import pamqp.commands
import yarl
from aio_pika.abc import (
    AbstractExchange,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)
from aiormq.abc import ChannelFrame

from mesh import constants as c
from mesh.errors import (
    BrokerUnavailable,
    LocalProtocolError,
    PublishNacked,
    PublishTimeout,
    PublishUnroutable,
    TopologyMismatch,
    TopologyMissing,
    TransportError,
)
from mesh.ids import IdSequence
from mesh.topology.specs import BindingSpec, Declarations, ExchangeSpec, QueueSpec, reply_queue
from mesh.transport import dead_letters, moves
from mesh.transport.addresses import BrokerAddresses, first_url
from mesh.transport.addresses import redact as redact  # re-exported
from mesh.transport.delivery import DEFAULT_EXCHANGE as DEFAULT_EXCHANGE  # re-exported
from mesh.transport.delivery import NO_SETTLE, Handler, Settlement
from mesh.transport.delivery import Delivery as Delivery  # re-exported
from mesh.transport.frames import message_properties, publish_frames
from mesh.transport.lean import DeliveriesCallback, LeanConnection, LeanConsumer
from mesh.transport.lean import RawBatch as RawBatch  # re-exported
from mesh.transport.lean import RawBatchCallback as RawBatchCallback  # re-exported
from mesh.transport.lean import RawCallback as RawCallback  # re-exported
from mesh.wire.codec import encode
from mesh.wire.models import Message

log = logging.getLogger(__name__)

WRITE_QUEUE_FRAMES = 1024
"""How many frames an aiormq connection queues for its writer task (aiormq's default: 10).

A publish puts its frames on that queue *while holding its channel's lock*, and the writer
task empties it once per event-loop turn. With ten, a burst of more than ten publishes on one
channel — a batch's replies, a producer's next requests after a batch of answers — queues on
the lock and goes out one loop turn per publish: with 64 admissions in flight, ~55 publishes
waited there at any moment, and admissions ran at ~0.6x the raw aiormq echo; with 1,024, at
~0.77x (``bench/admission.py``). The writer never waits for the socket (asyncio's transport
buffers), so the small queue held nothing back but the loop; publishers still wait for their
confirms, so the bound on work in flight is theirs. Process-wide: aiormq reads it as a class
attribute when it opens a connection, so every aiormq connection in the process gets it —
the benchmark's raw aiormq echo included, which keeps that comparison fair."""
aiormq.Connection.FRAME_BUFFER_SIZE = max(aiormq.Connection.FRAME_BUFFER_SIZE, WRITE_QUEUE_FRAMES)

_FAST_PROPERTIES = aiormq.spec.Basic.Properties(content_type=c.CONTENT_TYPE)
_FAST_MARSHALLED = _FAST_PROPERTIES.marshal()
_CONTROL_TIMEOUT_S = 5.0  # bound on channel operations that are not publishes
_REOPEN_EVERY_S = 5.0  # a refusing publishing channel is reopened at most this often

_Framed = tuple[str, bytes, bytes, str]
"""A confirmed publish as its frames are written: routing key, body, marshalled properties,
message ID."""


def _not_an_amqp_url(url: str) -> str | None:
    """Why ``url`` cannot be a broker's AMQP URL, or ``None``."""
    scheme = urlsplit(url).scheme
    if scheme in ("amqp", "amqps"):
        return None
    hint = (
        " (an http:// URL is the management API's: give it as --management-url)"
        if scheme in ("http", "https")
        else ""
    )
    return (
        f"{redact(url)} is not an AMQP URL{hint}; the broker's is "
        "amqp://USER:PASSWORD@HOST:5672/VHOST (MESH_AMQP_URL or --amqp-url)"
    )


def with_heartbeat(url: str, seconds: int) -> str:
    """``url`` asking for an AMQP heartbeat of ``seconds`` unless it names one already (the
    operator's choice wins); each of several comma-separated URLs alike. The broker closes a
    connection that stays silent for about two heartbeat intervals — a frozen or cut-off
    process's included."""
    if "," in url:
        return ",".join(with_heartbeat(part.strip(), seconds) for part in url.split(","))
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "heartbeat" for name, _ in query):
        return url
    return urlunsplit(parts._replace(query=urlencode([*query, ("heartbeat", str(seconds))])))


def _why_not_connected(url: str, exc: BaseException) -> str:
    """One sentence that points at the real cause of a failed connection."""
    parts = urlsplit(url)
    where = f"RabbitMQ at {parts.hostname}:{parts.port or 5672}"
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        return (
            f"{where} refused the login of user {parts.username or 'guest'!r} "
            "(ACCESS_REFUSED): check the user name and password in MESH_AMQP_URL or "
            "--amqp-url (`rabbitmqctl list_users`)"
        )
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        vhost = parts.path[1:] or "/"
        return (
            f"{where} accepted the login but closed the connection while opening vhost "
            f"{vhost!r}: it does not exist, or user {parts.username or 'guest'!r} has no "
            "permissions on it (`rabbitmqctl list_vhosts`, `rabbitmqctl list_permissions`)"
        )
    return (
        f"cannot reach RabbitMQ at {redact(url)} ({type(exc).__name__}: {exc}); "
        "start it (`rabbitmq-server -detached`, or `docker compose up -d rabbitmq`) "
        "or point MESH_AMQP_URL at a running broker"
    )


def url_user(url: str) -> str | None:
    """The broker user an AMQP URL logs in as (percent-decoded, as the client sends it), or
    ``None`` if it names none (the client then logs in as ``guest``)."""
    return unquote(urlsplit(first_url(url)).username or "") or None


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
        restoring: Callable[[], bool] = lambda: False,
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
            async with asyncio.timeout(_CONTROL_TIMEOUT_S):
                await self._underlay.basic_cancel(self._tag)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            log.debug("consumer cancel incomplete", extra={"queue": self.queue_name, "err": exc})


def _where(exchange: str, routing_key: str) -> str:
    return f"{exchange or '<default>'}/{routing_key}"


def _forget_message_id(
    channel: aiormq.Channel, message_id: str, tag: int, _: asyncio.Future[Any]
) -> None:
    """A settled publish's message ID no longer maps to its tag (as aiormq does)."""
    if channel.message_id_delivery_tag.get(message_id) == tag:
        channel.message_id_delivery_tag.pop(message_id)


class AmqpTransport:
    """A named connection to RabbitMQ with a confirming publish channel."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        publish_channel: AbstractRobustChannel,
        *,
        url: str,
        publish_timeout_s: float,
        name: str = "mesh",
    ) -> None:
        self.url = url
        self.name = name  # the connection's name in the management UI
        self.publish_timeout_s = publish_timeout_s
        self._connection = connection
        self._publish_channel = publish_channel
        self._exchanges: dict[str, AbstractExchange] = {}
        self._declared: set[ExchangeSpec | QueueSpec | BindingSpec] = set()
        self._queues: dict[str, AbstractRobustQueue] = {}
        self._closing = False
        self._queue_specs: dict[str, QueueSpec] = {}
        self._fast_channel: AbstractRobustChannel | None = None
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self.probes_unanswered = 0
        self._lean: LeanConnection | None = None  # heartbeats' consume-only connection
        self._message_ids = IdSequence()  # fresh per publish attempt
        # The user every publish is signed with (``user_id``), or None (``connect(sign=)``).
        self.signer: str | None = None
        self._fast_properties = _FAST_PROPERTIES  # signed by sign_as
        self._fast_marshalled = _FAST_MARSHALLED
        self._restoring = False  # the connection dropped and is not whole again yet
        # The broker addresses (several: a cluster's nodes) and the one connected to.
        self._addresses = BrokerAddresses((url,))
        self._address = url
        self._moving_on: asyncio.Task[None] | None = None
        self._reopened_at = -math.inf  # monotonic: the publishing channel last reopened
        self.reopened_channels = 0  # reopened after refusals (RabbitMQ 3.10's stuck channel)
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        connection.reconnect_callbacks.add(self._reconnected)
        connection.close_callbacks.add(self._dropped)

    @classmethod
    async def connect(
        cls,
        url: str = c.DEFAULT_AMQP_URL,
        *,
        name: str,
        publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
        liveness_probe_s: float | None = None,
        sign: bool = False,
        properties: Mapping[str, str] | None = None,
    ) -> AmqpTransport:
        """Connect, or raise :class:`BrokerUnavailable` with one sentence that says what to do.

        ``sign``: every publish carries ``user_id`` = the URL's user (where the caller gives
        none), which RabbitMQ validates — so a receiver can tell this process's messages from
        anyone else's (agents take control messages only from the managers' user).

        ``liveness_probe_s``: also probe the broker twice every so many seconds and drop the
        connection (so it reconnects) when a probe gets no answer within that many seconds: a
        silent broker (a blackholed path) is noticed within one and a half intervals — two at
        the most — where the AMQP heartbeat alone takes ``(heartbeat + 1) * 3`` s or more
        (aiormq's rule).

        ``properties``: more client properties beside ``connection_name`` (an agent's
        incarnation), shown in the management API's connection list."""
        for part in url.split(","):
            not_amqp = _not_an_amqp_url(part.strip())
            if not_amqp is not None:
                raise BrokerUnavailable(not_amqp)
        try:
            addresses = BrokerAddresses.parse(url)
        except LocalProtocolError as exc:
            raise BrokerUnavailable(str(exc)) from None
        connection: AbstractRobustConnection | None = None
        for address in addresses.urls:  # in this process's order; the first that answers
            try:
                connection = await aio_pika.connect_robust(
                    address,
                    client_properties={**(properties or {}), "connection_name": name},
                    timeout=connect_timeout_s,
                )
                break
            except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as exc:
                failed: tuple[str, BaseException] = (address, exc)
        if connection is None:
            address, error = failed
            others = len(addresses.urls) - 1
            tried = f" (nor at the {others} other addresses given)" if others else ""
            raise BrokerUnavailable(_why_not_connected(address, error) + tried) from None
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        transport = cls(
            connection, channel, url=url, publish_timeout_s=publish_timeout_s, name=name
        )
        transport._addresses, transport._address = addresses, address
        if sign:
            transport.sign_as(url_user(url) or "guest")
        if liveness_probe_s is not None:
            transport.watch(liveness_probe_s)
        return transport

    @property
    def is_closed(self) -> bool:
        return bool(self._connection.is_closed)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the connection drops (before reconnection starts)."""

        def closed(*_: Any) -> None:
            if not self._closing:
                callback()

        self._connection.close_callbacks.add(closed)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every reconnection (consumers are restored before it)."""
        self._on_reconnect.append(callback)

    def _dropped(self, *_: Any) -> None:
        """The connection dropped (the broker, the network, the liveness probe): the
        consume-only connection is dropped too, whether or not it has noticed yet, so the
        two come back together (:meth:`_reconnected`)."""
        if not self._closing:
            self._restoring = True
            self._move_on()
        if self._lean is not None and not self._closing:
            self._lean.reset()

    @property
    def address(self) -> str:
        """The broker URL this connection reached, or is reconnecting to (of several given:
        :mod:`mesh.transport.addresses`)."""
        return self._address

    def _move_on(self) -> None:
        """Several addresses: the connection dropped, so reconnect to the next one (the node
        may be gone), and to the one after it every reconnect interval until connected."""
        if len(self._addresses.urls) < 2 or (
            self._moving_on is not None and not self._moving_on.done()
        ):
            return
        self._moving_on = asyncio.create_task(self._next_addresses(), name="broker-addresses")

    async def _next_addresses(self) -> None:
        connection = self._connection
        interval = float(getattr(connection, "reconnect_interval", 5.0))
        while not self._closing:
            self._address = self._addresses.after(self._address)
            # aio-pika's robust connection reads its URL at every attempt.
            connection.url = yarl.URL(self._address)  # type: ignore[attr-defined]
            log.info(
                "reconnecting to the next broker address", extra={"url": redact(self._address)}
            )
            await asyncio.sleep(interval)
            if connection.connected.is_set():
                return

    async def _reconnected(self, *_: Any) -> None:
        # aio-pika swallows exceptions from reconnect callbacks: log every failure here.
        log.warning("reconnected to the broker", extra={"url": redact(self.url)})
        # aio-pika has restored what it knew; forget our cache so later declares are real.
        self._declared.clear()
        # Every channel is back: only now do the consumers take messages again.
        self._restoring = False
        for consumer in list(self._consumers):
            await consumer.resubscribe_deferred()
        if self._lean is not None and not await self._lean.restored(_CONTROL_TIMEOUT_S):
            log.warning("the consume-only connection is not back yet; it keeps trying")
        for callback in self._on_reconnect:
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback failed")

    async def close(self) -> None:
        self._closing = True
        if self._lean is not None:
            await self._lean.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        if not self._connection.is_closed:
            await self._connection.close()

    # ---- liveness ---------------------------------------------------------------------------
    def watch(self, interval_s: float) -> None:
        """Start the liveness probe (see :meth:`connect`)."""
        if interval_s <= 0:
            raise ValueError(f"the liveness probe interval must be > 0, got {interval_s}")
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._probe_forever(interval_s))

    async def _probe_forever(self, interval_s: float) -> None:
        """One round trip (``basic.qos`` on the publish channel: it consumes nothing, so
        the setting changes nothing) every half ``interval_s``. Unanswered within
        ``interval_s``, the broker is taken for gone: the connection is closed — its close
        callbacks run, and the robust connection reconnects once the broker answers again.
        A path that goes silent is noticed at most half an interval (until the next probe)
        plus one interval (its timeout) later. Not while the broker blocks us (an alarm: it
        stops reading our socket on purpose) or while reconnecting."""
        while not self._closing:
            await asyncio.sleep(interval_s / 2)
            connection = self._connection
            if connection.is_closed or connection.reconnecting or self.blocked:
                continue
            try:
                async with asyncio.timeout(interval_s):
                    channel = await self._publish_channel.get_underlay_channel()
                    await channel.basic_qos(prefetch_count=0)
            except TimeoutError:
                self.probes_unanswered += 1
                log.warning(
                    "the broker did not answer a liveness probe; dropping the connection",
                    extra={"url": redact(self.url), "waited_s": interval_s},
                )
                await self._drop(interval_s / 4)  # a silent broker never sends Close-Ok
            except (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError) as exc:
                log.debug("liveness probe on a closing connection", extra={"error": str(exc)})

    async def _drop(self, wait_s: float) -> None:
        """Close the current AMQP connection without waiting on a broker that does not
        answer (its Close-Ok would never come): the close callbacks run either way."""
        underlay = self._connection.transport
        if underlay is None:
            return
        with contextlib.suppress(Exception):  # TimeoutError included
            async with asyncio.timeout(wait_s):
                await underlay.connection.close(ConnectionError("liveness probe unanswered"))

    # ---- declaration ----------------------------------------------------------------------
    async def declare(self, declarations: Declarations) -> None:
        """Declare exchanges, queues and bindings; specs already declared are skipped.

        Everything is declared through aio-pika's robust objects, so after a reconnect the
        library re-declares the queues (with their arguments) and re-binds them.
        """
        channel = self._publish_channel
        for ex in declarations.exchanges:
            if ex not in self._declared:
                self._exchanges[ex.name] = await channel.declare_exchange(
                    ex.name, type=ex.type, durable=ex.durable
                )
                self._declared.add(ex)
        for q in declarations.queues:
            if q not in self._declared:
                if q.replaces_classic:
                    await self._upgrade(q, declarations.bindings)
                try:
                    self._queues[q.name] = await self._declare_queue(channel, q)
                except aiormq.exceptions.ChannelPreconditionFailed as exc:
                    self._queue_specs.pop(q.name, None)
                    raise TopologyMismatch.for_queue(q.name, _arguments_text(q), str(exc)) from None
                self._declared.add(q)
        for b in declarations.bindings:
            if b not in self._declared:
                queue = self._queues.get(b.queue)
                if queue is None:
                    queue = await channel.declare_queue(b.queue, passive=True)
                    self._queues[b.queue] = queue
                await queue.bind(b.exchange, routing_key=b.routing_key)
                self._declared.add(b)

    async def _upgrade(self, spec: QueueSpec, bindings: Sequence[BindingSpec]) -> None:
        """Before ``spec`` is declared: if an older version declared its queue classic (or a
        move was left half-done), move it to ``spec``, messages and all."""
        connection = self._connection
        try:
            async with asyncio.timeout(60):
                old_type = await moves.is_other_type(connection, spec)
                if not (old_type or await moves.has_holding_queue(connection, spec)):
                    return
                own = [b for b in bindings if b.queue == spec.name]
                moved = await moves.move_in_place(connection, spec, own, old_type=old_type)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            raise TransportError(f"could not move queue {spec.name!r}: {exc}") from exc
        log.warning(
            "a queue an older version declared was moved to its new type",
            extra={"queue": spec.name, "type": spec.arguments.queue_type, "moved": moved},
        )

    async def empty_old_queue(self, name: str, bindings: Sequence[BindingSpec], into: str) -> int:
        """A queue renamed since an older version: move what ``name`` holds into ``into``
        (declared) and delete it; how many messages moved (0: there was none)."""
        try:
            async with asyncio.timeout(60):
                return await moves.empty_into(self._connection, name, bindings, into)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            raise TransportError(f"could not empty queue {name!r} into {into!r}: {exc}") from exc

    async def check_exchanges(self, names: Sequence[str]) -> None:
        """Check that each exchange exists with passive declares (which need no permission),
        on a channel of their own: a missing one closes that channel (404), not ours."""
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            channel = await self._connection.channel()
            try:
                for name in names:
                    try:
                        await channel.declare_exchange(name, passive=True)
                    except aio_pika.exceptions.ChannelNotFoundEntity:
                        raise TopologyMissing(
                            f"exchange {name!r} does not exist: the manager declares the "
                            "namespace's shared topology — start it first (or let this "
                            "client declare it: shared_topology='declare')"
                        ) from None
            finally:
                if not channel.is_closed:
                    await channel.close()

    async def try_declare(self, declarations: Declarations) -> bool:
        """Declare on a channel of its own; ``False`` if a queue already exists with other
        arguments (PRECONDITION_FAILED closes only that channel), leaving it as it is.

        For queues whose arguments follow something that changes (a pool's bound follows its
        capacity): the caller decides what to do with the old one. Durable queues declared
        here outlive a reconnect on the broker; the caller declares them again periodically.
        """
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            await self.declare(Declarations(exchanges=declarations.exchanges))
            channel = await self._connection.channel()
            try:
                queues = {
                    q.name: await channel.declare_queue(
                        q.name,
                        durable=q.durable,
                        exclusive=q.exclusive,
                        auto_delete=q.auto_delete,
                        arguments=q.arguments.to_amqp(),
                        robust=False,
                    )
                    for q in declarations.queues
                }
                for b in declarations.bindings:
                    queue = queues.get(b.queue) or await channel.declare_queue(
                        b.queue, passive=True, robust=False
                    )
                    await queue.bind(b.exchange, routing_key=b.routing_key)
            except aiormq.exceptions.ChannelPreconditionFailed:
                return False
            finally:
                if not channel.is_closed:
                    await channel.close()
        return True

    @property
    def blocked(self) -> bool:
        """RabbitMQ sent ``connection.blocked`` (a memory or disk alarm) and no ``unblocked``
        since. aiormq tracks it in an event it does not expose; read it defensively."""
        underlying = getattr(self._connection, "transport", None)
        amqp = getattr(underlying, "connection", None)
        unblocked = getattr(amqp, "_Connection__connection_unblocked", None)
        return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()

    async def _declare_queue(
        self, channel: AbstractRobustChannel, spec: QueueSpec
    ) -> AbstractRobustQueue:
        self._queue_specs[spec.name] = spec
        return await channel.declare_queue(
            spec.name,
            durable=spec.durable,
            exclusive=spec.exclusive,
            auto_delete=spec.auto_delete,
            arguments=spec.arguments.to_amqp(),
        )

    async def _queue_on(self, channel: AbstractRobustChannel, name: str) -> AbstractRobustQueue:
        """The queue, declared on ``channel`` so a reconnect restores it before its consumer."""
        spec = self._queue_specs.get(name)
        if spec is not None:
            return await self._declare_queue(channel, spec)
        return await channel.declare_queue(name, passive=True)

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None:
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            await self._publish_channel.queue_delete(name, if_empty=if_empty)
        self._queues.pop(name, None)
        self._queue_specs.pop(name, None)
        self._declared = {s for s in self._declared if getattr(s, "name", None) != name}

    async def delete_declared(self, made: Declarations) -> None:
        """Delete the queues and exchanges of ``made``: for a tool that ran in a namespace of
        its own (the conformance kit, a benchmark) and leaves nothing behind."""
        for queue in dict.fromkeys(q.name for q in made.queues):
            await self.delete_queue(queue)
        for exchange in dict.fromkeys(e.name for e in made.exchanges):
            await self.delete_exchange(exchange)

    async def delete_exchange(self, name: str) -> None:
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            await self._publish_channel.exchange_delete(name)
        self._declared = {s for s in self._declared if getattr(s, "name", None) != name}

    async def declare_reply_queue(self, name: str) -> str:
        """An exclusive, auto-deleted queue for replies to this connection."""
        spec = reply_queue(name)
        self._queues[name] = await self._declare_queue(self._publish_channel, spec)
        return name

    def sign_as(self, user: str) -> None:
        """Sign every publish from now on with ``user_id`` = ``user`` (the connection's
        user: RabbitMQ refuses any other)."""
        self.signer = user
        self._fast_properties = aiormq.spec.Basic.Properties(
            content_type=c.CONTENT_TYPE, user_id=user
        )
        self._fast_marshalled = self._fast_properties.marshal()

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
        """Publish and wait for the broker's confirm. See the module doc for the outcomes.

        ``user_id``, when set, must be this connection's user: RabbitMQ validates it, which is
        what lets the manager trust it as the authenticated publisher (the tenant)."""
        body = message if isinstance(message, bytes) else encode(message)
        signer = self.signer if user_id is None else user_id
        # Whole seconds (AMQP's resolution): the management API reports the head message's
        # timestamp per (classic) queue, which is how the manager shows the oldest one's age.
        timestamp = int(time.time()) if persistent else None
        kind = None if isinstance(message, bytes) else message.type
        timeout = self.publish_timeout_s if timeout_s is None else timeout_s
        for attempt in (1, 2):
            message_id = self._message_ids.next()  # fresh per attempt (returns match by it)
            properties = message_properties(
                kind,
                message_id,
                reply_to=reply_to,
                correlation_id=correlation_id,
                user_id=signer,
                headers=headers or None,
                persistent=persistent,
                timestamp=timestamp,
            )
            try:
                await self._publish_once(
                    exchange, routing_key, body, properties, message_id, mandatory, timeout
                )
                return
            except PublishNacked:
                # RabbitMQ 3.10 can keep refusing every publish on a channel whose publish
                # met a quorum queue leader's death, while a fresh channel is accepted: the
                # channel is reopened (at most every _REOPEN_EVERY_S) and the publish tried
                # once more there. A queue that is really full refuses that one too.
                if attempt == 2 or not await self._reopen_refusing_channel():
                    raise

    async def _publish_once(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        message_id: str,
        mandatory: bool,
        wait_s: float,
    ) -> None:
        timeout = wait_s
        try:
            # On aiormq's confirming channel, with its bookkeeping (a delivery tag and a
            # confirm future, the message ID mapped to the tag so a return finds it), but the
            # frames written here (mesh.transport.frames) rather than through pamqp's objects.
            # The confirm is the wait: nothing waits for the writer to flush the frames, so
            # concurrent publishes do not go out one loop turn at a time.
            async with asyncio.timeout(timeout):  # the reconnect wait counts, too
                channel = cast(aiormq.Channel, await self._publish_channel.get_underlay_channel())
                (confirm,) = await self._put_confirmed(
                    channel, exchange, [(routing_key, body, properties, message_id)], mandatory
                )
                await confirm
        # Where it went is named (_where) on an error only: not built on every publish.
        except aiormq.exceptions.PublishError as exc:
            raise PublishUnroutable(
                f"no queue bound for {_where(exchange, routing_key)} ({exc})"
            ) from None
        except aiormq.exceptions.DeliveryError as exc:
            raise PublishNacked(
                f"broker refused publish to {_where(exchange, routing_key)} ({exc})"
            ) from None
        except TimeoutError:
            raise PublishTimeout(
                f"no confirm within {timeout:g} s for {_where(exchange, routing_key)}; the"
                " message may still be enqueued"
            ) from None
        except (aiormq.exceptions.AMQPError, RuntimeError) as exc:
            raise TransportError(
                f"publish to {_where(exchange, routing_key)} failed: {exc}"
            ) from exc
        except asyncio.CancelledError:
            # aiormq fails a closing connection's pending futures with CancelledError (its
            # default close reason; a missed-heartbeats close too): the connection died, this
            # task was not cancelled. A real cancellation of the caller still propagates.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise TransportError(
                f"publish to {exchange}/{routing_key} failed: the connection closed"
            ) from None

    async def _reopen_refusing_channel(self) -> bool:
        """Reopen the publishing channel after a refusal, unless it was reopened less than
        ``_REOPEN_EVERY_S`` ago (a queue really full refuses again and again: one more try
        each so often, not each time); whether it was reopened now. Publishes in flight on
        the old channel fail ``TransportError`` (outcome unknown: they are retried)."""
        now = time.monotonic()
        if now - self._reopened_at < _REOPEN_EVERY_S:
            return False
        self._reopened_at = now
        self.reopened_channels += 1
        log.warning("publishes refused: reopening the publishing channel")
        try:
            async with asyncio.timeout(_CONTROL_TIMEOUT_S):
                await self._publish_channel.close()
                await self._publish_channel.reopen()
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            log.warning("publishing channel not reopened", extra={"error": str(exc)})
            return False
        return True

    async def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, Message]],
        *,
        timeout_s: float | None = None,
    ) -> list[TransportError | None]:
        """:meth:`publish` (mandatory, not persistent) of several ``(routing key, message)``
        pairs in one write to the confirming channel, waiting for all their confirms
        together: each outcome is ``None`` (confirmed) or the error :meth:`publish` would
        have raised for it (:class:`PublishUnroutable`, :class:`PublishNacked`,
        :class:`PublishTimeout`, :class:`TransportError`). A batch of registrations answers
        its agents with this.

        aiormq publishes one message per call; this does what ``Channel.basic_publish``
        does for each (a delivery tag and a confirm future per message, its message ID mapped
        to the tag so a return finds it) under the channel's lock once, and hands all the
        frames to the connection's writer as one write."""
        if not messages:
            return []
        timeout = self.publish_timeout_s if timeout_s is None else timeout_s
        outcomes: list[TransportError | None] = [None] * len(messages)
        try:
            async with asyncio.timeout(timeout):
                channel = cast(aiormq.Channel, await self._publish_channel.get_underlay_channel())
                confirms = await self._put_confirmed(
                    channel, exchange, [self._framed(key, message) for key, message in messages]
                )
                answers = await asyncio.gather(*confirms, return_exceptions=True)
        except TimeoutError:
            return [
                PublishTimeout(
                    f"no confirm within {timeout:g} s for {exchange or '<default>'}/{key}; "
                    "the message may still be enqueued"
                )
                for key, _ in messages
            ]
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError, ValueError) as exc:
            failed = TransportError(f"publish of {len(messages)} to {exchange} failed: {exc}")
            return [failed] * len(messages)
        for index, ((key, _), answer) in enumerate(zip(messages, answers, strict=True)):
            where = _where(exchange, key)
            if isinstance(answer, aiormq.exceptions.PublishError):
                outcomes[index] = PublishUnroutable(f"no queue bound for {where} ({answer})")
            elif isinstance(answer, aiormq.exceptions.DeliveryError):
                outcomes[index] = PublishNacked(f"broker refused publish to {where} ({answer})")
            elif isinstance(answer, BaseException):
                outcomes[index] = TransportError(f"publish to {where} failed: {answer!r}")
        return outcomes

    def _framed(self, routing_key: str, message: Message) -> _Framed:
        """A message of :meth:`publish_many` as :meth:`_put_confirmed` takes it."""
        message_id = self._message_ids.next()
        properties = message_properties(message.type, message_id, user_id=self.signer)
        return routing_key, encode(message), properties, message_id

    async def _put_confirmed(
        self,
        channel: aiormq.Channel,
        exchange: str,
        messages: Sequence[_Framed],
        mandatory: bool = True,
    ) -> list[asyncio.Future[Any]]:
        """Under the channel's lock: a delivery tag and a confirm future per message, then
        every message's frames in one write (``Channel.basic_publish``'s bookkeeping).
        ``RuntimeError`` if the channel is closed: frames on it would close the connection."""
        if channel.is_closed:
            raise RuntimeError("the channel is closed")
        frames: list[bytes] = []
        confirms: list[asyncio.Future[Any]] = []
        async with channel.lock:
            first = channel.delivery_tag + 1
            try:
                await self._write_confirmed(
                    channel, exchange, messages, mandatory, frames, confirms
                )
            except BaseException:
                # The broker has seen none of them: give their tags back, as aiormq does (the
                # broker numbers what it receives; a tag skipped here would shift every later
                # confirm onto the wrong publish).
                for tag in range(first, channel.delivery_tag + 1):
                    channel.confirmations.pop(tag, None)
                channel.delivery_tag = first - 1
                for confirm in confirms:
                    confirm.cancel()
                raise
        return confirms

    async def _write_confirmed(
        self,
        channel: aiormq.Channel,
        exchange: str,
        messages: Sequence[_Framed],
        mandatory: bool,
        frames: list[bytes],
        confirms: list[asyncio.Future[Any]],
    ) -> None:
        for routing_key, body, properties, message_id in messages:
            channel.delivery_tag += 1
            tag = channel.delivery_tag
            confirm = channel.create_future()
            channel.confirmations[tag] = confirm
            channel.message_id_delivery_tag[message_id] = tag
            confirm.add_done_callback(partial(_forget_message_id, channel, message_id, tag))
            confirms.append(confirm)
            frames.append(
                publish_frames(
                    channel.number,
                    exchange,
                    routing_key,
                    body,
                    properties,
                    mandatory=mandatory,
                    max_body=channel.max_content_size,
                )
            )
        await channel.write_queue.put(ChannelFrame(b"".join(frames), should_close=False))

    async def _fast_underlay(self) -> aiormq.Channel:
        """The confirm-less channel's current underlying aiormq channel (opened on first use).
        Straight to aiormq: without confirms, aio-pika's Exchange and Message objects only add
        per-message work."""
        if self._fast_channel is None:
            self._fast_channel = await self._connection.channel(publisher_confirms=False)
        return cast(aiormq.Channel, await self._fast_channel.get_underlay_channel())

    async def publish_fast(
        self, exchange: str, routing_key: str, body: bytes, *, user_id: str | None = None
    ) -> None:
        """Fire-and-forget on a channel without confirms: for superseded messages (heartbeats).
        ``user_id`` as for :meth:`publish` (RabbitMQ validates it: the manager may trust it)."""
        try:
            channel = await self._fast_underlay()
            properties = (
                self._fast_properties
                if user_id is None
                else aiormq.spec.Basic.Properties(content_type=c.CONTENT_TYPE, user_id=user_id)
            )
            # ``wait=False``: handed to the connection's writer, not waited for until it is
            # flushed (aiormq would hold the channel's lock meanwhile, so a burst of these went
            # out one loop turn each); there is no confirm to wait for anyway.
            await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                wait=False,
            )
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError) as exc:
            raise TransportError(
                f"publish to {_where(exchange, routing_key)} failed: {exc}"
            ) from exc

    async def publish_fast_many(self, exchange: str, messages: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`publish_fast` of several ``(routing key, body)`` messages, in order, as one
        write to the connection: their frames are encoded together and handed to aiormq's
        writer once (one lock, one queue hand-off, one socket send) instead of once each — a
        batch of registrations publishes hundreds of feed events at a time.

        aiormq has no batch publish, so this builds what ``Channel.basic_publish`` builds for
        each message (a ``basic.publish`` method frame, a content header, the body in frames
        of at most the negotiated size) on a channel without confirms, where no delivery tag
        or confirm is tracked."""
        if not messages:
            return
        try:
            channel = await self._fast_underlay()
            if channel.is_closed:  # frames on a closed channel would close the connection
                raise RuntimeError("the channel is closed")
            number, size = channel.number, channel.max_content_size
            payload = ChannelFrame(
                b"".join(
                    publish_frames(
                        number,
                        exchange,
                        key,
                        body,
                        self._fast_marshalled,
                        mandatory=False,
                        max_body=size,
                    )
                    for key, body in messages
                ),
                should_close=False,
            )
            async with channel.lock:  # after any publish already under way on the channel
                await channel.write_queue.put(payload)
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError, ValueError) as exc:
            raise TransportError(
                f"publish of {len(messages)} messages to {exchange} failed: {exc}"
            ) from exc

    # ---- consuming ------------------------------------------------------------------------
    async def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, no_ack: bool = False
    ) -> Consumer:
        """Consume ``queue`` on its own channel. With ``no_ack`` nothing needs acking.
        ``TopologyMissing`` if the queue does not exist; ``TransportError`` if it is another
        connection's exclusive queue.

        Each delivery goes from aiormq straight into a :class:`Delivery` (no aio-pika
        ``IncomingMessage``, one task per message instead of two); the consumer subscribes
        again whenever its channel reopens (after a reconnect: before the ``on_reconnect``
        callbacks run)."""
        channel = await self._connection.channel()
        try:
            await self._queue_on(channel, queue)  # it exists (and aio-pika restores it)
            consumer = Consumer(
                channel,
                queue,
                handler,
                prefetch=prefetch,
                no_ack=no_ack,
                restoring=lambda: self._restoring,
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
        """The cheapest path, for superseded messages (heartbeats): no acks, and only the body
        (and the validated ``user_id``) handed to a synchronous callback, or in batches (what
        arrived in one read) to its ``ingest_many`` if it is a :class:`RawBatchCallback`.
        On a consume-only connection of its own (:mod:`mesh.transport.lean`), opened on
        first use; it reconnects and consumes again by itself, and is dropped and restored
        with this transport's connection (before the ``on_reconnect`` callbacks run)."""
        return await self._consume_only().consume(queue, callback)

    async def consume_acked(
        self, queue: str, on_deliveries: DeliveriesCallback, *, prefetch: int
    ) -> LeanConsumer:
        """Consume ``queue`` with acks, at most ``prefetch`` deliveries unsettled, on the
        consume-only connection (:mod:`mesh.transport.lean`): the deliveries of each read
        from the socket go to ``on_deliveries`` (synchronous: it hands them on), each
        settled later with ``ack``/``reject``. For a busy queue whose messages are handled in
        batches (announcements while a fleet registers): without aiormq's task, lock and
        frame objects per message, and with every ack of one loop turn in one write.
        Cancelling stops deliveries at once; its channel closes once all are settled."""
        return await self._consume_only().consume_acked(queue, on_deliveries, prefetch=prefetch)

    def _consume_only(self) -> LeanConnection:
        if self._lean is None:
            # From the node this connection reached, then in this process's order.
            where = self._addresses.starting_at(self._address)
            self._lean = LeanConnection(where, name=f"{self.name}:consume")
        return self._lean

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

    async def consume_replies(self, name: str, on_deliveries: DeliveriesCallback) -> LeanConsumer:
        """A client's reply queue ``name`` (:func:`~mesh.topology.specs.reply_queue`:
        exclusive, auto-deleted), declared on the consume-only connection — an exclusive
        queue is consumed only by the connection that declared it — and consumed there
        without acks: each read's replies to ``on_deliveries`` as :class:`Delivery` objects
        (nothing to settle). Declared and consumed again after a reconnect, before the
        ``on_reconnect`` callbacks run. Requests still go out on this transport's connection,
        with ``reply_to=name``."""
        spec = reply_queue(name)
        declare = pamqp.commands.Queue.Declare(
            queue=spec.name,
            durable=spec.durable,
            exclusive=spec.exclusive,
            auto_delete=spec.auto_delete,
            arguments=spec.arguments.to_amqp(),
        )
        return await self._consume_only().consume_replies(declare, on_deliveries)

    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None:
        """Fetch one message with basic.get (for tools and tests); ``None`` if empty."""
        async with asyncio.timeout(timeout_s + _CONTROL_TIMEOUT_S):
            channel = await self._connection.channel()
            try:
                underlay = await channel.get_underlay_channel()
                msg = await underlay.basic_get(queue, no_ack=True, timeout=timeout_s)
                if isinstance(msg.delivery, aiormq.spec.Basic.GetEmpty):
                    return None
                return _raw_delivery(msg, NO_SETTLE)
            finally:
                await channel.close()

    async def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (passive declare)."""
        return (await self._queue_counts(queue))[0]

    async def queue_consumers(self, queue: str) -> int:
        """Consumers of ``queue`` now (passive declare)."""
        return (await self._queue_counts(queue))[1]

    async def _queue_counts(self, queue: str) -> tuple[int, int]:
        """``(ready, consumers)`` of ``queue``; :class:`TopologyMissing` if it does not
        exist (not declared yet, or deleted)."""
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            counts = await moves.queue_counts(self._connection, queue)
        if counts is None:
            raise TopologyMissing(f"no queue {queue!r} (not declared yet, or deleted)")
        return counts


def _arguments_text(spec: QueueSpec) -> str:
    """``durable, x-max-length=5, …``: what a declaration asked for, for error messages."""
    args = spec.arguments.to_amqp()
    flags = [f for f, on in (("durable", spec.durable), ("auto-delete", spec.auto_delete)) if on]
    return ", ".join([*flags, *(f"{k}={v}" for k, v in sorted(args.items()))])
