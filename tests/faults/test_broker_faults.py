"""The broker under faults, on the suite's own node: nothing confirmed is lost, nothing is
applied twice, no publish waits past its timeout.

* ``kill -9`` of the broker mid-stream and a restart, with a classic and a quorum queue:
  persistent messages the broker confirmed survive; in-flight deliveries come back; the
  producer's unknown outcomes are retried under the same ID. (A single-node quorum queue
  younger than RabbitMQ's registry save interval does *not* survive a kill -9 on 3.10: see
  the test, and docs/faults.md.)
* A graceful restart (``stop_app``/``start_app``): the consumer is back within
  :data:`CONSUMER_BACK_WITHIN_S` of the broker accepting connections again.
* The broker closing every connection (``rabbitmqctl close_all_connections``).
* A disk alarm and a memory alarm: publishes become ``unknown`` within their timeout (the
  broker blocks publishers, it does not refuse them), nothing is lost once the alarm clears.
* A full bounded queue: publishes are nacked (never silently dropped), everything confirmed
  is consumed.
* An unroutable publish is returned, never confirmed.
* A poison message on a quorum queue with a delivery limit is dead-lettered after its limit
  while the other messages keep flowing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from integration.harness import eventually

from mesh.errors import PublishUnroutable
from mesh.topology import BindingSpec, Declarations, ExchangeSpec, QueueSpec
from mesh.topology.specs import QueueArguments, QueueType
from mesh.transport import Delivery
from mesh.transport.amqp import AmqpTransport

from .broker_node import BrokerNode
from .workload import POLL_S, Workload, ids, work_queue

CONSUMER_BACK_WITHIN_S = 10.0
"""After a graceful restart, the consumer is back this soon after AMQP answers again."""
PUBLISH_TIMEOUT_S = 2.0
# aio-pika's robust connection retries every 5 s by default; 1 s keeps the tests short.
URL_OPTIONS = "?reconnect_interval=1&heartbeat=5"

TransportMaker = Callable[[str], Awaitable[AmqpTransport]]


@pytest.fixture
async def connect(node: BrokerNode) -> AsyncIterator[TransportMaker]:
    made: list[AmqpTransport] = []

    async def make(name: str) -> AmqpTransport:
        transport = await AmqpTransport.connect(
            node.amqp_url + URL_OPTIONS, name=name, publish_timeout_s=PUBLISH_TIMEOUT_S
        )
        made.append(transport)
        return transport

    yield make
    for transport in reversed(made):
        await transport.close()


async def workload(
    connect: TransportMaker,
    namespace: str,
    queue_type: QueueType = "classic",
    **arguments: object,
) -> Workload:
    declarations = work_queue(namespace, queue_type, **arguments)
    producer = await connect(f"{namespace}:producer")
    consumer = await connect(f"{namespace}:consumer")
    return await Workload.over(producer, consumer, declarations, PUBLISH_TIMEOUT_S)


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
async def test_kill_9_mid_stream_loses_nothing_confirmed(
    node: BrokerNode, connect: TransportMaker, namespace: str, queue_type: QueueType
) -> None:
    if queue_type == "quorum":
        # RabbitMQ 3.10 keeps a quorum queue's Ra registration in a DETS table it saves every
        # few minutes: a single node killed before that forgets the queue's log and starts an
        # empty, leaderless member (rabbitmq-server#10070, #15725; this suite found it). A
        # graceful restart saves it — what a queue older than a few minutes has anyway. (The
        # queue is declared and the node restarted before the workload connects.)
        setup = await AmqpTransport.connect(node.amqp_url, name=f"{namespace}:setup")
        await setup.declare(work_queue(namespace, queue_type))
        await setup.close()
        await asyncio.to_thread(node.restart_app)
    work = await workload(connect, namespace, queue_type)
    work.handle_s = 0.01  # deliveries are in flight (unacked) when the broker dies
    await work.consume()
    producing = asyncio.create_task(work.produce(ids("k", 400)))

    await eventually(
        lambda: work.tally.confirmed >= 150,
        what="150 confirms before the kill",
        timeout_s=60,
        poll_s=POLL_S,
    )
    await asyncio.to_thread(node.kill9)
    confirmed_at_kill = work.tally.confirmed
    await asyncio.sleep(1.0)  # publishes meet a dead broker: unknown, retried
    restart_s = await asyncio.to_thread(node.start)

    await asyncio.wait_for(producing, 120)
    await work.settled()
    work.tally.check()
    print(f"broker back in {restart_s:.1f} s; {confirmed_at_kill} confirmed before the kill")
    assert work.tally.confirmed == 400  # every ID was confirmed in the end
    assert work.tally.unknown > 0  # the kill did land mid-stream


async def test_a_graceful_restart_brings_the_consumer_back(
    node: BrokerNode, connect: TransportMaker, namespace: str
) -> None:
    work = await workload(connect, namespace, "quorum")
    await work.consume()
    await work.produce(ids("before", 50))
    await work.settled()

    await asyncio.to_thread(node.restart_app)
    back_at = time.monotonic()
    # Back means working, not listed: one message through, from publish to applied (the
    # management API's consumer count lags by its 5 s statistics interval).
    await work.produce(["first-after"])
    await work.settled(timeout_s=30)
    took = time.monotonic() - back_at
    print(f"consuming again {took:.1f} s after the broker accepted connections again")
    assert took <= CONSUMER_BACK_WITHIN_S

    await work.produce(ids("after", 50))
    await work.settled()
    work.tally.check()


async def test_the_broker_closing_every_connection_loses_nothing(
    node: BrokerNode, connect: TransportMaker, namespace: str
) -> None:
    work = await workload(connect, namespace, "quorum")
    work.handle_s = 0.01
    await work.consume()
    producing = asyncio.create_task(work.produce(ids("c", 300)))
    await eventually(
        lambda: work.tally.confirmed >= 100, what="100 confirms", timeout_s=60, poll_s=POLL_S
    )
    await asyncio.to_thread(node.close_all_connections)
    await asyncio.wait_for(producing, 90)
    await work.settled()
    work.tally.check()
    assert work.tally.confirmed == 300


@pytest.mark.parametrize("alarm", ["disk", "memory"])
async def test_under_a_resource_alarm_publishes_become_unknown_in_time_and_nothing_is_lost(
    node: BrokerNode, connect: TransportMaker, namespace: str, alarm: str
) -> None:
    work = await workload(connect, namespace, "quorum")
    await work.consume()
    await work.produce(ids("pre", 20))

    raise_alarm = node.raise_disk_alarm if alarm == "disk" else node.raise_memory_alarm
    await asyncio.to_thread(raise_alarm)
    outcomes = [await work.publish_one(f"blocked-{n}") for n in range(3)]
    assert outcomes == ["unknown"] * 3  # blocked, not refused: the outcome is unknown
    assert work.tally.slowest_publish_s <= PUBLISH_TIMEOUT_S + 1.0  # and bounded by its timeout

    await asyncio.to_thread(node.clear_alarms)
    # The producer retries what it does not know about, under the same IDs.
    await work.produce([f"blocked-{n}" for n in range(3)] + ids("post", 20))
    await work.settled()
    work.tally.check()


async def test_a_full_queue_nacks_and_loses_nothing_confirmed(
    node: BrokerNode, connect: TransportMaker, namespace: str
) -> None:
    work = await workload(connect, namespace, "quorum", max_length=10, overflow="reject-publish")
    outcomes = [await work.publish_one(business_id) for business_id in ids("f", 30)]
    assert outcomes.count("confirmed") >= 10  # the bound (a quorum queue may take one more)
    assert outcomes.count("nacked") >= 15  # the rest were refused, loudly
    assert "unknown" not in outcomes
    await work.consume()
    await work.settled()
    work.tally.check()
    assert len(work.tally.deliveries) == work.tally.confirmed  # exactly the confirmed ones


async def test_an_unroutable_publish_is_returned_never_confirmed(
    connect: TransportMaker, namespace: str
) -> None:
    producer = await connect(f"{namespace}:producer")
    exchange = f"{namespace}.nowhere"
    await producer.declare(Declarations(exchanges=(ExchangeSpec(exchange),)))
    with pytest.raises(PublishUnroutable):
        await producer.publish(exchange, "no.queue.bound", b"x", persistent=True)


async def test_a_poison_message_is_dead_lettered_while_traffic_flows(
    node: BrokerNode, connect: TransportMaker, namespace: str
) -> None:
    dlx, dlq = f"{namespace}.dlx", f"{namespace}.dlq"
    work = await workload(connect, namespace, "quorum", dead_letter_exchange=dlx, delivery_limit=3)
    await work.producer.declare(
        Declarations(
            exchanges=(ExchangeSpec(dlx),),
            queues=(QueueSpec(dlq, arguments=QueueArguments(queue_type="quorum")),),
            bindings=(BindingSpec(dlq, dlx, "#"),),
        )
    )
    work.poison = lambda business_id: business_id == "p-0005"

    async def on_dead(delivery: Delivery) -> None:
        deaths = delivery.headers.get("x-death") or [{}]
        work.tally.dead_lettered(delivery.body.decode(), str(deaths[0].get("reason")))
        await delivery.ack()

    await work.consumer.consume(dlq, on_dead)
    await work.consume()
    await work.produce(ids("p", 40))
    await work.settled()
    work.tally.check()
    assert set(work.tally.dead) == {"p-0005"}
    assert work.tally.dead["p-0005"] == "delivery_limit"
    assert work.tally.deliveries["p-0005"] == 4  # the first delivery and three redeliveries
    assert len(work.applied) == 39  # every other message went through meanwhile
