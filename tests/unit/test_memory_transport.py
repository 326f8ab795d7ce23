"""``mesh.testing``: the in-memory broker behaves like RabbitMQ as the mesh uses it, and a
user's agent, the real manager and a client run together on it without a broker.

The behaviours shared with RabbitMQ are also checked against the real broker, by one suite
run on both, in ``tests/integration/test_transport_contract.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.errors import (
    PublishNacked,
    PublishTimeout,
    PublishUnroutable,
    TaskInputInvalid,
    TopologyMismatch,
    TopologyMissing,
    TransportError,
)
from mesh.manager.clock import Clock
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.samples import CalcAgent
from mesh.testing import (
    AccessRefused,
    DeliverySettleError,
    FakeClock,
    InMemoryBroker,
    InMemoryTransport,
    NotFound,
    PreconditionFailed,
    ResourceLocked,
    TransportClosed,
    topic_matches,
)
from mesh.topology import BindingSpec, Declarations, ExchangeSpec, QueueArguments, QueueSpec
from mesh.transport import Delivery
from mesh.wire.models import DrainAccepted


# ---- helpers --------------------------------------------------------------------------------
class Inbox:
    """A consumer's handler that records deliveries; ``auto_ack`` settles each at once."""

    def __init__(self, *, auto_ack: bool = False) -> None:
        self.auto_ack = auto_ack
        self.deliveries: list[Delivery] = []
        self._arrived = asyncio.Event()

    async def __call__(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self._arrived.set()
        if self.auto_ack:
            await delivery.ack()

    @property
    def bodies(self) -> list[bytes]:
        return [d.body for d in self.deliveries]

    async def wait_for(self, count: int, timeout_s: float = 1.0) -> list[Delivery]:
        async with asyncio.timeout(timeout_s):
            while len(self.deliveries) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.deliveries


async def settle() -> None:
    """Let every task that is ready run (handlers, callbacks scheduled with call_soon)."""
    for _ in range(10):
        await asyncio.sleep(0)


def queue(name: str, **arguments: Any) -> QueueSpec:
    return QueueSpec(name, arguments=QueueArguments(**arguments))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[InMemoryBroker]:
    memory = InMemoryBroker(clock=clock.monotonic)
    yield memory
    await memory.close()


@pytest.fixture
def transport(broker: InMemoryBroker) -> InMemoryTransport:
    return InMemoryTransport(broker, "test")


async def declare(
    transport: InMemoryTransport,
    *,
    exchanges: tuple[ExchangeSpec, ...] = (),
    queues: tuple[QueueSpec, ...] = (),
    bindings: tuple[BindingSpec, ...] = (),
) -> None:
    await transport.declare(Declarations(exchanges, queues, bindings))


# ---- routing ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("binding", "key", "matches"),
    [
        ("hb.*", "hb.calc-1", True),
        ("hb.*", "hb", False),
        ("hb.*", "hb.a.b", False),
        ("agent.*.*", "agent.calc-1.register", True),
        ("agent.*.*", "agent.calc-1", False),
        ("capability.#.calc-1", "capability.rag.search.calc-1", True),
        ("capability.#.calc-1", "capability.calc-1", True),
        ("capability.rag.search.*", "capability.rag.search.x", True),
        ("capability.rag.search.*", "capability.rag.searching.x", False),
        ("#", "", True),
        ("#", "any.thing.at.all", True),
        ("*", "", False),
        ("", "", True),
        ("a.#.#.b", "a.b", True),
        ("a.*.#", "a", False),
        ("a.*.#", "a.x", True),
    ],
)
def test_topic_bindings_match_star_for_one_word_and_hash_for_any_number(
    binding: str, key: str, matches: bool
) -> None:
    assert topic_matches(binding, key) is matches


async def test_a_topic_exchange_gives_a_copy_to_every_queue_whose_binding_matches(
    transport: InMemoryTransport,
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("x"),),
        queues=(queue("one"), queue("any"), queue("other")),
        bindings=(
            BindingSpec("one", "x", "log.*"),
            BindingSpec("any", "x", "log.#"),
            BindingSpec("any", "x", "#"),  # a second matching binding: still one copy
            BindingSpec("other", "x", "warning.*"),
        ),
    )

    await transport.publish("x", "log.calc-1", b"1")
    await transport.publish("x", "log.calc-1.ready", b"2")

    assert await transport.queue_depth("one") == 1
    assert await transport.queue_depth("any") == 2
    assert await transport.queue_depth("other") == 0


async def test_a_direct_exchange_matches_the_whole_key_and_the_default_exchange_the_queue_name(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("tasks", type="direct"),),
        queues=(queue("calc-1.tasks"),),
        bindings=(BindingSpec("calc-1.tasks", "tasks", "calc-1"),),
    )

    await transport.publish("tasks", "calc-1", b"task")
    await transport.publish("", "calc-1.tasks", b"direct to the queue")
    with pytest.raises(PublishUnroutable):
        await transport.publish("tasks", "calc-*", b"no wildcards on a direct exchange")

    assert [m.body for m in broker.messages("calc-1.tasks")] == [b"task", b"direct to the queue"]


async def test_a_mandatory_publish_that_matches_no_queue_is_unroutable_and_others_are_dropped(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, exchanges=(ExchangeSpec("x"),))

    with pytest.raises(PublishUnroutable):
        await transport.publish("x", "nobody.listens", b"")
    with pytest.raises(PublishUnroutable):
        await transport.publish("", "no-such-queue", b"")
    await transport.publish("x", "nobody.listens", b"", mandatory=False)
    await transport.publish_fast("x", "nobody.listens", b"")
    await transport.publish_fast("no-such-exchange", "k", b"")  # fire-and-forget: dropped


async def test_publishing_to_an_exchange_that_does_not_exist_is_a_transport_error(
    transport: InMemoryTransport,
) -> None:
    with pytest.raises(NotFound) as caught:
        await transport.publish("no-such-exchange", "k", b"")

    assert isinstance(caught.value, TransportError)


# ---- declarations ---------------------------------------------------------------------------
async def test_declaring_the_same_spec_again_is_harmless_and_another_spec_is_refused(
    broker: InMemoryBroker, transport: InMemoryTransport
) -> None:
    bounded = queue("q", max_length=2, overflow="reject-publish")
    await declare(transport, exchanges=(ExchangeSpec("x"),), queues=(bounded,))
    other = InMemoryTransport(broker, "other")
    await declare(other, exchanges=(ExchangeSpec("x"),), queues=(bounded,))

    with pytest.raises(TopologyMismatch, match="inequivalent"):
        await declare(other, queues=(queue("q", max_length=3, overflow="reject-publish"),))
    with pytest.raises(PreconditionFailed):
        await declare(other, exchanges=(ExchangeSpec("x", type="direct"),))
    with pytest.raises(NotFound):
        await declare(other, bindings=(BindingSpec("missing", "x", "#"),))
    with pytest.raises(AccessRefused):
        await declare(other, exchanges=(ExchangeSpec("amq.mine"),))
    transient_quorum = QueueSpec("qq", durable=False, arguments=QueueArguments("quorum"))
    with pytest.raises(PreconditionFailed, match="quorum"):
        await declare(other, queues=(transient_quorum,))


# ---- bounded queues ---------------------------------------------------------------------------
async def test_reject_publish_nacks_the_publish_past_the_bound_and_keeps_the_first_ones(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(transport, queues=(queue("q", max_length=2, overflow="reject-publish"),))

    await transport.publish("", "q", b"1")
    await transport.publish("", "q", b"2")
    with pytest.raises(PublishNacked):
        await transport.publish("", "q", b"3")

    assert [m.body for m in broker.messages("q")] == [b"1", b"2"]


async def test_drop_head_drops_the_oldest_and_dead_letters_it_as_maxlen(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("dlx"),),
        queues=(queue("q", max_length=2, dead_letter_exchange="dlx"), queue("dead")),
        bindings=(BindingSpec("dead", "dlx", "#"),),
    )

    for body in (b"1", b"2", b"3"):
        await transport.publish("", "q", body)

    assert [m.body for m in broker.messages("q")] == [b"2", b"3"]
    [dropped] = broker.messages("dead")
    assert dropped.body == b"1"
    assert dropped.headers["x-first-death-reason"] == "maxlen"


async def test_reject_publish_dlx_nacks_and_dead_letters_the_refused_message(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("dlx"),),
        queues=(
            queue("q", max_length=1, overflow="reject-publish-dlx", dead_letter_exchange="dlx"),
            queue("dead"),
        ),
        bindings=(BindingSpec("dead", "dlx", "#"),),
    )
    await transport.publish("", "q", b"kept")

    with pytest.raises(PublishNacked):
        await transport.publish("", "q", b"refused")

    assert [m.body for m in broker.messages("dead")] == [b"refused"]


async def test_unacked_messages_do_not_count_against_the_bound(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, queues=(queue("q", max_length=1, overflow="reject-publish"),))
    inbox = Inbox()
    await transport.consume("q", inbox, prefetch=1)

    await transport.publish("", "q", b"held by the consumer")
    await transport.publish("", "q", b"ready")
    with pytest.raises(PublishNacked):
        await transport.publish("", "q", b"one too many")

    assert inbox.bodies == [b"held by the consumer"]
    assert await transport.queue_depth("q") == 1


# ---- time -----------------------------------------------------------------------------------
async def test_messages_expire_after_the_queue_ttl_on_the_brokers_clock(
    transport: InMemoryTransport, broker: InMemoryBroker, clock: FakeClock
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("dlx"),),
        queues=(queue("q", message_ttl_ms=5_000, dead_letter_exchange="dlx"), queue("dead")),
        bindings=(BindingSpec("dead", "dlx", "#"),),
    )
    await transport.publish("", "q", b"old")
    clock.advance(3)
    await transport.publish("", "q", b"young")

    clock.advance(2)
    assert await transport.queue_depth("q") == 1
    assert [m.body for m in broker.messages("dead")] == [b"old"]
    assert broker.messages("dead")[0].headers["x-death"][0]["reason"] == "expired"

    clock.advance(3)
    broker.expire()  # without any transport call
    assert broker.messages("q") == []


async def test_a_queue_with_x_expires_goes_once_unused_for_that_long(
    transport: InMemoryTransport, broker: InMemoryBroker, clock: FakeClock
) -> None:
    await declare(transport, queues=(queue("q", expires_ms=60_000),))
    consumer = await transport.consume("q", Inbox())
    clock.advance(120)
    broker.expire()
    assert broker.has_queue("q"), "a queue with a consumer is in use"

    await consumer.cancel()
    clock.advance(59)
    broker.expire()
    assert broker.has_queue("q")
    clock.advance(1)
    broker.expire()
    assert not broker.has_queue("q")


# ---- settling ---------------------------------------------------------------------------------
async def test_prefetch_bounds_the_unacked_deliveries_of_each_consumer(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(transport, queues=(queue("q"),))
    inbox = Inbox()
    await transport.consume("q", inbox, prefetch=2)

    for i in range(5):
        await transport.publish("", "q", str(i).encode())
    await settle()
    assert inbox.bodies == [b"0", b"1"]
    assert broker.queue_info("q").unacked == 2
    assert await transport.queue_depth("q") == 3

    await inbox.deliveries[0].ack()
    await inbox.wait_for(3)
    assert inbox.bodies == [b"0", b"1", b"2"]


async def test_a_requeued_message_comes_back_first_marked_redelivered(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, queues=(queue("q"),))
    await transport.publish("", "q", b"first")
    await transport.publish("", "q", b"second")
    inbox = Inbox()
    await transport.consume("q", inbox, prefetch=1)
    [first] = await inbox.wait_for(1)
    assert not first.redelivered

    await first.reject(requeue=True)
    await inbox.wait_for(2)

    again = inbox.deliveries[1]
    assert (again.body, again.redelivered) == (b"first", True)


async def test_reject_without_requeue_dead_letters_with_the_x_death_record(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("in"), ExchangeSpec("dlx")),
        queues=(queue("q", dead_letter_exchange="dlx"), queue("dead")),
        bindings=(BindingSpec("q", "in", "work.*"), BindingSpec("dead", "dlx", "#")),
    )
    inbox = Inbox()
    await transport.consume("q", inbox)
    await transport.publish("in", "work.1", b"bad", headers={"x-custom": "kept"})
    [delivery] = await inbox.wait_for(1)

    await delivery.reject(requeue=False)

    [dead] = broker.messages("dead")
    assert dead.routing_key == "work.1"  # no x-dead-letter-routing-key: the original key
    assert dead.headers["x-custom"] == "kept"
    assert dead.headers["x-death"] == [
        {
            "count": 1,
            "reason": "rejected",
            "queue": "q",
            "exchange": "in",
            "routing-keys": ["work.1"],
        }
    ]
    assert dead.headers["x-first-death-queue"] == "q"


async def test_dead_letter_republishes_with_the_mesh_reason_headers(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(
        transport,
        exchanges=(ExchangeSpec("dlx"),),
        queues=(queue("q"), queue("dead")),
        bindings=(BindingSpec("dead", "dlx", "#"),),
    )
    await transport.publish("", "q", b"garbage", correlation_id="c-1")
    delivery = await transport.get_one("q")
    assert delivery is not None

    await transport.dead_letter(
        delivery, dead_letter_exchange="dlx", source_queue="q", reason="NOT_JSON", detail="x"
    )

    [dead] = broker.messages("dead")
    assert dead.headers[c.H_REASON] == "NOT_JSON"
    assert dead.headers[c.H_SOURCE_QUEUE] == "q"
    assert (dead.routing_key, dead.correlation_id) == ("q", "c-1")


async def test_a_quorum_queue_dead_letters_a_message_returned_more_than_its_delivery_limit(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    announce = queue("announce", queue_type="quorum", delivery_limit=1, dead_letter_exchange="d")
    await declare(
        transport,
        exchanges=(ExchangeSpec("d"),),
        queues=(announce, queue("dead")),
        bindings=(BindingSpec("dead", "d", "#"),),
    )
    inbox = Inbox()
    await transport.consume("announce", inbox)
    await transport.publish("", "announce", b"poison")

    await (await inbox.wait_for(1))[0].reject(requeue=True)
    await (await inbox.wait_for(2))[1].reject(requeue=True)
    await settle()

    assert len(inbox.deliveries) == 2
    assert inbox.deliveries[1].headers["x-delivery-count"] == 1
    assert broker.messages("dead")[0].headers["x-first-death-reason"] == "delivery_limit"


async def test_settling_twice_or_settling_a_no_ack_delivery_is_a_local_error(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, queues=(queue("acked"), queue("auto")))
    acked, auto = Inbox(), Inbox()
    await transport.consume("acked", acked)
    await transport.consume("auto", auto, no_ack=True)
    await transport.publish("", "acked", b"")
    await transport.publish("", "auto", b"")
    [delivery] = await acked.wait_for(1)
    [no_ack] = await auto.wait_for(1)

    await delivery.ack()
    with pytest.raises(DeliverySettleError):
        await delivery.reject()
    with pytest.raises(DeliverySettleError):
        await no_ack.ack()


async def test_no_ack_consumers_take_everything_at_once(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, queues=(queue("q"),))
    for i in range(5):
        await transport.publish("", "q", str(i).encode())
    inbox = Inbox()

    await transport.consume("q", inbox, prefetch=1, no_ack=True)

    await inbox.wait_for(5)
    assert await transport.queue_depth("q") == 0


async def test_consumers_of_one_queue_take_turns(transport: InMemoryTransport) -> None:
    await declare(transport, queues=(queue("q"),))
    a, b = Inbox(auto_ack=True), Inbox(auto_ack=True)
    await transport.consume("q", a, prefetch=10)
    await transport.consume("q", b, prefetch=10)

    for i in range(4):
        await transport.publish("", "q", str(i).encode())
    await settle()

    assert (a.bodies, b.bodies) == ([b"0", b"2"], [b"1", b"3"])


async def test_each_delivery_runs_in_its_own_task_started_in_delivery_order(
    transport: InMemoryTransport,
) -> None:
    await declare(transport, queues=(queue("q"),))
    started: list[bytes] = []
    release = asyncio.Event()

    async def slow(delivery: Delivery) -> None:
        started.append(delivery.body)
        await release.wait()
        await delivery.ack()

    await transport.consume("q", slow, prefetch=3)
    for body in (b"a", b"b", b"c"):
        await transport.publish("", "q", body)
    await settle()

    assert started == [b"a", b"b", b"c"], "all three run although none has finished"
    release.set()


async def test_a_raw_consumer_gets_bodies_without_acks(transport: InMemoryTransport) -> None:
    await declare(transport, queues=(queue("hb"),))
    got: list[tuple[bytes, str | None]] = []
    await transport.consume_raw("hb", lambda body, user_id: got.append((body, user_id)))

    await transport.publish_fast("", "hb", b"beat-1")
    await transport.publish_fast("", "hb", b"beat-2", user_id="agent-a")
    await settle()

    assert got == [(b"beat-1", None), (b"beat-2", "agent-a")]


# ---- queue and connection lifetimes -----------------------------------------------------------
async def test_an_auto_delete_queue_goes_with_its_last_consumer(
    transport: InMemoryTransport, broker: InMemoryBroker
) -> None:
    await declare(transport, queues=(QueueSpec("inbox", durable=False, auto_delete=True),))
    assert broker.has_queue("inbox"), "never consumed: it stays"
    first = await transport.consume("inbox", Inbox())
    second = await transport.consume("inbox", Inbox())

    await first.cancel()
    assert broker.has_queue("inbox")
    await second.cancel()
    assert not broker.has_queue("inbox")


async def test_an_exclusive_queue_is_its_transports_alone_and_goes_when_it_closes(
    broker: InMemoryBroker,
) -> None:
    owner = InMemoryTransport(broker, "owner")
    other = InMemoryTransport(broker, "other")
    await owner.declare_reply_queue("replies")

    await other.publish("", "replies", b"publishing to it is fine")
    with pytest.raises(ResourceLocked):
        await other.consume("replies", Inbox())
    with pytest.raises(ResourceLocked):
        await other.queue_depth("replies")

    await owner.close()
    assert not broker.has_queue("replies")
    with pytest.raises(TransportClosed):
        await owner.publish("", "anything", b"")


async def test_closing_a_transport_requeues_what_its_consumers_held_and_cancels_them(
    broker: InMemoryBroker, transport: InMemoryTransport
) -> None:
    await declare(transport, queues=(queue("q"),))
    worker = InMemoryTransport(broker, "worker")
    cancelled = asyncio.Event()
    held: list[Delivery] = []

    async def hold_forever(delivery: Delivery) -> None:
        held.append(delivery)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await worker.consume("q", hold_forever, prefetch=2)
    await transport.publish("", "q", b"1")
    await transport.publish("", "q", b"2")
    await settle()

    await worker.close()
    await settle()

    assert cancelled.is_set()
    assert [(m.body, m.redelivered) for m in broker.messages("q")] == [(b"1", True), (b"2", True)]
    with pytest.raises(TransportClosed):
        await held[0].ack()


async def test_a_disconnect_fires_the_callbacks_and_a_reconnect_restores_the_consumers(
    broker: InMemoryBroker, transport: InMemoryTransport
) -> None:
    await declare(transport, queues=(queue("q"),))
    worker = InMemoryTransport(broker, "worker")
    events: list[str] = []
    worker.on_disconnect(lambda: events.append("lost"))

    async def restored() -> None:
        events.append("back")

    worker.on_reconnect(restored)
    reply_queue = await worker.declare_reply_queue("replies")
    inbox = Inbox()
    await worker.consume("q", inbox)
    await transport.publish("", "q", b"unacked when the connection drops")
    await inbox.wait_for(1)

    await broker.disconnect(worker)
    assert events == ["lost"] and worker.is_closed
    assert not broker.has_queue(reply_queue), "exclusive queues go with the connection"
    with pytest.raises(TransportClosed):
        await worker.queue_depth("q")

    await broker.reconnect(worker)
    await inbox.wait_for(2)

    assert events == ["lost", "back"]
    assert broker.has_queue(reply_queue), "declared again, as a robust connection does"
    assert (inbox.deliveries[1].body, inbox.deliveries[1].redelivered) == (
        b"unacked when the connection drops",
        True,
    )


def test_the_fake_clock_moves_only_when_advanced_and_is_a_manager_clock() -> None:
    clock: Clock = FakeClock(mono=10.0, wall=1_000.0)
    assert clock.now() == clock.now()

    fake = FakeClock(mono=10.0, wall=1_000.0)
    later = fake.advance(2.5)

    assert (later.mono, later.wall, fake.monotonic()) == (12.5, 1_002.5, 12.5)
    with pytest.raises(ValueError):
        fake.advance(-1)


# ---- the user story: an agent, the real manager and a client, no broker -------------------
async def started_manager(transport: InMemoryTransport, namespace: str) -> ManagerService:
    """The real manager on the in-memory broker: an in-memory ledger and journal, a fake clock."""
    manager = ManagerService(
        ManagerSettings(
            namespace=namespace,
            tick_interval_s=0.05,
            ledger_url="sqlite::memory:",
            operator_user="operator",  # the client below speaks as it, to drain
        ),
        transport=transport,
        journal=SqliteJournal(":memory:"),
        clock=FakeClock(),
    )
    await manager.start()
    return manager


async def test_an_agent_the_manager_and_a_client_run_a_task_and_drain_without_a_broker() -> None:
    broker = InMemoryBroker()
    namespace = "demo"
    manager = await started_manager(InMemoryTransport(broker, "manager"), namespace)
    runtime = AgentRuntime(
        CalcAgent("calc-1", heartbeat_interval_s=5.0),
        AgentSettings(namespace=namespace, drain_timeout_s=5.0),
        InMemoryTransport(broker, "calc-1"),
    )
    await runtime.start()
    client = await MeshClient.connect(
        namespace=namespace,
        name="producer",
        transport=InMemoryTransport(broker, "producer"),
        user_id="operator",
    )
    try:
        outcome = await client.run_task(
            "math.evaluate", {"expression": "6 * 7"}, version_spec=">=1,<2"
        )
        assert outcome.output["value"] == 42
        assert outcome.lease.agent_id == "calc-1"
        assert manager.counters["heartbeats"] >= 1, "heartbeats reach the manager's raw consumer"
        with pytest.raises(TaskInputInvalid):
            await client.run_task("math.evaluate", {"expr": "1 + 1"})

        assert isinstance(await client.drain("calc-1"), DrainAccepted)
        await asyncio.wait_for(runtime.stopped.wait(), timeout=5.0)

        assert not broker.has_queue(f"{namespace}.agent.calc-1.tasks"), "left empty: deleted"
        assert not broker.has_queue(f"{namespace}.agent.calc-1.control"), "auto-deleted"
        status = await client.status()
        assert {a.agent_id: a.state for a in status.agents} in ({}, {"calc-1": "Terminated"})
    finally:
        await client.close()
        await runtime.stop()
        await manager.stop()
        await broker.close()


async def test_the_manager_and_an_agent_carry_on_after_their_connections_drop_and_return() -> None:
    broker = InMemoryBroker()
    manager_transport = InMemoryTransport(broker, "manager")
    agent_transport = InMemoryTransport(broker, "calc-1")
    manager = await started_manager(manager_transport, "ns")
    runtime = AgentRuntime(
        CalcAgent("calc-1", heartbeat_interval_s=5.0),
        AgentSettings(namespace="ns"),
        agent_transport,
    )
    await runtime.start()
    client = await MeshClient.connect(namespace="ns", transport=InMemoryTransport(broker, "c"))
    try:
        for transport in (manager_transport, agent_transport):
            await broker.disconnect(transport)
            await broker.reconnect(transport)

        outcome = await client.run_task("math.evaluate", {"expression": "2 ** 10"})

        assert outcome.output["value"] == 1024
        assert (manager.counters["reconnects"], runtime.counters["reconnects"]) == (1, 1)
    finally:
        await client.close()
        await runtime.stop()
        await manager.stop()
        await broker.close()


class _DeadLetterFails(InMemoryTransport):
    """The manager's transport, except that the first dead-letter republish fails (the
    dead-letter exchange's confirm never comes)."""

    failures = 1

    async def dead_letter(self, delivery: Delivery, **kwargs: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise PublishTimeout("no confirm for the dead letter")
        await super().dead_letter(delivery, **kwargs)


async def test_bad_input_the_manager_cannot_dead_letter_goes_back_to_its_queue() -> None:
    broker = InMemoryBroker()
    transport = _DeadLetterFails(broker, "manager")
    manager = await started_manager(transport, "ns")
    producer = InMemoryTransport(broker, "producer")
    try:
        topology = manager.topology
        await producer.publish(topology.announce_exchange, "agent.x.register", b"not json")
        dlq = topology.dead_letter_queue
        for _ in range(100):
            if broker.queue_info(dlq).ready:
                break
            await asyncio.sleep(0.01)
        # The first attempt failed and the message went back; the second dead-lettered it.
        [dead] = broker.messages(dlq)
        assert dead.body == b"not json"
        assert transport.failures == 0
        assert manager.counters["handler_errors"] == 0
        announce = broker.queue_info(topology.announce_queue)
        assert (announce.ready, announce.unacked) == (0, 0)
    finally:
        await producer.close()
        await manager.stop()
        await broker.close()


async def test_a_checking_agent_needs_the_managers_topology_and_declares_only_its_own() -> None:
    # shared_topology="check": what an agent whose broker user may not declare exchanges does.
    broker = InMemoryBroker()
    namespace = "demo"

    def checking_agent() -> AgentRuntime:
        return AgentRuntime(
            CalcAgent("calc-1", heartbeat_interval_s=5.0),
            AgentSettings(namespace=namespace, drain_timeout_s=5.0, shared_topology="check"),
            InMemoryTransport(broker, "calc-1"),
        )

    with pytest.raises(TopologyMissing, match=f"{namespace}\\."):
        await checking_agent().start()
    assert broker.exchange_names() == [], "a checking agent declared nothing shared"

    manager = await started_manager(InMemoryTransport(broker, "manager"), namespace)
    runtime = checking_agent()
    try:
        await runtime.start()
        assert "calc-1" in manager.core.agents
        assert broker.has_queue(f"{namespace}.agent.calc-1.tasks")
    finally:
        await runtime.stop()
        await manager.stop()
        await broker.close()
