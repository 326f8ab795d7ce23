"""The consume-only connection on the real broker. Raw (no ack): a callback with
``ingest_many`` gets what arrived in one read from the socket as one batch, in order; a plain
callback gets each delivery as it comes. Acked: at most the prefetch unsettled, a rejected
delivery comes again, a cancelled consumer's deliveries are still settled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from mesh.errors import TopologyMissing, TransportError
from mesh.topology import Declarations, QueueSpec
from mesh.transport.amqp import AmqpTransport, RawBatch, RawBatchCallback
from mesh.transport.delivery import Delivery

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
    assert len(got.batches) < BACKLOG  # deliveries of one read go together


async def test_a_plain_callback_gets_each_delivery_as_it_comes(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue = await backlog(transport_factory, namespace, "raw-plain")
    got: list[bytes] = []

    consumer = await transport.consume_raw(queue, lambda body, _: got.append(body))
    await eventually(lambda: len(got) == BACKLOG, what="the whole backlog")
    await consumer.cancel()

    assert got == [b"%d" % n for n in range(BACKLOG)]


async def raw_queues(
    transport_factory: Any, namespace: str, name: str, count: int
) -> tuple[AmqpTransport, list[str], dict[str, list[bytes]]]:
    """``count`` queues consumed raw on one transport: it, the queues, and each queue's
    bodies as they came."""
    transport: AmqpTransport = await transport_factory(suffix=name)
    queues = [f"{namespace}.{name}-{n}" for n in range(count)]
    await transport.declare(Declarations(queues=tuple(QueueSpec(q, durable=False) for q in queues)))
    got: dict[str, list[bytes]] = {q: [] for q in queues}
    for queue in queues:
        await transport.consume_raw(queue, lambda body, _, q=queue: got[q].append(body))
    return transport, queues, got


async def test_raw_consumers_share_a_consume_only_connection_that_comes_back_when_closed(
    transport_factory: Any, namespace: str, management_api: Any
) -> None:
    transport, queues, got = await raw_queues(transport_factory, namespace, "raw-lean", 2)
    # One consume-only connection, named after the transport's, for both queues.
    name = f"{transport.name}:consume"

    async def listed() -> list[str]:
        found = await asyncio.to_thread(management_api.connections, name)
        return [c["client_properties"]["connection_name"] for c in found]

    await eventually(listed, what="the connection in the management API")  # listed late
    assert await listed() == [name]
    for queue in queues:
        await transport.publish_fast("", queue, b"before")
    await eventually(lambda: all(got[q] == [b"before"] for q in queues), what="both queues")

    assert await asyncio.to_thread(management_api.close_connections, name) == 1
    await transport.publish_fast("", queues[0], b"lost?")  # may be delivered to nobody

    async def consuming_again() -> bool:
        for queue in queues:
            await transport.publish_fast("", queue, b"after")
        await asyncio.sleep(0.2)
        return all(b"after" in got[q] for q in queues)

    await eventually(consuming_again, timeout_s=20, what="both queues consumed again")


async def test_a_raw_consumer_of_a_missing_queue_is_a_clear_error(
    transport_factory: Any, namespace: str
) -> None:
    transport: AmqpTransport = await transport_factory(suffix="lean-missing")
    with pytest.raises(TopologyMissing, match="no-such-queue"):
        await transport.consume_raw(f"{namespace}.no-such-queue", lambda body, _: None)
    # The connection is still good for the next consumer.
    transport_queue = f"{namespace}.raw-after-missing"
    await transport.declare(Declarations(queues=(QueueSpec(transport_queue, durable=False),)))
    got: list[bytes] = []
    await transport.consume_raw(transport_queue, lambda body, _: got.append(body))
    await transport.publish_fast("", transport_queue, b"x")
    await eventually(lambda: got == [b"x"], what="the delivery")


async def test_a_raw_consumer_whose_queue_is_deleted_resumes_once_it_is_declared_again(
    transport_factory: Any, namespace: str
) -> None:
    transport: AmqpTransport = await transport_factory(suffix="lean-deleted")
    queue = f"{namespace}.raw-deleted"
    spec = Declarations(queues=(QueueSpec(queue, durable=False),))
    await transport.declare(spec)
    got: list[bytes] = []
    await transport.consume_raw(queue, lambda body, _: got.append(body))
    other = f"{namespace}.raw-kept"
    await transport.declare(Declarations(queues=(QueueSpec(other, durable=False),)))
    kept: list[bytes] = []
    await transport.consume_raw(other, lambda body, _: kept.append(body))

    await transport.delete_queue(queue)
    await transport.publish_fast("", other, b"still")  # the other consumer is untouched
    await eventually(lambda: kept == [b"still"], what="the other queue's delivery")
    await transport.declare(spec)

    async def consumed_again() -> bool:
        await transport.publish_fast("", queue, b"again")
        await asyncio.sleep(0.3)
        return b"again" in got

    await eventually(consumed_again, timeout_s=20, what="the queue consumed again")


# ---- acked consumers (announcements) --------------------------------------------------------


async def test_an_acked_consumer_holds_at_most_its_prefetch_and_gets_more_as_it_acks(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue = await backlog(transport_factory, namespace, "acked")
    got: list[Delivery] = []
    await transport.consume_acked(queue, got.extend, prefetch=50)
    await eventually(lambda: len(got) == 50, what="a prefetch's worth")
    await asyncio.sleep(0.3)
    assert len(got) == 50  # nothing past the prefetch while none is settled
    assert [d.body for d in got] == [b"%d" % n for n in range(50)]
    assert not any(d.redelivered for d in got)
    for delivery in got:
        await delivery.ack()
    await eventually(lambda: len(got) == 100, what="the next prefetch's worth")
    while len(got) < BACKLOG:
        for delivery in got[-50:]:
            await delivery.ack()
        wanted = min(len(got) + 50, BACKLOG)
        await eventually(lambda: len(got) >= wanted, what="more")  # noqa: B023 - awaited here
    for delivery in got[-50:]:
        await delivery.ack()
    assert [d.body for d in got] == [b"%d" % n for n in range(BACKLOG)]

    async def acked() -> bool:
        return await transport.queue_depth(queue) == 0

    await eventually(acked, what="the queue empty once all are acked")


async def test_an_acked_consumer_gets_a_rejected_delivery_again_and_a_cancelled_one_settles(
    transport_factory: Any, namespace: str
) -> None:
    transport, queue = await backlog(transport_factory, namespace, "acked-reject")
    got: list[Delivery] = []
    consumer = await transport.consume_acked(queue, got.extend, prefetch=10)
    await eventually(lambda: len(got) == 10, what="a prefetch's worth")
    first = got[0]
    await first.reject(requeue=True)
    await eventually(lambda: any(d.redelivered for d in got), what="the rejected one again")
    again = next(d for d in got if d.redelivered)
    assert again.body == first.body and again.routing_key == queue and again.exchange == ""
    # Cancelled with deliveries unsettled: nothing more comes, and those it holds are still
    # settled on its channel (acked, not requeued to be handled twice).
    await consumer.cancel()
    held = [d for d in got if d is not first]
    for delivery in held:
        await delivery.ack()
    await asyncio.sleep(0.5)
    assert len(got) == 11

    async def settled() -> bool:
        return await transport.queue_depth(queue) == BACKLOG - len(held)

    await eventually(settled, what="the cancelled consumer's acks kept")


async def test_an_acked_delivery_is_held_until_the_broker_closes_its_connection(
    transport_factory: Any, namespace: str, management_api: Any
) -> None:
    """``Delivery.held`` on the consume-only connection (the manager's intake): False once the
    broker closed the connection the delivery came on, as it does to a frozen process."""
    transport, queue = await backlog(transport_factory, namespace, "acked-held")
    got: list[Delivery] = []
    await transport.consume_acked(queue, got.extend, prefetch=2)
    await eventually(lambda: len(got) == 2, what="a prefetch's worth")
    assert all(d.held() for d in got)
    name = f"{transport.name}:consume"
    await eventually(
        lambda: asyncio.to_thread(management_api.connections, name), what="listed"
    )  # fmt: skip
    assert await asyncio.to_thread(management_api.close_connections, name) == 1
    await eventually(lambda: not any(d.held() for d in got[:2]), what="not held once closed")


# ---- replies (a client's exclusive reply queue) -----------------------------------------------


async def test_replies_come_on_the_consume_only_connection_from_an_exclusive_queue_declared_again(
    transport_factory: Any, namespace: str, management_api: Any
) -> None:
    """A client's reply queue is declared where it is read: replies arrive with their
    correlation IDs, nobody else may consume the queue, and after the consume-only
    connection is closed by the broker (which deletes the exclusive queue) the queue is
    declared again and replies flow."""
    client: AmqpTransport = await transport_factory(suffix="replies")
    other: AmqpTransport = await transport_factory(suffix="replies-other")
    queue = f"{namespace}.reply.replies.0000"
    got: list[Delivery] = []
    await client.consume_replies(queue, got.extend)
    await other.publish("", queue, b"one", correlation_id="c-1")
    await eventually(lambda: len(got) == 1, what="the reply")
    assert (got[0].body, got[0].correlation_id, got[0].routing_key) == (b"one", "c-1", queue)
    await got[0].ack()  # nothing to settle: no error

    with pytest.raises(TransportError, match="exclusive to another connection"):
        await other.consume(queue, lambda _: asyncio.sleep(0), no_ack=True)

    name = f"{client.name}:consume"

    async def listed() -> bool:
        return bool(await asyncio.to_thread(management_api.connections, name))

    await eventually(listed, what="the consume-only connection in the management API")
    assert await asyncio.to_thread(management_api.close_connections, name) == 1

    async def replies_again() -> bool:
        with contextlib.suppress(TransportError):  # unroutable until it is declared again
            await other.publish("", queue, b"two", correlation_id="c-2")
        await asyncio.sleep(0.2)
        return any(d.correlation_id == "c-2" for d in got)

    await eventually(replies_again, timeout_s=20, what="the reply queue declared again")


async def test_closing_the_consume_only_connection_closes_its_socket_on_the_brokers_close_ok(
    transport_factory: Any, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker answers connection.close with close-ok and waits for the client to close
    the socket: closing it then, not after waiting out a timeout (which cost every `mesh`
    command and every client's close a second)."""
    transport, _, _ = await raw_queues(transport_factory, namespace, "raw-close", 1)
    with caplog.at_level(logging.WARNING, logger="mesh.transport.amqp091"):
        await transport.close()
    assert "did not confirm the close" not in caplog.text
