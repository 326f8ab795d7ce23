"""After a reconnect, consumers take messages only once the whole connection is back (issue
47). aio-pika restores a robust connection's channels one at a time, in no fixed order: a
consumer whose channel came back before the publishing channel took tasks it could not answer
(every publish failed, "the channel is closed"), requeued them at once and had them again, a
loop that used up a quorum queue's delivery limit in milliseconds.

Eight consumers, each holding one unacked message, are cut off the broker by
:class:`~tests.faults.tcp_proxy.TcpProxy` (only the proxy's connections suffer); each message
comes back after the reconnect, and its handler publishes at once. Every one of those publishes
must succeed: with the consumers subscribed as their channels reopen, most of the eight would
be restored before the publishing channel and fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from integration.harness import eventually

from mesh.errors import TransportError
from mesh.topology import Declarations, QueueSpec
from mesh.transport import DEFAULT_EXCHANGE, Delivery
from mesh.transport.amqp import AmqpTransport

from .tcp_proxy import TcpProxy
from .test_network_faults import BROKER, delete_directly

CONSUMERS = 8


@pytest.fixture
async def proxy() -> AsyncIterator[TcpProxy]:
    async with TcpProxy(BROKER) as running:
        yield running


async def test_consumers_restored_after_a_reconnect_can_publish_their_answers_at_once(
    proxy: TcpProxy, namespace: str
) -> None:
    queues = [f"{namespace}.work.{n}" for n in range(CONSUMERS)]
    answers = f"{namespace}.answers"
    declarations = Declarations(
        queues=tuple(QueueSpec(name, durable=True) for name in [*queues, answers])
    )
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?reconnect_interval=0.5"
    transport = await AmqpTransport.connect(url, name=f"{namespace}:consumers")
    try:
        await transport.declare(declarations)
        first: set[str] = set()
        redelivered: list[str] = []
        failed: list[str] = []

        async def on_message(delivery: Delivery) -> None:
            queue = delivery.body.decode()
            if not delivery.redelivered:
                first.add(queue)  # held unacked until the cut
                return
            redelivered.append(queue)
            try:
                await transport.publish(DEFAULT_EXCHANGE, answers, delivery.body, timeout_s=5)
            except TransportError as exc:
                failed.append(f"{queue}: {exc}")
            await delivery.ack()

        for queue in queues:
            await transport.consume(queue, on_message, prefetch=1)
        for queue in queues:
            await transport.publish(DEFAULT_EXCHANGE, queue, queue.encode())
        await eventually(lambda: len(first) == CONSUMERS, what="every message held")

        proxy.reset()
        await asyncio.sleep(0.3)
        proxy.pass_through()

        await eventually(lambda: len(redelivered) == CONSUMERS, what="every message again")
        print(f"\nredelivered {len(redelivered)}, answers failed {len(failed)}")
        assert failed == []
    finally:
        proxy.pass_through()
        await transport.close()
        await delete_directly(declarations)
