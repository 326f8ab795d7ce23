"""A graceful broker restart (``stop_app`` / ``start_app``) under a running mesh, on the fault
suite's own node — never the shared broker other tests use.

Non-durable queues (heartbeats, requests, agent control queues) vanish with the broker; the
robust connections must declare them again, re-bind them and restore every consumer, and the
manager must not evict agents for the silence the outage caused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from integration.harness import eventually, manager_settings, start_manager

from mesh.agent import AgentRuntime, AgentSettings
from mesh.errors import RequestTimeout
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.wire import StatusReply, StatusRequest

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


def manager_process(url: str, namespace: str, tmp: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``mesh manager`` in a process of its own (to be frozen), on the suite's node."""
    flags = {
        "--journal": str(tmp / "journal.sqlite3"),
        "--ledger": f"sqlite:{tmp / 'ledger.sqlite3'}",
        "--http-port": "-1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "mesh", "manager", *(x for f in flags.items() for x in f)],
        env={**os.environ, "MESH_AMQP_URL": url, "MESH_NAMESPACE": namespace},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


async def test_a_request_lost_with_the_broker_is_asked_again_after_the_reconnect(
    node: BrokerNode, namespace: str, tmp_path: Path
) -> None:
    """A request sitting in the manager's request queue (a classic queue, gone with its
    node) when the broker restarts: the client asks it again once it has reconnected, under
    the same correlation ID, and has its answer long before the request's own timeout (it
    waited for the whole timeout before: 10 s of ``submit`` after a cluster node's kill)."""
    url = node.amqp_url + URL_OPTIONS
    log = (tmp_path / "manager.log").open("wb")
    manager = manager_process(url, namespace, tmp_path, log)
    client = await MeshClient.connect(url, namespace=namespace, name="asked-again")
    try:

        async def answers() -> bool:
            try:
                await client.request(StatusRequest(agents_limit=0), timeout_s=2)
            except RequestTimeout:
                return False
            return True

        await eventually(answers, timeout_s=30, what="the manager answering")
        manager.send_signal(signal.SIGSTOP)  # it takes nothing from its queue now
        asked_at = time.monotonic()
        waiting = asyncio.create_task(client.request(StatusRequest(agents_limit=0), timeout_s=45))
        await asyncio.sleep(0.5)  # in the manager's request queue
        await asyncio.to_thread(node.ctl, "stop_app")  # the queue and the request are gone
        manager.send_signal(signal.SIGCONT)
        await asyncio.to_thread(node.ctl, "start_app")
        reply = await waiting
        took = time.monotonic() - asked_at

        assert isinstance(reply, StatusReply)
        assert client.counters["requests_asked_again"] >= 1
        assert took < 30, took  # answered after the reconnect, not at its timeout
        print(f"\nrequest lost with the broker answered {took:.1f} s after it was asked")
    finally:
        await client.close()
        manager.send_signal(signal.SIGCONT)
        manager.terminate()
        try:
            manager.wait(timeout=30)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()
        log.close()
