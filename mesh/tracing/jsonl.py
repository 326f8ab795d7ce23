"""A span exporter the mesh ships: one JSON object a line per finished span, appended to a
file (``OTEL_TRACES_EXPORTER=mesh_jsonl``, ``MESH_OTEL_JSONL_PATH``) — what the tests read,
and a trace one can ``grep`` without a collector.

Each line: ``name``, ``trace_id`` and ``span_id`` (hex), ``parent_span_id`` (hex, or
``null`` for a root), ``kind`` (``SERVER``…), ``start_ns``/``end_ns``, ``attributes``,
``events`` (each ``name``, ``time_ns``, ``attributes``), ``service`` (the resource's
``service.name``), ``resource`` and ``status`` (``code``, ``description``). Imports the
OpenTelemetry SDK: loaded only where it is configured (:mod:`mesh.tracing.setup`).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Imported by name: type checking sees the same with the SDK installed or not.
_export = importlib.import_module("opentelemetry.sdk.trace.export")
SpanExporter: Any = _export.SpanExporter
SpanExportResult: Any = _export.SpanExportResult

__all__ = ["JsonLinesExporter", "span_record"]


def span_record(span: Any) -> dict[str, Any]:
    """One finished span as the JSON object its line holds."""
    context = span.get_span_context()
    parent = span.parent
    resource = dict(span.resource.attributes) if span.resource is not None else {}
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}" if context else None,
        "span_id": f"{context.span_id:016x}" if context else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "service": resource.get("service.name"),
        "resource": resource,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
    }


class JsonLinesExporter(SpanExporter):  # type: ignore[misc]
    """Appends each finished span to ``path`` as one JSON line (one write per batch, so
    processes appending to one file do not interleave within a line)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        lines = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, lines.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
