"""A graceful broker restart (``stop_app`` / ``start_app``) under a running mesh, on the fault
suite's own node — never the shared broker other tests use.

Non-durable queues (heartbeats, requests, agent control queues) vanish with the broker; the
robust connections must declare them again, re-bind them and restore every consumer, and the
manager must not evict agents for the silence the outage caused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from integration.harness import eventually, manager_settings, start_manager

from mesh.agent import AgentRuntime, AgentSettings
from mesh.producer import MeshClient
from mesh.samples import SAMPLES

from .broker_node import BrokerNode

# aio-pika's robust connection retries every 5 s by default; 1 s keeps the test short.
URL_OPTIONS = "?reconnect_interval=1&heartbeat=5"


async def test_after_a_broker_restart_consumers_are_restored_and_tasks_run_again(
    node: BrokerNode, namespace: str, tmp_path: Path
) -> None:
    url = node.amqp_url + URL_OPTIONS
    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=url)
    )
    agent = SAMPLES["calc"]("calc-restart", heartbeat_interval_s=5.0)
    runtime = AgentRuntime(agent, AgentSettings(amqp_url=url, namespace=namespace))
    await runtime.start()
    client = await MeshClient.connect(url, namespace=namespace, name="restart-client")
    try:
        assert (await client.run_task("math.evaluate", {"expression": "1+1"})).output["value"] == 2

        await asyncio.to_thread(node.restart_app)

        async def serves() -> bool:
            try:
                outcome = await client.run_task(
                    "math.evaluate", {"expression": "20+22"}, timeout_s=3
                )
            except Exception:
                return False
            return outcome.output["value"] == 42

        await eventually(serves, timeout_s=60, what="a task to run after the broker restart")
        # aio-pika runs reconnect callbacks once every channel is restored; the manager's
        # consumers resubscribe as their own channels reopen, so it can serve a task first.
        await eventually(
            lambda: manager.counters["reconnects"] >= 1,
            timeout_s=15,
            what="the manager's reconnect callback (ConnectionRestored)",
        )
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
        await manager.stop()


async def test_run_task_waits_out_a_broker_outage_instead_of_failing_at_once(
    node: BrokerNode, namespace: str, tmp_path: Path
) -> None:
    """A ``run_task`` called while the broker is down asks for its lease again until its
    timeout and completes when the broker is back (it used to raise ``TransportError`` at
    once: 3,171 of 5,000 calls in the first run of ``test_effects_once.py``)."""
    url = node.amqp_url + URL_OPTIONS
    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=url)
    )
    agent = SAMPLES["calc"]("calc-outage", heartbeat_interval_s=5.0)
    runtime = AgentRuntime(agent, AgentSettings(amqp_url=url, namespace=namespace))
    await runtime.start()
    client = await MeshClient.connect(url, namespace=namespace, name="outage-client")
    try:
        assert (await client.run_task("math.evaluate", {"expression": "1+1"})).output["value"] == 2
        await asyncio.to_thread(node.ctl, "stop_app")
        try:
            running = asyncio.create_task(
                client.run_task("math.evaluate", {"expression": "6*7"}, timeout_s=60)
            )
            await asyncio.sleep(3.0)  # the broker away: the call keeps asking
            assert not running.done()
        finally:
            await asyncio.to_thread(node.ctl, "start_app")
        outcome = await asyncio.wait_for(running, 60)

        assert outcome.output["value"] == 42
        assert client.counters["acquire_retries"] >= 1
        assert manager.core.counters["lost"] == 0
    finally:
        await client.close()
        await runtime.stop()
        await manager.stop()
