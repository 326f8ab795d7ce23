"""The agent's HTTP endpoints: readiness follows the manager's acceptance and the drain,
liveness follows the runtime, and ``/drain`` (the preStop hook) returns when the work is done.

The first tests run a real SDK agent against the real broker and manager; the last ones talk
to the server over a stand-in runtime, for the HTTP edge cases that need no broker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.agent import AgentHttpServer, AgentRuntime, AgentSettings, HttpServerError
from mesh.agent.http import default_drain_deadline_s
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES

from .harness import eventually, manager_settings, start_manager


async def http(
    port: int, path: str, *, method: str = "GET", raw: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    """One request to 127.0.0.1:``port``; the status and the JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw or f"{method} {path} HTTP/1.1\r\nHost: agent\r\n\r\n".encode())
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 120)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *headers = head.decode().split("\r\n")
    assert "connection: close" in [h.lower() for h in headers]
    return int(status_line.split()[1]), json.loads(body)


async def status_of(port: int, raw: bytes) -> bytes:
    """The status line the server answers ``raw`` with (``b""``: it closed without one)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
        await writer.wait_closed()
    return response.partition(b"\r\n")[0]


def runtime_for(
    sample: str, agent_id: str, amqp_url: str, namespace: str, **settings: Any
) -> AgentRuntime:
    agent = SAMPLES[sample](agent_id, heartbeat_interval_s=5.0)
    return AgentRuntime(
        agent,
        AgentSettings(
            amqp_url=amqp_url,
            namespace=namespace,
            http_host="127.0.0.1",
            http_port=0,
            **settings,
        ),
    )


@pytest.fixture
async def runtimes() -> AsyncIterator[list[AgentRuntime]]:
    started: list[AgentRuntime] = []
    yield started
    for runtime in reversed(started):
        await runtime.stop()


# ---- with the real broker and manager ---------------------------------------------------------
async def test_ready_is_503_while_registering_and_200_once_the_manager_accepts(
    amqp_url: str, namespace: str, tmp_path: Path, runtimes: list[AgentRuntime]
) -> None:
    runtime = runtime_for("calc", "calc-probe", amqp_url, namespace, registration_backoff_cap_s=0.5)
    runtimes.append(runtime)
    starting = asyncio.create_task(runtime.start())  # no manager yet: it keeps registering
    await eventually(lambda: runtime.http_port is not None, what="the http server")
    port = runtime.http_port
    assert port is not None

    assert await http(port, "/healthz") == (200, {"alive": True, "phase": "starting"})
    assert await http(port, "/ready") == (
        503,
        {"ready": False, "phase": "starting", "draining": False},
    )

    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    try:
        await asyncio.wait_for(starting, 20)
        assert "calc-probe" in manager.core.agents
        assert await http(port, "/ready") == (
            200,
            {"ready": True, "phase": "running", "draining": False},
        )
        assert (await http(port, "/healthz"))[0] == 200
        await runtime.stop()
    finally:
        await manager.stop()

    # At the very end of the shutdown the server is gone: the probes fail hard.
    assert runtime.http_port is None
    with pytest.raises(ConnectionRefusedError):
        await http(port, "/healthz")


async def test_drain_flips_ready_at_once_and_returns_only_when_the_work_in_flight_is_done(
    amqp_url: str,
    namespace: str,
    manager: ManagerService,
    client: MeshClient,
    runtimes: list[AgentRuntime],
) -> None:
    runtime = runtime_for("echo", "echo-prestop", amqp_url, namespace)
    runtimes.append(runtime)
    await runtime.start()
    port = runtime.http_port
    assert port is not None
    assert (await http(port, "/ready"))[0] == 200
    tasks = [
        asyncio.create_task(
            client.run_task("test.echo", {"message": f"m{i}", "sleep_ms": 1500}, timeout_s=30)
        )
        for i in range(4)
    ]
    await eventually(lambda: runtime.in_flight["test.echo"] == 4, what="four tasks in flight")

    drain = asyncio.create_task(http(port, "/drain", method="POST"))
    await eventually(lambda: runtime.draining, timeout_s=5, what="the drain to start")
    ready = await http(port, "/ready")
    assert ready == (503, {"ready": False, "phase": "running", "draining": True})
    assert (await http(port, "/healthz"))[0] == 200  # draining is alive
    assert not drain.done()

    status, body = await drain
    answered_at = time.time()

    assert (status, body["drained"]) == (200, True)
    assert body["in_flight"] == {"test.echo": 0}
    assert runtime.stopped.is_set()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert sorted(o.output["message"] for o in outcomes) == ["m0", "m1", "m2", "m3"]
    assert all(o.result.finished_at <= answered_at for o in outcomes)
    await eventually(lambda: "echo-prestop" not in manager.core.agents, what="deregistration")


async def test_drain_answers_before_its_deadline_when_the_work_takes_longer(
    amqp_url: str, namespace: str, client: MeshClient, runtimes: list[AgentRuntime]
) -> None:
    runtime = runtime_for("echo", "echo-deadline", amqp_url, namespace)
    runtimes.append(runtime)
    await runtime.start()
    port = runtime.http_port
    assert port is not None
    tasks = [
        asyncio.create_task(
            client.run_task("test.echo", {"message": f"long{i}", "sleep_ms": 3000}, timeout_s=30)
        )
        for i in range(2)
    ]
    await eventually(lambda: runtime.in_flight["test.echo"] == 2, what="two tasks in flight")

    started = time.monotonic()
    status, body = await http(port, "/drain?deadline_s=0.5")

    assert time.monotonic() - started < 2.5
    assert (status, body["drained"], body["in_flight"]) == (200, False, {"test.echo": 2})
    # The drain goes on without the hook: the work still finishes.
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    assert [o.output["message"] for o in outcomes] == ["long0", "long1"]
    await asyncio.wait_for(runtime.stopped.wait(), 15)


# ---- HTTP edge cases, over a stand-in runtime -------------------------------------------------
class StandIn:
    """Just enough of a runtime for the endpoints."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self.draining = False
        self.phase = "running"
        self.in_flight = {"x.y": 0}
        self.drains: list[str] = []

    async def drain(self, reason: str = "", *, timeout_s: float | None = None) -> None:
        self.drains.append(reason)
        self.draining = True
        self.ready.clear()


@pytest.fixture
async def stand_in_server() -> AsyncIterator[tuple[StandIn, AgentHttpServer]]:
    target = StandIn()
    server = AgentHttpServer(target, host="127.0.0.1", port=0, read_timeout_s=0.3)
    await server.start()
    yield target, server
    await server.close()


async def test_unknown_paths_are_404_and_wrong_methods_405(
    stand_in_server: tuple[StandIn, AgentHttpServer],
) -> None:
    _, server = stand_in_server
    assert server.port is not None

    assert (await http(server.port, "/nope"))[0] == 404
    assert (await http(server.port, "/ready", method="POST"))[0] == 405
    assert (await http(server.port, "/drain", method="DELETE"))[0] == 405
    assert (await http(server.port, "/ready?x=1"))[0] == 503  # the query is not the path


async def test_malformed_slow_and_oversized_requests_are_refused(
    stand_in_server: tuple[StandIn, AgentHttpServer],
) -> None:
    target, server = stand_in_server
    port = server.port
    assert port is not None

    # A malformed or oversized head: aiohttp's parser answers 400 (in plain text).
    assert (await status_of(port, b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.0 400 ")
    huge = b"GET /ready HTTP/1.1\r\nX-Pad: " + b"a" * 10_000 + b"\r\n\r\n"
    assert (await status_of(port, huge)).startswith(b"HTTP/1.0 400 ")
    # A request whose head never ends: its connection is closed after read_timeout_s.
    started = time.monotonic()
    assert await status_of(port, b"GET /ready HTTP/1.1\r\nHost: a\r\n") == b""
    assert time.monotonic() - started < 5
    big_body = b"POST /drain HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n"
    assert (await http(port, "", raw=big_body))[0] == 413
    assert target.drains == []  # refused before the endpoint ran
    assert (await http(port, "/drain?deadline_s=soon"))[0] == 400


async def test_healthz_is_503_once_the_runtime_stopped_and_drain_answers_at_once(
    stand_in_server: tuple[StandIn, AgentHttpServer],
) -> None:
    target, server = stand_in_server
    assert server.port is not None
    target.ready.set()
    assert (await http(server.port, "/ready"))[0] == 200

    target.phase = "stopped"
    target.stopped.set()

    assert await http(server.port, "/healthz") == (503, {"alive": False, "phase": "stopped"})
    assert (await http(server.port, "/ready"))[0] == 503
    status, body = await http(server.port, "/drain")
    assert (status, body["drained"]) == (200, True)
    assert target.drains == []  # nothing left to drain


async def test_closing_the_server_answers_a_pending_drain(
    stand_in_server: tuple[StandIn, AgentHttpServer],
) -> None:
    target, server = stand_in_server
    assert server.port is not None
    drain = asyncio.create_task(http(server.port, "/drain", method="POST"))
    await eventually(lambda: target.drains != [], what="the drain to start")

    await server.close()  # what the runtime does at the very end of its shutdown

    status, body = await asyncio.wait_for(drain, 5)
    assert (status, body["drained"]) == (200, True)
    assert target.drains == ["preStop: drain requested over http"]


async def test_a_port_in_use_is_a_clear_error() -> None:
    first = AgentHttpServer(StandIn(), host="127.0.0.1", port=0)
    await first.start()
    try:
        second = AgentHttpServer(StandIn(), host="127.0.0.1", port=first.port or 0)
        with pytest.raises(HttpServerError, match=r"cannot listen on 127\.0\.0\.1"):
            await second.start()
    finally:
        await first.close()


def test_the_default_drain_deadline_leaves_a_safety_margin() -> None:
    assert default_drain_deadline_s(60.0, 30.0) == 88.0
    assert default_drain_deadline_s(0.5, 0.5) == 1.0
