"""The frames of an AMQP 0-9-1 ``basic.publish``, written with ``struct``.

aiormq builds a published message from pamqp objects (a ``Basic.Publish`` method, a
``ContentHeader``, ``ContentBody`` chunks) and marshals them frame by frame; at a batch of
registrations (hundreds of acceptances and feed events a turn) that is a sixth of the
manager's time. The layout of these three frame types is fixed by the specification
(section 4.2.3 and the ``basic`` class), so the batch publishes of
:class:`mesh.transport.amqp.AmqpTransport` write them here; the content properties are still
marshalled by pamqp (once, where they do not change). ``tests/unit/test_frames.py`` checks
every byte against pamqp's own marshalling.
"""

from __future__ import annotations

import struct

from mesh import constants as c

_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY = 1, 2, 3
_FRAME_END = b"\xce"
_BASIC = 60
_PUBLISH = 40
_FRAME_START = struct.Struct(">BHI")  # type, channel, payload size
_PUBLISH_START = struct.Struct(">HHH")  # class, method, reserved (ticket)
_HEADER_START = struct.Struct(">HHQ")  # class, weight, body size

# Basic property flags (the first property is the highest bit), as far as they are used here.
_CONTENT_TYPE = 0x8000
_DELIVERY_MODE = 0x1000
_MESSAGE_ID = 0x0080
_TYPE = 0x0020
_USER_ID = 0x0010


def _shortstr(text: str) -> bytes:
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"longer than 255 bytes: {text[:64]}…")
    return bytes((len(data),)) + data


_JSON = _shortstr(c.CONTENT_TYPE)


def typed_properties(message_type: str, message_id: str, user_id: str | None = None) -> bytes:
    """The marshalled properties of a confirmed wire message: content type (JSON),
    delivery mode 1 (transient), message ID, type and, if given, user ID — what pamqp writes
    for ``Basic.Properties(content_type=…, message_type=…, message_id=…, delivery_mode=1,
    user_id=…)``."""
    flags = _CONTENT_TYPE | _DELIVERY_MODE | _MESSAGE_ID | _TYPE
    if user_id is not None:
        flags |= _USER_ID
    return (
        flags.to_bytes(2, "big")
        + _JSON
        + b"\x01"
        + _shortstr(message_id)
        + _shortstr(message_type)
        + (b"" if user_id is None else _shortstr(user_id))
    )


def publish_frames(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: bytes,
    *,
    mandatory: bool,
    max_body: int,
) -> bytes:
    """One message's frames: the ``basic.publish`` method, the content header with
    ``properties`` (marshalled: flags, then values), the body in frames of at most
    ``max_body`` bytes (the negotiated frame size less the frame's own eight bytes).
    ``ValueError`` for an exchange or routing key longer than 255 bytes."""
    method = (
        _PUBLISH_START.pack(_BASIC, _PUBLISH, 0)
        + _shortstr(exchange)
        + _shortstr(routing_key)
        + (b"\x01" if mandatory else b"\x00")
    )
    header = _HEADER_START.pack(_BASIC, 0, len(body)) + properties
    parts = [
        _FRAME_START.pack(_FRAME_METHOD, channel, len(method)),
        method,
        _FRAME_END,
        _FRAME_START.pack(_FRAME_HEADER, channel, len(header)),
        header,
        _FRAME_END,
    ]
    for start in range(0, len(body), max_body):
        chunk = body[start : start + max_body]
        parts += (_FRAME_START.pack(_FRAME_BODY, channel, len(chunk)), chunk, _FRAME_END)
    return b"".join(parts)
