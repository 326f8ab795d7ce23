"""The raw (no-ack) consumer on the real broker: a callback with ``ingest_many`` gets what
arrived within one turn of the event loop as one batch, in order; a plain callback gets each
delivery as it comes."""

from __future__ import annotations

from typing import Any

from mesh.topology import Declarations, QueueSpec
from mesh.transport.amqp import AmqpTransport, RawBatch, RawBatchCallback

from .harness import eventually

BACKLOG = 200


class Batches:
    """A raw batch callback that records every call."""

    def __init__(self) -> None:
        self.batches: list[RawBatch] = []
        self.single: list[bytes] = []

    def __call__(self, body: bytes, user_id: str | None, /) -> None:
        self.single.append(body)

    def ingest_many(self, bodies: RawBatch, /) -> None:
        self.batches.append(bodies)

    @property
    def bodies(self) -> list[bytes]:
        return [body for batch in self.batches for body, _ in batch]


async def backlog(transport_factory: Any, namespace: str, name: str) -> tuple[AmqpTransport, str]:
    transport: AmqpTransport = await transport_factory(suffix=name)
    queue = f"{namespace}.{name}"
    await transport.declare(Declarations(queues=(QueueSpec(queue, durable=False),)))
    for n in range(BACKLOG):
        await transport.publish_fast("", queue, b"%d" % n)

    async def all_queued() -> bool:
        return await transport.queue_depth(queue) == BACKLOG

    await eventually(all_queued, what="the backlog in the queue")
    return transport, queue


async def test_a_batch_callback_gets_a_backlog_in_batches_in_order(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue = await backlog(transport_factory, namespace, "raw-batches")
    got = Batches()
    assert isinstance(got, RawBatchCallback)

    consumer = await transport.consume_raw(queue, got)
    await eventually(lambda: len(got.bodies) == BACKLOG, what="the whole backlog")
    await consumer.cancel()

    assert got.bodies == [b"%d" % n for n in range(BACKLOG)]
    assert got.single == []
    assert len(got.batches) < BACKLOG  # deliveries of one turn of the loop go together


async def test_a_plain_callback_gets_each_delivery_as_it_comes(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue = await backlog(transport_factory, namespace, "raw-plain")
    got: list[bytes] = []

    consumer = await transport.consume_raw(queue, lambda body, _: got.append(body))
    await eventually(lambda: len(got) == BACKLOG, what="the whole backlog")
    await consumer.cancel()

    assert got == [b"%d" % n for n in range(BACKLOG)]
