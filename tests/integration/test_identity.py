"""Agent identity, enforced by the broker and checked again by the manager (issue 7).

Each agent has a broker user of its own, named as the agent; everything it says about itself
(registration, heartbeats, drain request, deregistration) carries ``user_id``, which RabbitMQ
validates against the connection's user. A manager with ``agent_identity`` on counts such a
message only when the agent it names is the user who published it.

* The broker refuses a ``user_id`` that is not the connection's user: a forged signature never
  reaches the manager.
* A registration for another agent, correctly signed by its real publisher, is dead-lettered
  ``NOT_AUTHORIZED``, counted, and registers nobody (and nothing is sent to the named agent).
* Heartbeats for another agent are counted and dropped: they cannot keep a dead agent alive.
* An SDK agent on its own user registers and serves a task.
* A revoked user (deleted) is disconnected by the broker, and its agent is declared lost.
* A producer whose user name the URL must escape (``team%40a`` for ``team@a``) signs its
  requests with the name RabbitMQ decoded, and is the tenant of its admissions.

The users are made for each test through the management API (all permissions on the vhost:
topic permissions per agent are the next step) and deleted afterwards.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh.agent import AgentRuntime, AgentSettings
from mesh.errors import TransportError
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport.amqp import AmqpTransport
from mesh.wire import CapabilityRange, TaskRequirements
from mesh.wire.reasons import Reason

from .harness import FAST_POOL, RawAgent, eventually, manager_settings, start_manager

PASSWORD = "identity-test"


@pytest.fixture
def broker_users(management_api: Any, amqp_url: str) -> Iterator[Callable[[str], str]]:
    """``make(name)``: a broker user ``name`` (all permissions on the test vhost); returns
    its AMQP URL. Every user made is deleted afterwards (which closes its connections)."""
    made: list[str] = []
    parts = urllib.parse.urlsplit(amqp_url)
    vhost = management_api._q(management_api.vhost)

    def make(name: str) -> str:
        quoted = management_api._q(name)  # a name may hold characters a URL escapes
        management_api.request(
            "PUT", f"/api/users/{quoted}", body={"password": PASSWORD, "tags": ""}
        )
        made.append(quoted)
        management_api.request(
            "PUT",
            f"/api/permissions/{vhost}/{quoted}",
            body={"configure": ".*", "write": ".*", "read": ".*"},
        )
        user = urllib.parse.quote(name, safe="")
        netloc = f"{user}:{PASSWORD}@{parts.hostname}:{parts.port or 5672}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    yield make
    for quoted in made:
        management_api._delete(f"/api/users/{quoted}")


@pytest.fixture
async def manager(amqp_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[ManagerService]:
    service = await start_manager(
        manager_settings(
            namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url, agent_identity=True
        )
    )
    yield service
    await service.stop()


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[str, str], Any]]:
    made: list[AmqpTransport] = []

    async def make(url: str, name: str) -> AmqpTransport:
        transport = await AmqpTransport.connect(url, name=name, publish_timeout_s=3.0)
        made.append(transport)
        return transport

    yield make
    for transport in reversed(made):
        await transport.close()


def agent_name(tag: str) -> str:
    return f"id-{uuid.uuid4().hex[:8]}-{tag}"


async def test_the_broker_refuses_a_user_id_that_is_not_the_connections_user(
    manager: ManagerService, broker_users: Callable[[str], str], connect: Any, namespace: str
) -> None:
    name = agent_name("a")
    transport = await connect(broker_users(name), name)
    agent = RawAgent(transport, Topology(namespace), "someone-else", user_id="someone-else")
    before = manager.counters.copy()
    with pytest.raises(TransportError):
        await agent.register()  # RabbitMQ: PRECONDITION_FAILED, the channel is closed
    await asyncio.sleep(0.5)
    assert "someone-else" not in manager.core.agents
    assert (
        manager.counters["received.mesh.agent-registration.v1"]
        == (before["received.mesh.agent-registration.v1"])
    )


async def test_a_registration_for_another_agent_is_dead_lettered_and_registers_nobody(
    manager: ManagerService, broker_users: Callable[[str], str], connect: Any, namespace: str
) -> None:
    impostor, victim = agent_name("impostor"), agent_name("victim")
    transport = await connect(broker_users(impostor), impostor)
    # Signed honestly as the impostor, but speaking for the victim.
    forged = RawAgent(transport, Topology(namespace), victim, user_id=impostor)
    await forged.start()
    await forged.register()
    await eventually(
        lambda: manager.counters[f"dead_lettered.{Reason.NOT_AUTHORIZED}"] == 1,
        what="the forged registration dead-lettered",
    )
    await asyncio.sleep(0.5)
    assert victim not in manager.core.agents
    assert not forged.inbox, "the named agent's control queue must hear nothing"

    # The same user speaking for itself is welcome.
    honest = RawAgent(transport, Topology(namespace), impostor, user_id=impostor)
    await honest.start()
    await honest.register()
    await eventually(lambda: impostor in manager.core.agents, what="the honest registration")


async def test_the_agent_itself_restarting_replaces_its_live_incarnation_at_once(
    manager: ManagerService, broker_users: Callable[[str], str], connect: Any, namespace: str
) -> None:
    """With identities on the broker vouches that a new incarnation is the agent itself (a
    kill -9 and restart): it replaces the live one at once, without waiting out the window."""
    name = agent_name("restart")
    url = broker_users(name)
    first = RawAgent(await connect(url, name), Topology(namespace), name, user_id=name)
    await first.start()
    await first.register()
    await eventually(lambda: name in manager.core.agents, what="the first incarnation")
    first.start_heartbeats()
    second = RawAgent(await connect(url, f"{name}-2"), Topology(namespace), name, user_id=name)
    await second.start()
    try:
        await second.register()
        await eventually(
            lambda: (
                manager.core.agents.get(name) is not None
                and manager.core.agents[name].incarnation == second.incarnation
            ),
            timeout_s=FAST_POOL.min_heartbeat_interval_s,  # well inside the liveness window
            what="the second incarnation replaces the first",
        )
        assert manager.core.counters["registration_incarnation_live"] == 0
    finally:
        await first.stop_heartbeats()


async def test_heartbeats_for_another_agent_cannot_keep_it_alive(
    manager: ManagerService, broker_users: Callable[[str], str], connect: Any, namespace: str
) -> None:
    real, other = agent_name("real"), agent_name("other")
    topology = Topology(namespace)
    agent = RawAgent(await connect(broker_users(real), real), topology, real, user_id=real)
    await agent.start()
    await agent.register()
    await eventually(lambda: real in manager.core.agents, what="the agent registered")
    # ``other`` beats on the real agent's behalf (its incarnation and sequence numbers, so only
    # the identity check can tell), while the real agent falls silent.
    spoofer = RawAgent(await connect(broker_users(other), other), topology, real, user_id=other)
    spoofer.incarnation, spoofer.seq = agent.incarnation, 1_000
    spoofer.start_heartbeats()
    try:
        window = FAST_POOL.min_heartbeat_interval_s * 3
        await eventually(
            lambda: real not in manager.core.agents,
            timeout_s=window + 5,
            what="the silent agent declared lost despite the spoofed heartbeats",
        )
    finally:
        await spoofer.stop_heartbeats()
    assert manager.counters[f"heartbeat_rejected.{Reason.NOT_AUTHORIZED}"] >= 2


async def test_an_sdk_agent_on_its_own_broker_user_registers_and_serves(
    manager: ManagerService, broker_users: Callable[[str], str], amqp_url: str, namespace: str
) -> None:
    name = agent_name("calc")
    runtime = AgentRuntime(
        SAMPLES["calc"](name, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=broker_users(name), namespace=namespace),
    )
    await runtime.start()
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="identity-client")
    try:
        outcome = await client.run_task("math.evaluate", {"expression": "6 * 7"})
        assert outcome.output["value"] == 42 and outcome.lease.agent_id == name
        assert manager.counters[f"dead_lettered.{Reason.NOT_AUTHORIZED}"] == 0
    finally:
        await client.close()
        await runtime.stop()


async def test_a_revoked_user_is_disconnected_and_its_agent_declared_lost(
    manager: ManagerService,
    broker_users: Callable[[str], str],
    connect: Any,
    namespace: str,
    management_api: Any,
) -> None:
    name = agent_name("revoked")
    transport = await connect(broker_users(name), name)
    dropped = asyncio.Event()
    transport.on_disconnect(dropped.set)
    agent = RawAgent(transport, Topology(namespace), name, user_id=name)
    await agent.start()
    await agent.register()
    agent.start_heartbeats()
    await eventually(lambda: name in manager.core.agents, what="the agent registered")

    management_api.request("DELETE", f"/api/users/{name}")  # revoked: RabbitMQ closes it
    await asyncio.wait_for(dropped.wait(), 10)
    await eventually(
        lambda: name not in manager.core.agents,
        timeout_s=FAST_POOL.min_heartbeat_interval_s * 3 + 5,
        what="the revoked agent declared lost",
    )
    await agent.stop_heartbeats()
    connections = management_api.request("GET", "/api/connections")
    assert not [c for c in connections if c.get("user") == name], "still connected"


async def test_a_producer_whose_user_name_is_escaped_in_the_url_signs_as_the_decoded_name(
    manager: ManagerService, broker_users: Callable[[str], str], namespace: str
) -> None:
    name = f"perm-{uuid.uuid4().hex[:8]}@team a"  # '@' and ' ' are escaped in a URL
    url = broker_users(name)
    assert name not in url
    client = await MeshClient.connect(url, namespace=namespace, name="escaped-producer")
    try:
        assert client.user_id == name
        decision = await client.admit(
            TaskRequirements(
                capability=CapabilityRange(name="calc.nothing", version_spec=">=1"),
                task_schema_version="1.0.0",
                result_schema_version="1.0.0",
                input_classifications=["internal"],
                estimated_tokens=10,
                estimated_duration_s=0.1,
            ),
            timeout_s=5,
        )
        assert decision.outcome == "rejected"  # nobody offers it; the point is the answer
        explained = await client.explain(decision.admission_id)
        assert explained.found and explained.tenant == name
    finally:
        await client.close()
