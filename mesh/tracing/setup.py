"""Setting up the OpenTelemetry SDK for a ``mesh`` process, from the standard environment.

Only the CLI calls :func:`configure` (``mesh manager``, ``mesh agent``, ``mesh demo``), at
process start; a library user who sets up their own tracer provider is never overridden.
Nothing is set up unless the SDK is installed and ``OTEL_TRACES_EXPORTER`` (or
``OTEL_EXPORTER_OTLP_ENDPOINT``, which means ``otlp``) is set; ``OTEL_SDK_DISABLED=true``
turns it off. Then:

* the service name is ``OTEL_SERVICE_NAME``, else the process's own (``mesh-manager``,
  ``mesh-agent-<id>``, ``mesh-producer``); ``OTEL_RESOURCE_ATTRIBUTES`` adds to the resource;
* the sampler is the SDK's, from ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
  (default ``parentbased_always_on``: a process follows the sampling decision its messages
  carry);
* each exporter named (comma-separated): ``otlp`` (OTLP over HTTP, batched; its endpoint
  from ``OTEL_EXPORTER_OTLP_ENDPOINT``; needs ``opentelemetry-exporter-otlp-proto-http``),
  ``console`` (stdout), ``mesh_jsonl`` (one JSON line per span appended to
  ``MESH_OTEL_JSONL_PATH``, exported as each span ends: :mod:`mesh.tracing.jsonl`),
  ``none``.

The provider flushes and shuts down at process exit (the SDK's own exit hook). A missing
package is one line on stderr naming what to install, and the process runs untraced.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

from mesh.tracing.state import available

__all__ = [
    "EXPORTER_ENV",
    "JSONL_EXPORTER",
    "JSONL_PATH_ENV",
    "MANAGER_SERVICE",
    "PRODUCER_SERVICE",
    "agent_service",
    "configure",
    "exporters_wanted",
]

EXPORTER_ENV: Final = "OTEL_TRACES_EXPORTER"
ENDPOINT_ENVS: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_ENV: Final = "OTEL_SERVICE_NAME"
JSONL_EXPORTER: Final = "mesh_jsonl"
JSONL_PATH_ENV: Final = "MESH_OTEL_JSONL_PATH"
OTLP_PACKAGE: Final = "opentelemetry-exporter-otlp-proto-http"
SDK_PACKAGE: Final = "'agent-mesh[otel]'"

MANAGER_SERVICE: Final = "mesh-manager"
PRODUCER_SERVICE: Final = "mesh-producer"

Warn = Callable[[str], None]


def agent_service(agent_id: str) -> str:
    """An agent process's default service name."""
    return f"mesh-agent-{agent_id}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def exporters_wanted(env: Mapping[str, str]) -> list[str]:
    """The exporters the environment asks for (empty: do not set up tracing)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get(EXPORTER_ENV)
    if named is None:
        return ["otlp"] if any(env.get(name) for name in ENDPOINT_ENVS) else []
    wanted = [name.strip().lower() for name in named.split(",") if name.strip()]
    return [name for name in wanted if name != "none"]


def configure(
    service: str, env: Mapping[str, str] | None = None, warn: Warn = _stderr
) -> str | None:
    """Set the global tracer provider as the environment asks, for a process whose service
    name is ``service`` unless ``OTEL_SERVICE_NAME`` says otherwise; what it exports, in
    one line (``None``: not set up)."""
    env = os.environ if env is None else env
    wanted = exporters_wanted(env)
    if not wanted:
        return None
    if not available():
        warn(f"mesh: {EXPORTER_ENV} is set but OpenTelemetry is not installed "
             f"(pip install {SDK_PACKAGE}); not tracing")  # fmt: skip
        return None
    try:
        sdk = importlib.import_module("opentelemetry.sdk.trace")
        export = importlib.import_module("opentelemetry.sdk.trace.export")
        resources = importlib.import_module("opentelemetry.sdk.resources")
    except ImportError:
        warn(f"mesh: {EXPORTER_ENV} is set but the OpenTelemetry SDK is not installed "
             f"(pip install {SDK_PACKAGE}); not tracing")  # fmt: skip
        return None
    processors = [(name, _processor(name, env, export, warn)) for name in wanted]
    used = [(name, processor) for name, processor in processors if processor is not None]
    if not used:
        return None
    name = env.get(SERVICE_ENV) or service
    provider = sdk.TracerProvider(resource=resources.Resource.create({"service.name": name}))
    for _, processor in used:
        provider.add_span_processor(processor)
    importlib.import_module("opentelemetry.trace").set_tracer_provider(provider)
    return f"tracing as {name} to {', '.join(_where(n, env) for n, _ in used)}"


def _processor(name: str, env: Mapping[str, str], export: Any, warn: Warn) -> Any:
    """The span processor for exporter ``name`` (``None``: it cannot be had, said why)."""
    if name == "otlp":
        try:
            otlp = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        except ImportError:
            warn(f"mesh: {EXPORTER_ENV}=otlp needs the OTLP exporter "
                 f"(pip install {OTLP_PACKAGE}); not exporting there")  # fmt: skip
            return None
        return export.BatchSpanProcessor(otlp.OTLPSpanExporter())
    if name == "console":
        return export.SimpleSpanProcessor(export.ConsoleSpanExporter())
    if name == JSONL_EXPORTER:
        path = env.get(JSONL_PATH_ENV)
        if not path:
            warn(f"mesh: {EXPORTER_ENV}={JSONL_EXPORTER} needs {JSONL_PATH_ENV} (a file to "
                 "append spans to); not exporting there")  # fmt: skip
            return None
        from mesh.tracing.jsonl import JsonLinesExporter

        return export.SimpleSpanProcessor(JsonLinesExporter(path))
    warn(f"mesh: unknown trace exporter {name!r} in {EXPORTER_ENV} (otlp, console, "
         f"{JSONL_EXPORTER} or none); ignored")  # fmt: skip
    return None


def _where(name: str, env: Mapping[str, str]) -> str:
    if name == "otlp":
        endpoint = next((env[e] for e in ENDPOINT_ENVS if env.get(e)), "http://localhost:4318")
        return f"otlp ({endpoint})"
    if name == JSONL_EXPORTER:
        return f"{JSONL_EXPORTER} ({env.get(JSONL_PATH_ENV)})"
    return name
