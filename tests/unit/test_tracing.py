"""Trace context across a task's hops (mesh.tracing), with the OpenTelemetry SDK in memory.

Each test hands ``mesh.tracing`` a provider of its own (``use_provider``), so nothing global
is set: the producer's spans, the headers its messages carry, the manager's and the agent's
spans parented on them, the replies carrying those on; tracing off and sampled out.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from mesh import tracing
from mesh.tracing.jsonl import JsonLinesExporter
from mesh.tracing.setup import configure, exporters_wanted
from mesh.wire import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRequest,
    CapabilityRange,
    TaskRequirements,
)
from mesh.wire.models import AdmissionGrant, ErrorInfo, Task, TaskResult
from mesh.wire.reasons import Reason

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_global_provider()


@pytest.fixture
def off() -> Iterator[None]:
    tracing.use_provider(None)
    yield
    tracing.use_global_provider()


def requirements() -> TaskRequirements:
    return TaskRequirements(
        capability=CapabilityRange(name="test.echo", version_spec=">=1"),
        task_schema_version="1.0.0",
        result_schema_version="1.0.0",
        input_classifications=["internal"],
        estimated_tokens=10,
        estimated_duration_s=0.2,
    )


def grant(admission_id: str = "a-1") -> AdmissionGrant:
    return AdmissionGrant(
        admission_id=admission_id,
        pool_id="echo",
        descriptor_epoch=7,
        policy_generation=1,
        fence=42,
        expires_at=time.time() + 60,
        fallback_for="echo-big",
    )


def task(admission_id: str = "a-1") -> Task:
    return Task(
        task_id="t-1",
        capability="test.echo",
        payload={"message": "hi"},
        submitted_at=time.time(),
        grant=grant(admission_id),
    )


def result(error: Reason | None = None) -> TaskResult:
    now = time.time()
    return TaskResult(
        task_id="t-1",
        agent_id="echo-1",
        capability="test.echo",
        status="error" if error else "ok",
        output=None if error else {"message": "hi"},
        error=ErrorInfo(code=error, message="boom") if error else None,
        started_at=now,
        finished_at=now,
    )


def ids(headers: Any) -> tuple[str, str, str]:
    found = TRACEPARENT.match(headers["traceparent"])
    assert found is not None, headers
    return found.group(1), found.group(2), found.group(3)


def named(exporter: InMemorySpanExporter, prefix: str) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]
    return span


# ---- the headers, without OpenTelemetry --------------------------------------------------------
def test_trace_headers_are_carried_on_as_text_and_nothing_is_made_without_them() -> None:
    received = {"traceparent": b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01", "tracestate": "a=b"}
    assert tracing.carried(received) == {
        "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "tracestate": "a=b",
    }
    assert tracing.carried({"x-mesh-agent-id": "a"}) is None
    base = {"x-mesh-agent-id": "a"}
    assert tracing.carry_into({}, base) is base and base == {"x-mesh-agent-id": "a"}


def test_tracing_off_hands_out_one_object_and_carries_received_context_on(off: None) -> None:
    assert tracing.send("x", "rpc.admit") is tracing.OFF
    assert tracing.operation("submit", "test.echo") is tracing.OFF
    headers = {"x-mesh-features": "f"}
    with tracing.send("x", "rpc.admit") as sent:
        assert sent.headers(headers) is headers  # nothing built
    received = {"traceparent": "00-" + "3" * 32 + "-" + "4" * 16 + "-01"}
    decision = AdmissionDecision(admission_id="a-1", outcome="admitted", grant=grant())
    request = AdmissionRequest(admission_id="a-1", requirements=requirements())
    with tracing.serving(request, received, "q"):
        assert tracing.reply_headers(received, decision) == received
    assert tracing.reply_headers({}, decision) is None
    with tracing.invoke(received, task(), agent_id="echo-1", agent_name="echo"):
        out = tracing.result_headers(received, {"x-mesh-agent-id": "echo-1"})
    assert out == {"x-mesh-agent-id": "echo-1", **received}


# ---- one trace across the hops ----------------------------------------------------------------
def test_a_submit_its_request_the_admission_and_the_run_are_one_trace(
    spans: InMemorySpanExporter,
) -> None:
    request = AdmissionRequest(admission_id="a-1", requirements=requirements())
    deferred = AdmissionDecision(
        admission_id="a-1",
        outcome="deferred",
        reason=AdmissionReason.CAPACITY,
        retry_after_ms=250,
        position=1,
    )
    admitted = AdmissionDecision(admission_id="a-1", outcome="admitted", grant=grant())
    with tracing.operation("submit", "test.echo") as submit:
        submit.deferred(deferred, 1)
        with tracing.send("ns.control", "rpc.admit", conversation_id="c-1") as sent:
            asked = sent.headers({"x-mesh-features": "f"})
        assert asked is not None and asked["x-mesh-features"] == "f"
        # The manager: a span parented on the request's context; its reply carries its own.
        with tracing.serving(request, asked, "ns.manager.rpc"):
            replied = tracing.reply_headers(asked, admitted)
        with tracing.send("ns.tasks", "pool.echo", task_id="t-1") as sent_task:
            carried_task = sent_task.headers({"x-mesh-admission-id": "a-1"})
        assert carried_task is not None
        with tracing.invoke(carried_task, task(), agent_id="echo-1", agent_name="echo") as run:
            run.ran(result())
            answered = tracing.result_headers(carried_task, {"x-mesh-agent-id": "echo-1"})

    s_submit, s_send = named(spans, "submit test.echo"), named(spans, "send ns.control")
    s_admission, s_run = named(spans, "admission test.echo"), named(spans, "invoke_agent")
    s_task = named(spans, "send ns.tasks")
    trace_id = s_submit.context.trace_id
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {trace_id}
    assert s_send.parent is not None and s_send.parent.span_id == s_submit.context.span_id
    assert s_admission.parent is not None and s_admission.parent.span_id == s_send.context.span_id
    assert s_task.parent is not None and s_task.parent.span_id == s_submit.context.span_id
    assert s_run.parent is not None and s_run.parent.span_id == s_task.context.span_id
    assert (s_send.kind, s_admission.kind, s_run.kind) == (
        SpanKind.PRODUCER,
        SpanKind.SERVER,
        SpanKind.CONSUMER,
    )
    # The headers say what the spans are: each message carries its sender's span.
    assert ids(asked)[:2] == (f"{trace_id:032x}", f"{s_send.context.span_id:016x}")
    assert ids(replied)[1] == f"{s_admission.context.span_id:016x}"
    assert ids(answered)[1] == f"{s_run.context.span_id:016x}"
    assert answered["x-mesh-agent-id"] == "echo-1"
    # The deferral: an event with its reason; the decision: the admission span's attributes.
    (event,) = s_submit.events
    assert event.name == "mesh.admission.deferred"
    assert dict(event.attributes or {}) == {
        "mesh.admission_id": "a-1",
        "mesh.admission.decision": "deferred",
        "mesh.admission.reason": "CAPACITY",
        "mesh.retry_after_ms": 250,
        "mesh.line.position": 1,
        "mesh.attempt": 1,
    }
    attributes = dict(s_admission.attributes or {})
    assert {k: attributes[k] for k in attributes if k.startswith("mesh.")} == {
        "mesh.capability": "test.echo",
        "mesh.capability.version_spec": ">=1",
        "mesh.admission_id": "a-1",
        "mesh.service_class": "batch",
        "mesh.admission.decision": "admitted",
        "mesh.pool": "echo",
        "mesh.descriptor_epoch": 7,
        "mesh.fence": 42,
        "mesh.fallback": True,
        "mesh.fallback_for": "echo-big",
    }
    assert dict(s_send.attributes or {})["messaging.system"] == "rabbitmq"
    assert dict(s_send.attributes or {})["messaging.destination.name"] == "ns.control"
    run_attributes = dict(s_run.attributes or {})
    assert run_attributes["gen_ai.operation.name"] == "invoke_agent"
    assert (run_attributes["gen_ai.agent.id"], run_attributes["gen_ai.agent.name"]) == (
        "echo-1",
        "echo",
    )
    assert run_attributes["mesh.admission_id"] == "a-1"


def test_the_callers_span_is_the_parent_of_a_submit(spans: InMemorySpanExporter) -> None:
    assert tracing.tracer() is not None
    with tracing.tracer().start_as_current_span("plan step") as step:
        with tracing.operation("submit", "test.echo"):
            pass
    submit = named(spans, "submit")
    assert submit.parent is not None and submit.parent.span_id == step.get_span_context().span_id


def test_a_failed_run_and_a_raising_call_end_their_spans_in_error(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.invoke({}, task(), agent_id="echo-1", agent_name="echo") as run:
        run.ran(result(Reason.HANDLER_ERROR))
    with pytest.raises(RuntimeError), tracing.operation("run_task", "test.echo"):
        raise RuntimeError("no agent")
    failed_run, failed_call = named(spans, "invoke_agent"), named(spans, "run_task")
    assert failed_run.status.status_code is StatusCode.ERROR
    assert failed_run.parent is None  # a task without trace context starts a trace
    assert dict(failed_run.attributes or {})["error.type"] == "HANDLER_ERROR"
    assert failed_call.status.status_code is StatusCode.ERROR
    assert dict(failed_call.attributes or {})["error.type"] == "RuntimeError"


def test_a_reply_outside_its_requests_span_carries_the_request_context_on(
    spans: InMemorySpanExporter,
) -> None:
    received = {"traceparent": "00-" + "5" * 32 + "-" + "6" * 16 + "-01"}
    other = {"traceparent": "00-" + "7" * 32 + "-" + "8" * 16 + "-01"}
    request = AdmissionRequest(admission_id="a-1", requirements=requirements())
    decision = AdmissionDecision(admission_id="a-1", outcome="admitted", grant=grant())
    with tracing.serving(request, received, "q"):
        assert tracing.reply_headers(other, decision) == other  # another request's reply
    (served,) = spans.get_finished_spans()
    assert f"{served.context.trace_id:032x}" == "5" * 32
    assert "mesh.admission.decision" not in dict(served.attributes or {})


# ---- sampled out ----------------------------------------------------------------------------
def test_a_sampled_out_trace_records_nothing_but_still_says_so_downstream() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        with tracing.operation("submit", "test.echo") as submit:
            submit.deferred(
                AdmissionDecision(
                    admission_id="a-1", outcome="deferred", reason=AdmissionReason.CAPACITY
                ),
                1,
            )
            with tracing.send("x", "rpc.admit") as sent:
                headers = sent.headers(None)
        assert int(ids(headers)[2], 16) & 1 == 0  # not sampled: the next process follows
        # No span of its own for the message: the call's context, as it is.
        assert ids(headers)[1] == f"{submit._span.get_span_context().span_id:016x}"  # type: ignore[attr-defined]
        request = AdmissionRequest(admission_id="a-1", requirements=requirements())
        decision = AdmissionDecision(admission_id="a-1", outcome="admitted", grant=grant())
        assert headers is not None
        with tracing.serving(request, headers, "q") as served:
            assert served is tracing.OFF  # the manager makes no span for it, and carries it on
            assert tracing.reply_headers(headers, decision) == headers
        with tracing.invoke(headers, task(), agent_id="echo-1", agent_name="echo") as run:
            assert run is tracing.OFF
            answer = tracing.result_headers(headers, {})
        assert answer == headers
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.use_global_provider()


@pytest.mark.parametrize("sampler", [ALWAYS_OFF, ParentBased(ALWAYS_OFF)], ids=str)
def test_with_the_sampler_off_a_root_message_starts_a_fresh_unsampled_trace_without_the_sdk(
    sampler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler off (``always_off``, ``parentbased_always_off``): a message sent outside
    any span, and a ``submit`` with no caller's span, get a fresh trace context flagged "not
    sampled" — what the SDK would write — without the SDK's span machinery; a message sent
    inside a sampled-out ``submit`` carries the submit's trace on."""
    from mesh.tracing import spans as spans_module

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    found = tracing.tracer()

    def no_sdk_span(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the SDK was asked for a span the sampler drops")

    monkeypatch.setattr(found, "start_span", no_sdk_span)
    try:
        seen = set()
        for _ in range(3):
            with tracing.send("x", "rpc.admit") as sent:
                trace_id, span_id, flags = ids(sent.headers({"x-mesh-features": "a"}))
            assert flags == "00" and trace_id != "0" * 32 and span_id != "0" * 16
            seen.add(trace_id)
        assert len(seen) == 3  # a trace of its own each
        with tracing.operation("submit", "test.echo") as submit:
            with tracing.send("x", "rpc.admit") as sent:
                inside = ids(sent.headers(None))
        root = submit._span.get_span_context()  # type: ignore[attr-defined]
        assert inside == (f"{root.trace_id:032x}", f"{root.span_id:016x}", "00")
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.use_global_provider()
    assert spans_module._drops_roots(found)


def test_a_sampler_that_keeps_some_roots_is_asked_for_each() -> None:
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from mesh.tracing import spans as spans_module

    for sampler, drops in (
        (ParentBased(TraceIdRatioBased(0.5)), False),
        (TraceIdRatioBased(0.0), False),  # drops all, but is not known to: asked each time
        (ParentBased(ALWAYS_OFF), True),
    ):
        assert spans_module._drops_roots(TracerProvider(sampler=sampler).get_tracer("t")) is drops


# ---- the JSON-lines exporter ----------------------------------------------------------------
def test_the_jsonl_exporter_writes_one_line_per_span_with_what_the_tests_read(
    tmp_path: Path,
) -> None:
    from opentelemetry.sdk.resources import Resource

    path = tmp_path / "spans" / "x.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "mesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    tracing.use_provider(provider)
    try:
        deferred = AdmissionDecision(
            admission_id="a-1", outcome="deferred", reason=AdmissionReason.CAPACITY
        )
        with tracing.operation("submit", "test.echo") as submit:
            submit.deferred(deferred, 2)
            with tracing.send("x", "rpc.admit"):
                pass
    finally:
        tracing.use_global_provider()
        provider.shutdown()
    sent, call = [json.loads(line) for line in path.read_text().splitlines()]
    assert (sent["name"], call["name"]) == ("send x", "submit test.echo")
    assert sent["trace_id"] == call["trace_id"] and len(sent["trace_id"]) == 32
    assert sent["parent_span_id"] == call["span_id"] and call["parent_span_id"] is None
    assert (sent["kind"], call["kind"]) == ("PRODUCER", "INTERNAL")
    assert call["service"] == "mesh-test"
    assert call["events"][0]["name"] == "mesh.admission.deferred"
    assert call["events"][0]["attributes"]["mesh.admission.reason"] == "CAPACITY"
    assert call["status"]["code"] == "UNSET"
    assert sent["attributes"]["messaging.operation.type"] == "send"


# ---- the environment ---------------------------------------------------------------------------
def test_only_an_exporter_or_an_endpoint_in_the_environment_sets_tracing_up() -> None:
    assert exporters_wanted({}) == []
    assert exporters_wanted({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318"}) == ["otlp"]
    assert exporters_wanted({"OTEL_TRACES_EXPORTER": "otlp, Console"}) == ["otlp", "console"]
    assert exporters_wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []
    said: list[str] = []
    assert configure("mesh-x", {}, said.append) is None
    assert configure("mesh-x", {"OTEL_TRACES_EXPORTER": "mesh_jsonl"}, said.append) is None
    assert configure("mesh-x", {"OTEL_TRACES_EXPORTER": "zipkin2"}, said.append) is None
    assert said == [
        "mesh: OTEL_TRACES_EXPORTER=mesh_jsonl needs MESH_OTEL_JSONL_PATH (a file to append "
        "spans to); not exporting there",
        "mesh: unknown trace exporter 'zipkin2' in OTEL_TRACES_EXPORTER (otlp, console, "
        "mesh_jsonl or none); ignored",
    ]


# ---- the headers on the wire ---------------------------------------------------------------------
def test_trace_headers_are_written_and_read_as_pamqp_does_them() -> None:
    from pamqp import decode, encode

    from mesh.transport.amqp091.publish import field_table as written
    from mesh.transport.amqp091.reading import field_table as read

    tables: list[dict[str, Any]] = [
        {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "tracestate": "k=v,é=ü"},
        {"x-mesh-agent-id": "echo-1"},
        {"x-delivery-count": 2, "traceparent": "t"},  # not all text: pamqp's own way
        {},
    ]
    for table in tables:
        assert written(table) == encode.field_table(table)
        assert read(written(table)) == decode.field_table(encode.field_table(table))[1]


def test_the_headers_written_directly_are_the_default_propagators(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The send path writes ``traceparent``/``tracestate`` itself while the global propagator
    is OpenTelemetry's default: what it writes is byte for byte what the propagator writes;
    with baggage in the context, or another propagator, the propagator writes them."""
    from opentelemetry import baggage, context, propagate, trace
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    from mesh.tracing import spans as spans_module

    parent = SpanContext(
        trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
        span_id=0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "x1"), ("other", "y2")]),
    )
    span = NonRecordingSpan(parent)
    direct = spans_module._inject(span, {"x-mesh-features": "a"})
    by_propagator: dict[str, Any] = {"x-mesh-features": "a"}
    propagate.inject(by_propagator, context=trace.set_span_in_context(span))
    assert direct == by_propagator
    assert direct["tracestate"] == "vendor=x1,other=y2"

    token = context.attach(baggage.set_baggage("tenant", "t-1"))
    try:
        assert spans_module._inject(span, None)["baggage"] == "tenant=t-1"  # the propagator's
    finally:
        context.detach(token)

    class Marker(TextMapPropagator):  # a user's own: not W3C's format at all
        def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
            return context

        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            carrier["x-marker"] = "mine"

        @property
        def fields(self) -> set[str]:
            return {"x-marker"}

    monkeypatch.setattr(propagate, "get_global_textmap", lambda: Marker())
    assert spans_module._inject(span, None) == {"x-marker": "mine"}
