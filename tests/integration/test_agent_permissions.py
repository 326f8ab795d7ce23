"""Per-agent broker permissions (issue 7): each agent's user may do what it needs, nothing else.

The users are made the way operators make them — :class:`mesh.broker_admin.BrokerAdmin`, what
``mesh broker add-agent`` runs — with the permissions of
:func:`mesh.topology.permissions.agent_permissions`, and deleted afterwards. The broker does
the refusing (``ACCESS_REFUSED`` closes the channel); the manager (``--agent-identity on``)
would refuse the same again, but these messages never reach it.

* An SDK agent under exactly these permissions (``shared_topology="check"``) registers, takes
  a task, returns the result and drains.
* Another agent's routing keys — heartbeat and announcement — are refused, and nobody is
  registered or kept alive by them.
* Another agent's queue, and another pool's queue, cannot be consumed; its own pool's can.
* Shared exchanges can be neither declared nor deleted; an agent that would declare them
  (``shared_topology="declare"``) cannot start.
* Before the manager has declared the topology, a ``check`` agent fails with
  ``TopologyMissing`` and says what to do.
* One user shared by a pool's agents (``mesh broker add-pool-agents``, for a Deployment's
  pods): two agents under it register and serve; another pool's queue stays refused; and a
  drain notice one of them forges for the other, signed with the shared user, is refused by
  the other — it takes control messages only from the managers' user.
* Against a manager with ``--agent-identity on`` such an agent is refused in silence (the
  registration is dead-lettered, not answered: a refusal would reach the agent it names);
  the agent itself says why when it gives up: its user is not its agent ID.
"""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh.agent import AgentRuntime, AgentSettings
from mesh.agent.errors import RegistrationTimeoutError
from mesh.broker_admin import BrokerAdmin
from mesh.errors import TopologyMissing, TransportError
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology, names
from mesh.wire import DrainNotice
from mesh.wire.models import Heartbeat

from .harness import eventually, management_url, manager_settings, start_manager
from .test_identity import connect, manager

__all__ = ["connect", "manager"]  # fixtures, used by name

PASSWORD = "permissions-test"
POOL = "calc"  # the calc sample's deployment


@pytest.fixture
def admin(management_api: Any, amqp_url: str) -> BrokerAdmin:
    return BrokerAdmin(management_url(management_api, amqp_url), vhost=management_api.vhost)


@pytest.fixture
def agent_users(admin: BrokerAdmin, amqp_url: str, namespace: str) -> Iterator[Callable[..., str]]:
    """``make(agent_id, pool=POOL)``: the agent's user with its own permissions; returns its
    AMQP URL. Every user made is deleted afterwards."""
    made: list[str] = []
    parts = urllib.parse.urlsplit(amqp_url)

    def make(agent_id: str, pool: str = POOL) -> str:
        admin.add_agent(agent_id, PASSWORD, namespace=namespace, pool_id=pool)
        made.append(agent_id)
        netloc = f"{agent_id}:{PASSWORD}@{parts.hostname}:{parts.port or 5672}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    yield make
    for agent_id in made:
        admin.remove_agent(agent_id)


@pytest.fixture
async def open_manager(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[ManagerService]:
    """A manager with agent identity off: where a pool's agents share a user, the user names
    no agent (the manager cannot tell them apart by it)."""
    service = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    yield service
    await service.stop()


@pytest.fixture
def pool_user(admin: BrokerAdmin, amqp_url: str, namespace: str) -> Iterator[str]:
    """A user for every agent of pool ``POOL``, as ``mesh broker add-pool-agents`` makes it;
    its AMQP URL. Deleted afterwards."""
    user = agent_name("pool")
    admin.add_pool_agents(user, PASSWORD, namespace=namespace, pool_ids=[POOL])
    parts = urllib.parse.urlsplit(amqp_url)
    netloc = f"{user}:{PASSWORD}@{parts.hostname}:{parts.port or 5672}"
    yield urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    admin.remove_agent(user)


def agent_name(tag: str) -> str:
    return f"perm-{uuid.uuid4().hex[:8]}-{tag}"


def calc_runtime(name: str, url: str, namespace: str, **settings: Any) -> AgentRuntime:
    return AgentRuntime(
        SAMPLES["calc"](name, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=url, namespace=namespace, shared_topology="check", **settings),
    )


async def test_an_sdk_agent_with_only_its_own_permissions_registers_serves_and_drains(
    manager: ManagerService, agent_users: Callable[..., str], amqp_url: str, namespace: str
) -> None:
    name = agent_name("calc")
    runtime = calc_runtime(name, agent_users(name), namespace)
    await runtime.start()
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="permissions-client")
    try:
        assert name in manager.core.agents
        outcome = await client.run_task("math.evaluate", {"expression": "6 * 7"})
        assert outcome.output["value"] == 42 and outcome.lease.agent_id == name
        await runtime.drain("test over")
        await eventually(lambda: name not in manager.core.agents, what="the agent deregistered")
        assert runtime.counters["results_requeued"] == 0
    finally:
        await client.close()
        await runtime.stop()


async def test_another_agents_routing_keys_are_refused_by_the_broker(
    manager: ManagerService,
    agent_users: Callable[..., str],
    connect: Any,
    namespace: str,
) -> None:
    # Each refusal closes the channel: every attempt on a connection of its own.
    name, victim = agent_name("mallory"), agent_name("victim")
    topology, url = Topology(namespace), agent_users(name)
    beat = Heartbeat(agent_id=victim, incarnation="i-1", seq=0, sent_at=1.0)

    with pytest.raises(TransportError, match="ACCESS_REFUSED"):
        await (await connect(url, name)).publish(
            topology.heartbeat_exchange, names.heartbeat_key(victim), beat, user_id=name
        )
    with pytest.raises(TransportError, match="ACCESS_REFUSED"):
        await (await connect(url, name)).publish(
            topology.announce_exchange,
            names.agent_announce_key(victim, "deregister"),
            b"{}",
            user_id=name,
        )
    # Its own keys go through (the manager then judges the content: not a registered agent).
    await (await connect(url, name)).publish(
        topology.heartbeat_exchange,
        names.heartbeat_key(name),
        Heartbeat(agent_id=name, incarnation="i-1", seq=0, sent_at=1.0),
        user_id=name,
    )
    assert victim not in manager.core.agents and name not in manager.core.agents


async def test_another_agents_queue_and_another_pools_queue_are_refused(
    manager: ManagerService,
    agent_users: Callable[..., str],
    amqp_url: str,
    connect: Any,
    namespace: str,
) -> None:
    topology = Topology(namespace)
    owner = await connect(amqp_url, "queue-owner")  # an operator declares what exists
    victim = agent_name("victim")
    await owner.declare(
        topology.agent_queues(victim, 4) + topology.pool(POOL) + topology.pool("search")
    )
    name = agent_name("mallory")

    async def ignore(_: Any) -> None:
        return None

    url = agent_users(name)
    for foreign in (topology.agent_task_queue(victim), topology.pool_task_queue("search")):
        with pytest.raises(Exception, match="ACCESS_REFUSED"):
            await (await connect(url, name)).consume(foreign, ignore)
    own_pool = await (await connect(url, name)).consume(topology.pool_task_queue(POOL), ignore)
    await own_pool.cancel()


async def test_shared_exchanges_can_be_neither_declared_nor_deleted(
    manager: ManagerService,
    agent_users: Callable[..., str],
    connect: Any,
    namespace: str,
    management_api: Any,
) -> None:
    topology = Topology(namespace)
    name = agent_name("mallory")
    url = agent_users(name)

    with pytest.raises(Exception, match="ACCESS_REFUSED"):
        await (await connect(url, name)).declare(topology.shared())
    with pytest.raises(Exception, match="ACCESS_REFUSED"):
        transport = await connect(url, name)
        await transport._publish_channel.exchange_delete(topology.announce_exchange)
    assert management_api.get_exchange(topology.announce_exchange)["name"]

    declaring = AgentRuntime(
        SAMPLES["calc"](name, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=url, namespace=namespace, shared_topology="declare"),
    )
    with pytest.raises(Exception, match="ACCESS_REFUSED"):
        await declaring.start()
    assert name not in manager.core.agents


async def test_a_checking_agent_before_the_manager_fails_with_topology_missing(
    agent_users: Callable[..., str], namespace: str
) -> None:
    name = agent_name("early")
    runtime = calc_runtime(name, agent_users(name), namespace)
    with pytest.raises(TopologyMissing, match="start it first"):
        await runtime.start()


async def test_a_pools_agents_share_one_user_and_still_cannot_speak_for_the_managers(
    open_manager: ManagerService, pool_user: str, amqp_url: str, connect: Any, namespace: str
) -> None:
    topology = Topology(namespace)
    user = urllib.parse.unquote(urllib.parse.urlsplit(pool_user).username or "")
    first, second = agent_name("calc-a"), agent_name("calc-b")
    runtimes = [calc_runtime(name, pool_user, namespace) for name in (first, second)]
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="permissions-client")
    try:
        for runtime in runtimes:
            await runtime.start()
        assert {first, second} <= set(open_manager.core.agents)
        outcome = await client.run_task("math.evaluate", {"expression": "6 * 7"})
        assert outcome.output["value"] == 42 and outcome.lease.agent_id in (first, second)

        owner = await connect(amqp_url, "queue-owner")  # another pool's queue exists
        await owner.declare(topology.pool("search"))

        async def ignore(_: Any) -> None:
            return None

        with pytest.raises(Exception, match="ACCESS_REFUSED"):
            await (await connect(pool_user, user)).consume(
                topology.pool_task_queue("search"), ignore
            )

        # The second agent's user forges a drain notice for the first, through amq.default
        # by its control queue's name (which the shared user may write to): refused.
        forger = await connect(pool_user, user)
        await forger.publish(
            "",
            topology.agent_control_queue(first),
            DrainNotice(agent_id=first, reason="forged"),
            user_id=user,
        )
        await eventually(
            lambda: runtimes[0].counters["control_not_from_manager"] == 1, what="the refusal"
        )
        assert not runtimes[0]._draining and first in open_manager.core.agents
    finally:
        await client.close()
        for runtime in runtimes:
            await runtime.stop()


async def test_a_pool_user_agent_facing_an_identity_manager_says_why_nobody_answers(
    manager: ManagerService, pool_user: str, namespace: str
) -> None:
    user = urllib.parse.unquote(urllib.parse.urlsplit(pool_user).username or "")
    name = agent_name("calc")
    runtime = calc_runtime(
        name, pool_user, namespace, registration_timeout_s=0.5, max_registration_attempts=2
    )
    with pytest.raises(RegistrationTimeoutError) as caught:
        await runtime.start()
    message = str(caught.value)
    assert f"broker user {user!r}, not as its agent ID" in message, message
    assert "--agent-identity on" in message and "add-pool-agents" in message, message
    assert name not in manager.core.agents
    assert manager.counters["dead_lettered.NOT_AUTHORIZED"] >= 1
