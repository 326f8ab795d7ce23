"""The W3C trace context (``traceparent``, ``tracestate``) in AMQP headers, read and copied
without OpenTelemetry: what a process that does not trace carries on from a message it
received to the one it sends in answer (docs/protocol.md, "Trace context")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mesh import constants as c

__all__ = ["TRACE_HEADERS", "carried", "carry_into", "text"]

TRACE_HEADERS: Final = (c.H_TRACEPARENT, c.H_TRACESTATE)


def text(value: Any) -> str:
    """A header's value as text (AMQP field tables may hand strings over as bytes)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)


def carry_into(received: Mapping[str, Any], into: dict[str, Any]) -> dict[str, Any]:
    """``into`` with the trace headers of ``received`` copied in (none: unchanged)."""
    parent = received.get(c.H_TRACEPARENT)
    if parent is not None:
        into[c.H_TRACEPARENT] = text(parent)
        state = received.get(c.H_TRACESTATE)
        if state is not None:
            into[c.H_TRACESTATE] = text(state)
    return into


def carried(received: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trace headers of ``received`` alone, or ``None`` when it has none."""
    if received.get(c.H_TRACEPARENT) is None:
        return None
    return carry_into(received, {})
