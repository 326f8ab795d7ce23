"""The transport and the test harness against the real broker.

These pin down the RabbitMQ behaviour the rest of the mesh builds on: idempotent declaration,
unroutable publishes that fail loudly, bounded queues that nack the publisher, dead-lettering
with a reason, heartbeat queues that never backlog, and consumers that come back after the
broker drops the connection.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from mesh import constants as c
from mesh.errors import PublishNacked, PublishUnroutable
from mesh.topology import Declarations, QueueArguments, QueueSpec, Topology
from mesh.transport import DEFAULT_EXCHANGE, Delivery

if TYPE_CHECKING:  # fixtures' types only; conftest modules are not imported by tests
    from tests.conftest import ManagementApi, TransportFactory

BODY = b'{"hello": "broker"}'


@pytest.mark.parametrize("label", ["Odd/Param ID, with SPACES and a rather long tail"])
def test_each_test_gets_a_short_readable_namespace(namespace: str, label: str) -> None:
    assert namespace.startswith("t-each-test-gets-a-short-")
    assert len(namespace) <= 40
    assert set(namespace) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert "--" not in namespace


def test_the_topology_fixture_uses_the_namespace(namespace: str, topology: Topology) -> None:
    assert topology.namespace == namespace
    assert topology.heartbeat_queue.startswith(f"{namespace}.")


async def test_declaring_the_manager_topology_twice_is_idempotent(
    transport_factory: TransportFactory, topology: Topology, management_api: ManagementApi
) -> None:
    first = await transport_factory(suffix="first")
    second = await transport_factory(suffix="second")
    await first.declare(topology.manager())
    await second.declare(topology.manager())  # a second process, same specs: no conflict
    await first.declare(topology.manager())  # cached: nothing sent

    queues = management_api.list_names("queues", f"{topology.namespace}.")
    assert queues == sorted(q.name for q in topology.manager().queues)
    announce = management_api.get_queue(topology.announce_queue)
    assert announce["type"] == "quorum"
    assert announce["arguments"]["x-dead-letter-exchange"] == topology.dead_letter_exchange


async def test_an_unroutable_publish_raises_instead_of_being_confirmed(
    transport_factory: TransportFactory, topology: Topology
) -> None:
    transport = await transport_factory()
    await transport.declare(topology.shared())

    with pytest.raises(PublishUnroutable):
        await transport.publish(topology.announce_exchange, "agent.nobody.register", BODY)
    with pytest.raises(PublishUnroutable):
        await transport.publish("", f"{topology.namespace}.no-such-queue", BODY)


async def test_a_full_task_queue_nacks_the_publish_past_its_bound(
    transport_factory: TransportFactory, topology: Topology, management_api: ManagementApi
) -> None:
    bound = 3
    transport = await transport_factory()
    await transport.declare(topology.agent("calc-1", task_queue_bound=bound))
    queue = topology.agent_task_queue("calc-1")

    # A quorum queue (an agent's task queue is one) takes one publish past its bound before it
    # nacks: the leases, not the queue, are the exact capacity.
    held = bound + topology.pool_queue_overshoot
    for _ in range(held):
        await transport.publish(topology.tasks_exchange, "calc-1", BODY)
    with pytest.raises(PublishNacked):
        await transport.publish(topology.tasks_exchange, "calc-1", BODY)

    assert await transport.queue_depth(queue) == held
    info = management_api.wait_for_queue(queue, "messages", held)
    assert info["messages"] == held
    assert info["arguments"]["x-queue-type"] == "quorum"
    assert info["arguments"]["x-max-length"] == bound
    assert info["arguments"]["x-overflow"] == "reject-publish"


async def test_a_refusing_channel_is_reopened_and_the_publish_tried_once_more_at_most_so_often(
    transport_factory: TransportFactory, topology: Topology
) -> None:
    """RabbitMQ 3.10 can keep refusing every publish on a channel whose publish met a quorum
    leader's death while a fresh channel is accepted: a refusal reopens the publishing channel
    and tries the publish once more there — at most every few seconds, so a queue really full
    (here: a bound of one) costs one more try each so often, not a reopen per publish."""
    transport = await transport_factory()
    full = f"{topology.namespace}.full"
    spare = f"{topology.namespace}.spare"
    bounded = QueueArguments(max_length=1, overflow="reject-publish")
    await transport.declare(
        Declarations(queues=(QueueSpec(full, arguments=bounded), QueueSpec(spare)))
    )
    await transport.publish(DEFAULT_EXCHANGE, full, BODY)

    with pytest.raises(PublishNacked):
        await transport.publish(DEFAULT_EXCHANGE, full, BODY)
    assert transport.reopened_channels == 1  # reopened, tried again there, refused again
    with pytest.raises(PublishNacked):
        await transport.publish(DEFAULT_EXCHANGE, full, BODY)
    assert transport.reopened_channels == 1  # not again within the interval

    await transport.publish(DEFAULT_EXCHANGE, spare, BODY)  # the reopened channel publishes
    assert await transport.queue_depth(full) == 1 and await transport.queue_depth(spare) == 1


async def test_a_dead_lettered_message_arrives_with_its_reason(
    transport_factory: TransportFactory, topology: Topology
) -> None:
    transport = await transport_factory()
    # The dead-letter queue is the manager's to declare; an agent only publishes to its
    # exchange.
    await transport.declare(topology.dead_letters() + topology.agent("calc-1", 10))
    source = topology.agent_task_queue("calc-1")
    await transport.publish(topology.tasks_exchange, "calc-1", BODY, correlation_id="corr-1")
    delivery = await transport.get_one(source)
    assert delivery is not None

    await transport.dead_letter(
        delivery,
        dead_letter_exchange=topology.dead_letter_exchange,
        source_queue=source,
        reason="malformed-json",
        detail="expected an object",
    )

    dead = await transport.get_one(topology.dead_letter_queue)
    assert dead is not None
    assert dead.body == BODY
    assert dead.routing_key == source
    assert dead.correlation_id == "corr-1"
    assert dead.headers[c.H_REASON] == "malformed-json"
    assert dead.headers[c.H_DETAIL] == "expected an object"
    assert dead.headers[c.H_SOURCE_QUEUE] == source


async def test_the_heartbeat_queue_drops_old_beats_instead_of_backlogging(
    transport_factory: TransportFactory, topology: Topology, management_api: ManagementApi
) -> None:
    transport = await transport_factory()
    await transport.declare(topology.manager())

    arguments = management_api.get_queue(topology.heartbeat_queue)["arguments"]
    assert arguments["x-overflow"] == "drop-head"
    assert arguments["x-message-ttl"] == topology.heartbeat_ttl_ms
    assert arguments["x-max-length"] == topology.heartbeat_queue_max_length


async def test_a_consumer_resumes_after_the_broker_drops_its_connection(
    transport_factory: TransportFactory, topology: Topology, management_api: ManagementApi
) -> None:
    consumer_side = await transport_factory(suffix="consumer")
    producer_side = await transport_factory(suffix="producer")
    queue = QueueSpec(f"{topology.namespace}.reconnect-probe", durable=True)
    await consumer_side.declare(Declarations(queues=(queue,)))
    await producer_side.declare(Declarations(queues=(queue,)))

    received: asyncio.Queue[bytes] = asyncio.Queue()
    reconnected = asyncio.Event()

    async def handle(delivery: Delivery) -> None:
        await delivery.ack()
        received.put_nowait(delivery.body)

    async def on_reconnect() -> None:
        reconnected.set()

    consumer_side.on_reconnect(on_reconnect)
    await consumer_side.consume(queue.name, handle)
    await producer_side.publish("", queue.name, b"before")
    assert await asyncio.wait_for(received.get(), timeout=5) == b"before"

    closed = management_api.close_connections(transport_factory.name_for("consumer"))
    assert closed == 1
    await producer_side.publish("", queue.name, b"after", persistent=True)

    # The robust connection retries every few seconds; the consumer must come back with it.
    deadline = time.monotonic() + 20
    body = await asyncio.wait_for(received.get(), timeout=deadline - time.monotonic())
    assert body == b"after"
    await asyncio.wait_for(reconnected.wait(), timeout=max(deadline - time.monotonic(), 1))
    assert not consumer_side.is_closed
    assert management_api.wait_for_queue(queue.name, "consumers", 1)["consumers"] == 1
