"""Whether this process traces: OpenTelemetry imported lazily, and the tracer the mesh uses.

Tracing is on when ``opentelemetry`` imports and a real tracer provider is set — the global
one (``opentelemetry.trace.set_tracer_provider``: the ``mesh`` CLI sets it from the ``OTEL_*``
environment, :mod:`mesh.tracing.setup`; a library user sets their own), or one handed to
:func:`use_provider` (tests and benchmarks). Without the package, :func:`tracer` answers
``None`` after one check of a module global; with the package and no provider, after a look
at the global provider (one set later is still found: a found tracer is kept, a missing one
is looked for again).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any, Final

__all__ = ["available", "otel", "tracer", "use_global_provider", "use_provider"]

TRACER_NAME: Final = "agent-mesh"

_UNSET: Final[Any] = object()
_api: Any = None  # the OpenTelemetry API's modules once imported; False when they cannot be
_tracer: Any = None  # the tracer once a real provider was found
_override: Any = _UNSET  # a provider handed to use_provider (None: tracing off)


def _load() -> Any:
    """The API's modules (``trace``, ``context``, ``propagate``), or ``False`` when they cannot
    be imported (then never tried again). Imported by name, so that type checking sees the
    same thing with the package installed or not."""
    global _api
    if _api is None:
        try:
            _api = SimpleNamespace(
                trace=importlib.import_module("opentelemetry.trace"),
                context=importlib.import_module("opentelemetry.context"),
                propagate=importlib.import_module("opentelemetry.propagate"),
                baggage=importlib.import_module("opentelemetry.baggage"),
            )
        except ImportError:
            _api = False
    return _api


def otel() -> Any:
    """The API's modules (``.trace``, ``.context``, ``.propagate``, ``.baggage``); only for
    code that runs once :func:`tracer` gave a tracer (so they imported)."""
    return _api


def available() -> bool:
    """Whether ``opentelemetry`` (the API) can be imported here."""
    return _load() is not False


def tracer() -> Any:
    """The tracer the mesh's spans come from, or ``None``: tracing is off."""
    found = _tracer
    if found is not None:
        return found
    return _find()


def _find() -> Any:
    global _tracer
    api = _load()
    if api is False:
        return None
    provider = _override
    if provider is _UNSET:
        trace = api.trace
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None  # nobody set one: the API would hand out no-op spans
    if provider is None:
        return None
    _tracer = provider.get_tracer(TRACER_NAME, _version())
    return _tracer


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-mesh")
    except PackageNotFoundError:
        return None


def use_provider(provider: Any) -> None:
    """Trace through ``provider`` from now on, whatever the global one is (``None``: do not
    trace). For tests and benchmarks, which switch tracing on and off in one process; the
    global provider can be set only once."""
    global _override, _tracer
    _override, _tracer = provider, None


def use_global_provider() -> None:
    """Undo :func:`use_provider`: follow the global tracer provider again."""
    use_provider(_UNSET)
