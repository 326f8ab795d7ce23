"""The local-process scaler with a stand-in command: counts, IDs, removal order, replacement."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from mesh.scaler.base import Scaler, ScalerError
from mesh.scaler.local import LocalProcessScaler, sample_command

# Sleeps until SIGTERM, then says so and exits 0 (as a draining agent does).
STAND_IN = (
    "import os, signal, sys, time\n"
    "def bye(*_):\n"
    "    print('got SIGTERM', os.environ['AGENT_ID'], flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('started', sys.argv[1], flush=True)\n"
    "time.sleep(600)\n"
)
IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
)


def stand_in(deployment: str, agent_id: str) -> list[str]:
    return [sys.executable, "-c", STAND_IN, agent_id]


@pytest.fixture
async def scaler(tmp_path: Path) -> AsyncIterator[LocalProcessScaler]:
    local = LocalProcessScaler(
        stand_in, log_dir=tmp_path / "logs", termination_grace_s=5, reconcile_interval_s=0.05
    )
    yield local
    await local.close()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def all_started(log_dir: Path, *agent_ids: str) -> None:
    """Wait until each stand-in has installed its SIGTERM handler (it says so in its log)."""

    def started(agent_id: str) -> bool:
        log = log_dir / f"{agent_id}.log"
        return log.exists() and f"started {agent_id}".encode() in log.read_bytes()

    await until(lambda: all(started(a) for a in agent_ids))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_it_is_a_scaler(scaler: LocalProcessScaler) -> None:
    port: Scaler = scaler
    assert port is scaler


async def test_scaling_up_starts_processes_named_after_the_deployment(
    scaler: LocalProcessScaler, tmp_path: Path
) -> None:
    assert await scaler.current_replicas("echo") == 0

    await scaler.scale_to("echo", 3)

    assert await scaler.current_replicas("echo") == 3
    assert scaler.pods("echo") == ["echo-1", "echo-2", "echo-3"]
    await all_started(tmp_path / "logs", "echo-1", "echo-2", "echo-3")


async def test_scaling_down_stops_remove_first_then_the_newest(
    scaler: LocalProcessScaler, tmp_path: Path
) -> None:
    await scaler.scale_to("echo", 4)
    await all_started(tmp_path / "logs", "echo-1", "echo-2", "echo-3", "echo-4")
    pids = {agent_id: scaler.pid(agent_id) for agent_id in scaler.pods("echo")}

    await scaler.scale_to("echo", 2, remove_first="echo-2")

    assert scaler.pods("echo") == ["echo-1", "echo-3"]
    assert await scaler.current_replicas("echo") == 2
    await until(lambda: scaler.exit_code("echo-2") == 0 and scaler.exit_code("echo-4") == 0)
    assert scaler.terminating("echo") == []
    assert all(alive(pid) for aid, pid in pids.items() if aid in ("echo-1", "echo-3") and pid)
    assert b"got SIGTERM echo-2" in (tmp_path / "logs" / "echo-2.log").read_bytes()


async def test_an_unknown_remove_first_stops_the_newest_instead(
    scaler: LocalProcessScaler,
) -> None:
    await scaler.scale_to("echo", 2)

    await scaler.scale_to("echo", 1, remove_first="echo-99")

    assert scaler.pods("echo") == ["echo-1"]


async def test_agent_ids_are_never_reused(scaler: LocalProcessScaler) -> None:
    await scaler.scale_to("echo", 2)
    await scaler.scale_to("echo", 0)
    await scaler.scale_to("echo", 2)
    await scaler.scale_to("calc", 1)

    assert scaler.pods("echo") == ["echo-3", "echo-4"]
    assert scaler.pods("calc") == ["calc-1"]


async def test_deleting_a_lost_pod_kills_it_and_starts_a_replacement(
    scaler: LocalProcessScaler,
) -> None:
    await scaler.scale_to("echo", 2)
    lost_pid = scaler.pid("echo-1")

    await scaler.delete_pod("echo", "echo-1")

    assert scaler.pods("echo") == ["echo-2", "echo-3"]
    assert await scaler.current_replicas("echo") == 2
    await until(lambda: scaler.exit_code("echo-1") is not None)
    assert scaler.exit_code("echo-1") == -9  # SIGKILL: a lost agent gets no drain
    assert lost_pid is not None and not alive(lost_pid)


async def test_a_process_that_dies_on_its_own_is_replaced(scaler: LocalProcessScaler) -> None:
    await scaler.scale_to("echo", 2)
    pid = scaler.pid("echo-1")
    assert pid is not None

    os.kill(pid, 9)

    await until(lambda: scaler.pods("echo") == ["echo-2", "echo-3"])
    assert await scaler.current_replicas("echo") == 2


async def test_a_crash_looping_command_backs_off(tmp_path: Path) -> None:
    crashing = LocalProcessScaler(
        lambda d, a: [sys.executable, "-c", "raise SystemExit(3)"],
        log_dir=tmp_path,
        reconcile_interval_s=0.02,
    )
    try:
        await crashing.scale_to("bad", 1)
        await asyncio.sleep(1.5)
        started = len(crashing.pods("bad")) + sum(
            crashing.exit_code(f"bad-{n}") is not None for n in range(1, 20)
        )
    finally:
        await crashing.close()
    # Back-off 0.5 s, 1 s, 2 s ... after each young death: a handful, not dozens.
    assert 2 <= started <= 4
    assert crashing.exit_code("bad-1") == 3


async def test_close_stops_every_process(tmp_path: Path) -> None:
    local = LocalProcessScaler(stand_in, log_dir=tmp_path, reconcile_interval_s=None)
    await local.scale_to("echo", 2)
    await local.scale_to("calc", 1)
    await all_started(tmp_path, "echo-1", "echo-2", "calc-1")
    pids = [local.pid(a) for a in ("echo-1", "echo-2", "calc-1")]

    await local.close()

    assert [local.exit_code(a) for a in ("echo-1", "echo-2", "calc-1")] == [0, 0, 0]
    assert not any(alive(pid) for pid in pids if pid)
    with pytest.raises(ScalerError):
        await local.scale_to("echo", 1)


async def test_close_kills_what_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    stubborn = LocalProcessScaler(
        lambda d, a: [sys.executable, "-c", IGNORES_SIGTERM],
        log_dir=tmp_path,
        termination_grace_s=0.5,
        reconcile_interval_s=None,
    )
    await stubborn.scale_to("stuck", 1)
    await asyncio.sleep(0.3)  # let it install its handler

    started = time.monotonic()
    await stubborn.close()

    assert stubborn.exit_code("stuck-1") == -9
    assert time.monotonic() - started < 3


async def test_a_command_that_cannot_start_is_a_scaler_error(tmp_path: Path) -> None:
    broken = LocalProcessScaler(
        lambda d, a: [str(tmp_path / "no-such-binary")], log_dir=tmp_path, reconcile_interval_s=None
    )
    try:
        with pytest.raises(ScalerError, match="cannot start broken-1"):
            await broken.scale_to("broken", 1)
    finally:
        await broken.close()


def test_the_sample_command_runs_mesh_agent_with_the_deployment_as_the_sample() -> None:
    command_for = sample_command("ns1", "amqp://u:p@h:5672/", 5.0, extra_args=["--x", "1"])

    argv = command_for("echo", "echo-7")

    assert argv[:3] == [sys.executable, "-m", "mesh"]
    assert argv[3:] == [
        "--amqp-url", "amqp://u:p@h:5672/", "--namespace", "ns1",
        "agent", "echo", "--id", "echo-7", "--heartbeat-interval", "5.0", "--x", "1",
    ]  # fmt: skip
    assert "--amqp-url" not in sample_command("ns1", None, 5.0)("calc", "calc-1")
    with pytest.raises(ScalerError, match="no sample agent"):
        command_for("nope", "nope-1")
