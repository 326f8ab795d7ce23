"""One AMQP 0-9-1 connection as an ``asyncio.Protocol``: the handshake, then frames parsed
as they arrive.

Control frames (the handshake, channel open and close, qos, consume and cancel, the broker's
close) are marshalled and parsed by pamqp, as aiormq does; only the frames of a delivery
(``basic.deliver``, the content header, the body) are read by hand, in ``data_received``
(:mod:`mesh.transport.amqp091.reading`), and every message that arrived in one read goes to
its consumer as one batch. Acks and rejects asked for in one turn of the event loop go out in
one write. A frame larger than the negotiated ``frame_max`` is refused: the connection is
dropped (and reconnected by its owner) rather than buffering whatever size a peer announces.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable

import pamqp.commands as spec
import pamqp.frame
from pamqp.base import Frame
from pamqp.common import FieldTable

from mesh.errors import TopologyMissing, TransportError
from mesh.transport.amqp091.callbacks import (
    DeliveriesCallback,
    RawBatch,
    RawBatchCallback,
    RawCallback,
)
from mesh.transport.amqp091.reading import Properties, deliver_fields, user_id_of
from mesh.transport.delivery import NO_SETTLE, Delivery, NoSettle

log = logging.getLogger(__name__)

_PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_BODY_SIZE = struct.Struct(">Q")
_METHOD, _HEADER, _BODY, _HEARTBEAT = 1, 2, 3, 8
_FRAME_END = 0xCE
_FRAME_OVERHEAD = 8  # a frame's header (7 bytes) and frame-end octet around its payload
_DELIVER = b"\x00\x3c\x00\x3c"  # basic (60) . deliver (60)
_HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
_ACK = struct.Struct(">BHIHHQBB")  # a whole basic.ack frame: header, method, tag, bits, end
_NOT_FOUND = 404
CONTROL_TIMEOUT_S = 10.0
CLOSE_CHANNEL = spec.Channel.Close(reply_code=200, reply_text="done", class_id=0, method_id=0)


class Consuming:
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


def _deliver(consuming: Consuming | None, buffer: bytearray, at: int, end: int) -> None:
    """A ``basic.deliver`` frame: a consumer of :class:`Delivery` objects keeps it (its tag,
    exchange and routing key); a raw consumer needs nothing in it (one queue per channel)."""
    if consuming is not None and consuming.on_deliveries is not None:
        consuming.deliver = bytes(buffer[at + 7 : end])


class _Settle:
    """Ack or reject one delivery of an acked consumer (see :meth:`Wire.settle`)."""

    __slots__ = ("_consuming", "_tag", "_wire")

    def __init__(self, wire: Wire, consuming: Consuming, tag: int) -> None:
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


class Wire(asyncio.Protocol):
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
        self.consumers: dict[int, Consuming] = {}  # channel -> what is delivered on it
        self.in_use: set[int] = set()  # channels open or closing
        self._waiting: dict[int, tuple[tuple[type[Frame], ...], asyncio.Future[Frame]]] = {}
        self.callback_errors = 0
        self._settling: list[bytes] = []  # ack and reject frames to write this loop turn
        self.on_drained: Callable[[Consuming], None] | None = None

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
        touched: list[Consuming] = []
        try:
            del buffer[: self._read_frames(buffer, touched)]
        except Exception as exc:  # a stream we cannot read: start again on a new one
            buffer.clear()  # nothing more is read on this connection
            log.error("unreadable frame from the broker; reconnecting", extra={"error": str(exc)})
            self.abort()
        finally:
            for consuming in dict.fromkeys(touched):
                self._hand_over(consuming)

    def _read_frames(self, buffer: bytearray, touched: list[Consuming]) -> int:
        """Handle every whole frame in ``buffer``; where the first one not whole yet starts.
        A consumer that completed a delivery is added to ``touched``."""
        size, at = len(buffer), 0
        while size - at >= 8:
            kind, channel, length = _FRAME.unpack_from(buffer, at)
            if length > self.frame_max - _FRAME_OVERHEAD:
                raise ValueError(
                    f"a frame of type {kind} of {length + _FRAME_OVERHEAD} bytes, over "
                    f"the negotiated frame_max of {self.frame_max}"
                )
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
        return at

    # ---- deliveries -------------------------------------------------------------------------
    def _header(self, consuming: Consuming, buffer: bytearray, at: int, end: int) -> bool:
        """A content header frame (at ``at``): the body size, and the user (no ack) or the
        whole header for later (acked); True if the delivery is whole (an empty body)."""
        consuming.size = _BODY_SIZE.unpack_from(buffer, at + 11)[0]
        consuming.have = 0
        if consuming.on_deliveries is None:
            consuming.user_id = user_id_of(buffer, at + 19)
        else:
            consuming.header = bytes(buffer[at + 7 : end])
        return consuming.size == 0 and self._body(consuming, b"")

    def _body(self, consuming: Consuming, chunk: bytes) -> bool:
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

    def _delivery(self, consuming: Consuming, body: bytes) -> Delivery:
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

    def settle(self, consuming: Consuming, tag: int, requeue: bool | None) -> None:
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

    def _hand_over(self, consuming: Consuming) -> None:
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
            self.send(channel, CLOSE_CHANNEL)  # CloseOk frees the number
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
        async with asyncio.timeout(CONTROL_TIMEOUT_S):
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
