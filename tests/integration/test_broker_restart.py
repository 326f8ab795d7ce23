"""A real broker restart (``rabbitmqctl stop_app`` / ``start_app``) under a running mesh.

Non-durable queues (heartbeats, requests, agent control queues) vanish with the broker; the
robust connections must declare them again, re-bind them and restore every consumer, and the
manager must not evict agents for the silence the outage caused.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES

from .harness import eventually

RABBITMQCTL = shutil.which("rabbitmqctl")

pytestmark = pytest.mark.skipif(
    RABBITMQCTL is None, reason="needs rabbitmqctl for the broker under test (a local broker)"
)


def rabbitmqctl(*args: str) -> None:
    assert RABBITMQCTL is not None
    subprocess.run([RABBITMQCTL, *args], check=True, capture_output=True, timeout=120)


async def test_after_a_broker_restart_consumers_are_restored_and_tasks_run_again(
    amqp_url: str, namespace: str, manager: ManagerService
) -> None:
    agent = SAMPLES["calc"]("calc-restart", heartbeat_interval_s=5.0)
    runtime = AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))
    await runtime.start()
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="restart-client")
    try:
        assert (await client.run_task("math.evaluate", {"expression": "1+1"})).output["value"] == 2

        await asyncio.to_thread(rabbitmqctl, "stop_app")
        try:
            await asyncio.sleep(1)
        finally:
            await asyncio.to_thread(rabbitmqctl, "start_app")
        await asyncio.to_thread(rabbitmqctl, "await_startup")

        async def serves() -> bool:
            try:
                outcome = await client.run_task(
                    "math.evaluate", {"expression": "20+22"}, timeout_s=3
                )
            except Exception:
                return False
            return outcome.output["value"] == 42

        await eventually(serves, timeout_s=60, what="a task to run after the broker restart")
        assert manager.counters["reconnects"] >= 1
        assert manager.core.counters["lost"] == 0
        assert "calc-restart" in manager.core.agents
        heartbeats = manager.counters["heartbeats"]
        await eventually(
            lambda: manager.counters["heartbeats"] > heartbeats,
            timeout_s=15,
            what="heartbeats to flow again",
        )
    finally:
        await client.close()
        await runtime.stop()
