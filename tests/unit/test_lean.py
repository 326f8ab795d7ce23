"""The consume-only connection's reading of deliveries (mesh.transport.amqp091): frames written
by pamqp — as RabbitMQ writes them — split at any byte, give back every body and validated
``user_id`` in order. The connection itself is exercised on the real broker
(tests/integration/test_raw_consumer.py and every manager test)."""

from __future__ import annotations

import asyncio
import struct
from datetime import datetime

import aiormq
import pamqp.frame
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from mesh.transport.amqp091 import RawBatch
from mesh.transport.amqp091.protocol import Consuming, Wire
from mesh.transport.amqp091.reading import Properties, deliver_fields, user_id_of

shortstr = st.text(max_size=30).filter(lambda t: 0 < len(t.encode()) <= 255)

properties_st = st.builds(
    aiormq.spec.Basic.Properties,
    content_type=st.none() | shortstr,
    content_encoding=st.none() | shortstr,
    headers=st.none() | st.dictionaries(st.sampled_from(["a", "x-mesh"]), shortstr, max_size=2),
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 9),
    correlation_id=st.none() | shortstr,
    reply_to=st.none() | shortstr,
    expiration=st.none() | st.integers(1, 99_999).map(str),
    message_id=st.none() | shortstr,
    timestamp=st.none()
    | st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1)).map(
        lambda d: d.replace(microsecond=0)
    ),
    message_type=st.none() | shortstr,
    user_id=st.none() | shortstr,
    app_id=st.none() | shortstr,
)


@given(properties_st)
def test_the_user_id_is_read_past_every_property_before_it(
    properties: aiormq.spec.Basic.Properties,
) -> None:
    payload = ContentHeader(properties=properties, body_size=3).marshal()
    assert user_id_of(payload) == properties.user_id


def delivery_frames(channel: int, body: bytes, user_id: str | None, frame_max: int) -> bytes:
    """A delivery as the broker sends it: deliver, content header, body frames."""
    deliver = aiormq.spec.Basic.Deliver(
        consumer_tag="ctag", delivery_tag=1, exchange="mesh.hb", routing_key="hb.a"
    )
    header = ContentHeader(
        properties=aiormq.spec.Basic.Properties(content_type="application/json", user_id=user_id),
        body_size=len(body),
    )
    frames = [deliver, header]
    frames += [ContentBody(body[i : i + frame_max]) for i in range(0, len(body), frame_max)]
    return b"".join(pamqp.frame.marshal(f, channel) for f in frames)


class Batches:
    def __init__(self) -> None:
        self.batches: list[RawBatch] = []

    def __call__(self, body: bytes, user_id: str | None, /) -> None:
        self.batches.append([(body, user_id)])

    def ingest_many(self, bodies: RawBatch, /) -> None:
        self.batches.append(bodies)


messages_st = st.lists(
    st.tuples(st.binary(max_size=200), st.none() | st.sampled_from(["agent-1", "agent-2"])),
    min_size=1,
    max_size=20,
)


@settings(deadline=None)
@given(messages=messages_st, frame_max=st.sampled_from([5, 64, 4096]), cuts=st.data())
def test_deliveries_split_anywhere_come_back_whole_and_in_order(
    messages: list[tuple[bytes, str | None]], frame_max: int, cuts: st.DataObject
) -> None:
    stream = b"".join(delivery_frames(3, body, user, frame_max) for body, user in messages)
    points = sorted(cuts.draw(st.sets(st.integers(1, len(stream) - 1), max_size=10)))

    async def read() -> list[RawBatch]:
        wire = Wire(("guest", "guest"), "/", 0, "test", lambda _: None)
        got = Batches()
        wire.consumers[3] = Consuming(3, got)
        for start, end in zip([0, *points], [*points, len(stream)], strict=True):
            wire.data_received(stream[start:end])
        return got.batches

    batches = asyncio.run(read())
    assert [m for batch in batches for m in batch] == messages
    assert all(batches)  # no empty batch is handed over


@given(properties_st)
def test_the_properties_an_acked_consumer_reads_are_pamqps(
    properties: aiormq.spec.Basic.Properties,
) -> None:
    payload = ContentHeader(properties=properties, body_size=3).marshal()
    got = Properties(payload)
    assert got.headers == (properties.headers or {})
    assert got.correlation_id == properties.correlation_id
    assert got.reply_to == properties.reply_to
    assert got.message_id == properties.message_id
    assert got.user_id == properties.user_id


@given(
    st.text(max_size=40).filter(lambda t: len(t.encode()) <= 255),
    st.integers(1, 2**63 - 1),  # what pamqp writes (the broker counts from 1 per channel)
    st.booleans(),
    st.from_regex(r"[a-zA-Z0-9_.:-]{0,40}", fullmatch=True),  # pamqp's rule for exchange names
    st.text(max_size=60).filter(lambda t: len(t.encode()) <= 255),
)
def test_the_delivery_tag_and_route_are_read_from_basic_deliver(
    consumer_tag: str, tag: int, redelivered: bool, exchange: str, routing_key: str
) -> None:
    method = aiormq.spec.Basic.Deliver(consumer_tag, tag, redelivered, exchange, routing_key)
    payload = method.marshal()
    assert deliver_fields(b"\x00\x3c\x00\x3c" + payload) == (
        tag,
        redelivered,
        exchange,
        routing_key,
    )


class Socket(asyncio.Transport):
    """A transport that keeps what is written and whether it was aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def test_a_frame_larger_than_the_negotiated_frame_max_drops_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def read() -> tuple[Socket, Batches]:
        wire = Wire(("guest", "guest"), "/", 0, "test", lambda _: None)
        socket, got = Socket(), Batches()
        wire.connection_made(socket)
        wire.consumers[3] = Consuming(3, got)
        too_big = wire.frame_max - 8 + 1  # one byte of payload past the bound
        wire.data_received(struct.pack(">BHI", 3, 3, too_big) + b"x")
        return socket, got

    socket, got = asyncio.run(read())
    assert socket.aborted  # refused at its header, not buffered until it is whole
    assert got.batches == []
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "unreadable frame" in record.getMessage()
    assert "over the negotiated frame_max of 131072" in record.error  # type: ignore[attr-defined]


def test_a_frame_of_exactly_the_negotiated_frame_max_is_read() -> None:
    async def read() -> tuple[Socket, list[RawBatch]]:
        wire = Wire(("guest", "guest"), "/", 0, "test", lambda _: None)
        socket, got = Socket(), Batches()
        wire.connection_made(socket)
        wire.consumers[3] = Consuming(3, got)
        body = b"x" * (wire.frame_max - 8)
        wire.data_received(delivery_frames(3, body, None, len(body)))
        return socket, got.batches

    socket, batches = asyncio.run(read())
    assert not socket.aborted
    assert [m for batch in batches for m in batch] == [(b"x" * (131_072 - 8), None)]
