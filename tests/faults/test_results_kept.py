"""A finished task whose result cannot be published is not run again on the same agent
(issue 47): the broker is away when the handler returns, so the result publish fails and the
task goes back to the queue; when the connection is back, the broker redelivers it to the same
agent, which publishes the result it kept instead of running the handler a second time.

The agent reaches the shared broker through :class:`~tests.faults.tcp_proxy.TcpProxy` (only
the proxy's connections suffer); the manager and the producer connect directly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from integration.harness import eventually, manager_settings, start_manager

from mesh.agent import Agent, AgentRuntime, AgentSettings, capability
from mesh.producer import MeshClient

from .tcp_proxy import TcpProxy

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


class GatedAgent(Agent):
    """Runs one task at a time and finishes it only when the test opens the gate."""

    deployment = "gated"

    def __init__(self, agent_id: str) -> None:
        super().__init__(agent_id, heartbeat_interval_s=5.0)
        self.runs = 0
        self.started = asyncio.Event()
        self.gate = asyncio.Event()

    @capability(
        "test.gated", version="1.0.0", input_schema=SCHEMA, output_schema=SCHEMA, cost_class="C"
    )
    async def gated(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.runs += 1
        self.started.set()
        await self.gate.wait()
        return {"n": payload["n"]}


async def test_a_result_the_broker_could_not_take_is_published_on_redelivery_not_run_again(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    # (amqp_url: the shared broker the proxy fronts; asking for it also has the namespace's
    # queues deleted after the test.)
    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="results-kept")
    agent = GatedAgent("gated-1")
    async with TcpProxy() as proxy:
        runtime = AgentRuntime(
            agent,
            AgentSettings(
                amqp_url=f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
                namespace=namespace,
                result_publish_attempts=1,  # the broker is away for longer than one attempt
            ),
        )
        try:
            await asyncio.wait_for(runtime.start(), 20)
            running = asyncio.create_task(client.run_task("test.gated", {"n": 7}, timeout_s=60))
            await asyncio.wait_for(agent.started.wait(), 10)

            proxy.reset()  # the broker is gone for the agent: connections cut, new ones refused
            agent.gate.set()  # the handler returns while nothing can be published
            await asyncio.sleep(1.0)  # the handler returns; its publish fails
            proxy.pass_through()  # back: the agent reconnects and the task comes back to it

            outcome = await asyncio.wait_for(running, 40)
            await eventually(lambda: runtime.counters["reconnects"] >= 1, what="reconnected")
            counts = {
                "handler runs": agent.runs,
                "answered from the kept result": runtime.counters["tasks_finished_answered_later"],
                "reconnects": runtime.counters["reconnects"],
            }
            print(f"\nresults kept: {counts}")
            assert outcome.output == {"n": 7}
            assert agent.runs == 1, "the handler ran again for a result it had already"
            assert counts["answered from the kept result"] == 1
        finally:
            await runtime.stop()
            await client.close()
            await manager.stop()
