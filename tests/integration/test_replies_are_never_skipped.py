"""A command that fails must never skip the reply its requester waits for. The case that
broke: ``mesh drain`` of an agent killed a moment ago — its control queue is gone, so the drain
notice is unroutable, and logging that with a reserved field (``msg``) raised ``KeyError`` and
took the rest of the command batch, the reply included, with it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.transport import AmqpTransport
from mesh.wire import DrainAccepted

from .harness import RawAgent, eventually


async def test_draining_an_agent_whose_queues_are_gone_is_answered(
    amqp_url: str,
    manager: ManagerService,
    client: MeshClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As `mesh manager` logs (INFO): a record is only built, and its fields checked, for a
    # level that is on.
    caplog.set_level(logging.INFO, logger="mesh")
    transport = await AmqpTransport.connect(amqp_url, name="doomed-agent")
    agent = RawAgent(transport, manager.topology, "doomed-1", interval_s=5.0)
    await agent.start()
    await agent.register()
    await eventually(lambda: "doomed-1" in manager.core.agents, what="doomed-1 registered")
    await transport.close()  # its auto-delete control queue goes with its connection

    async def control_queue_gone() -> bool:
        try:
            await client.transport.queue_depth(manager.topology.agent_control_queue("doomed-1"))
        except Exception:
            return True
        return False

    await eventually(control_queue_gone, what="the agent's control queue deleted")
    reply = await client.drain("doomed-1", "it was killed a moment ago")

    assert isinstance(reply, DrainAccepted), reply
    assert manager.counters["agent_unreachable"] >= 1  # the notice found no queue, counted
    assert manager.counters["command_errors"] == 0
