"""The confirmed publishes' frames (mesh.transport.amqp091.publish) are byte for byte what
aiormq and pamqp write for the same ``basic.publish``: the frames, and the content properties
for every combination the transport sets."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import aiormq
import pytest
from aiormq.abc import ChannelFrame
from hypothesis import given
from hypothesis import strategies as st
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from mesh import constants as c
from mesh.transport.amqp091 import message_properties, publish_frames

shortstr = st.text(max_size=40).filter(lambda t: len(t.encode()) <= 255)
exchange_names = st.from_regex(r"[a-zA-Z0-9_.:-]{0,40}", fullmatch=True)  # pamqp checks them


def pamqp_frames(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: aiormq.spec.Basic.Properties,
    mandatory: bool,
    max_body: int,
) -> bytes:
    """What ``Channel.basic_publish`` hands aiormq's writer (aiormq/channel.py)."""
    frames = [
        aiormq.spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
        ContentHeader(properties=properties, body_size=len(body)),
        *(ContentBody(body[i : i + max_body]) for i in range(0, len(body), max_body)),
    ]
    return ChannelFrame.marshall(channel_number=channel, frames=frames).payload


@given(
    channel=st.integers(1, 2047),
    exchange=exchange_names,
    routing_key=shortstr,
    body=st.binary(max_size=300),
    mandatory=st.booleans(),
    max_body=st.sampled_from([1, 7, 64, 131_064]),
    message_type=shortstr.filter(bool),  # every wire message has a type
    message_id=st.uuids().map(lambda u: u.hex),
)
def test_the_frames_are_pamqps(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    mandatory: bool,
    max_body: int,
    message_type: str,
    message_id: str,
) -> None:
    typed = aiormq.spec.Basic.Properties(
        content_type=c.CONTENT_TYPE,
        message_type=message_type,
        message_id=message_id,
        delivery_mode=1,
    )
    assert message_properties(message_type, message_id) == typed.marshal()
    signed = aiormq.spec.Basic.Properties(
        content_type=c.CONTENT_TYPE,
        message_type=message_type,
        message_id=message_id,
        delivery_mode=1,
        user_id="mesh-manager",
    )
    signed_ours = message_properties(message_type, message_id, user_id="mesh-manager")
    assert signed_ours == signed.marshal()
    for properties in (typed, aiormq.spec.Basic.Properties(content_type=c.CONTENT_TYPE)):
        ours = publish_frames(
            channel,
            exchange,
            routing_key,
            body,
            properties.marshal(),
            mandatory=mandatory,
            max_body=max_body,
        )
        theirs = pamqp_frames(channel, exchange, routing_key, body, properties, mandatory, max_body)
        assert ours == theirs


def test_a_routing_key_longer_than_255_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than 255 bytes"):
        publish_frames(1, "x", "k" * 256, b"{}", b"\x00\x00", mandatory=False, max_body=100)


header_values = st.one_of(
    shortstr, st.integers(-(2**31), 2**31 - 1), st.booleans(), st.none(), st.floats(0, 10)
)


@given(
    message_type=st.one_of(st.none(), shortstr),
    message_id=st.uuids().map(lambda u: u.hex),
    reply_to=st.one_of(st.none(), shortstr),
    correlation_id=st.one_of(st.none(), shortstr),
    user_id=st.one_of(st.none(), shortstr),
    headers=st.one_of(st.none(), st.dictionaries(shortstr, header_values, max_size=3)),
    persistent=st.booleans(),
    timestamp=st.one_of(st.none(), st.integers(0, 2**33)),
)
def test_every_property_the_transport_sets_is_marshalled_as_pamqp_does(
    message_type: str | None,
    message_id: str,
    reply_to: str | None,
    correlation_id: str | None,
    user_id: str | None,
    headers: dict[str, Any] | None,
    persistent: bool,
    timestamp: int | None,
) -> None:
    theirs = aiormq.spec.Basic.Properties(
        content_type=c.CONTENT_TYPE,
        message_type=message_type,
        message_id=message_id,
        reply_to=reply_to,
        correlation_id=correlation_id,
        user_id=user_id,
        headers=headers,
        delivery_mode=2 if persistent else 1,
        timestamp=None if timestamp is None else datetime.fromtimestamp(timestamp, UTC),
    )
    ours = message_properties(
        message_type,
        message_id,
        reply_to=reply_to,
        correlation_id=correlation_id,
        user_id=user_id,
        headers=headers,
        persistent=persistent,
        timestamp=timestamp,
    )
    assert ours == theirs.marshal()
