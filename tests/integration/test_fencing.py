"""A lost agent is cut off the broker (issue 7): with the management API configured, the manager
closes the connections of an agent it declares lost, so the broker requeues the tasks the agent
still held at once — rather than when the agent's AMQP heartbeat finally times out (a minute by
default), or never, if the agent is frozen but its TCP connection is not.

The agent here is connected and holds an unacked task, but stops heartbeating: exactly what a
frozen process looks like to the manager. Without a management API the manager cannot fence,
and says so in a counter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mesh.topology import Topology
from mesh.transport import Delivery
from mesh.transport.amqp import AmqpTransport

from .harness import RawAgent, eventually, management_url, manager_settings, start_manager


async def silent_agent_holding_a_task(
    amqp_url: str, topology: Topology, agent_id: str
) -> tuple[RawAgent, AmqpTransport, asyncio.Event, list[Delivery]]:
    """An agent that registers, beats, takes one task from its queue without acking it, then
    goes silent; its connection is named as agents name theirs."""
    transport = await AmqpTransport.connect(amqp_url, name=f"agent:{agent_id}")
    dropped = asyncio.Event()
    transport.on_disconnect(dropped.set)
    agent = RawAgent(transport, topology, agent_id)
    await agent.start()
    held: list[Delivery] = []

    async def hold(delivery: Delivery) -> None:
        held.append(delivery)  # never settled: the task stays unacked with this agent

    await transport.consume(topology.agent_task_queue(agent_id), hold, prefetch=1)
    await agent.register()
    agent.start_heartbeats()
    return agent, transport, dropped, held


async def test_a_lost_agents_connections_are_closed_and_its_task_requeued_at_once(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any, topology: Topology
) -> None:
    manager = await start_manager(
        manager_settings(
            namespace,
            tmp_path / "journal.sqlite3",
            amqp_url=amqp_url,
            management_url=management_url(management_api, amqp_url),
        )
    )
    probe = await AmqpTransport.connect(amqp_url, name="fencing-probe")
    agent, transport, dropped, held = await silent_agent_holding_a_task(
        amqp_url, topology, "fenced-1"
    )
    try:
        await eventually(lambda: "fenced-1" in manager.core.agents, what="registered")
        queue = topology.agent_task_queue("fenced-1")
        await probe.publish("", queue, b'{"task": 1}')
        await eventually(lambda: len(held) == 1, what="the agent holding the task")

        await agent.stop_heartbeats()  # frozen, as far as the manager can tell
        await eventually(
            lambda: "fenced-1" not in manager.core.agents, timeout_s=10, what="declared lost"
        )
        await asyncio.wait_for(dropped.wait(), 10)  # cut off the broker (bound: 3 retries)
        await eventually(  # counted once the API's answer is back (after the close itself)
            lambda: manager.counters["agent_connections_closed"] == 1, what="counted"
        )
        # Requeued at once: back in the queue, or — this agent's client is not really frozen
        # and reconnects — already redelivered to it, marked as such.
        await eventually(
            lambda: (
                any(d.redelivered for d in held[1:])
                # (the statistics may not list the field until their first round)
                or management_api.get_queue(queue).get("messages_ready") == 1
            ),
            timeout_s=15,
            what="the held task requeued",
        )
    finally:
        await agent.stop_heartbeats()
        await transport.close()
        await probe.close()
        await manager.stop()


async def test_without_a_management_api_the_manager_cannot_fence_and_counts_it(
    amqp_url: str, namespace: str, tmp_path: Path, topology: Topology
) -> None:
    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    agent, transport, dropped, _ = await silent_agent_holding_a_task(
        amqp_url, topology, "unfenced-1"
    )
    try:
        await eventually(lambda: "unfenced-1" in manager.core.agents, what="registered")
        await agent.stop_heartbeats()
        await eventually(
            lambda: "unfenced-1" not in manager.core.agents, timeout_s=10, what="declared lost"
        )
        await eventually(lambda: manager.counters["fence_unavailable"] == 1, what="counted")
        assert not dropped.is_set()  # its connection lives on
    finally:
        await transport.close()
        await manager.stop()
