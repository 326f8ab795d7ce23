"""The frames of an AMQP 0-9-1 ``basic.publish``, written with ``struct``.

aiormq builds a published message from pamqp objects (a ``Basic.Publish`` method, a
``ContentHeader``, ``ContentBody`` chunks) and marshals them frame by frame; at a batch of
registrations (hundreds of acceptances and feed events a turn) that is a sixth of the
manager's time. The layout of these three frame types is fixed by the specification
(section 4.2.3 and the ``basic`` class), so :class:`mesh.transport.amqp.AmqpTransport`
writes them here for every confirmed publish, one or a batch (~4 µs a message against ~25 µs
through pamqp's objects), and for its confirm-less batches; so are the content properties
the transport sets (:func:`message_properties`); a header table's values are still encoded
by pamqp. ``tests/unit/test_frames.py`` checks every byte against pamqp's own marshalling.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from pamqp import encode as pamqp_encode

from mesh import constants as c

_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY = 1, 2, 3
_FRAME_END = b"\xce"
_BASIC = 60
_PUBLISH = 40
_FRAME_START = struct.Struct(">BHI")  # type, channel, payload size
_PUBLISH_START = struct.Struct(">HHH")  # class, method, reserved (ticket)
_HEADER_START = struct.Struct(">HHQ")  # class, weight, body size

# Basic property flags (the first property is the highest bit), as far as they are used here;
# the values follow the flags in this order.
_CONTENT_TYPE = 0x8000
_HEADERS = 0x2000
_DELIVERY_MODE = 0x1000
_CORRELATION_ID = 0x0400
_REPLY_TO = 0x0200
_MESSAGE_ID = 0x0080
_TIMESTAMP = 0x0040
_TYPE = 0x0020
_USER_ID = 0x0010
_TIMESTAMP_VALUE = struct.Struct(">Q")


def _shortstr(text: str) -> bytes:
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"longer than 255 bytes: {text[:64]}…")
    return bytes((len(data),)) + data


_JSON = _shortstr(c.CONTENT_TYPE)


def field_table(headers: Mapping[str, Any]) -> bytes:
    """``headers`` as an AMQP field table, as pamqp writes it; a table of short names and
    text values (the mesh's own headers, a trace context) written here, without pamqp's
    per-value dispatch, anything else by pamqp."""
    parts = []
    for name, value in headers.items():
        if type(value) is not str:
            return bytes(pamqp_encode.field_table(dict(headers)))
        key, text = name.encode(), value.encode()
        if len(key) > 255:
            return bytes(pamqp_encode.field_table(dict(headers)))
        parts.append(b"%c%sS%s%s" % (len(key), key, len(text).to_bytes(4, "big"), text))
    body = b"".join(parts)
    return len(body).to_bytes(4, "big") + body


def message_properties(
    message_type: str | None,
    message_id: str,
    *,
    reply_to: str | None = None,
    correlation_id: str | None = None,
    user_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    persistent: bool = False,
    timestamp: int | None = None,
) -> bytes:
    """The marshalled content properties of a published wire message: content type (JSON),
    the header table if any, delivery mode 2 (``persistent``) or 1, correlation ID, reply-to,
    message ID, timestamp (whole seconds since the epoch), type and user ID — what pamqp
    writes for ``Basic.Properties`` with those values. As pamqp does, a property that is
    ``None`` or an empty string is left out."""
    flags = _CONTENT_TYPE | _DELIVERY_MODE | _MESSAGE_ID
    parts = [_JSON]
    if headers is not None:
        flags |= _HEADERS
        parts.append(field_table(headers))
    parts.append(b"\x02" if persistent else b"\x01")
    if correlation_id:
        flags |= _CORRELATION_ID
        parts.append(_shortstr(correlation_id))
    if reply_to:
        flags |= _REPLY_TO
        parts.append(_shortstr(reply_to))
    parts.append(_shortstr(message_id))
    if timestamp is not None:
        flags |= _TIMESTAMP
        parts.append(_TIMESTAMP_VALUE.pack(timestamp))
    if message_type:
        flags |= _TYPE
        parts.append(_shortstr(message_type))
    if user_id:
        flags |= _USER_ID
        parts.append(_shortstr(user_id))
    return flags.to_bytes(2, "big") + b"".join(parts)


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
