"""A process restarted under its own name (issue 47): Kubernetes restarts a crashed container
under the same pod name, so the same agent ID comes back as a new incarnation while the
manager still counts the old one. The new incarnation takes no work before the manager
accepted it, and fencing the old one never cuts the new one.

Each test plays the killed process with a :class:`RawAgent` that stops beating (silent, never
deregistered) and starts the real SDK runtime under the same ID beside it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology, names
from mesh.transport.amqp import AmqpTransport
from mesh.wire import OrchestrationEvent

from .harness import RawAgent, eventually, management_url, manager_settings, start_manager

AGENT_ID = "phoenix"


@pytest.fixture
async def fencing_manager(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> AsyncIterator[ManagerService]:
    """A manager that fences lost agents through the management API."""
    service = await start_manager(
        manager_settings(
            namespace,
            tmp_path / "journal.sqlite3",
            amqp_url=amqp_url,
            management_url=management_url(management_api, amqp_url),
        )
    )
    yield service
    await service.stop()


async def a_live_old_incarnation(
    manager: ManagerService, amqp_url: str, topology: Topology, deployment: str
) -> tuple[RawAgent, AmqpTransport, asyncio.Event]:
    """The incarnation a kill -9 leaves behind, still counted by the manager: registered,
    beating, its connection named and tagged as the SDK names and tags its own. Its queues
    are bounded as the echo sample's (8 slots), which is what the restarted process runs."""
    incarnation = uuid.uuid4().hex
    transport = await AmqpTransport.connect(
        amqp_url,
        name=f"agent:{AGENT_ID}",
        properties={c.CLIENT_PROPERTY_INCARNATION: incarnation},
    )
    dropped = asyncio.Event()
    transport.on_disconnect(dropped.set)
    old = RawAgent(transport, topology, AGENT_ID, deployment=deployment)
    old.incarnation = incarnation
    # Its queues, but no consumer on the control queue: a killed process's consumers are
    # gone at once (the kernel closes its socket), only its record in the manager lives on.
    await transport.declare(topology.agent(AGENT_ID, 16))
    await old.register()
    await eventually(lambda: AGENT_ID in manager.core.agents, what="acceptance")
    old.start_heartbeats()
    return old, transport, dropped


@asynccontextmanager
async def closing_at_the_end(transport: AmqpTransport) -> AsyncIterator[None]:
    """The old incarnation's transport closed when the test ends: fenced, it reconnects (it
    is robust), and a reconnect left to the event loop's teardown leaks its socket into
    whichever test the garbage collector runs in next."""
    try:
        yield
    finally:
        await transport.close()


def the_restarted_process(amqp_url: str, namespace: str) -> AgentRuntime:
    return AgentRuntime(
        SAMPLES["echo"](AGENT_ID, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )


@asynccontextmanager
async def deferred_start(runtime: AgentRuntime) -> AsyncIterator[asyncio.Task[None]]:
    """``runtime.start()`` under way, entered once its registration was deferred
    (``AGENT_ID_IN_USE``); the runtime stopped on the way out."""
    starting = asyncio.create_task(runtime.start())
    try:
        await eventually(
            lambda: runtime.counters["registration_deferred"] >= 1, what="the deferral"
        )
        yield starting
    finally:
        await runtime.stop()
        if not starting.done():
            starting.cancel()


async def announce_epoch(transport: AmqpTransport, topology: Topology, pool: str) -> None:
    """What the manager announces when a pool's descriptor is published: its active epoch."""
    event = OrchestrationEvent(
        at=time.time(),
        kind=c.EVENT_DESCRIPTOR_ACTIVE,
        reason="epoch 1",
        detail={"pool_id": pool, "descriptor_epoch": 1, "policy_generation": 1},
    )
    await transport.publish(topology.events_exchange, names.pool_grant_key(pool), event)


async def test_a_restarted_agent_takes_no_pool_task_before_its_own_incarnation_is_accepted(
    fencing_manager: ManagerService,
    amqp_url: str,
    namespace: str,
    topology: Topology,
    transport_factory: Any,
) -> None:
    """While its registration is deferred (``AGENT_ID_IN_USE``: the old incarnation is live), a
    ``descriptor_active`` announcement reaches the new process's control queue; it must not
    subscribe to the pool queue then, only once the manager accepted it."""
    runtime = the_restarted_process(amqp_url, namespace)
    pool = runtime.agent.deployment
    old, old_transport, _ = await a_live_old_incarnation(fencing_manager, amqp_url, topology, pool)
    operator = await transport_factory(suffix="operator")
    await operator.declare(topology.pool(pool))
    async with closing_at_the_end(old_transport), deferred_start(runtime) as starting:
        await announce_epoch(operator, topology, pool)
        await eventually(lambda: runtime.core.active_epoch == 1, what="the epoch heard")
        await asyncio.sleep(0.5)  # time for a subscription the announcement would start
        assert runtime.counters["pool_subscriptions"] == 0
        assert not starting.done()

        await old.stop_heartbeats()  # now it is the kill -9: silent from here on
        await asyncio.wait_for(starting, 20)
        assert fencing_manager.core.agents[AGENT_ID].incarnation != old.incarnation
        assert runtime.counters["pool_subscriptions"] == 1


async def test_fencing_a_lost_incarnation_leaves_its_successor_connected(
    fencing_manager: ManagerService,
    amqp_url: str,
    namespace: str,
    topology: Topology,
) -> None:
    """The old incarnation is declared lost and cut off the broker (by its connection's
    incarnation tag); the new process, connected under the same name and waiting to
    register, keeps its connection and is accepted."""
    runtime = the_restarted_process(amqp_url, namespace)
    old, old_transport, old_dropped = await a_live_old_incarnation(
        fencing_manager, amqp_url, topology, "raw"
    )
    reconnected = asyncio.Event()
    async with deferred_start(runtime) as starting:
        runtime.transport.on_disconnect(reconnected.set)
        await old.stop_heartbeats()
        await asyncio.wait_for(starting, 20)
        await asyncio.wait_for(old_dropped.wait(), 20)  # the fence found the old one
        await old_transport.close()  # a killed process does not come back
        await eventually(
            lambda: fencing_manager.counters["agent_connections_closed"] == 1, what="counted"
        )
        await asyncio.sleep(1.0)  # a close of the new connection would land by now
        assert not reconnected.is_set(), "the fence cut the new incarnation's connection"
        assert runtime.counters["reconnects"] == 0
        assert fencing_manager.core.agents[AGENT_ID].incarnation != old.incarnation


async def test_work_leased_to_a_lost_incarnation_is_served_by_its_successor_through_run_task(
    fencing_manager: ManagerService,
    amqp_url: str,
    namespace: str,
    topology: Topology,
    transport_factory: Any,
) -> None:
    """``run_task`` leases the old incarnation's slot and queues the task on the agent's own
    queue; the old process is dead (nothing consumes it). Its successor under the same ID
    finds the task under a lease that ended with its predecessor: it refuses it
    ``UNKNOWN_LEASE`` (not the permanent ``NOT_AUTHORIZED``), and ``run_task`` leases again
    and is served within its deadline."""
    runtime = the_restarted_process(amqp_url, namespace)
    old, old_transport, _ = await a_live_old_incarnation(fencing_manager, amqp_url, topology, "raw")
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="restarts-producer")
    try:
        running = asyncio.create_task(
            client.run_task("test.echo", {"message": "queued"}, timeout_s=40)
        )
        await eventually(lambda: bool(fencing_manager.core.leases), what="the old one leased")
        await old.stop_heartbeats()
        await asyncio.wait_for(runtime.start(), 20)

        outcome = await asyncio.wait_for(running, 40)
        assert outcome.output["message"] == "queued"
        assert outcome.lease.agent_id == AGENT_ID
        assert runtime.counters["tasks_without_credentials"] == 1  # the old lease's task
        assert client.counters["run_task_lease_retries"] == 1
    finally:
        await client.close()
        await runtime.stop()
        await old_transport.close()
