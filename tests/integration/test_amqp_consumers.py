"""The AMQP transport's consumers on the real broker, where RabbitMQ alone can show them: a
channel the broker closes comes back consuming, a settlement on a channel that is gone is a
no-op (the broker redelivers), and a cancelled consumer still acks what it holds."""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.topology import Declarations, QueueSpec
from mesh.transport import Delivery
from mesh.transport.amqp import AmqpTransport

from .harness import eventually


async def queue_with(
    transport_factory: Any, namespace: str, name: str
) -> tuple[AmqpTransport, str, list[Delivery]]:
    transport: AmqpTransport = await transport_factory(suffix=name)
    queue = f"{namespace}.{name}"
    await transport.declare(Declarations(queues=(QueueSpec(queue, durable=False),)))
    return transport, queue, []


async def test_a_consumer_whose_channel_the_broker_closed_consumes_again(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue, got = await queue_with(transport_factory, namespace, "reopen")
    held: list[Delivery] = []

    async def handler(delivery: Delivery) -> None:
        got.append(delivery)
        if delivery.body == b"hold":
            held.append(delivery)  # never acked: in flight when the channel goes
        else:
            await delivery.ack()

    consumer = await transport.consume(queue, handler, prefetch=10)
    await transport.publish("", queue, b"hold")
    await eventually(lambda: len(held) == 1, what="the first delivery")

    # A channel-level error: acking a delivery tag the channel never gave out. The broker
    # closes the channel (PRECONDITION_FAILED); aio-pika reopens it; the consumer resubscribes.
    underlay = await consumer._channel.get_underlay_channel()
    await underlay.basic_ack(999_999)
    await eventually(lambda: underlay.is_closed, what="the broker closes the channel")

    await held[0].ack()  # its channel is gone: nothing to settle, no error
    await eventually(
        lambda: any(d.body == b"hold" and d.redelivered for d in got),
        what="the unacked message redelivered on the new channel",
    )
    await transport.publish("", queue, b"after")
    await eventually(lambda: any(d.body == b"after" for d in got), what="new deliveries")


async def test_a_cancelled_consumer_gets_nothing_new_but_acks_what_it_holds(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue, got = await queue_with(transport_factory, namespace, "cancel")
    release = asyncio.Event()

    async def handler(delivery: Delivery) -> None:
        got.append(delivery)
        await release.wait()
        await delivery.ack()

    consumer = await transport.consume(queue, handler, prefetch=1)
    await transport.publish("", queue, b"one")
    await eventually(lambda: len(got) == 1, what="the first delivery")
    await consumer.cancel()
    await transport.publish("", queue, b"two")
    release.set()

    await asyncio.sleep(0.5)
    assert [d.body for d in got] == [b"one"]  # nothing new after the cancel
    assert await transport.queue_depth(queue) == 1  # "two" waits; "one" was acked, not requeued
    left = await transport.get_one(queue)
    assert left is not None and left.body == b"two" and not left.redelivered
