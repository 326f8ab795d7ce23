"""Traces across every hop of a task: W3C trace context in AMQP headers, OpenTelemetry spans.

The only package that touches ``opentelemetry``, an optional extra (``agent-mesh[otel]``):
without it (or without a tracer provider) every helper here returns at once and the mesh
runs as before, carrying on the trace headers it receives. :mod:`mesh.tracing.spans` has
the spans, :mod:`mesh.tracing.describe` their attributes, :mod:`mesh.tracing.carry` the
headers, :mod:`mesh.tracing.setup` the SDK set up from ``OTEL_*`` for the ``mesh`` CLI's
processes, and :mod:`mesh.tracing.jsonl` an exporter of one JSON line per span.
docs/tracing.md says how to turn it on and what each span says.
"""

from mesh.tracing.carry import TRACE_HEADERS, carried, carry_into
from mesh.tracing.spans import (
    OFF,
    Traced,
    invoke,
    operation,
    reply_headers,
    result_headers,
    send,
    serving,
)
from mesh.tracing.state import available, tracer, use_global_provider, use_provider

__all__ = [
    "OFF",
    "TRACE_HEADERS",
    "Traced",
    "available",
    "carried",
    "carry_into",
    "invoke",
    "operation",
    "reply_headers",
    "result_headers",
    "send",
    "serving",
    "tracer",
    "use_global_provider",
    "use_provider",
]
