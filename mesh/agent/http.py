"""The agent's HTTP endpoints for probes and the preStop hook: ``/ready``, ``/healthz``, ``/drain``.

Theory of operation
-------------------
A deliberately small HTTP/1.1 server on :func:`asyncio.start_server`: one request per
connection (every response says ``Connection: close``), a bounded request head
(:data:`MAX_HEAD_BYTES`, else 431) and body (else 413), and a timeout on reading the
request (408). Parsing and rendering are pure functions (:func:`parse_request_head`,
:func:`render_response`); only :class:`AgentHttpServer` does I/O.

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
import contextlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from mesh.errors import MeshError

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024
"""The longest request line plus headers accepted."""
MAX_BODY_BYTES = 4 * 1024
"""The longest request body accepted (and discarded: no endpoint reads one)."""
DRAIN_SAFETY_MARGIN_S = 2.0
"""How long before the drain's own worst case the default ``/drain`` deadline answers."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_REQUEST_LEFT_UNREAD = frozenset({400, 408, 413, 431})
_LINGER_S = 1.0
_ROUTES: dict[str, tuple[str, ...]] = {
    "/ready": ("GET",),
    "/healthz": ("GET",),
    "/drain": ("GET", "POST"),
}


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


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request head."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]

    @property
    def content_length(self) -> int:
        """The declared body length (0 when absent); :class:`HttpError` when malformed."""
        raw = self.headers.get("content-length", "0").strip()
        if not raw.isdigit():
            raise HttpError(400, f"bad Content-Length {raw[:20]!r}")
        return int(raw)


@dataclass(frozen=True, slots=True)
class Response:
    """A JSON response; ``headers`` are added to the standard ones."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


class HttpError(Exception):
    """A request this server answers with an error status (the client's fault)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> Response:
        """The error as a JSON response."""
        return Response(self.status, {"error": self.message})


def parse_request_head(head: bytes) -> Request:
    """Parse a request line and headers (without the blank line); :class:`HttpError` if bad."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise HttpError(400, "undecodable request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise HttpError(400, "malformed request line")
    method, target, _version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "malformed header line")
        headers[name.lower()] = value.strip()
    url = urlsplit(target)
    if not url.path.startswith("/"):
        raise HttpError(400, "the request target must be an absolute path")
    return Request(method.upper(), url.path, parse_qs(url.query), headers)


def render_response(response: Response) -> bytes:
    """The bytes of ``response``: status line, headers (``Connection: close``), JSON body."""
    body = json.dumps(response.body, separators=(",", ":"), sort_keys=True).encode()
    reason = _REASONS.get(response.status, "Unknown")
    headers = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Cache-Control": "no-store",
        "Connection": "close",
        **response.headers,
    }
    head = f"HTTP/1.1 {response.status} {reason}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


def default_drain_deadline_s(drain_timeout_s: float, shutdown_grace_s: float) -> float:
    """``drain_timeout_s + shutdown_grace_s`` less the safety margin, at least 1 s."""
    return max(1.0, drain_timeout_s + shutdown_grace_s - DRAIN_SAFETY_MARGIN_S)


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
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._closing = asyncio.Event()
        self._connections: set[asyncio.Task[Any]] = set()
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int | None:
        """The bound port (the real one when 0 was asked for); ``None`` when not listening."""
        return self._port

    async def start(self) -> None:
        """Listen; :class:`HttpServerError` when the address cannot be bound."""
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self._requested_port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise HttpServerError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror or exc}"
            ) from exc
        self._port = int(self._server.sockets[0].getsockname()[1])
        log.info("http endpoints listening", extra={**self._extra, "port": self._port})

    async def close(self) -> None:
        """Stop listening, let pending answers (``/drain``) go out, then drop what is left."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        self._closing.set()
        pending = {task for task in self._connections if not task.done()}
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.close_grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=self.close_grace_s)
        await server.wait_closed()
        self._port = None

    # ---- connections ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        current = asyncio.current_task()
        if current is not None:
            self._connections.add(current)
        try:
            response = await self._answer(reader)
            writer.write(render_response(response))
            async with asyncio.timeout(self.read_timeout_s):
                await writer.drain()
            if response.status in _REQUEST_LEFT_UNREAD:
                await _discard_input(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the client went away or stopped reading: nobody to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()
            if current is not None:
                self._connections.discard(current)

    async def _answer(self, reader: asyncio.StreamReader) -> Response:
        try:
            request = await self._read_request(reader)
            return await self._route(request)
        except HttpError as exc:
            return exc.response()
        except Exception:
            log.exception("http endpoint failed", extra=self._extra)
            return Response(500, {"error": "internal error"})

    async def _read_request(self, reader: asyncio.StreamReader) -> Request:
        try:
            async with asyncio.timeout(self.read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
                request = parse_request_head(head[:-4])
                length = request.content_length
                if length > MAX_BODY_BYTES:
                    raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes")
                if length:
                    await reader.readexactly(length)
        except TimeoutError:
            raise HttpError(408, "request not received in time") from None
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head over {MAX_HEAD_BYTES} bytes") from None
        except asyncio.IncompleteReadError:
            raise HttpError(400, "incomplete request") from None
        return request

    async def _route(self, request: Request) -> Response:
        allowed = _ROUTES.get(request.path)
        if allowed is None:
            raise HttpError(404, f"no endpoint {request.path[:100]}")
        if request.method not in allowed:
            return Response(
                405, {"error": f"use {' or '.join(allowed)}"}, {"Allow": ", ".join(allowed)}
            )
        if request.path == "/ready":
            return self._ready()
        if request.path == "/healthz":
            return self._healthz()
        return await self._drain(request)

    # ---- endpoints --------------------------------------------------------------------------
    def _ready(self) -> Response:
        target = self.target
        ready = target.ready.is_set() and not target.draining and not target.stopped.is_set()
        body = {"ready": ready, "phase": target.phase, "draining": target.draining}
        return Response(200 if ready else 503, body)

    def _healthz(self) -> Response:
        alive = not self.target.stopped.is_set() and self.target.phase != "stopped"
        return Response(200 if alive else 503, {"alive": alive, "phase": self.target.phase})

    async def _drain(self, request: Request) -> Response:
        deadline_s = self._deadline_s(request)
        self._start_drain()
        finished = await self._wait_finished(deadline_s)
        body = {
            "drained": finished,
            "in_flight": self.target.in_flight,
            "phase": self.target.phase,
        }
        log.info("drain endpoint answered", extra={**self._extra, "drained": finished})
        return Response(200, body)

    def _deadline_s(self, request: Request) -> float:
        values = request.query.get("deadline_s")
        if not values:
            return self.drain_deadline_s
        try:
            deadline = float(values[-1])
        except ValueError:
            raise HttpError(400, "deadline_s must be a number of seconds") from None
        if not math.isfinite(deadline) or deadline < 0:
            raise HttpError(400, "deadline_s must be a finite number >= 0")
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


async def _discard_input(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A lingering close: closing with unread input would reset the connection, and the
    client could lose the error response. Send FIN, then read (bounded) until the client's."""
    if writer.can_write_eof():
        writer.write_eof()
    budget = MAX_HEAD_BYTES + MAX_BODY_BYTES
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(_LINGER_S):
            while budget > 0 and (chunk := await reader.read(budget)):
                budget -= len(chunk)
