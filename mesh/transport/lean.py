"""A consume-only AMQP 0-9-1 connection: heartbeats without acks, announcements acked.

Why. aiormq handles every frame as an object: three ``readexactly`` calls and an
``asyncio.Lock`` per frame, a pamqp object for each of the three frames of a message, two
queue hand-offs and a task per delivery. For the manager's heartbeats — thousands a second,
no ack, no reply — that is ~60 µs of CPU per message before the manager looks at it, most of
a manager's time at 50,000 agents. This connection parses the byte stream in place, in
``data_received``: a delivery costs a few slices and a ``struct`` unpack (~5 µs), and every
message that arrived in one read goes to the callback as one batch.

What it does, and no more: connect (TCP or TLS, PLAIN login, the vhost of the URL), negotiate
the AMQP heartbeat (the URL's ``heartbeat``, else 60 s, as aiormq), open one channel per
consumer and ``basic.consume``; reconnect and consume again after any loss. It never
publishes. Control frames (the handshake, channel open and close, qos, consume and cancel,
the broker's close) are marshalled and parsed by pamqp, as aiormq does; only the frames of a
delivery (``basic.deliver``, the content header, the body) are read by hand.

Two ways to consume:

* **No ack** (:meth:`LeanConnection.consume`, heartbeats): of the header only the body size
  and the ``user_id`` property (which RabbitMQ validates) are read, and the callback gets
  ``(body, user_id)`` pairs.
* **Acked** (:meth:`LeanConnection.consume_acked`, announcements: thousands a second while a
  fleet registers): with a prefetch, each delivery handed over as a :class:`Delivery` whose
  ``ack``/``reject`` queue a frame; every settlement asked for in one turn of the event loop
  goes out in one write. A settlement on a connection or channel gone since is dropped (the
  broker requeued the message). Cancelling stops deliveries at once and closes the channel
  once everything it delivered is settled.
* **Replies** (:meth:`LeanConnection.consume_replies`, a client's answers): the exclusive
  reply queue is declared on this connection (an exclusive queue can be consumed only by the
  connection that declared it; declared again after every reconnect) and consumed without
  acks, each delivery handed over as a :class:`Delivery` whose ``ack``/``reject`` do nothing.

``tests/unit/test_lean.py`` checks the reading of deliveries and properties against pamqp's
marshalling.

TLS takes aiormq's URL options: ``cafile``, ``capath``, ``keyfile``, ``certfile``,
``no_verify_ssl=1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs, unquote, urlsplit

import pamqp.commands as spec
import pamqp.decode
import pamqp.frame
from pamqp.base import Frame
from pamqp.common import FieldTable

from mesh.errors import TopologyMissing, TransportError
from mesh.transport.addresses import BrokerAddresses
from mesh.transport.delivery import NO_SETTLE, Delivery, NoSettle

log = logging.getLogger(__name__)

RawCallback = Callable[[bytes, str | None], None]
"""A raw consumer's callback: the body, and the ``user_id`` RabbitMQ validated (if any)."""

RawBatch = list[tuple[bytes, str | None]]
"""Raw deliveries in arrival order: (body, validated ``user_id``) pairs."""


DeliveriesCallback = Callable[[list[Delivery]], None]
"""An acked consumer's callback: the deliveries that arrived in one read, in order. It must
not block: it hands them on (a queue, a task) and each is settled later."""


@runtime_checkable
class RawBatchCallback(Protocol):
    """A raw callback that can also take a batch: :meth:`ingest_many` gets, in one call and
    in order, every delivery that arrived in one read from the socket."""

    def __call__(self, body: bytes, user_id: str | None, /) -> None: ...

    def ingest_many(self, bodies: RawBatch, /) -> None: ...


_PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_BODY_SIZE = struct.Struct(">Q")
_METHOD, _HEADER, _BODY, _HEARTBEAT = 1, 2, 3, 8
_FRAME_END = 0xCE
_DELIVER = b"\x00\x3c\x00\x3c"  # basic (60) . deliver (60)
_HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
_USER_ID = 0x0010
_SHORT = struct.Struct(">B")
_TAG = struct.Struct(">QB")  # delivery tag, redelivered
_ACK = struct.Struct(">BHIHHQBB")  # a whole basic.ack frame: header, method, tag, bits, end
_CONTROL_TIMEOUT_S = 10.0
_CLOSE_WAIT_S = 1.0  # for the broker's close-ok
_NOT_FOUND = 404
_CLOSE_CHANNEL = spec.Channel.Close(reply_code=200, reply_text="done", class_id=0, method_id=0)


def user_id_of(header: bytes | bytearray | memoryview, offset: int = 12) -> str | None:
    """The ``user_id`` property of a content header payload (``offset``: where its property
    flags start, after class, weight and body size), or ``None``: every property before it
    is skipped by its wire size (AMQP 0-9-1, ``basic`` class properties in order)."""
    flags = int.from_bytes(header[offset : offset + 2], "big")
    if not flags & _USER_ID:
        return None
    at = offset + 2
    for bit in (0x8000, 0x4000):  # content-type, content-encoding: shortstr
        if flags & bit:
            at += 1 + header[at]
    if flags & 0x2000:  # headers: a table, its size first
        at += 4 + int.from_bytes(header[at : at + 4], "big")
    at += bool(flags & 0x1000) + bool(flags & 0x0800)  # delivery-mode, priority: octets
    for bit in (0x0400, 0x0200, 0x0100, 0x0080):  # correlation-id … message-id: shortstr
        if flags & bit:
            at += 1 + header[at]
    if flags & 0x0040:  # timestamp
        at += 8
    if flags & 0x0020:  # type
        at += 1 + header[at]
    size = header[at]
    return bytes(header[at + 1 : at + 1 + size]).decode()


class Properties:
    """The properties of a delivery the manager reads (``headers``, ``correlation_id``,
    ``reply_to``, ``message_id``, ``user_id``), from a content header payload."""

    __slots__ = ("correlation_id", "headers", "message_id", "reply_to", "user_id")

    def __init__(self, header: bytes | bytearray | memoryview, offset: int = 12) -> None:
        flags = int.from_bytes(header[offset : offset + 2], "big")
        at = offset + 2
        self.headers: dict[str, Any] = {}
        self.correlation_id = self.reply_to = self.message_id = self.user_id = None
        for bit in (0x8000, 0x4000):  # content-type, content-encoding: shortstr
            if flags & bit:
                at += 1 + header[at]
        if flags & 0x2000:  # headers: a table, its size first
            size = 4 + int.from_bytes(header[at : at + 4], "big")
            _, self.headers = pamqp.decode.field_table(bytes(header[at : at + size]))
            at += size
        at += bool(flags & 0x1000) + bool(flags & 0x0800)  # delivery-mode, priority: octets
        self.correlation_id, at = _shortstr_if(header, at, flags & 0x0400)
        self.reply_to, at = _shortstr_if(header, at, flags & 0x0200)
        if flags & 0x0100:  # expiration
            at += 1 + header[at]
        self.message_id, at = _shortstr_if(header, at, flags & 0x0080)
        if flags & 0x0040:  # timestamp
            at += 8
        if flags & 0x0020:  # type
            at += 1 + header[at]
        self.user_id, at = _shortstr_if(header, at, flags & _USER_ID)


def _shortstr_if(data: bytes | bytearray | memoryview, at: int, present: int) -> tuple[Any, int]:
    if not present:
        return None, at
    size = data[at]
    return bytes(data[at + 1 : at + 1 + size]).decode(), at + 1 + size


def deliver_fields(
    method: bytes | bytearray | memoryview, offset: int = 4
) -> tuple[int, bool, str, str]:
    """``basic.deliver``'s delivery tag, redelivered flag, exchange and routing key, from its
    method payload (``offset``: after class and method IDs)."""
    at = offset + 1 + method[offset]  # the consumer tag
    tag, redelivered = _TAG.unpack_from(method, at)
    at += 9
    exchange, at = _shortstr_if(method, at, 1)
    routing_key, _ = _shortstr_if(method, at, 1)
    return tag, bool(redelivered & 1), exchange, routing_key


class _Consuming:
    """One consumer's channel and what is being assembled on it."""

    __slots__ = (
        "acked",
        "batch",
        "body",
        "callback",
        "cancelled",
        "channel",
        "consumer_tag",
        "deliver",
        "deliveries",
        "have",
        "header",
        "ingest_many",
        "on_deliveries",
        "size",
        "unsettled",
        "user_id",
    )

    def __init__(
        self,
        channel: int,
        callback: RawCallback | None,
        on_deliveries: DeliveriesCallback | None = None,
        acked: bool = True,
    ) -> None:
        self.channel = channel
        self.callback = callback
        # A batch-taking raw callback's ``ingest_many``, looked up once: an isinstance check
        # against a runtime-checkable Protocol inspects the class's members, too slow per read.
        self.ingest_many: Callable[[RawBatch], None] | None = (
            callback.ingest_many if isinstance(callback, RawBatchCallback) else None
        )
        self.on_deliveries = on_deliveries  # set: deliveries handed over as Delivery objects
        self.acked = acked and on_deliveries is not None  # else nothing to settle (replies)
        self.size = -1  # the body size of the delivery under way; -1: none
        self.have = 0
        self.body: list[bytes] = []
        self.user_id: str | None = None
        self.batch: RawBatch = []
        self.deliver = b""  # acked: the delivery under way's method and header payloads
        self.header = b""
        self.deliveries: list[Delivery] = []
        self.unsettled = 0  # acked: delivered, not settled yet
        self.cancelled = False  # acked: cancelled, its channel closed once all are settled
        self.consumer_tag = ""


def _deliver(consuming: _Consuming | None, buffer: bytearray, at: int, end: int) -> None:
    """A ``basic.deliver`` frame: a consumer of :class:`Delivery` objects keeps it (its tag,
    exchange and routing key); a raw consumer needs nothing in it (one queue per channel)."""
    if consuming is not None and consuming.on_deliveries is not None:
        consuming.deliver = bytes(buffer[at + 7 : end])


class _Settle:
    """Ack or reject one delivery of an acked consumer (see :meth:`_Wire.settle`)."""

    __slots__ = ("_consuming", "_tag", "_wire")

    def __init__(self, wire: _Wire, consuming: _Consuming, tag: int) -> None:
        self._wire, self._consuming, self._tag = wire, consuming, tag

    async def ack(self) -> None:
        self._wire.settle(self._consuming, self._tag, None)

    async def reject(self, requeue: bool = False) -> None:
        self._wire.settle(self._consuming, self._tag, requeue)

    def held(self) -> bool:
        wire = self._wire
        return wire.consumers.get(self._consuming.channel) is self._consuming and not (
            wire.lost.done()
        )


class _Wire(asyncio.Protocol):
    """One TCP connection: the handshake, then frames parsed as they arrive."""

    def __init__(
        self,
        login: tuple[str, str],
        vhost: str,
        heartbeat: int,
        name: str,
        on_lost_consumer: Callable[[int], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        self._login, self._vhost, self._heartbeat, self._name = login, vhost, heartbeat, name
        self._on_lost_consumer = on_lost_consumer
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.received_at = time.monotonic()
        self.frame_max = 131_072
        self.channel_max = 2047
        self.consumers: dict[int, _Consuming] = {}  # channel -> what is delivered on it
        self.in_use: set[int] = set()  # channels open or closing
        self._waiting: dict[int, tuple[tuple[type[Frame], ...], asyncio.Future[Frame]]] = {}
        self.callback_errors = 0
        self._settling: list[bytes] = []  # ack and reject frames to write this loop turn
        self.on_drained: Callable[[_Consuming], None] | None = None

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(_PROTOCOL_HEADER)

    def connection_lost(self, exc: Exception | None) -> None:
        failure = ConnectionError(f"connection lost: {exc or 'closed by the broker'}")
        if not self.opened.done():
            self.opened.set_exception(failure)
        for _, waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(failure)
        self._waiting.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.received_at = time.monotonic()
        buffer = self._buffer
        buffer += data
        size, at = len(buffer), 0
        touched: list[_Consuming] = []
        try:
            while size - at >= 8:
                kind, channel, length = _FRAME.unpack_from(buffer, at)
                end = at + 7 + length  # where the frame-end octet is
                if end >= size:
                    break  # the rest of this frame has not arrived yet
                if buffer[end] != _FRAME_END:
                    raise ValueError(f"a frame of type {kind} without its frame-end octet")
                consuming = self.consumers.get(channel)
                if kind == _BODY and consuming is not None:
                    if self._body(consuming, bytes(buffer[at + 7 : end])):
                        touched.append(consuming)
                elif kind == _HEADER and consuming is not None:
                    if self._header(consuming, buffer, at, end):
                        touched.append(consuming)
                elif kind == _METHOD and buffer[at + 7 : at + 11] == _DELIVER:
                    _deliver(consuming, buffer, at, end)
                elif kind == _METHOD:
                    self._method(channel, bytes(buffer[at : end + 1]))
                at = end + 1
        except Exception as exc:  # a stream we cannot read: start again on a new one
            log.error("unreadable frame from the broker; reconnecting", extra={"error": str(exc)})
            self.abort()
        finally:
            del buffer[:at]
            for consuming in dict.fromkeys(touched):
                self._hand_over(consuming)

    # ---- deliveries -------------------------------------------------------------------------
    def _header(self, consuming: _Consuming, buffer: bytearray, at: int, end: int) -> bool:
        """A content header frame (at ``at``): the body size, and the user (no ack) or the
        whole header for later (acked); True if the delivery is whole (an empty body)."""
        consuming.size = _BODY_SIZE.unpack_from(buffer, at + 11)[0]
        consuming.have = 0
        if consuming.on_deliveries is None:
            consuming.user_id = user_id_of(buffer, at + 19)
        else:
            consuming.header = bytes(buffer[at + 7 : end])
        return consuming.size == 0 and self._body(consuming, b"")

    def _body(self, consuming: _Consuming, chunk: bytes) -> bool:
        """Add a body frame; True once the delivery's body is whole (queued for the batch)."""
        consuming.have += len(chunk)
        if consuming.have < consuming.size:
            consuming.body.append(chunk)
            return False
        if consuming.body:
            consuming.body.append(chunk)
            chunk = b"".join(consuming.body)
            consuming.body = []
        if consuming.on_deliveries is None:
            consuming.batch.append((chunk, consuming.user_id))
        else:
            consuming.deliveries.append(self._delivery(consuming, chunk))
        consuming.size = -1
        return True

    def _delivery(self, consuming: _Consuming, body: bytes) -> Delivery:
        tag, redelivered, exchange, routing_key = deliver_fields(consuming.deliver)
        props = Properties(consuming.header)
        settle: _Settle | NoSettle = NO_SETTLE
        if consuming.acked:
            consuming.unsettled += 1
            settle = _Settle(self, consuming, tag)
        return Delivery(
            body=body,
            routing_key=routing_key,
            exchange=exchange,
            headers=props.headers,
            reply_to=props.reply_to,
            correlation_id=props.correlation_id,
            message_id=props.message_id,
            user_id=props.user_id,
            redelivered=redelivered,
            _raw=settle,
        )

    def settle(self, consuming: _Consuming, tag: int, requeue: bool | None) -> None:
        """Queue an ack (``requeue`` None) or a reject of ``tag``; what one loop turn queues
        goes out in one write. Dropped when the channel or connection is gone: the broker
        has requeued the message."""
        if self.consumers.get(consuming.channel) is not consuming or self.lost.done():
            return
        if requeue is None:
            frame = _ACK.pack(_METHOD, consuming.channel, 13, 60, 80, tag, 0, _FRAME_END)
        else:
            frame = pamqp.frame.marshal(spec.Basic.Reject(tag, requeue), consuming.channel)
        if not self._settling:
            asyncio.get_running_loop().call_soon(self._flush_settled)
        self._settling.append(frame)
        consuming.unsettled -= 1
        if consuming.cancelled and consuming.unsettled <= 0 and self.on_drained is not None:
            self.on_drained(consuming)

    def _flush_settled(self) -> None:
        frames, self._settling = self._settling, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(frames))

    def _hand_over(self, consuming: _Consuming) -> None:
        if consuming.on_deliveries is not None:
            deliveries, consuming.deliveries = consuming.deliveries, []
            try:
                consuming.on_deliveries(deliveries)
            except Exception:  # not settled: redelivered after the channel closes
                self.callback_errors += 1
                log.exception("an acked consumer's callback failed")
            return
        batch, consuming.batch = consuming.batch, []
        callback = consuming.callback
        assert callback is not None
        try:
            if consuming.ingest_many is not None:
                consuming.ingest_many(batch)
            else:
                for body, user_id in batch:
                    callback(body, user_id)
        except Exception:
            self.callback_errors += 1
            log.exception("a raw consumer's callback failed; the rest of its batch is dropped")

    # ---- control ----------------------------------------------------------------------------
    def _method(self, channel: int, raw: bytes) -> None:
        _, _, frame = pamqp.frame.unmarshal(raw)
        if not isinstance(frame, Frame):  # pragma: no cover - a method frame holds a method
            return
        if isinstance(frame, spec.Connection.Start):
            user, password = self._login
            properties: FieldTable = {
                "connection_name": self._name,
                "product": "mesh consume-only connection",
                "capabilities": {
                    "authentication_failure_close": True,
                    "consumer_cancel_notify": True,
                },
            }
            response = f"\0{user}\0{password}"
            self.send(0, spec.Connection.StartOk(properties, "PLAIN", response))
        elif isinstance(frame, spec.Connection.Tune):
            self.frame_max = frame.frame_max or self.frame_max
            self.channel_max = frame.channel_max or self.channel_max
            tune = spec.Connection.TuneOk(self.channel_max, self.frame_max, self._heartbeat)
            self.send(0, tune)
            self.send(0, spec.Connection.Open(virtual_host=self._vhost))
        elif isinstance(frame, spec.Connection.OpenOk):
            if not self.opened.done():
                self.opened.set_result(None)
        elif isinstance(frame, spec.Connection.CloseOk):  # our close, confirmed: the
            self.abort()  # socket is ours to close (the broker waits for us to)
        elif isinstance(frame, spec.Connection.Close):
            self.send(0, spec.Connection.CloseOk())
            if not self.opened.done():
                reason = f"{frame.reply_code} {frame.reply_text}"
                self.opened.set_exception(ConnectionRefusedError(reason))
            self.abort()
        elif isinstance(frame, spec.Channel.Close):
            self.send(channel, spec.Channel.CloseOk())
            self.in_use.discard(channel)
            self._lose(channel, f"{frame.reply_code} {frame.reply_text}")
            self._answer(channel, frame)
        elif isinstance(frame, spec.Basic.Cancel):  # its queue was deleted
            self.send(channel, _CLOSE_CHANNEL)  # CloseOk frees the number
            self._lose(channel, "the broker cancelled the consumer (its queue deleted?)")
        elif isinstance(frame, spec.Channel.CloseOk):
            self.in_use.discard(channel)
            self._answer(channel, frame)
        else:
            self._answer(channel, frame)

    def _lose(self, channel: int, why: str) -> None:
        """A consumer's channel ended without our asking: its owner tries it again."""
        if self.consumers.pop(channel, None) is not None:
            log.warning("a consume-only channel ended", extra={"channel": channel, "why": why})
            self._on_lost_consumer(channel)

    def _answer(self, channel: int, frame: Frame) -> None:
        waiting = self._waiting.pop(channel, None)
        if waiting is None:
            return
        expected, future = waiting
        if future.done():
            return
        if isinstance(frame, expected):
            future.set_result(frame)
        elif isinstance(frame, spec.Channel.Close):
            future.set_exception(_channel_closed(frame))
        else:
            future.set_exception(TransportError(f"unexpected {frame.name} on channel {channel}"))

    def send(self, channel: int, frame: Frame) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(pamqp.frame.marshal(frame, channel))

    async def call(self, channel: int, frame: Frame, *expected: type[Frame]) -> Frame:
        """Send ``frame`` on ``channel`` and wait for one of ``expected`` there."""
        if self.lost.done():
            raise ConnectionError("connection lost")
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._waiting[channel] = (expected, future)
        self.send(channel, frame)
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            return await future

    def free_channel(self) -> int:
        for channel in range(1, self.channel_max + 1):
            if channel not in self.in_use:
                return channel
        raise TransportError(f"all {self.channel_max} channels of the connection are in use")

    def beat(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_HEARTBEAT_FRAME)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


def _channel_closed(frame: spec.Channel.Close) -> TransportError:
    if frame.reply_code == _NOT_FOUND:
        return TopologyMissing(f"{frame.reply_text}: declare the topology first")
    return TransportError(f"the broker closed the channel: {frame.reply_code} {frame.reply_text}")


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
        self._wire: _Wire | None = None
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

    def _drained(self, consuming: _Consuming) -> None:
        """A cancelled acked consumer has settled all it was given: close its channel."""
        wire = self._wire
        if wire is None or wire.consumers.get(consuming.channel) is not consuming:
            return
        del wire.consumers[consuming.channel]
        task = asyncio.create_task(self._close_channel(wire, consuming.channel))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _close_channel(self, wire: _Wire, channel: int) -> None:
        async with self._lock:
            with contextlib.suppress(TransportError, *_CONNECTION_LOST):
                await wire.call(channel, _CLOSE_CHANNEL, spec.Channel.CloseOk)

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

    async def _try_subscribe(self, wire: _Wire, consumer: LeanConsumer) -> None:
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
    async def _open(self) -> _Wire:
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

    async def _open_at(self, host: str, port: int) -> _Wire:
        loop = asyncio.get_running_loop()
        context = await loop.run_in_executor(None, self._ssl_context) if self._tls else None
        login, vhost, heartbeat, name = self._login, self._vhost, self._heartbeat, self._name
        async with asyncio.timeout(_CONTROL_TIMEOUT_S):
            _, wire = await loop.create_connection(
                lambda: _Wire(login, vhost, heartbeat, name, self._lost_consumer),
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

    async def _subscribe(self, wire: _Wire, consumer: LeanConsumer) -> None:
        """Open a channel and consume ``consumer``'s queue on it (under the lock)."""
        channel = wire.free_channel()
        wire.in_use.add(channel)
        await wire.call(channel, spec.Channel.Open(), spec.Channel.OpenOk)
        acked = consumer.acked
        wire.consumers[channel] = _Consuming(
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

    async def _watch(self, wire: _Wire) -> None:
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
