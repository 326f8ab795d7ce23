"""The consume-only connection: it keeps one AMQP 0-9-1 connection up and its consumers
consuming.

It connects (TCP or TLS, PLAIN login, the vhost of the URL; several URLs: a cluster's nodes,
tried in turn), negotiates the AMQP heartbeat (the URL's ``heartbeat``, else 60 s, as
aiormq), opens one channel per consumer and consumes on it; it sends heartbeats, notices
a silent broker, and reconnects and consumes again after any loss. It never publishes.

Three ways to consume:

* **No ack** (:meth:`LeanConnection.consume`, heartbeats): of the header only the body size
  and the ``user_id`` property (which RabbitMQ validates) are read, and the callback gets
  ``(body, user_id)`` pairs.
* **Acked** (:meth:`LeanConnection.consume_acked`, the manager's announcements and requests):
  with a prefetch, each delivery handed over as a :class:`Delivery` whose ``ack``/``reject``
  queue a frame; every settlement asked for in one turn of the event loop goes out in one
  write. A settlement on a connection or channel gone since is dropped (the broker requeued
  the message). Cancelling stops deliveries at once and closes the channel once everything it
  delivered is settled.
* **Replies** (:meth:`LeanConnection.consume_replies`, a client's answers): the exclusive
  reply queue is declared on this connection (an exclusive queue can be consumed only by the
  connection that declared it; declared again after every reconnect) and consumed without
  acks, each delivery handed over as a :class:`Delivery` whose ``ack``/``reject`` do nothing.

TLS takes aiormq's URL options: ``cafile``, ``capath``, ``keyfile``, ``certfile``,
``no_verify_ssl=1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from urllib.parse import parse_qs, unquote, urlsplit

import pamqp.commands as spec

from mesh.errors import TransportError
from mesh.transport.addresses import BrokerAddresses
from mesh.transport.amqp091.callbacks import DeliveriesCallback, RawCallback
from mesh.transport.amqp091.protocol import (
    CLOSE_CHANNEL,
    CONTROL_TIMEOUT_S,
    Consuming,
    Wire,
)

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 1.0  # for the broker's close-ok


class LeanConsumer:
    """A queue consumed on a :class:`LeanConnection` until :meth:`cancel`: without acks
    (``callback``), acked (``on_deliveries``, with a ``prefetch``), or without acks as
    deliveries (``on_deliveries``, no prefetch: replies). With ``declare`` the queue is
    declared on the consumer's channel first, on every (re)connection."""

    def __init__(
        self,
        connection: LeanConnection,
        queue: str,
        callback: RawCallback | None,
        on_deliveries: DeliveriesCallback | None = None,
        prefetch: int = 0,
        declare: spec.Queue.Declare | None = None,
    ) -> None:
        self.queue_name = queue
        self.callback = callback
        self.on_deliveries = on_deliveries
        self.prefetch = prefetch
        self.acked = on_deliveries is not None and prefetch > 0
        self.declare = declare
        self.cancelled = False
        self._connection = connection

    async def cancel(self) -> None:
        """Stop deliveries (bounded: with the broker away there is nothing to close)."""
        self.cancelled = True
        await self._connection.forget(self)


_CONNECTION_LOST = (OSError, TimeoutError, ConnectionError)


class LeanConnection:
    """A consume-only connection (see the module doc) that keeps itself connected: after a
    loss it reconnects every ``reconnect_interval_s`` (the URL's ``reconnect_interval``, as
    aio-pika) and consumes every queue again."""

    def __init__(self, url: str, *, name: str, reconnect_interval_s: float = 5.0) -> None:
        # Several comma-separated URLs (a cluster's nodes, mesh.transport.addresses): the same
        # login and vhost, each its own host; a connection that fails moves on to the next.
        addresses = BrokerAddresses.parse(url, shuffle=False)  # the caller's order
        parts = urlsplit(addresses.first)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self._tls = parts.scheme == "amqps"
        default_port = 5671 if self._tls else 5672
        self._hosts = [
            (where.hostname or "localhost", where.port or default_port)
            for where in map(urlsplit, addresses.urls)
        ]
        self._host_index = 0
        self._login = (unquote(parts.username or "guest"), unquote(parts.password or "guest"))
        self._vhost = unquote(parts.path[1:]) or "/"
        self._heartbeat = int(query.get("heartbeat", "60"))
        self._query = query
        self._name = name
        self.reconnect_interval_s = float(query.get("reconnect_interval", reconnect_interval_s))
        # every consumer -> its channel on the current connection (None: not consuming now)
        self._consumers: dict[LeanConsumer, int | None] = {}
        self._wire: Wire | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._retries: set[asyncio.Task[None]] = set()
        self._closing = False
        self._lock = asyncio.Lock()  # one channel opened or closed at a time
        self._up = asyncio.Event()  # connected, every queue consumed that can be
        self._wake = asyncio.Event()  # try to reconnect now, not at the next interval

    async def consume(self, queue: str, callback: RawCallback) -> LeanConsumer:
        """Consume ``queue`` (no ack). The first call connects (``TransportError`` if the
        broker cannot be reached); later ones, while the connection is being restored, are
        consumed once it is. ``TopologyMissing`` if the queue does not exist."""
        return await self._consume(LeanConsumer(self, queue, callback))

    async def consume_acked(
        self, queue: str, on_deliveries: DeliveriesCallback, *, prefetch: int
    ) -> LeanConsumer:
        """Consume ``queue`` with acks and at most ``prefetch`` deliveries unsettled: each
        read's deliveries go to ``on_deliveries`` (see the module doc); otherwise as
        :meth:`consume`."""
        if prefetch < 1:
            raise ValueError(f"an acked consumer needs a prefetch of at least 1, not {prefetch}")
        return await self._consume(LeanConsumer(self, queue, None, on_deliveries, prefetch))

    async def consume_replies(
        self, declare: spec.Queue.Declare, on_deliveries: DeliveriesCallback
    ) -> LeanConsumer:
        """Declare ``declare``'s queue (exclusive: it is this connection's) and consume it
        without acks, each read's deliveries to ``on_deliveries``; declared and consumed
        again after a reconnect. Otherwise as :meth:`consume`."""
        return await self._consume(
            LeanConsumer(self, declare.queue, None, on_deliveries, declare=declare)
        )

    async def _consume(self, consumer: LeanConsumer) -> LeanConsumer:
        queue = consumer.queue_name
        async with self._lock:
            if self._keeper is None:
                try:
                    self._wire = await self._open()
                except (*_CONNECTION_LOST, ConnectionRefusedError) as exc:
                    raise TransportError(f"could not connect to consume {queue}: {exc}") from exc
                self._keeper = asyncio.create_task(self._keep(), name="lean-connection")
                self._up.set()
            self._consumers[consumer] = None
            wire = self._wire
            if wire is not None:
                try:
                    await self._subscribe(wire, consumer)
                except TransportError:
                    del self._consumers[consumer]
                    raise
                except _CONNECTION_LOST:
                    pass  # consumed again with everything else once reconnected
        return consumer

    async def forget(self, consumer: LeanConsumer) -> None:
        channel = self._consumers.pop(consumer, None)
        wire = self._wire
        if channel is None or wire is None:
            return
        consuming = wire.consumers.get(channel)
        if consuming is not None and consuming.acked:
            # Acked: no more deliveries from now on; the channel stays open until what it
            # delivered is settled (closing it would requeue those: handled twice).
            consuming.cancelled = True
            consuming.deliveries = []
            async with self._lock:
                with contextlib.suppress(TransportError, *_CONNECTION_LOST):
                    cancel = spec.Basic.Cancel(consuming.consumer_tag)
                    await wire.call(channel, cancel, spec.Basic.CancelOk)
            if consuming.unsettled <= 0:
                self._drained(consuming)
            return
        wire.consumers.pop(channel, None)  # nothing more is handed to it
        await self._close_channel(wire, channel)

    def _drained(self, consuming: Consuming) -> None:
        """A cancelled acked consumer has settled all it was given: close its channel."""
        wire = self._wire
        if wire is None or wire.consumers.get(consuming.channel) is not consuming:
            return
        del wire.consumers[consuming.channel]
        task = asyncio.create_task(self._close_channel(wire, consuming.channel))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _close_channel(self, wire: Wire, channel: int) -> None:
        async with self._lock:
            with contextlib.suppress(TransportError, *_CONNECTION_LOST):
                await wire.call(channel, CLOSE_CHANNEL, spec.Channel.CloseOk)

    def reset(self) -> None:
        """Drop the current connection (the keeper reconnects): when the connection beside
        it found the broker gone, this one is not trusted to have noticed."""
        if self._wire is not None:
            self._wire.abort()

    async def restored(self, timeout_s: float) -> bool:
        """Reconnect now if disconnected, wait (at most ``timeout_s``) until connected, and
        consume at once every queue that could not be consumed yet (after a broker restart
        this connection may be back before the other one declared the queues again):
        whether it is connected."""
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._up.wait()
        if not self._up.is_set():
            return False
        async with self._lock:
            wire = self._wire
            for consumer in [c for c, channel in self._consumers.items() if channel is None]:
                if wire is not None:
                    await self._try_subscribe(wire, consumer)
        return True

    async def _try_subscribe(self, wire: Wire, consumer: LeanConsumer) -> None:
        """Subscribe (under the lock); a queue that cannot be consumed now is tried again
        every reconnect interval."""
        try:
            await self._subscribe(wire, consumer)
        except (TransportError, *_CONNECTION_LOST) as exc:
            log.warning(
                "a queue cannot be consumed yet; trying again",
                extra={"queue": consumer.queue_name, "error": str(exc)},
            )
            self._retry_soon(consumer)

    async def close(self) -> None:
        """Close the connection as AMQP says: ``connection.close``, and the socket once the
        broker's ``close-ok`` came (it waits for us to close it); dropped after
        ``_CLOSE_WAIT_S`` without one (logged)."""
        self._closing = True
        for task in [self._keeper, *self._retries]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.send(0, spec.Connection.Close(200, "closing", 0, 0))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await asyncio.shield(wire.lost)
            if not wire.lost.done():
                log.warning(
                    "the broker did not confirm the close in time; dropping the connection",
                    extra={"connection": self._name, "waited_s": _CLOSE_WAIT_S},
                )
            wire.abort()

    # ---- the connection's life --------------------------------------------------------------
    async def _open(self) -> Wire:
        """Connect to the broker address in turn, or the ones after it (several: a cluster's
        nodes); the last failure propagates when none answers."""
        for attempt in range(len(self._hosts)):
            try:
                return await self._open_at(*self._hosts[self._host_index])
            except (*_CONNECTION_LOST, ConnectionRefusedError):
                if attempt == len(self._hosts) - 1:
                    raise
                self._host_index = (self._host_index + 1) % len(self._hosts)
        raise AssertionError("unreachable: at least one address")  # pragma: no cover

    async def _open_at(self, host: str, port: int) -> Wire:
        loop = asyncio.get_running_loop()
        context = await loop.run_in_executor(None, self._ssl_context) if self._tls else None
        login, vhost, heartbeat, name = self._login, self._vhost, self._heartbeat, self._name
        async with asyncio.timeout(CONTROL_TIMEOUT_S):
            _, wire = await loop.create_connection(
                lambda: Wire(login, vhost, heartbeat, name, self._lost_consumer),
                host,
                port,
                ssl=context,
            )
            wire.on_drained = self._drained
            try:
                await wire.opened
            except BaseException:
                wire.abort()
                raise
        return wire

    async def _subscribe(self, wire: Wire, consumer: LeanConsumer) -> None:
        """Open a channel and consume ``consumer``'s queue on it (under the lock)."""
        channel = wire.free_channel()
        wire.in_use.add(channel)
        await wire.call(channel, spec.Channel.Open(), spec.Channel.OpenOk)
        acked = consumer.acked
        wire.consumers[channel] = Consuming(
            channel, consumer.callback, consumer.on_deliveries, acked
        )
        try:
            if consumer.declare is not None:
                await wire.call(channel, consumer.declare, spec.Queue.DeclareOk)
            if acked:
                await wire.call(
                    channel, spec.Basic.Qos(prefetch_count=consumer.prefetch), spec.Basic.QosOk
                )
            consume = spec.Basic.Consume(queue=consumer.queue_name, no_ack=not acked)
            ok = await wire.call(channel, consume, spec.Basic.ConsumeOk)
            assert isinstance(ok, spec.Basic.ConsumeOk)
            wire.consumers[channel].consumer_tag = ok.consumer_tag or ""
        except BaseException:
            wire.consumers.pop(channel, None)
            raise
        self._consumers[consumer] = channel

    def _lost_consumer(self, channel: int) -> None:
        """A consumer's channel ended (its queue deleted, a channel error): tried again
        every reconnect interval while the connection lasts (and with it after a reconnect)."""
        for consumer, on in self._consumers.items():
            if on == channel:
                self._consumers[consumer] = None
                self._retry_soon(consumer)

    def _retry_soon(self, consumer: LeanConsumer) -> None:
        task = asyncio.create_task(self._retry(consumer))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _retry(self, consumer: LeanConsumer) -> None:
        while not self._closing and consumer in self._consumers:
            await asyncio.sleep(self.reconnect_interval_s)
            async with self._lock:
                wire = self._wire
                if wire is None or consumer not in self._consumers or self._consumers[consumer]:
                    return  # gone, or the reconnect consumes it
                try:
                    await self._subscribe(wire, consumer)
                    return
                except (TransportError, *_CONNECTION_LOST) as exc:
                    log.warning(
                        "a queue cannot be consumed yet",
                        extra={"queue": consumer.queue_name, "error": str(exc)},
                    )

    async def _keep(self) -> None:
        """Send AMQP heartbeats, notice a silent broker, and reconnect after any loss."""
        while not self._closing:
            wire = self._wire
            assert wire is not None
            await self._watch(wire)
            self._up.clear()
            self._wire = None
            self._host_index = (self._host_index + 1) % len(self._hosts)  # it may be gone
            for consumer in self._consumers:
                self._consumers[consumer] = None
            self._wake.clear()
            while not self._closing:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.reconnect_interval_s):
                        await self._wake.wait()
                self._wake.clear()
                if await self._reconnect():
                    break

    async def _reconnect(self) -> bool:
        try:
            wire = await self._open()
        except (*_CONNECTION_LOST, ConnectionRefusedError) as exc:
            log.info("consume-only connection: not yet", extra={"error": str(exc)})
            return False
        async with self._lock:
            for consumer in list(self._consumers):
                try:
                    await self._subscribe(wire, consumer)
                except TransportError as exc:  # this queue only (not declared again yet?)
                    log.warning(
                        "a queue cannot be consumed yet; trying again",
                        extra={"queue": consumer.queue_name, "error": str(exc)},
                    )
                    self._retry_soon(consumer)
                except _CONNECTION_LOST:
                    wire.abort()
                    return False
            self._wire = wire
        self._up.set()
        log.warning("consume-only connection restored", extra={"connection": self._name})
        return True

    async def _watch(self, wire: Wire) -> None:
        """Until ``wire`` is lost: a heartbeat every half interval; nothing received for three
        intervals (aiormq's rule, ``(heartbeat + 1) * 3``) and the connection is dropped."""
        if self._heartbeat <= 0:
            await asyncio.shield(wire.lost)
            return
        every = max(1.0, self._heartbeat / 2)
        grace = (self._heartbeat + 1) * 3
        while not wire.lost.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await asyncio.shield(wire.lost)
            if wire.lost.done():
                return
            wire.beat()
            if time.monotonic() - wire.received_at > grace:
                log.warning(
                    "the broker went silent; reconnecting", extra={"connection": self._name}
                )
                wire.abort()

    def _ssl_context(self) -> ssl.SSLContext:
        q = self._query
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=q.get("cafile"), capath=q.get("capath")
        )
        if q.get("certfile"):
            context.load_cert_chain(q["certfile"], q.get("keyfile"))
        if q.get("no_verify_ssl", "0") != "0":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context
