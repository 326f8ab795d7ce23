"""The manager's HTTP side: ``/metrics`` for Prometheus, ``/api/status``, ``/api/pools`` and a
status page.

Theory of operation
-------------------
An aiohttp application on the manager's event loop (aiohttp is already in every install: the
official Kubernetes client depends on it; it gives us a correct HTTP/1.1 server, routing and
static files without hand-written parsing). Nothing here changes state: every handler reads.

* ``GET /metrics`` — :class:`~mesh.manager.metrics.ManagerMetrics` in the Prometheus text
  format.
* ``GET /api/status`` — one JSON document with the whole picture an operator needs (see
  :meth:`~mesh.manager.observe.Observer.document`): pools with their descriptors' epochs,
  agents per state, in-flight against capacity per capability, queue depths with links into
  the RabbitMQ management UI, the most recent refusals, and the last minutes of history (one
  point per manager tick) for the charts. The figures come from running aggregates; agent
  rows come one page at a time (``?agents_offset=0&agents_limit=200``, the default; at most
  5,000 a page), with ``agents_total`` beside them.
* ``GET /api/pools`` — every pool's signals for scaling (``{"pools": {"<pool>": {...}}}``,
  each a :class:`~mesh.wire.status.PoolSignals`), and ``GET /api/pools/<pool>`` one pool's
  (404 for a pool this manager does not know): what an autoscaler reads (KEDA's
  ``metrics-api`` scaler, ``valueLocation: demand``). Both carry ``manager_id`` and
  ``served_at``.
* ``GET /`` — the status page (``mesh/manager/static/status.html``): plain HTML and one
  script, no build step; it polls ``/api/status``.

:class:`StatusHistory` keeps the time series and recent refusals in bounded memory; the
manager feeds it one sample per tick and every refusal as it happens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import quote

from aiohttp import web

from mesh.errors import MeshError
from mesh.manager.metrics import CONTENT_TYPE, ManagerMetrics
from mesh.wire.status import PoolSignals

log = logging.getLogger(__name__)

HISTORY_POINTS = 600
"""Samples kept for the charts (ten minutes at the default one-second tick)."""
RECENT_REFUSALS = 50


class WebServerError(MeshError):
    """The manager's HTTP server could not listen (the port is taken, for instance)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of history: cumulative counters and current levels at ``at``."""

    at: float
    admitted: int
    refused: int
    queue_messages: int
    agents_ready: int


class StatusHistory:
    """Bounded history for the status page: samples per tick, the latest refusals."""

    def __init__(self, points: int = HISTORY_POINTS, refusals: int = RECENT_REFUSALS) -> None:
        self.samples: deque[Sample] = deque(maxlen=points)
        self.refusals: deque[dict[str, Any]] = deque(maxlen=refusals)

    def sample(self, sample: Sample) -> None:
        self.samples.append(sample)

    def refusal(self, at: float, admission_id: str, outcome: str, reason: str, detail: str) -> None:
        self.refusals.appendleft(
            {
                "at": at,
                "admission_id": admission_id,
                "outcome": outcome,
                "reason": reason,
                "detail": detail[:300],
            }
        )


def management_queue_url(management_ui: str | None, vhost: str, queue: str) -> str | None:
    """The queue's page in the RabbitMQ management UI, or ``None`` without a UI address."""
    if not management_ui:
        return None
    return f"{management_ui.rstrip('/')}/#/queues/{quote(vhost, safe='')}/{quote(queue, safe='')}"


STATUS_AGENTS_LIMIT = 200
"""Agent rows ``/api/status`` includes unless asked for another page (``agents_limit``)."""
MAX_STATUS_AGENTS_LIMIT = 5_000


def _count(text: str, name: str, most: int | None) -> int:
    """A non-negative integer query parameter, at most ``most``."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {text!r}") from None
    if value < 0 or (most is not None and value > most):
        bound = "" if most is None else f" and at most {most}"
        raise ValueError(f"{name} must be at least 0{bound}, not {value}")
    return value


class ManagerWeb:
    """Serves ``/metrics``, ``/api/status``, ``/api/pools`` and ``/`` for one manager."""

    def __init__(
        self,
        metrics: ManagerMetrics,
        status: Callable[[int, int], Mapping[str, Any]],
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        pools: Callable[[], Mapping[str, PoolSignals]] = dict,
    ) -> None:
        self.metrics = metrics
        self.status = status
        self.pools = pools
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.router.add_get("/", self._page)
        # The page's script and style sheet (static/status.js, static/status.css).
        static = resources.files("mesh.manager").joinpath("static")
        app.router.add_static("/static/", str(static))
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/pools", self._pools)
        app.router.add_get("/api/pools/{pool_id}", self._pool)
        self.app = app

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise WebServerError(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
        self._runner = runner
        if runner.addresses:  # the bound socket tells the port when 0 was asked for
            self.port = int(runner.addresses[0][1])
        log.info("status page and metrics serving", extra={"url": self.url})

    async def close(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None

    async def _page(self, _: web.Request) -> web.Response:
        page = resources.files("mesh.manager").joinpath("static/status.html").read_text()
        return web.Response(
            text=page, content_type="text/html", headers={"Cache-Control": "no-store"}
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _status(self, request: web.Request) -> web.Response:
        try:
            offset = _count(request.query.get("agents_offset", "0"), "agents_offset", None)
            limit = _count(
                request.query.get("agents_limit", str(STATUS_AGENTS_LIMIT)),
                "agents_limit",
                MAX_STATUS_AGENTS_LIMIT,
            )
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        document = dict(self.status(offset, limit))
        document["served_at"] = time.time()
        return web.json_response(document, headers={"Cache-Control": "no-store"})

    async def _pools(self, _: web.Request) -> web.Response:
        pools = {
            pool_id: signals.model_dump(mode="json") for pool_id, signals in self.pools().items()
        }
        return self._json({"pools": pools})

    async def _pool(self, request: web.Request) -> web.Response:
        pool_id = request.match_info["pool_id"]
        found = self.pools().get(pool_id)
        if found is None:
            return web.json_response(
                {"error": f"no pool {pool_id!r} known to this manager"}, status=404
            )
        return self._json(found.model_dump(mode="json"))

    def _json(self, document: dict[str, Any]) -> web.Response:
        document["manager_id"] = self.metrics.view.manager_id
        document["served_at"] = time.time()
        return web.json_response(document, headers={"Cache-Control": "no-store"})
