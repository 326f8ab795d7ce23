"""A rolling deploy under load, with real ``mesh agent echo`` processes run by the local scaler.

Two "old" agents serve a steady stream of tasks. The roll-out replaces them one at a time, as
a Deployment with ``maxSurge: 1, maxUnavailable: 0`` does: start a new agent, wait until the
agent's ``/ready`` says 200, then scale down with ``remove_first`` = the old one, whose process
gets SIGTERM and drains (its ``/ready`` turns 503 at once, then the server goes with the
process). Every task submitted meanwhile must complete exactly once; the journal shows each old
agent Draining then Terminated, and each new one Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh.core.lifecycle import AgentState
from mesh.errors import MeshError
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.local import LocalProcessScaler

from .harness import eventually, http_agent_scaler

WORKERS = 6
LIVE = (AgentState.READY, AgentState.BUSY)


@dataclass
class Load:
    """What the producer sent and what came back, by message."""

    submitted: list[str] = field(default_factory=list)
    succeeded: Counter[str] = field(default_factory=Counter)
    failed: list[tuple[str, str]] = field(default_factory=list)
    served_by: Counter[str] = field(default_factory=Counter)


async def produce(client: MeshClient, load: Load, stop: asyncio.Event, worker: int) -> None:
    rng = random.Random(worker)
    for n in itertools.count():
        if stop.is_set():
            return
        message = f"w{worker}-{n}"
        load.submitted.append(message)
        try:
            outcome = await client.run_task(
                "test.echo", {"message": message, "sleep_ms": rng.randint(200, 400)}, timeout_s=20
            )
        except MeshError as exc:  # TaskFailed, TaskRefused, TaskTimeout, RequestTimeout...
            load.failed.append((message, f"{type(exc).__name__}: {exc}"))
            continue
        assert outcome.output["message"] == message
        load.succeeded[message] += 1
        load.served_by[outcome.lease.agent_id] += 1


async def ready_status(port: int) -> int | None:
    """The agent's ``GET /ready`` status; ``None`` when nothing listens (not yet, or gone)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(b"GET /ready HTTP/1.1\r\nHost: agent\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
    except ConnectionError:  # accepted just as the server closed: gone too
        return None
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return int(status_line.split()[1]) if status_line else None


async def watch_ready(port: int, seen: list[int | None], until_gone_s: float = 25.0) -> None:
    """Record each change of ``/ready`` in ``seen`` until the server is gone: [200, 503, None]
    for an agent that was ready, then drained and stopped."""
    deadline = time.monotonic() + until_gone_s
    while time.monotonic() < deadline:
        status = await ready_status(port)
        if not seen or seen[-1] != status:
            seen.append(status)
        if status is None:
            break
        await asyncio.sleep(0.02)


@pytest.fixture
async def scaler_and_ports(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[tuple[LocalProcessScaler, dict[str, int]]]:
    """The scaler, and the HTTP port of each agent it starts."""
    local, ports = http_agent_scaler(
        namespace,
        amqp_url,
        tmp_path / "agents",
        heartbeat_s=5.0,
        drain_timeout_s=20,
        termination_grace_s=25,
    )
    yield local, ports
    await local.close()


async def is_ready(port: int) -> bool:
    return await ready_status(port) == 200


def state(manager: ManagerService, agent_id: str) -> AgentState | None:
    agent = manager.core.agents.get(agent_id)
    return None if agent is None else agent.state


async def test_a_rolling_deploy_under_load_completes_every_task_exactly_once(
    manager: ManagerService,
    client: MeshClient,
    scaler_and_ports: tuple[LocalProcessScaler, dict[str, int]],
    tmp_path: Path,
) -> None:
    scaler, ports = scaler_and_ports
    started = time.monotonic()
    await scaler.scale_to("echo", 2)
    old = ["echo-1", "echo-2"]
    assert scaler.pods("echo") == old
    await eventually(
        lambda: all(state(manager, a) in LIVE for a in old), timeout_s=30, what="old agents Ready"
    )

    load, stop = Load(), asyncio.Event()
    workers = [asyncio.create_task(produce(client, load, stop, w)) for w in range(WORKERS)]
    try:
        await eventually(lambda: len(load.succeeded) >= 2 * WORKERS, what="steady traffic")
        for retiring in old:
            await scaler.scale_to("echo", 3)
            fresh = scaler.pods("echo")[-1]
            # The roll-out waits for the new agent's readiness probe, as Kubernetes does.
            await eventually(
                lambda p=ports[fresh]: is_ready(p), timeout_s=30, what=f"{fresh}'s /ready"
            )
            assert state(manager, fresh) in LIVE
            await eventually(
                lambda r=retiring: manager.core.agents[r].in_flight > 0,
                what=f"{retiring} to hold work as it is removed",
            )
            seen: list[int | None] = []
            watch = asyncio.create_task(watch_ready(ports[retiring], seen))
            await eventually(lambda s=seen: s == [200], what=f"{retiring}'s /ready watched")
            await scaler.scale_to("echo", 2, remove_first=retiring)
            assert retiring in scaler.terminating("echo")
            await watch
            # Ready until SIGTERM, 503 while it drains, then gone with the process.
            assert seen == [200, 503, None]
            await eventually(
                lambda r=retiring: scaler.exit_code(r) is not None,
                timeout_s=10,
                what=f"{retiring} to exit",
            )
        during_roll = len(load.submitted)
        await eventually(
            lambda: len(load.submitted) >= during_roll + WORKERS, what="traffic after the roll"
        )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 30)

    # Every task submitted before, during and after the roll-out: one result each, no failure.
    assert load.failed == []
    assert len(load.submitted) == len(set(load.submitted))
    assert set(load.succeeded) == set(load.submitted)
    assert all(n == 1 for n in load.succeeded.values())
    assert client.counters["late_replies"] == 0  # no task answered twice
    assert scaler.exit_code("echo-1") == 0 and scaler.exit_code("echo-2") == 0
    assert scaler.pods("echo") == ["echo-3", "echo-4"]
    assert {"echo-1", "echo-2", "echo-3", "echo-4"} <= set(load.served_by)
    for agent_id in ("echo-1", "echo-2"):
        agent_log = (tmp_path / "agents" / f"{agent_id}.log").read_text()
        assert "redelivered" not in agent_log  # no task ran twice
        assert "giving up a task" not in agent_log

    journal = SqliteJournal(tmp_path / "journal.sqlite3")
    try:
        for agent_id in ("echo-1", "echo-2"):
            moves = [(e.from_state, e.to_state) for e in journal.tail(500, agent_id=agent_id)]
            entered = [to for _, to in moves]
            assert "Draining" in entered and ("Draining", "Terminated") in moves, moves
            assert entered.index("Draining") < entered.index("Terminated"), moves
        for agent_id in ("echo-3", "echo-4"):
            moves = [(e.from_state, e.to_state) for e in journal.tail(500, agent_id=agent_id)]
            assert ("Registering", "Ready") in moves, moves
            assert "Terminated" not in [to for _, to in moves]
    finally:
        journal.close()
    print(
        f"\nrolling deploy: {len(load.submitted)} tasks, served by {dict(load.served_by)}, "
        f"{time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
