"""The mesh's spans: what each process opens around a task's hops, and the headers that carry
a span's context to the next process.

Every helper returns a :class:`Traced`, used as a ``with`` block. With tracing off it is the
one shared :data:`OFF`, whose methods do nothing and allocate nothing; with tracing on it
wraps an OpenTelemetry span, ended when the block ends (an exception sets its status to
error). The spans, by process:

* producer — :func:`operation` (``submit {capability}``, ``run_task {capability}``; current
  while it runs, so the caller's span is its parent and its messages its children) and
  :func:`send` (``send {exchange}``, kind PRODUCER, one per message: its context is what the
  message's headers carry);
* manager — :func:`serving` (``admission {capability}``, ``acquire {capability}``,
  ``release …``; kind SERVER, the request's context its parent), described by the reply it
  sends (:func:`reply_headers`);
* agent — :func:`invoke` (``invoke_agent {capability}``, kind CONSUMER, the task's context
  its parent; current while the handler runs, so a handler's own spans nest in it), the
  result's headers from :func:`result_headers`.

A hop's span — the manager's or the agent's — is found by the reply to its message sent
inside its block (a context variable): the reply carries that span's context. Where there
is none (tracing off here, or a reply sent outside one), the received trace headers are
copied onto the reply unchanged (:mod:`mesh.tracing.carry`), so a trace does not break at
a process that does not trace.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Final

from mesh import constants as c
from mesh.tracing import describe
from mesh.tracing.carry import carried, carry_into, text
from mesh.tracing.state import otel, tracer
from mesh.wire.admission import AdmissionDecision
from mesh.wire.models import Message, Task, TaskResult

__all__ = [
    "OFF",
    "Traced",
    "invoke",
    "operation",
    "reply_headers",
    "result_headers",
    "send",
    "serving",
]

# The hop span (manager or agent) whose block the current task is in: its replies carry it.
_HOP: ContextVar[_Span | None] = ContextVar("mesh_tracing_hop", default=None)

_PRODUCER: Final = "PRODUCER"
_CONSUMER: Final = "CONSUMER"
_SERVER: Final = "SERVER"
_INTERNAL: Final = "INTERNAL"


class Traced:
    """A span of the mesh; this base class is tracing off: every method does nothing."""

    __slots__ = ()

    def __enter__(self) -> Traced:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    @property
    def recording(self) -> bool:
        """Whether the span records (off, or sampled out: it does not)."""
        return False

    def headers(self, headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """``headers`` with this span's trace context added (off: ``headers`` itself)."""
        return headers

    def note(self, key: str, value: Any) -> None:
        """Set an attribute (``None``: not known, left out)."""

    def deferred(self, decision: AdmissionDecision, attempt: int) -> None:
        """A deferral the producer waits out: an event on its span."""

    def answered(self, reply: Message) -> None:
        """The manager's reply to the request this span serves."""

    def ran(self, result: TaskResult) -> None:
        """The agent's result of the task this span runs."""


OFF: Final = Traced()


class _Span(Traced):
    """A live OpenTelemetry span (maybe sampled out), current in its block if ``current``."""

    __slots__ = ("_attach", "_hop", "_span", "_tokens", "received")

    def __init__(
        self, span: Any, *, current: bool, hop: bool, received: Mapping[str, Any] | None = None
    ) -> None:
        self._span = span
        self._attach = current
        self._hop = hop
        self.received = received  # a hop's: the headers of the message it handles
        self._tokens: tuple[Any, Token[_Span | None] | None] | None = None

    def __enter__(self) -> Traced:
        token = None
        if self._attach:
            api = otel()
            token = api.context.attach(api.trace.set_span_in_context(self._span))
        self._tokens = (token, _HOP.set(self) if self._hop else None)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._tokens is not None:
            token, hop = self._tokens
            if hop is not None:
                _HOP.reset(hop)
            if token is not None:
                otel().context.detach(token)
        if exc is not None:
            _failed(self._span, exc)
        self._span.end()

    @property
    def recording(self) -> bool:
        return bool(self._span.is_recording())

    def headers(self, headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        return _inject(self._span, headers)

    def note(self, key: str, value: Any) -> None:
        if value is not None and self._span.is_recording():
            self._span.set_attribute(key, value)

    def deferred(self, decision: AdmissionDecision, attempt: int) -> None:
        if self._span.is_recording():
            self._span.add_event(
                describe.DEFERRED_EVENT, describe.deferral_attributes(decision, attempt)
            )

    def answered(self, reply: Message) -> None:
        if self._span.is_recording():
            self._span.set_attributes(describe.reply_attributes(reply))

    def ran(self, result: TaskResult) -> None:
        if not self._span.is_recording():
            return
        self._span.set_attributes(describe.result_attributes(result))
        if result.error is not None:
            trace = otel().trace
            code = result.error.code.value
            self._span.set_status(
                trace.Status(trace.StatusCode.ERROR, f"{code}: {result.error.message}")
            )


class _Unsampled(Traced):
    """A message sent in a trace that is not sampled: no span of its own (it would record
    nothing), the current span's context carried (its flag says "not sampled" downstream)."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def headers(self, headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        return _inject(self._span, headers)


class _DroppedRoot(Traced):
    """A message that starts a trace the sampler drops (:func:`_drops_roots`): no span, and a
    fresh trace context flagged "not sampled" on the message, so no process downstream
    records it either."""

    __slots__ = ()

    def headers(self, headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if not _w3c_only(otel()):
            return _inject(_dropped_root(), headers)
        out = dict(headers) if headers else {}
        out[c.H_TRACEPARENT] = _traceparent(*_fresh_ids(), 0)
        return out


_DROPPED: Final = _DroppedRoot()


def _fresh_ids() -> tuple[int, int]:
    """A new trace ID and span ID, random and never zero (as the SDK's generator makes them)."""
    return random.getrandbits(128) or 1, random.getrandbits(64) or 1


def _traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """W3C ``traceparent`` (version 00) for these IDs and flags."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def _inject(span: Any, headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """``headers`` (copied) with ``span``'s context, as the global propagator writes it."""
    api = otel()
    out = dict(headers) if headers else {}
    if _w3c_only(api):
        # What the default propagator (W3C trace context, and baggage: none here) writes,
        # written directly: the propagator's way costs as much as the span itself.
        context = span.get_span_context()
        if context.is_valid:
            out[c.H_TRACEPARENT] = _traceparent(
                context.trace_id, context.span_id, context.trace_flags
            )
            if context.trace_state:
                out[c.H_TRACESTATE] = context.trace_state.to_header()
        return out
    api.propagate.inject(out, context=api.trace.set_span_in_context(span))
    return out


_judged: list[Any] = [None, False]  # the global propagator last judged, and the judgement


def _w3c_only(api: Any) -> bool:
    """The global propagator is OpenTelemetry's default (W3C trace context, with or without
    W3C baggage) and the current context holds no baggage: injecting writes ``traceparent``
    (and ``tracestate``) alone. Judged once per propagator object; a user's own propagator
    (``OTEL_PROPAGATORS``, ``set_global_textmap``) always takes the propagator's way."""
    propagator = api.propagate.get_global_textmap()
    if propagator is not _judged[0]:
        _judged[:] = [propagator, _is_default(propagator)]
    return bool(_judged[1]) and not api.baggage.get_all()


def _is_default(propagator: Any) -> bool:
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parts = getattr(propagator, "_propagators", [propagator])  # a composite's, or itself
    kinds = [type(part) for part in parts]
    return kinds in (
        [TraceContextTextMapPropagator],
        [TraceContextTextMapPropagator, W3CBaggagePropagator],
    )


def _unsampled(received: Mapping[str, Any]) -> bool:
    """The message's trace context says "not sampled" (W3C ``traceparent``'s flags): the
    producer decided, and a hop makes no span for it — it carries the context on as it came
    (what the SDK's default, parent-based sampler would decide, without the cost)."""
    parent = received.get(c.H_TRACEPARENT)
    if parent is None:
        return False
    flags = text(parent)[-2:]
    try:
        return not int(flags, 16) & 1
    except ValueError:
        return False  # not W3C's: the propagator makes of it what it can


def _failed(span: Any, exc: BaseException) -> None:
    """An exception ended the span's block: its status is an error, saying which."""
    if not span.is_recording():
        return
    trace = otel().trace
    code = getattr(exc, "code", None)
    kind = code if isinstance(code, str) else type(exc).__name__
    span.set_attribute("error.type", kind)
    if not isinstance(exc, asyncio.CancelledError):
        span.record_exception(exc)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{kind}: {exc}"[:500]))


def _start(
    found: Any, name: str, kind: str, parent: Any, attributes: Mapping[str, Any] | None
) -> Any:
    span = found.start_span(name, context=parent, kind=otel().trace.SpanKind[kind])
    if attributes and span.is_recording():
        span.set_attributes(attributes)
    return span


_roots_dropped: list[Any] = [None, False]  # the tracer last judged, and the judgement


def _drops_roots(found: Any) -> bool:
    """The tracer's sampler drops every span that starts a trace (``always_off``, or
    ``parentbased_always_off``: the SDK's "sampler off"). Judged once per tracer, from the
    sampler's description; a tracer that is not the SDK's is never judged to."""
    if found is not _roots_dropped[0]:
        sampler = getattr(found, "sampler", None)
        describe_sampler = getattr(sampler, "get_description", None)
        said = describe_sampler() if callable(describe_sampler) else ""
        drops = said == "AlwaysOffSampler" or said.startswith("ParentBased{root:AlwaysOffSampler,")
        _roots_dropped[:] = [found, drops]
    return bool(_roots_dropped[1])


def _dropped_root() -> Any:
    """What the SDK makes of a root span its sampler drops — a non-recording span with
    fresh random IDs, flagged "not sampled" — without the SDK's span machinery (half the
    cost of a message with tracing on and the sampler off)."""
    trace = otel().trace
    trace_id, span_id = _fresh_ids()
    context = trace.SpanContext(
        trace_id=trace_id,
        span_id=span_id,
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT),
    )
    return trace.NonRecordingSpan(context)


def _parent(received: Mapping[str, Any]) -> Any:
    """The context a received message carries (an empty one without trace headers: a hop's
    span then starts a trace of its own, never a child of whatever else is current)."""
    api = otel()
    headers = carried(received)
    if headers is None:
        return api.context.Context()
    return api.propagate.extract(headers, context=api.context.Context())


# ---- the producer ------------------------------------------------------------------------
def operation(name: str, capability: str) -> Traced:
    """The producer's call (``submit``, ``run_task``) for ``capability``, current in its
    block: the caller's current span is its parent, the messages it sends its children."""
    found = tracer()
    if found is None:
        return OFF
    if _drops_roots(found) and not otel().trace.get_current_span().get_span_context().is_valid:
        return _Span(_dropped_root(), current=True, hop=False)
    attributes = {"mesh.capability": capability}
    return _Span(
        _start(found, f"{name} {capability}", _INTERNAL, None, attributes), current=True, hop=False
    )


def send(
    exchange: str,
    routing_key: str,
    *,
    conversation_id: str | None = None,
    task_id: str | None = None,
) -> Traced:
    """One message sent to ``exchange`` (PRODUCER): ``headers()`` gives what it carries."""
    found = tracer()
    if found is None:
        return OFF
    current = otel().trace.get_current_span()
    within = current.get_span_context()
    if within.is_valid and not within.trace_flags.sampled:
        return _Unsampled(current)  # inside a call sampled out: nothing to record
    if not within.is_valid and _drops_roots(found):
        return _DROPPED  # a trace of its own, which the sampler drops
    attributes = describe.messaging_attributes(exchange, routing_key, "send", conversation_id)
    if task_id is not None:
        attributes["mesh.task_id"] = task_id
    name = f"send {exchange or describe.DEFAULT_EXCHANGE_NAME}"
    return _Span(_start(found, name, _PRODUCER, None, attributes), current=False, hop=False)


# ---- the manager -------------------------------------------------------------------------
def serving(message: Message, received: Mapping[str, Any], queue: str) -> Traced:
    """The manager's handling of a request of a task's life (admission, acquire, release;
    any other request: :data:`OFF`), from its receipt to its reply, parented on the
    request's trace context."""
    found = tracer()
    if found is None or _unsampled(received):
        return OFF
    named = describe.request_span(message)
    if named is None:
        return OFF
    name, attributes = named
    attributes.update(describe.messaging_attributes(queue, queue, "process", None))
    span = _start(found, name, _SERVER, _parent(received), attributes)
    # Not current: the admission batch a request joins is shared with others, and must not
    # take this request's span for its own.
    return _Span(span, current=False, hop=True, received=received)


def reply_headers(received: Mapping[str, Any], reply: Message) -> Mapping[str, Any] | None:
    """The trace headers of the manager's ``reply`` to a request whose headers were
    ``received``: the context of the span serving it (which the reply describes), or the
    request's own trace headers carried on; ``None`` when there are none."""
    hop = _HOP.get()
    if hop is None or hop.received is not received:
        return carried(received)
    hop.answered(reply)
    return hop.headers(None)


# ---- the agent ---------------------------------------------------------------------------
def invoke(received: Mapping[str, Any], task: Task, *, agent_id: str, agent_name: str) -> Traced:
    """The agent's run of ``task`` (``invoke_agent {capability}``), parented on the task's
    trace context and current in its block: the handler's own spans nest in it."""
    found = tracer()
    if found is None or _unsampled(received):
        return OFF
    attributes = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent_name,
        "gen_ai.agent.id": agent_id,
        "mesh.capability": task.capability,
        "mesh.task_id": task.task_id,
        "messaging.system": describe.MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
    }
    if task.grant is not None:
        attributes["mesh.admission_id"] = task.grant.admission_id
        attributes["mesh.pool"] = task.grant.pool_id
    if task.lease_id is not None:
        attributes["mesh.lease_id"] = task.lease_id
    name = f"invoke_agent {task.capability}"
    span = _start(found, name, _CONSUMER, _parent(received), attributes)
    return _Span(span, current=True, hop=True, received=received)


def result_headers(received: Mapping[str, Any], headers: dict[str, Any]) -> Mapping[str, Any]:
    """``headers`` (a fresh dict, changed in place) with the trace context a task's result
    carries: the agent's run's span's, or the task's own trace headers carried on."""
    hop = _HOP.get()
    if hop is None or hop.received is not received:
        return carry_into(received, headers)
    traced = hop.headers(headers)
    return headers if traced is None else traced
