"""An agent takes control messages only from the managers' broker user.

Anyone who may publish to the agents exchange (a producer's user with broad permissions, say)
can put a message on an agent's control queue. The manager signs everything it publishes
(``user_id``, which RabbitMQ validates against the connection's user), and the agent learns
that user from the acceptance of its registration:

* a drain notice from another user is dead-lettered ``NOT_AUTHORIZED``, counted, and not
  obeyed — the agent keeps serving;
* an unsigned request to register again (an older manager's, mid-upgrade) is obeyed but taken
  as one that keeps the leases, so nobody can make an agent drop the leases it was told of;
* the managers' own requests are obeyed as before.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.transport.amqp import AmqpTransport
from mesh.wire import DrainNotice, ReRegisterRequest
from mesh.wire.models import Lease

from .harness import eventually
from .test_identity import broker_users as broker_users  # the fixture, used by name

pytestmark = pytest.mark.integration


@pytest.fixture
async def agent(
    manager: ManagerService, amqp_url: str, namespace: str
) -> AsyncIterator[AgentRuntime]:
    runtime = AgentRuntime(
        SAMPLES["echo"]("echo-1", heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


async def test_an_agent_takes_control_messages_only_from_the_managers_user(
    manager: ManagerService,
    client: MeshClient,
    agent: AgentRuntime,
    broker_users: object,
    amqp_url: str,
) -> None:
    assert agent.manager_user == "guest"  # learned from the signed acceptance
    lease = await client.acquire("test.echo")
    assert isinstance(lease, Lease), lease
    await eventually(lambda: lease.lease_id in agent.credentials.issued, what="the lease notice")

    intruder = await AmqpTransport.connect(
        broker_users("control-intruder"),  # type: ignore[operator]
        name="intruder",
        sign=True,
    )
    try:
        agents = manager.topology.agents_exchange
        await intruder.publish(agents, "echo-1", DrainNotice(agent_id="echo-1", reason="forged"))
        await eventually(
            lambda: agent.counters["control_not_from_manager"] == 1, what="the refusal"
        )
        assert not agent.draining

        before = agent.counters["registration_attempts"]
        intruder.signer = None  # unsigned, as an older manager publishes
        await intruder.publish(agents, "echo-1", ReRegisterRequest(agent_id="echo-1"))
        await eventually(
            lambda: agent.counters["registration_attempts"] == before + 1,
            what="registration again",
        )
        assert agent.counters["control_unsigned_reregister"] == 1
        assert (
            agent.counters["leases_forgotten"] == 0 and lease.lease_id in agent.credentials.issued
        )
    finally:
        await intruder.close()

    # The lease it kept still runs; the managers' own request is obeyed in full.
    result = await client._send_and_wait(lease, {"message": "hi", "sleep_ms": 0}, time.time() + 10)
    assert result.status == "ok", result
    await manager.transport.publish(
        manager.topology.agents_exchange, "echo-1", ReRegisterRequest(agent_id="echo-1")
    )
    await eventually(lambda: agent.counters["leases_forgotten"] == 1, what="leases forgotten")
    assert agent.counters["control_not_from_manager"] == 1
