"""The agent's HTTP endpoints for probes and the preStop hook: ``/ready``, ``/healthz``, ``/drain``.

Theory of operation
-------------------
An aiohttp application on the agent's event loop (aiohttp parses and frames HTTP/1.1; this
module only routes and answers). Every answer is JSON and closes its connection. A request
whose head is not in within ``read_timeout_s`` has its connection closed; a malformed or
oversized head is answered 400 by aiohttp's parser; a body over :data:`MAX_BODY_BYTES` is
refused 413 unread (no endpoint reads one).

* ``GET /ready`` (readiness): 200 only while the manager has accepted the registration and
  the agent is not draining; 503 while registering, draining or stopped.
* ``GET /healthz`` (liveness): 200 while the event loop serves and the runtime has not
  stopped (a long drain is still alive); 503 once stopped.
* ``GET|POST /drain`` (the preStop hook): starts the drain, then answers when the runtime
  has finished its shutdown (``{"drained": true}``) or when the deadline is near
  (``{"drained": false}``; the drain goes on). The deadline is the ``deadline_s`` query
  parameter, else the server's ``drain_deadline_s``, else ``drain_timeout_s +
  shutdown_grace_s - 2`` s, so the hook returns before Kubernetes' grace period runs out.

The runtime starts the server at the beginning of ``start()`` and closes it at the very end
of its shutdown, *before* it reports itself stopped: :meth:`AgentHttpServer.close` wakes
pending ``/drain`` requests, lets them write their answer (bounded by ``close_grace_s``),
and only then returns, so a process that exits right after its runtime stopped has already
answered its preStop hook.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from mesh.agent.settings import AgentSettings
from mesh.errors import MeshError

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024
"""The longest request line, and the longest header line, accepted."""
MAX_BODY_BYTES = 4 * 1024
"""The longest request body accepted (and discarded: no endpoint reads one)."""
DRAIN_SAFETY_MARGIN_S = 2.0
"""How long before the drain's own worst case the default ``/drain`` deadline answers."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServerError(MeshError):
    """The agent's HTTP server could not listen (the port is taken, for instance)."""


class DrainTarget(Protocol):
    """What the HTTP endpoints need of a runtime (:class:`~mesh.agent.AgentRuntime` is one)."""

    @property
    def ready(self) -> asyncio.Event: ...
    @property
    def stopped(self) -> asyncio.Event: ...
    @property
    def draining(self) -> bool: ...
    @property
    def phase(self) -> str: ...
    @property
    def in_flight(self) -> dict[str, int]: ...

    async def drain(
        self, reason: str = "drain requested", *, timeout_s: float | None = None
    ) -> None: ...


def default_drain_deadline_s(drain_timeout_s: float, shutdown_grace_s: float) -> float:
    """``drain_timeout_s + shutdown_grace_s`` less the safety margin, at least 1 s."""
    return max(1.0, drain_timeout_s + shutdown_grace_s - DRAIN_SAFETY_MARGIN_S)


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    response = web.json_response(body, status=status, headers=headers)
    response.headers["Cache-Control"] = "no-store"
    response.force_close()  # one request per connection: nothing is left to time out
    return response


class AgentHttpServer:
    """Serves the probe and preStop endpoints of one runtime. See the module documentation."""

    def __init__(
        self,
        target: DrainTarget,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        drain_deadline_s: float = 88.0,
        read_timeout_s: float = 5.0,
        close_grace_s: float = 2.0,
        agent_id: str = "",
    ) -> None:
        """``drain_deadline_s``: when ``/drain`` answers at the latest without a ``deadline_s``
        parameter (the default suits the runtime's default settings: 60 + 30 - 2 s);
        ``read_timeout_s``: how long a client may take to send its request;
        ``close_grace_s``: how long :meth:`close` lets pending answers go out."""
        self.target = target
        self.host = host
        self.drain_deadline_s = drain_deadline_s
        self.read_timeout_s = read_timeout_s
        self.close_grace_s = close_grace_s
        self._requested_port = port
        self._extra = {"agent_id": agent_id}
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._closing = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None

    @classmethod
    def for_settings(
        cls, target: DrainTarget, settings: AgentSettings, agent_id: str
    ) -> AgentHttpServer | None:
        """The server ``settings`` ask for (``None``: no ``http_port``), its ``/drain``
        deadline derived from the drain's own timeouts unless set."""
        if settings.http_port is None:
            return None
        deadline = settings.http_drain_deadline_s
        if deadline is None:
            deadline = default_drain_deadline_s(settings.drain_timeout_s, settings.shutdown_grace_s)
        return cls(
            target,
            host=settings.http_host,
            port=settings.http_port,
            drain_deadline_s=deadline,
            agent_id=agent_id,
        )

    @property
    def port(self) -> int | None:
        """The bound port (the real one when 0 was asked for); ``None`` when not listening."""
        return self._port

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._answer_in_json])
        app.router.add_get("/ready", self._ready, allow_head=False)
        app.router.add_get("/healthz", self._healthz, allow_head=False)
        app.router.add_get("/drain", self._drain, allow_head=False)
        app.router.add_post("/drain", self._drain)
        return app

    async def start(self) -> None:
        """Listen; :class:`HttpServerError` when the address cannot be bound."""
        runner = web.AppRunner(
            self._app(),
            handle_signals=False,
            access_log=None,
            # No request may hold a connection open longer than this, answered or not (aiohttp
            # times an idle connection, the first request's head included, by this).
            keepalive_timeout=self.read_timeout_s,
            shutdown_timeout=self.close_grace_s,
            max_line_size=MAX_HEAD_BYTES,
            max_field_size=MAX_HEAD_BYTES,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self._requested_port).start()
        except OSError as exc:
            await runner.cleanup()
            raise HttpServerError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror or exc}"
            ) from exc
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        log.info("http endpoints listening", extra={**self._extra, "port": self._port})

    async def close(self) -> None:
        """Stop listening, let pending answers (``/drain``) go out, then drop what is left."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        self._closing.set()  # pending /drain requests answer now
        await runner.cleanup()  # waits for them, at most close_grace_s
        self._port = None

    @web.middleware
    async def _answer_in_json(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer JSON and closing its connection, errors included; a body too large
        refused before any endpoint runs."""
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return _json(413, {"error": f"request body over {MAX_BODY_BYTES} bytes"})
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = sorted(exc.allowed_methods)
            return _json(
                405, {"error": f"use {' or '.join(allowed)}"}, {"Allow": ", ".join(allowed)}
            )
        except web.HTTPNotFound:
            return _json(404, {"error": f"no endpoint {request.path[:100]}"})
        except web.HTTPException as exc:
            return _json(exc.status, {"error": exc.text or exc.reason})
        except Exception:
            log.exception("http endpoint failed", extra=self._extra)
            return _json(500, {"error": "internal error"})

    # ---- endpoints --------------------------------------------------------------------------
    async def _ready(self, request: web.Request) -> web.Response:
        target = self.target
        ready = target.ready.is_set() and not target.draining and not target.stopped.is_set()
        body = {"ready": ready, "phase": target.phase, "draining": target.draining}
        return _json(200 if ready else 503, body)

    async def _healthz(self, request: web.Request) -> web.Response:
        alive = not self.target.stopped.is_set() and self.target.phase != "stopped"
        return _json(200 if alive else 503, {"alive": alive, "phase": self.target.phase})

    async def _drain(self, request: web.Request) -> web.Response:
        deadline_s = self._deadline_s(request)
        self._start_drain()
        finished = await self._wait_finished(deadline_s)
        body = {
            "drained": finished,
            "in_flight": self.target.in_flight,
            "phase": self.target.phase,
        }
        log.info("drain endpoint answered", extra={**self._extra, "drained": finished})
        return _json(200, body)

    def _deadline_s(self, request: web.Request) -> float:
        values = request.query.getall("deadline_s", [])
        if not values:
            return self.drain_deadline_s
        try:
            deadline = float(values[-1])
        except ValueError:
            raise web.HTTPBadRequest(text="deadline_s must be a number of seconds") from None
        if not math.isfinite(deadline) or deadline < 0:
            raise web.HTTPBadRequest(text="deadline_s must be a finite number >= 0")
        return deadline

    def _start_drain(self) -> None:
        if self._drain_task is not None or self.target.stopped.is_set():
            return
        log.info("drain requested over http (preStop)", extra=self._extra)
        self._drain_task = asyncio.create_task(
            self.target.drain("preStop: drain requested over http"), name="agent-http-drain"
        )
        self._drain_task.add_done_callback(self._drain_done)

    def _drain_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain failed", exc_info=task.exception(), extra=self._extra)

    async def _wait_finished(self, deadline_s: float) -> bool:
        """Wait until the runtime has stopped or is closing this server, at most ``deadline_s``."""
        waiters = {
            asyncio.ensure_future(self.target.stopped.wait()),
            asyncio.ensure_future(self._closing.wait()),
        }
        try:
            await asyncio.wait(waiters, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return self.target.stopped.is_set() or self._closing.is_set()
