"""Reading the frames of a delivery in place: ``basic.deliver``'s fields and the content
header's properties, from the bytes as they arrived, without building pamqp objects.

Pure functions over byte strings (AMQP 0-9-1, the ``basic`` class's properties in order), so
``tests/unit/test_lean.py`` checks them against pamqp's own marshalling without a broker.
"""

from __future__ import annotations

import struct
from typing import Any

import pamqp.decode

_USER_ID = 0x0010
_TAG = struct.Struct(">QB")  # delivery tag, redelivered


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
            self.headers = field_table(bytes(header[at : at + size]))
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


def field_table(data: bytes) -> dict[str, Any]:
    """An AMQP field table (its size first), as pamqp decodes it; a table of text values
    (the mesh's own headers, a trace context) read here, anything else by pamqp."""
    table: dict[str, Any] = {}
    end, at = len(data), 4
    try:
        while at < end:
            size = data[at]
            name = data[at + 1 : at + 1 + size].decode()
            at += 1 + size
            if data[at] != 0x53:  # "S": a long string
                return dict(pamqp.decode.field_table(data)[1])
            size = int.from_bytes(data[at + 1 : at + 5], "big")
            table[name] = data[at + 5 : at + 5 + size].decode()
            at += 5 + size
    except (IndexError, UnicodeDecodeError):
        return dict(pamqp.decode.field_table(data)[1])
    return table


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
