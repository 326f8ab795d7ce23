"""One behavioural suite for the transport, run against the in-memory broker and RabbitMQ.

``mesh.testing.InMemoryBroker`` promises to behave like RabbitMQ as the mesh uses it, so users
can test their agents without a broker. Each test here runs twice, once per backend
(``[memory]`` and ``[rabbitmq]``), through the same transport calls: when the real broker and
the fake disagree, one of the two runs fails, and the fake is what gets fixed. Where the fake
differs on purpose, :mod:`mesh.testing.memory` says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from mesh import constants as c
from mesh.errors import (
    PublishNacked,
    PublishUnroutable,
    TopologyMismatch,
    TopologyMissing,
    TransportError,
)
from mesh.testing import InMemoryBroker, InMemoryTransport
from mesh.topology import BindingSpec, Declarations, ExchangeSpec, QueueArguments, QueueSpec
from mesh.transport import Delivery
from mesh.transport.ports import ClientTransport, ReportsBrokerCancel
from mesh.wire.codec import encode
from mesh.wire.models import Refusal
from mesh.wire.reasons import Reason

BACKENDS = ("memory", "rabbitmq")
WAIT_S = 10.0


class ContractTransport(ClientTransport, Protocol):
    """What the suite drives: the client port, plus ``get_one`` to look into a queue."""

    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None: ...


@dataclass
class Backend:
    """A way to open transports on one broker, real or in memory, in the test's namespace."""

    kind: str
    namespace: str
    connect: Callable[[str], Awaitable[ContractTransport]]
    broker: InMemoryBroker | None = None
    transports: list[ContractTransport] = field(default_factory=list)

    def name(self, suffix: str) -> str:
        """A queue or exchange name in the test's namespace (cleaned up after the test)."""
        return f"{self.namespace}.{suffix}"

    async def transport(self, suffix: str = "main") -> ContractTransport:
        transport = await self.connect(suffix)
        self.transports.append(transport)
        return transport


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which broker; for RabbitMQ, ``amqp_url`` is requested *before* ``namespace`` so the
    namespace fixture deletes everything named ``<namespace>.*`` after the test."""
    kind: str = request.param
    if kind == "rabbitmq":
        request.getfixturevalue("amqp_url")
    yield kind


@pytest.fixture
def backend_setup(backend_kind: str, request: pytest.FixtureRequest) -> Backend:
    namespace: str = request.getfixturevalue("namespace")
    if backend_kind == "memory":
        broker = InMemoryBroker()

        async def in_memory(suffix: str) -> ContractTransport:
            return InMemoryTransport(broker, suffix)

        return Backend(backend_kind, namespace, in_memory, broker=broker)
    factory = request.getfixturevalue("transport_factory")

    async def real(suffix: str) -> ContractTransport:
        transport: ContractTransport = await factory(suffix=suffix)
        return transport

    return Backend(backend_kind, namespace, real)


@pytest.fixture
async def backend(backend_setup: Backend) -> AsyncIterator[Backend]:
    yield backend_setup
    if backend_setup.broker is not None:
        await backend_setup.broker.close()
    # Real transports are closed by ``transport_factory``, then the namespace is deleted.


class Inbox:
    """A consumer's handler that records its deliveries and settles nothing by itself."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._arrived = asyncio.Event()

    async def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self._arrived.set()

    async def wait_for(self, count: int) -> list[Delivery]:
        async with asyncio.timeout(WAIT_S):
            while len(self.deliveries) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.deliveries


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        if await check():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        await asyncio.sleep(0.05)


def classic(name: str, **arguments: Any) -> QueueSpec:
    return QueueSpec(name, durable=False, arguments=QueueArguments(**arguments))


async def queue_exists(transport: ContractTransport, name: str) -> bool:
    try:
        await transport.queue_depth(name)
    except Exception:  # RabbitMQ: aiormq's 404; in memory: NotFound
        return False
    return True


# ---- routing ----------------------------------------------------------------------------------
async def test_a_topic_exchange_routes_by_words_with_star_for_one_and_hash_for_any(
    backend: Backend,
) -> None:
    t = await backend.transport()
    x, one, many, other = (backend.name(s) for s in ("x", "one", "many", "other"))
    await t.declare(
        Declarations(
            exchanges=(ExchangeSpec(x),),
            queues=(classic(one), classic(many), classic(other)),
            bindings=(
                BindingSpec(one, x, "log.*"),
                BindingSpec(many, x, "log.#"),
                BindingSpec(other, x, "capability.#.calc-1"),
            ),
        )
    )

    await t.publish(x, "log.calc-1", b"1")
    await t.publish(x, "log.calc-1.ready", b"2")
    await t.publish(x, "capability.rag.search.calc-1", b"3")
    await t.publish(x, "capability.calc-1", b"4")

    depths = [await t.queue_depth(q) for q in (one, many, other)]
    assert depths == [1, 2, 2]


async def test_fast_publishes_in_one_write_arrive_in_order_each_where_its_key_routes(
    backend: Backend,
) -> None:
    """publish_fast_many (the manager's feed events of a batch, one write): every message
    arrives once, in order, whole — one body larger than a frame (128 KiB) is split across
    body frames and joined again — and an empty batch publishes nothing."""
    t = await backend.transport()
    x, logs, caps = (backend.name(s) for s in ("fx", "logs", "caps"))
    await t.declare(
        Declarations(
            exchanges=(ExchangeSpec(x),),
            queues=(classic(logs), classic(caps)),
            bindings=(BindingSpec(logs, x, "log.#"), BindingSpec(caps, x, "capability.#")),
        )
    )
    large = bytes(range(256)) * 1200  # 300 KiB
    batch = [(f"log.agent-{n}.ready", b"%d" % n) for n in range(300)]
    batch.insert(150, ("capability.calc.agent-150", large))
    batch.append(("nobody.listens", b"dropped"))  # fire-and-forget: unroutable is dropped
    await t.publish_fast_many(x, [])
    await t.publish_fast_many(x, batch)

    async def queued() -> bool:
        return [await t.queue_depth(q) for q in (logs, caps)] == [300, 1]

    await eventually(queued, "the batch in both queues")
    got = [await _get(t, logs) for _ in range(300)]
    assert [(d.routing_key, d.body) for d in got] == [(k, b) for k, b in batch if k[0] == "l"]
    (whole,) = [await _get(t, caps)]
    assert (whole.routing_key, whole.body) == ("capability.calc.agent-150", large)


async def test_the_default_exchange_routes_to_the_queue_the_key_names(backend: Backend) -> None:
    t = await backend.transport()
    q = backend.name("direct")
    await t.declare(Declarations(queues=(classic(q),)))

    await t.publish("", q, b"hello", correlation_id="c-1", headers={"x-test": "yes"})

    delivery = await _get(t, q)
    assert (delivery.body, delivery.routing_key, delivery.exchange) == (b"hello", q, "")
    assert (delivery.correlation_id, delivery.headers["x-test"]) == ("c-1", "yes")
    assert delivery.message_id


async def test_a_mandatory_publish_that_no_queue_matches_raises_unroutable(
    backend: Backend,
) -> None:
    t = await backend.transport()
    x = backend.name("x")
    await t.declare(Declarations(exchanges=(ExchangeSpec(x),)))

    with pytest.raises(PublishUnroutable):
        await t.publish(x, "nobody.listens", b"")
    with pytest.raises(PublishUnroutable):
        await t.publish("", backend.name("no-such-queue"), b"")
    await t.publish(x, "nobody.listens", b"", mandatory=False)  # dropped, no error


# ---- bounded queues ---------------------------------------------------------------------------
async def test_a_bounded_queue_nacks_the_publish_past_the_bound_and_holds_exactly_the_bound(
    backend: Backend,
) -> None:
    t = await backend.transport()
    q = backend.name("bounded")
    await t.declare(Declarations(queues=(classic(q, max_length=3, overflow="reject-publish"),)))

    for i in range(3):
        await t.publish("", q, f"{i}".encode())
    with pytest.raises(PublishNacked):
        await t.publish("", q, b"one too many")

    assert await t.queue_depth(q) == 3


async def test_confirmed_publishes_in_one_write_each_get_their_own_outcome(
    backend: Backend,
) -> None:
    """publish_many (a registration batch's acceptances, one write): each message is
    confirmed, returned unroutable or nacked on its own, in order; publishes after it are
    confirmed as usual (its delivery tags did not shift theirs)."""
    t = await backend.transport()
    q, bounded = backend.name("many"), backend.name("many-bounded")
    await t.declare(
        Declarations(queues=(classic(q), classic(bounded, max_length=1, overflow="reject-publish")))
    )
    hello = [Refusal(reason=Reason.UNKNOWN_AGENT, detail=f"m{n}") for n in range(4)]
    outcomes = await t.publish_many(
        "",
        [(q, hello[0]), (backend.name("nobody"), hello[1]), (bounded, hello[2]),
         (bounded, hello[3])],
    )  # fmt: skip
    assert [type(o).__name__ for o in outcomes] == [
        "NoneType", "PublishUnroutable", "NoneType", "PublishNacked",
    ]  # fmt: skip
    assert await t.publish_many("", []) == []
    await t.publish("", q, b"after")  # its confirm is its own
    first, after = await _get(t, q), await _get(t, q)
    assert (first.body, after.body) == (encode(hello[0]), b"after")
    assert first.message_id and first.routing_key == q
    assert (await _get(t, bounded)).body == encode(hello[2])


async def test_drop_head_keeps_the_newest_messages(backend: Backend) -> None:
    t = await backend.transport()
    q = backend.name("newest")
    await t.declare(Declarations(queues=(classic(q, max_length=2, overflow="drop-head"),)))

    for body in (b"1", b"2", b"3"):
        await t.publish("", q, body)

    assert await t.queue_depth(q) == 2
    bodies = [(await _get(t, q)).body for _ in range(2)]
    assert bodies == [b"2", b"3"]


async def test_expired_messages_leave_the_queue_for_its_dead_letter_exchange(
    backend: Backend,
) -> None:
    t = await backend.transport()
    dlx, q, dead = backend.name("dlx"), backend.name("short-lived"), backend.name("dead")
    await t.declare(
        Declarations(
            exchanges=(ExchangeSpec(dlx),),
            queues=(classic(q, message_ttl_ms=100, dead_letter_exchange=dlx), classic(dead)),
            bindings=(BindingSpec(dead, dlx, "#"),),
        )
    )

    await t.publish("", q, b"stale soon")

    async def expired() -> bool:
        return await t.queue_depth(q) == 0 and await t.queue_depth(dead) == 1

    await eventually(expired, "the message to expire")
    assert (await _get(t, dead)).headers["x-first-death-reason"] == "expired"


# ---- dead-lettering -----------------------------------------------------------------------------
async def test_dead_letter_republishes_with_the_reason_in_x_mesh_reason(backend: Backend) -> None:
    t = await backend.transport()
    dlx, q, dead = backend.name("dead-letter"), backend.name("in"), backend.name("dead")
    await t.declare(
        Declarations(
            exchanges=(ExchangeSpec(dlx),),
            queues=(classic(q), classic(dead)),
            bindings=(BindingSpec(dead, dlx, "#"),),
        )
    )
    await t.publish("", q, b"not json", correlation_id="c-7", headers={"x-kept": "yes"})
    delivery = await _get(t, q)

    await t.dead_letter(
        delivery, dead_letter_exchange=dlx, source_queue=q, reason="NOT_JSON", detail="bad"
    )

    dead_one = await _get(t, dead)
    assert dead_one.body == b"not json"
    assert dead_one.routing_key == q
    assert dead_one.headers[c.H_REASON] == "NOT_JSON"
    assert dead_one.headers[c.H_SOURCE_QUEUE] == q
    assert dead_one.headers["x-kept"] == "yes"
    assert dead_one.correlation_id == "c-7"


async def test_a_rejected_message_goes_to_its_queues_dead_letter_exchange(
    backend: Backend,
) -> None:
    t = await backend.transport()
    dlx, q, dead = backend.name("dlx"), backend.name("work"), backend.name("dead")
    await t.declare(
        Declarations(
            exchanges=(ExchangeSpec(dlx),),
            queues=(classic(q, dead_letter_exchange=dlx), classic(dead)),
            bindings=(BindingSpec(dead, dlx, "#"),),
        )
    )
    inbox = Inbox()
    await t.consume(q, inbox)
    await t.publish("", q, b"refused")
    [delivery] = await inbox.wait_for(1)

    await delivery.reject(requeue=False)

    async def arrived() -> bool:
        return await t.queue_depth(dead) == 1

    await eventually(arrived, "the dead letter")
    dead_one = await _get(t, dead)
    assert dead_one.routing_key == q
    assert dead_one.headers["x-first-death-reason"] == "rejected"
    assert dead_one.headers["x-first-death-queue"] == q
    [death] = dead_one.headers["x-death"]
    assert (death["reason"], death["queue"], death["count"]) == ("rejected", q, 1)


# ---- consumers --------------------------------------------------------------------------------
async def test_prefetch_limits_the_unacked_deliveries_of_a_consumer(backend: Backend) -> None:
    t = await backend.transport()
    q = backend.name("prefetch")
    await t.declare(Declarations(queues=(classic(q),)))
    for i in range(5):
        await t.publish("", q, f"{i}".encode())
    inbox = Inbox()

    await t.consume(q, inbox, prefetch=2)
    await inbox.wait_for(2)
    await asyncio.sleep(0.3)  # room for a third delivery, were the limit not kept
    assert [d.body for d in inbox.deliveries] == [b"0", b"1"]

    await inbox.deliveries[0].ack()
    await inbox.wait_for(3)
    await asyncio.sleep(0.3)
    assert [d.body for d in inbox.deliveries] == [b"0", b"1", b"2"]
    assert await t.queue_depth(q) == 2


async def test_reject_with_requeue_redelivers_the_message_marked_redelivered(
    backend: Backend,
) -> None:
    t = await backend.transport()
    q = backend.name("requeue")
    await t.declare(Declarations(queues=(classic(q),)))
    inbox = Inbox()
    await t.consume(q, inbox, prefetch=1)
    await t.publish("", q, b"try again")
    [first] = await inbox.wait_for(1)
    assert first.redelivered is False

    await first.reject(requeue=True)
    second = (await inbox.wait_for(2))[1]

    assert (second.body, second.redelivered) == (b"try again", True)
    await second.ack()


async def test_consuming_a_missing_or_anothers_exclusive_queue_is_a_transport_error(
    backend: Backend,
) -> None:
    """Typed errors, naming the queue, and the transport still good for the next consumer."""
    t = await backend.transport()
    missing = backend.name("missing")
    with pytest.raises(TransportError, match="missing"):
        await t.consume(missing, Inbox())
    owner = await backend.transport("owner")
    mine = backend.name("exclusive")
    await owner.declare(Declarations(queues=(QueueSpec(mine, durable=False, exclusive=True),)))
    with pytest.raises(TransportError, match="exclusive"):
        await t.consume(mine, Inbox())
    q = backend.name("after")
    await t.declare(Declarations(queues=(QueueSpec(q, durable=False),)))
    inbox = Inbox()
    await t.consume(q, inbox, no_ack=True)
    await t.publish_fast("", q, b"x")
    assert [d.body for d in await inbox.wait_for(1)] == [b"x"]


async def test_an_auto_delete_queue_goes_when_its_last_consumer_is_cancelled(
    backend: Backend,
) -> None:
    t = await backend.transport()
    q = backend.name("inbox")
    await t.declare(Declarations(queues=(QueueSpec(q, durable=False, auto_delete=True),)))
    consumer = await t.consume(q, Inbox())
    assert await queue_exists(t, q)

    await consumer.cancel()

    async def gone() -> bool:
        return not await queue_exists(await backend.transport("probe"), q)

    await eventually(gone, "the auto-delete queue to go")


async def test_a_deleted_queues_consumer_is_told_and_its_depth_says_it_is_missing(
    backend: Backend,
) -> None:
    t = await backend.transport()
    q = backend.name("doomed")
    await t.declare(Declarations(queues=(classic(q),)))
    consumer = await t.consume(q, Inbox())
    assert isinstance(consumer, ReportsBrokerCancel)
    told: list[str] = []
    consumer.on_broker_cancel = lambda: told.append(q)

    await (await backend.transport("operator")).delete_queue(q)  # another connection's delete

    async def told_once() -> bool:
        return told == [q]

    await eventually(told_once, "the consumer to be told")
    with pytest.raises(TopologyMissing):
        await t.queue_depth(q)
    await consumer.cancel()  # nothing left to cancel: no error
    assert told == [q]


async def test_a_redeclaration_with_other_arguments_is_refused_as_a_precondition_failure(
    backend: Backend,
) -> None:
    first = await backend.transport("first")
    q = backend.name("args")
    await first.declare(Declarations(queues=(classic(q, max_length=2),)))
    second = await backend.transport("second")

    await second.declare(Declarations(queues=(classic(q, max_length=2),)))  # the same: fine
    with pytest.raises(TopologyMismatch) as caught:
        await second.declare(Declarations(queues=(classic(q, max_length=5),)))

    # Both transports name the queue and the way out (RabbitMQ answered 406).
    assert repr(q) in str(caught.value) and "delete_queue" in str(caught.value)


async def _get(transport: ContractTransport, queue: str) -> Delivery:
    delivery = await transport.get_one(queue)
    assert delivery is not None, f"{queue} is empty"
    return delivery


async def test_a_delivery_is_held_until_the_connection_it_came_on_is_gone(
    backend: Backend,
) -> None:
    """``Delivery.held``: once the channel a message came on is gone, the broker has given
    it back to its queue — the manager then answers nothing for it (another consumer may)."""
    first, second = await backend.transport("first"), await backend.transport("second")
    q = backend.name("held")
    await first.declare(Declarations(queues=(classic(q),)))
    inbox = Inbox()
    await first.consume(q, inbox, prefetch=1)
    await first.publish("", q, b"hold me")
    [delivery] = await inbox.wait_for(1)
    assert delivery.held()

    await first.close()
    assert not delivery.held()
    again = Inbox()
    await second.consume(q, again, prefetch=1)
    [redelivered] = await again.wait_for(1)  # the broker gave it to someone else
    assert (redelivered.body, redelivered.redelivered, redelivered.held()) == (
        b"hold me", True, True,
    )  # fmt: skip
    await redelivered.ack()
