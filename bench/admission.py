"""Benchmark of admission control: end to end over RabbitMQ, and in-core with each store.

Run: ``.venv/bin/python bench/admission.py`` (``--quick`` for a smoke run under a minute). It
prints both tables, then the targets with PASS/FAIL, and exits 1 if a target fails, so it
doubles as a check. Without a reachable broker part A and the ratios that need it are skipped
with one sentence; without a reachable PostgreSQL its rows of part B are (neither is a
failure). ``--part b`` runs part B alone.
``--profile`` adds one admission round under cProfile after part A and prints the time per
admission by stage, for the event loop (manager and client) and the manager's ledger thread.
``--tracing`` adds, per number in flight, rounds of ours with tracing off (no tracer provider)
and on with the sampler off (the OpenTelemetry SDK's ``ALWAYS_OFF``: every request still
makes its spans and carries ``traceparent``, nothing is recorded), interleaved (off, on, on,
off, …), and the target that tracing sampled out costs at most 5 % of the rate.

A) End-to-end admission. A producer's ``MeshClient.admit`` goes over RabbitMQ to the
   manager's ``rpc`` queue; the manager decodes it, runs ``Admitter.admit`` on its single
   ledger thread (eligibility, one ``read_for_decision`` and ``apply`` against SQLite),
   journals the decision, publishes it on the events feed and replies with publisher
   confirms. The question is what all of that costs on top of the request/reply round trip
   itself, so the baseline is a request/reply *echo* written on aiormq, the client the
   project builds on, with the project's publish tuning (:class:`AiormqEcho`: the server
   consumes a queue bound to a topic exchange with the manager's prefetch and publishes the
   body back to ``reply_to`` with the ``correlation_id`` on a confirming channel, ``wait=False``
   and the confirm awaited, then acks; the client publishes the same way with ``user_id`` and
   reads an exclusive reply queue without acks; each side on its own connection). Its payload
   is the encoded ``AdmissionRequest`` (same size as ours). The second baseline is the same
   echo on the project's own transport (:class:`TransportEcho`: its confirmed publish, its
   consume-only connection), the stricter of the two; ours is held to both. The same echo on
   aio-pika's high-level API is an extra row without a target (:class:`AioPikaEcho`). Each
   runs at 16 and at 64 in flight (``--concurrency``), ours too. Both sides keep C in flight
   for N requests; a round's throughput is N over the wall time from the first send to the
   last reply, and every request's latency (send to reply, as the caller sees it) feeds the
   round's p50/p99. Rounds alternate (ours, the echoes, then the reverse); the medians of
   the rounds are compared. The manager runs in-process (unique ``bench-<uuid8>``
   namespace, SQLite ledger and journal in a temp dir, the broker user as operator) with a
   descriptor whose capacities and tenant budget are too large to run out, live agents in
   the pool (registered over the broker, as agents do, with more concurrency than the run
   can hold: the manager's default ``admission_capacity="live"`` decides against them) and
   grants that outlive the run, so every decision must be ``admitted`` (checked) and no
   expiry sweep does work during the rounds. CPU per request is printed too: the whole
   process's (client and manager, or echo client and server) and the local broker's
   (``beam.smp`` read from /proc; it includes whatever other clients made
   the broker do meanwhile). On this 2-core machine the broker, both our threads and any
   neighbour share the cores, so throughput follows total CPU per request: when wall-clock
   rates jump between rounds while CPU per request stays put, the noise is a neighbour.
   Under the medians: the time a request spent inside ``AdmissionCore.decide`` (the decision
   itself, pure Python with no I/O; :class:`DecideClock`), and per fair echo what admission
   adds to its CPU a request beside what the throughput target leaves (≥ 0.8x a rate that
   follows CPU per request leaves a quarter of the echo's CPU): a decision dearer than the
   allowance puts the target out of reach of anything short of a cheaper decision.

B) In-core decisions on a mixed workload. ``Admitter.admit_many`` called directly, no
   broker, against ``SqliteLedger`` (a temp file, WAL) and ``PostgresLedger`` (a fresh schema,
   dropped afterwards), ``--concurrency`` decisions per ledger transaction (the manager's group
   commit; the target rows are medians of REPEATS runs on fresh stores) and one per
   transaction. Four pools with different descriptors and limits (one runs out), eight
   requirement shapes, three tenants, fresh time-ordered IDs, a fake clock advancing per
   request, short grants of which every other one is released and the rest expire during
   the run (:class:`MixedRun`); releases and sweeps are timed with the decisions. Each store
   is compared with a fixed reference measured in the same run: the faster fair echo's best
   requests/s (or ``--reference-rate``). Each row shows the decision's own share (``decide
   µs``), and the targets' lines what each leaves a decision in all.

The process's garbage collector is set up as ``mesh manager`` sets up its own
(:func:`mesh.gc_tuning.tune_gc`, after the imports), for both parts and for ours and the echo
alike: they share the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import aiormq
import psycopg
from report import Report, Target, add_json_argument

from mesh import constants as c
from mesh.core.admission import AdmissionCore
from mesh.core.batch import Batch
from mesh.core.capacity import LiveCapacity, LiveOffer
from mesh.errors import BrokerUnavailable, StoreError
from mesh.gc_tuning import tune_gc
from mesh.ids import IdSequence, new_admission_id
from mesh.ledger.model import LedgerView
from mesh.ledger.postgres import PostgresLedger
from mesh.ledger.sqlite import SqliteLedger
from mesh.ledger.store import LedgerStore
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.topology.specs import BindingSpec, Declarations, ExchangeSpec, QueueSpec, Topology
from mesh.transport.aiormq_bridge import WRITE_QUEUE_FRAMES
from mesh.transport.amqp import (
    DEFAULT_EXCHANGE,
    AmqpTransport,
    Delivery,
    redact,
)
from mesh.wire import (
    AdmissionRequest,
    AgentRegistration,
    Capability,
    CapabilityDescriptor,
    CapabilityRange,
    DescriptorAccepted,
    HealthEvidence,
    ModelLimits,
    PoolTool,
    Sandbox,
    TaskRequirements,
    TenantIsolation,
    ToolRequirement,
)
from mesh.wire.codec import encode

DEFAULT_PG_DSN = "postgresql://postgres@127.0.0.1:5432/mesh_test"

TARGET_THROUGHPUT_RATIO = 0.8  # ours / each fair echo's, at least
TARGET_TRACING_RATIO = 0.95  # ours traced with the sampler off / ours untraced, at least
# The tracing comparison: many short side-by-side pairs (a third of a round's requests each),
# so the median pair is not one the machine's noise picked; within the pool's live slots.
TRACING_PAIRS = 16
TRACING_ROUND_SHARE = 3
TARGET_P99_RATIO = 1.5  # ours / each fair echo's, at most
TARGET_ECHOES = (  # (path, target name, as the target's sentence says it)
    ("echo", "aiormq_echo", "the aiormq echo's"),
    ("own", "transport_echo", "our transport's echo's"),
)
"""The fair echoes ours must keep up with: the raw client the project builds on, and the
project's own transport (faster than aiormq's consumer and frame objects: ours beat the raw
echo at 64 in flight once the transport wrote its own publish frames, so the raw echo alone
no longer shows what admission costs)."""
STORE_BATCH = 16  # decisions a ledger transaction in part B: the manager's group commit

HUGE = 10**12  # no counter of the benchmark may run out
GRANT_TTL_S = 3_600.0  # grants outlive the run: the expiry sweep finds nothing to do
PREFETCH = ManagerSettings().prefetch
POLICY_GENERATION = 7


# ---- what is admitted -----------------------------------------------------------------------


def descriptor(now: float) -> CapabilityDescriptor:
    """The integration tests' sample pool (tests/unit/samples.py), with capacities to spare."""
    return CapabilityDescriptor(
        pool_id="rag-eu",
        descriptor_epoch=3,
        runtime_digest="sha256:" + "ab" * 32,
        capabilities=[
            CapabilityRange(name="rag.search", version_spec=">=2.0,<3"),
            CapabilityRange(name="rag.answer", version_spec="==1.*"),
        ],
        task_schema_range=">=1,<2",
        result_schema_range=">=1,<3",
        tools=[
            PoolTool(name="web-search", version="2.1.0", permits=HUGE),
            PoolTool(name="code.exec", version="1.0.0", permits=HUGE),
        ],
        data_classifications=["public", "internal", "confidential"],
        tenant_isolation=TenantIsolation(mode="shared", tenants=[]),
        regions=["eu-west-1", "eu-central-1"],
        model_limits=ModelLimits(context_tokens=128_000, max_output_tokens=8_192, slots=HUGE),
        sandbox=Sandbox(kind="gvisor", count=HUGE),
        policy_generation=POLICY_GENERATION,
        health=HealthEvidence(status="healthy", checked_at=now),
        issued_at=now - 60,
        expires_at=now + 3_600,
        issued_by="operator-alice",
    )


def requirements(now: float) -> TaskRequirements:
    """The sample task: rag.search, two web-search permits, a sandbox, 12k tokens."""
    return TaskRequirements(
        capability=CapabilityRange(name="rag.search", version_spec=">=2.1"),
        task_schema_version="1.4.0",
        result_schema_version="2.0.0",
        input_classifications=["internal"],
        required_tools=[ToolRequirement(name="web-search", version_spec=">=2", permits=2)],
        estimated_tokens=12_000,
        needs_sandbox=True,
        estimated_duration_s=30.0,
        deadline=now + 3_600,
        regions=["eu-west-1"],
        priority=5,
        service_class="interactive",
        allowed_degradations=["less_retrieval", "partial_results"],
        allowed_fallbacks=["rag-eu-2"],
    )


POOL_AGENTS = 6  # live agents of the pool, each at the most concurrency an agent may offer
# Part A's manager has twice as many: its rounds grant without releasing, and with --tracing
# they take more than 60,000 slots.
END_TO_END_AGENTS = 2 * POOL_AGENTS
AGENT_CONCURRENCY = 10_000


def agent_registration(agent_id: str) -> AgentRegistration:
    """A ``rag.search`` agent of the pool that beats rarely (it never does: the run is
    shorter than its liveness window)."""
    return AgentRegistration(
        agent_id=agent_id,
        incarnation=uuid.uuid4().hex,
        deployment="rag-eu",
        capabilities=[
            Capability(
                name="rag.search",
                version="2.1.0",
                input_schema={"type": "object"},
                output_schema={"type": "object"},
                max_concurrency=AGENT_CONCURRENCY,
                cost_class="B",
            )
        ],
        heartbeat_interval_s=3_600,
        features=list(c.AGENT_FEATURES),
    )


POLICY = AdmissionPolicy(
    grant_ttl_s=GRANT_TTL_S,
    active_generation=POLICY_GENERATION,  # the descriptor's, so it is eligible
    default_tenant_tokens=HUGE * 1_000,
)


# ---- timing ---------------------------------------------------------------------------------


class DecideClock:
    """Wall time spent inside one :class:`AdmissionCore`'s ``decide`` — the decision itself,
    pure Python with no I/O: no decoding, no ledger, no journal, no reply — and how many
    requests it decided. It is the floor under what admission adds to a request: whatever the
    rest costs, a target that leaves less than this per request cannot be met by this code.
    It wraps that one instance's method (an attribute on the instance, nothing global): two
    ``perf_counter`` calls and a call more a batch, ~0.2 µs a batch (timeit)."""

    def __init__(self, core: AdmissionCore) -> None:
        self.seconds = 0.0
        self.requests = 0
        decide = core.decide

        def timed(
            requests: Sequence[tuple[AdmissionRequest, str]],
            view: LedgerView,
            now: float,
            live: LiveCapacity | None = None,
        ) -> Batch:
            start = time.perf_counter()
            try:
                return decide(requests, view, now, live)
            finally:
                self.seconds += time.perf_counter() - start
                self.requests += len(requests)

        core.decide = timed


@dataclass(frozen=True, slots=True)
class Round:
    """One round of N requests: wall and process CPU seconds, and each request's latency."""

    seconds: float
    cpu_seconds: float  # the whole process: client, manager, ledger thread
    latencies_ms: list[float]
    ledger_cpu_seconds: float = 0.0  # the manager's ledger thread alone
    decide_seconds: float = 0.0  # wall time inside AdmissionCore.decide (ours only)
    broker_cpu_seconds: float | None = None  # RabbitMQ's, when it runs on this machine

    @property
    def ledger_cpu_us(self) -> float:
        return self.ledger_cpu_seconds / len(self.latencies_ms) * 1e6

    @property
    def decide_us(self) -> float:
        return self.decide_seconds / len(self.latencies_ms) * 1e6

    @property
    def broker_cpu_us(self) -> float | None:
        if self.broker_cpu_seconds is None:
            return None
        return self.broker_cpu_seconds / len(self.latencies_ms) * 1e6

    @property
    def rate(self) -> float:
        return len(self.latencies_ms) / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / len(self.latencies_ms) * 1e6

    def percentile(self, q: int) -> float:
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[q - 1]


def broker_cpu_seconds() -> float | None:
    """User+system CPU seconds of the local RabbitMQ (``beam.smp``), or ``None`` if there is
    none to read (another host, another OS). Both paths pay the broker; it shares the cores."""
    total, found = 0.0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if not fields[0].endswith("(beam.smp"):
                continue
            utime, stime = fields[1].split()[11:13]
        except (OSError, IndexError, ValueError):
            continue
        total, found = total + (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK"), True
    return total if found else None


async def closed_loop(
    call: Callable[[int], Awaitable[None]], count: int, concurrency: int
) -> Round:
    """``count`` calls, ``concurrency`` of them in flight at all times, each one timed."""
    numbers = iter(range(count))
    latencies: list[float] = []

    async def worker() -> None:
        for n in numbers:  # one shared iterator: each number is taken once
            start = time.perf_counter()
            await call(n)
            latencies.append((time.perf_counter() - start) * 1e3)

    broker = broker_cpu_seconds()
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    broker_after = broker_cpu_seconds()
    broker_used = None if broker is None or broker_after is None else broker_after - broker
    return Round(wall, cpu, latencies, broker_cpu_seconds=broker_used)


# ---- the baselines: raw request/reply echoes -------------------------------------------------


class AiormqEcho:
    """The fair baseline: a request/reply echo written on aiormq, the client the project builds
    on, with the project's publish tuning. Server and client each on their own connection.

    The server consumes a queue bound to a topic exchange (prefetch as the manager's) and, per
    request, publishes the body back to ``reply_to`` with the ``correlation_id`` on a channel
    with publisher confirms (``mandatory``, ``wait=False``: the confirm is the wait, as in
    :meth:`AmqpTransport.publish`), awaits the confirm, then acks. The client publishes with
    confirms, ``mandatory`` and ``user_id`` the same way, and consumes an exclusive reply queue
    without acks, matching replies to futures by ``correlation_id``. Its connections queue
    up to ``WRITE_QUEUE_FRAMES`` frames for their writer, as ours do (aiormq's default of 10
    queues a burst of publishes on the channel lock; mesh.transport.aiormq_bridge raises it for
    every aiormq connection in the process). Message and correlation IDs come from
    :class:`mesh.ids.IdSequence` (a prefix and a counter), as ours do, not a ``uuid4`` each.
    Nothing is decoded: everything ours does beyond this is the price of the feature.
    """

    label = "raw aiormq echo"

    def __init__(self, url: str, exchange: str, queue: str, user_id: str | None) -> None:
        self.url = url
        self.exchange_name = exchange
        self.queue_name = queue
        self.user_id = user_id
        self._connections: list[aiormq.abc.AbstractConnection] = []
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._publish: aiormq.abc.AbstractChannel | None = None
        self._reply_queue = ""
        self._ids = IdSequence()  # the client's message and correlation IDs
        self._server_ids = IdSequence()  # the server's message IDs

    async def start(self) -> None:
        assert aiormq.Connection.FRAME_BUFFER_SIZE >= WRITE_QUEUE_FRAMES  # tuned as ours
        server = await aiormq.connect(
            self.url, client_properties={"connection_name": "bench-admission-aiormq-echo-server"}
        )
        self._connections.append(server)
        replies = await server.channel(publisher_confirms=True)
        await replies.exchange_declare(self.exchange_name, exchange_type="topic", durable=False)
        requests = await server.channel(publisher_confirms=False)
        await requests.basic_qos(prefetch_count=PREFETCH)
        await requests.queue_declare(self.queue_name, durable=False)
        await requests.queue_bind(self.queue_name, self.exchange_name, routing_key="rpc.*")

        async def echo(message: aiormq.abc.DeliveredMessage) -> None:
            props = message.header.properties
            await replies.basic_publish(
                message.body,
                routing_key=str(props.reply_to),
                properties=aiormq.spec.Basic.Properties(
                    content_type=c.CONTENT_TYPE,
                    correlation_id=props.correlation_id,
                    message_id=self._server_ids.next(),
                ),
                mandatory=True,
                wait=False,
            )
            await requests.basic_ack(message.delivery_tag or 0)

        await requests.basic_consume(self.queue_name, echo)

        client = await aiormq.connect(
            self.url, client_properties={"connection_name": "bench-admission-aiormq-echo-client"}
        )
        self._connections.append(client)
        self._publish = await client.channel(publisher_confirms=True)
        consume = await client.channel(publisher_confirms=False)
        declared = await consume.queue_declare("", exclusive=True, auto_delete=True)
        self._reply_queue = str(declared.queue)
        await consume.basic_consume(self._reply_queue, self._on_reply, no_ack=True)

    async def _on_reply(self, message: aiormq.abc.DeliveredMessage) -> None:
        fut = self._pending.pop(message.header.properties.correlation_id or "", None)
        if fut is not None and not fut.done():
            fut.set_result(message.body)

    async def call(self, body: bytes) -> bytes:
        assert self._publish is not None
        correlation_id = self._ids.next()
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = fut
        try:
            async with asyncio.timeout(10):
                await self._publish.basic_publish(
                    body,
                    exchange=self.exchange_name,
                    routing_key="rpc.echo",
                    properties=aiormq.spec.Basic.Properties(
                        content_type=c.CONTENT_TYPE,
                        message_id=self._ids.next(),
                        reply_to=self._reply_queue,
                        correlation_id=correlation_id,
                        user_id=self.user_id,
                    ),
                    mandatory=True,
                    wait=False,
                )
                return await fut
        finally:
            self._pending.pop(correlation_id, None)

    async def close(self) -> None:
        for connection in reversed(self._connections):
            with contextlib.suppress(Exception):
                await connection.close()


class AioPikaEcho:
    """An extra row, no target: the same echo on aio-pika's high-level API (its ``Message``,
    ``Exchange.publish`` and ``IncomingMessage``), what a user of aio-pika would write first."""

    label = "aio-pika echo (extra)"

    def __init__(self, url: str, exchange: str, queue: str, user_id: str | None) -> None:
        self.url = url
        self.exchange_name = exchange
        self.queue_name = queue
        self.user_id = user_id
        self._server: aio_pika.abc.AbstractRobustConnection | None = None
        self._client: aio_pika.abc.AbstractRobustConnection | None = None
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._reply_queue = ""

    async def start(self) -> None:
        self._server = await aio_pika.connect_robust(
            self.url, client_properties={"connection_name": "bench-admission-echo-server"}
        )
        replies = await self._server.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await replies.declare_exchange(
            self.exchange_name, aio_pika.ExchangeType.TOPIC, durable=False
        )
        requests = await self._server.channel()
        await requests.set_qos(prefetch_count=PREFETCH)
        queue = await requests.declare_queue(self.queue_name, durable=False)
        await queue.bind(exchange, "rpc.*")
        default = replies.default_exchange

        async def echo(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            reply = aio_pika.Message(
                message.body,
                content_type=c.CONTENT_TYPE,
                correlation_id=message.correlation_id,
                message_id=uuid.uuid4().hex,
            )
            await default.publish(reply, str(message.reply_to), mandatory=True, timeout=10)
            await message.ack()

        await queue.consume(echo)

        self._client = await aio_pika.connect_robust(
            self.url, client_properties={"connection_name": "bench-admission-echo-client"}
        )
        publish = await self._client.channel(publisher_confirms=True, on_return_raises=True)
        self._exchange = await publish.get_exchange(self.exchange_name, ensure=False)
        consume = await self._client.channel()
        reply_queue = await consume.declare_queue(exclusive=True, auto_delete=True)
        self._reply_queue = reply_queue.name
        await reply_queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        fut = self._pending.pop(message.correlation_id or "", None)
        if fut is not None and not fut.done():
            fut.set_result(message.body)

    async def call(self, body: bytes) -> bytes:
        assert self._exchange is not None
        correlation_id = uuid.uuid4().hex
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = fut
        message = aio_pika.Message(
            body,
            content_type=c.CONTENT_TYPE,
            message_id=uuid.uuid4().hex,
            reply_to=self._reply_queue,
            correlation_id=correlation_id,
            user_id=self.user_id,
        )
        try:
            await self._exchange.publish(message, "rpc.echo", mandatory=True, timeout=10)
            return await asyncio.wait_for(fut, 10)
        finally:
            self._pending.pop(correlation_id, None)

    async def close(self) -> None:
        for connection in (self._client, self._server):
            if connection is not None:
                await connection.close()


# ---- part A -----------------------------------------------------------------------------------


class TransportEcho:
    """The second fair baseline: the same echo on the project's own transport
    (:class:`AmqpTransport`), each side on a transport of its own. The server reads requests
    with acks on the consume-only connection (``consume_acked``, as the manager reads its rpc
    queue) and answers each on a task of its own with a confirmed ``publish`` (its frames
    written by :mod:`mesh.transport.amqp091.publish` on aiormq's channel, as the manager's replies
    are) before acking; the client publishes the same way with ``user_id`` and reads its
    replies with ``consume_replies``, as ``MeshClient`` does. Ours against this row is what
    deciding, recording and answering an admission costs over the project's own transport:
    the aiormq echo pays aiormq's consumer and pamqp's frame objects on every message, this
    one does not, and is the stricter of the two."""

    label = "our transport's echo"

    def __init__(self, url: str, exchange: str, queue: str, user_id: str | None) -> None:
        self.url = url
        self.exchange_name = exchange
        self.queue_name = queue
        self.user_id = user_id
        self._transports: list[AmqpTransport] = []
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._ids = IdSequence()
        self._reply_queue = f"{queue}.replies"
        self._answering: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        server = await AmqpTransport.connect(self.url, name="bench-admission-own-echo-server")
        self._transports.append(server)
        await server.declare(
            Declarations(
                exchanges=(ExchangeSpec(self.exchange_name, durable=False),),
                queues=(QueueSpec(self.queue_name, durable=False),),
                bindings=(BindingSpec(self.queue_name, self.exchange_name, "rpc.*"),),
            )
        )

        async def echo(delivery: Delivery) -> None:
            await server.publish(
                DEFAULT_EXCHANGE,
                delivery.reply_to or "",
                delivery.body,
                correlation_id=delivery.correlation_id,
            )
            await delivery.ack()

        def take(deliveries: list[Delivery]) -> None:
            for delivery in deliveries:
                task = asyncio.create_task(echo(delivery))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)

        await server.consume_acked(self.queue_name, take, prefetch=PREFETCH)
        client = await AmqpTransport.connect(self.url, name="bench-admission-own-echo-client")
        self._transports.append(client)
        await client.consume_replies(self._reply_queue, self._on_replies)

    def _on_replies(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            fut = self._pending.pop(delivery.correlation_id or "", None)
            if fut is not None and not fut.done():
                fut.set_result(delivery.body)

    async def call(self, body: bytes) -> bytes:
        correlation_id = self._ids.next()
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = fut
        try:
            async with asyncio.timeout(10):
                await self._transports[1].publish(
                    self.exchange_name,
                    "rpc.echo",
                    body,
                    reply_to=self._reply_queue,
                    correlation_id=correlation_id,
                    user_id=self.user_id,
                )
                return await fut
        finally:
            self._pending.pop(correlation_id, None)

    async def close(self) -> None:
        for transport in reversed(self._transports):
            with contextlib.suppress(Exception):
                await transport.close()


class EndToEnd:
    """The manager, its producer and the echo, all in one ``bench-<uuid8>`` namespace."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.url = url
        self.workdir = workdir
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"
        self.requirements = requirements(time.time())
        self.payload = encode(
            AdmissionRequest(admission_id=uuid.uuid4().hex, requirements=self.requirements)
        )
        self.service: ManagerService | None = None
        self.client: MeshClient | None = None
        self.echoes: dict[str, AiormqEcho | AioPikaEcho | TransportEcho] = {}
        self.refused: list[str] = []
        self.decide_clock: DecideClock | None = None

    def echo_exchange(self, path: str) -> str:
        return f"{self.namespace}.{path}"

    def echo_queue(self, path: str) -> str:
        return f"{self.namespace}.{path}.rpc"

    async def start(self) -> None:
        settings = ManagerSettings(
            amqp_url=self.url,
            namespace=self.namespace,
            journal_path=self.workdir / "journal.sqlite3",
            ledger_url=f"sqlite:{self.workdir / 'ledger.sqlite3'}",
            manager_id=f"bench-{self.namespace}",
            admission=POLICY,
            operator_user=urlsplit(self.url).username or "guest",  # our producer is the operator
        )
        self.service = ManagerService(settings)
        await self.service.start()
        self.decide_clock = DecideClock(self.service.admission.admitter.core)
        self.client = await MeshClient.connect(
            self.url, namespace=self.namespace, name="bench-admission-producer"
        )
        accepted = await self.client.publish_descriptor(descriptor(time.time()))
        if not isinstance(accepted, DescriptorAccepted):
            raise RuntimeError(f"the manager refused the descriptor: {accepted}")
        await self._register_agents()
        kinds: tuple[tuple[str, type[AiormqEcho | AioPikaEcho | TransportEcho]], ...] = (
            ("echo", AiormqEcho),
            ("pika", AioPikaEcho),
            ("own", TransportEcho),
        )
        for path, kind in kinds:
            echo = kind(
                self.url, self.echo_exchange(path), self.echo_queue(path), self.client.user_id
            )
            self.echoes[path] = echo
            await echo.start()

    async def _register_agents(self) -> None:
        """The pool's live agents, registered on the announce exchange as an agent does."""
        assert self.client is not None and self.service is not None
        topology = Topology(self.namespace)
        for n in range(END_TO_END_AGENTS):
            agent_id = f"rag-eu-{n}"
            # Its control queue first: an acceptance the broker cannot route takes the
            # registration back (the agent never heard it was accepted).
            await self.client.transport.declare(topology.agent_queues(agent_id, 2))
            await self.client.transport.publish(
                topology.announce_exchange,
                f"{c.RK_AGENT}.{agent_id}.register",
                agent_registration(agent_id),
            )
        core = self.service.core
        for _ in range(100):
            if core.live_capacity(self.service.clock.now()).agents("rag-eu", "rag.search"):
                if len(core.agents) == END_TO_END_AGENTS:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError("the pool's agents did not register with the manager")

    async def ours(self, count: int, concurrency: int) -> Round:
        client = self.client
        assert client is not None

        async def admit(n: int) -> None:
            decision = await client.admit(self.requirements)  # a fresh ID, as the SDK makes it
            if decision.outcome != "admitted":
                self.refused.append(f"{decision.outcome} {decision.reason}: {decision.detail}")

        assert self.decide_clock is not None
        ledger_cpu, decide_seconds = await self.ledger_cpu(), self.decide_clock.seconds
        result = await closed_loop(admit, count, concurrency)
        result = replace(
            result,
            ledger_cpu_seconds=await self.ledger_cpu() - ledger_cpu,
            decide_seconds=self.decide_clock.seconds - decide_seconds,
        )
        if self.refused:
            raise RuntimeError(f"{len(self.refused)} admissions not admitted: {self.refused[0]}")
        return result

    async def ledger_cpu(self) -> float:
        """CPU seconds of the manager's ledger thread so far, read on that thread."""
        assert self.service is not None
        ledger_thread = (
            self.service.admission.ledger_thread
        )  # the one worker every ledger call runs on
        return await asyncio.get_running_loop().run_in_executor(ledger_thread, time.thread_time)

    def baseline(self, path: str) -> Callable[[int, int], Awaitable[Round]]:
        echo, payload = self.echoes[path], self.payload

        async def call(_: int) -> None:
            body = await echo.call(payload)
            assert len(body) == len(payload)

        async def run(count: int, concurrency: int) -> Round:
            return await closed_loop(call, count, concurrency)

        return run

    async def close(self) -> None:
        """Stop everything, then delete every queue and exchange of the namespace."""
        for part in (*self.echoes.values(), self.client, self.service):
            if part is not None:
                with contextlib.suppress(Exception):
                    await (part.stop() if isinstance(part, ManagerService) else part.close())
        topology = Topology(namespace=self.namespace)
        declared = topology.manager()
        queues = [q.name for q in declared.queues] + [self.echo_queue(p) for p in self.echoes]
        # The pool's task queue, declared by the manager when it accepted the descriptor.
        queues.append(topology.pool_task_queue(descriptor(time.time()).pool_id))
        for n in range(END_TO_END_AGENTS):  # the stand-in agents' own queues
            queues += [q.name for q in topology.agent_queues(f"rag-eu-{n}", 2).queues]
        exchanges = [x.name for x in declared.exchanges] + [
            self.echo_exchange(p) for p in self.echoes
        ]
        try:
            connection = await aio_pika.connect(
                self.url, client_properties={"connection_name": "bench-admission-cleanup"}
            )
            async with connection:
                channel = await connection.channel()
                for queue in queues:
                    await channel.queue_delete(queue)
                for exchange in exchanges:
                    await channel.exchange_delete(exchange)
        except Exception as exc:  # say what is left behind rather than hide the real error
            print(f"   could not delete the queues and exchanges of {self.namespace}: {exc}")


@dataclass(frozen=True, slots=True)
class Summary:
    rate: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    ledger_cpu_us: float
    broker_cpu_us: float | None
    decide_us: float  # inside AdmissionCore.decide a request (ours; 0 for the echoes)


def summarise(rounds: list[Round]) -> Summary:
    return Summary(
        rate=statistics.median(r.rate for r in rounds),
        p50_ms=statistics.median(r.percentile(50) for r in rounds),
        p99_ms=statistics.median(r.percentile(99) for r in rounds),
        cpu_us=statistics.median(r.cpu_us for r in rounds),
        ledger_cpu_us=statistics.median(r.ledger_cpu_us for r in rounds),
        decide_us=statistics.median(r.decide_us for r in rounds),
        broker_cpu_us=None
        if any(r.broker_cpu_us is None for r in rounds)
        else statistics.median(r.broker_cpu_us or 0.0 for r in rounds),
    )


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


LABELS = {
    "ours": "MeshClient.admit → manager",
    "echo": AiormqEcho.label,
    "pika": AioPikaEcho.label,
    "own": TransportEcho.label,
}
ORDERS = (("ours", "echo", "own", "pika"), ("pika", "own", "echo", "ours"))  # against drift


async def run_part_a(
    url: str,
    count: int,
    concurrencies: tuple[int, ...],
    rounds: int,
    profile: bool,
    workdir: Path,
    traced: bool = False,
) -> dict[int, dict[str, Summary]] | None:
    """For each number in flight: ``rounds`` rounds of each path, their medians by path."""
    try:
        probe = await AmqpTransport.connect(url, name="bench-admission-probe", connect_timeout_s=5)
    except BrokerUnavailable as exc:
        print(f"A) skipped: {exc}.")
        return None
    await probe.close()
    bench = EndToEnd(url, workdir)
    out: dict[int, dict[str, Summary]] = {}
    try:
        await bench.start()
        print(
            f"A) admissions end to end over RabbitMQ at {redact(url)}: {count:,} requests per "
            f"round, {len(bench.payload):,}-byte requests, namespace {bench.namespace}"
        )
        paths: dict[str, Callable[[int, int], Awaitable[Round]]] = {
            "ours": bench.ours,
            "echo": bench.baseline("echo"),
            "pika": bench.baseline("pika"),
            "own": bench.baseline("own"),
        }
        for run in paths.values():  # warm-up: first-call costs, caches, the ledger's pages
            await run(min(count, 200), max(concurrencies))
        for concurrency in concurrencies:
            out[concurrency] = await part_a_rounds(bench, paths, count, concurrency, rounds)
            if traced:
                out[concurrency].update(
                    await tracing_rounds(
                        bench.ours, count // TRACING_ROUND_SHARE, concurrency, TRACING_PAIRS
                    )
                )
        assert bench.service is not None
        decided, batches = (
            bench.service.counters["admission.admitted"],
            bench.service.counters["admission_batches"],
        )
        print(
            f"   the manager decided {decided:,} admissions in {batches:,} ledger transactions "
            f"(group commit: {decided / max(batches, 1):.1f} a transaction on average)"
        )
        if profile:
            await profile_round(bench, count, concurrencies[0])
    finally:
        await bench.close()
    return out


async def part_a_rounds(
    bench: EndToEnd,
    paths: dict[str, Callable[[int, int], Awaitable[Round]]],
    count: int,
    concurrency: int,
    rounds: int,
) -> dict[str, Summary]:
    print()
    print(
        f"   {concurrency} in flight\n   {'round':>5}  {'path':<28}{'seconds':>8}  {'req/s':>7}  "
        f"{'p50 ms':>7}  {'p99 ms':>7}  {'CPU µs/req: process':>19}  {'broker':>7}"
    )
    results: dict[str, list[Round]] = {path: [] for path in paths}
    for n in range(1, rounds + 1):
        for path in ORDERS[(n + 1) % 2]:
            result = await paths[path](count, concurrency)
            results[path].append(result)
            print(
                f"   {n:>5}  {LABELS[path]:<28}{result.seconds:>8.2f}  {result.rate:>7,.0f}  "
                f"{result.percentile(50):>7.2f}  {result.percentile(99):>7.2f}  "
                f"{result.cpu_us:>19,.0f}  {_us(result.broker_cpu_us):>7}",
                flush=True,
            )
    summaries = {path: summarise(rounds_) for path, rounds_ in results.items()}
    print()
    for path, s in summaries.items():
        broker = f"; broker {s.broker_cpu_us:,.0f}" if s.broker_cpu_us is not None else ""
        print(
            f"   median {LABELS[path]:<28} {s.rate:>7,.0f} req/s   p50 {s.p50_ms:6.2f} ms   "
            f"p99 {s.p99_ms:6.2f} ms   CPU µs/req: process {s.cpu_us:,.0f}{broker}"
        )
    print_floor(summaries)
    return summaries


async def tracing_rounds(
    ours: Callable[[int, int], Awaitable[Round]], count: int, concurrency: int, rounds: int
) -> dict[str, Summary]:
    """``rounds`` pairs of rounds of ours, untraced and traced with the SDK's sampler off
    (``mesh.tracing.use_provider``: the client and the manager share this process),
    interleaved against drift; their medians, as ``untraced`` and ``traced``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from mesh import tracing

    sampled_out = TracerProvider(sampler=ALWAYS_OFF)
    results: dict[str, list[Round]] = {"untraced": [], "traced": []}
    print(f"\n   tracing at {concurrency} in flight: off (no provider) and on (sampler off)")
    for n in range(rounds):
        for mode in ("untraced", "traced") if n % 2 == 0 else ("traced", "untraced"):
            tracing.use_provider(sampled_out if mode == "traced" else None)
            try:
                result = await ours(count, concurrency)
            finally:
                tracing.use_global_provider()
            results[mode].append(result)
            print(
                f"   {n + 1:>5}  {mode:<28}{result.seconds:>8.2f}  {result.rate:>7,.0f}  "
                f"{result.percentile(50):>7.2f}  {result.percentile(99):>7.2f}  "
                f"{result.cpu_us:>19,.0f}",
                flush=True,
            )
    summaries = {mode: summarise(rounds_) for mode, rounds_ in results.items()}
    off, on = summaries["untraced"], summaries["traced"]
    # Rounds drift (the ledger grows, the machine is shared): each traced round is compared
    # with the untraced one run next to it, and the target reads the median of those ratios.
    pairs = list(zip(results["untraced"], results["traced"], strict=True))
    TRACING_PAIR_RATIOS[concurrency] = statistics.median(t.rate / u.rate for u, t in pairs)
    cpu = statistics.median(t.cpu_us / u.cpu_us for u, t in pairs)
    print(
        f"   tracing, sampler off: {TRACING_PAIR_RATIOS[concurrency]:.3f}x the rate untraced "
        f"(median of {len(pairs)} side-by-side pairs; medians {on.rate:,.0f} vs "
        f"{off.rate:,.0f} req/s); CPU µs/req {cpu - 1:+.1%} (pairs; medians {on.cpu_us:,.0f} "
        f"vs {off.cpu_us:,.0f})"
    )
    return summaries


TRACING_PAIR_RATIOS: dict[int, float] = {}  # by number in flight: traced / untraced rate


def print_floor(summaries: dict[str, Summary]) -> None:
    """What admission adds to each fair echo's request, what the throughput target leaves
    it, and what the decision alone takes: throughput here follows the process's CPU per
    request, so ≥ 0.8x an echo's rate leaves admission at most a quarter of that echo's CPU."""
    ours = summaries["ours"]
    print(
        f"   the decision alone (AdmissionCore.decide: pure Python, no I/O) took "
        f"{ours.decide_us:,.0f} µs a request"
    )
    for path, _, _ in TARGET_ECHOES:
        echo = summaries[path]
        print(
            f"   {LABELS[path]}: {echo.cpu_us:,.0f} µs of process CPU a request; admission adds "
            f"{ours.cpu_us - echo.cpu_us:,.0f}, ≥ {TARGET_THROUGHPUT_RATIO:g}x its rate leaves "
            f"it at most {allowance_us(echo.cpu_us):,.0f}"
        )


def allowance_us(echo_cpu_us: float) -> float:
    """Admission's CPU a request that keeps throughput at the target ratio of an echo whose
    requests cost ``echo_cpu_us``, where throughput follows CPU per request."""
    return echo_cpu_us * (1 / TARGET_THROUGHPUT_RATIO - 1)


# Where a profiled round's time goes: (label, file, function); indentation shows nesting.
LOOP_STAGES = (
    ("manager: one rpc delivery, decode to ack", "mesh/manager/intake.py", "_guarded"),
    ("  decode the request (decode_as)", "mesh/wire/codec.py", "decode_as"),
    (
        "  group commit: wait for the batch (GroupCommit.submit)",
        "mesh/manager/batching.py",
        "submit",
    ),
    (
        "  a batch: ledger thread, journal, feed (per admission)",
        "mesh/manager/admission_service.py",
        "_ledger_batch",
    ),
    (
        "    the ledger's work, on its thread or inline, and back",
        "mesh/manager/admission_service.py",
        "_on_ledger",
    ),
    ("    journal the decisions (SQLite, on the loop)", "mesh/manager/commands.py", "append"),
    ("    publish them on the events feed", "mesh/manager/commands.py", "publish_events"),
    ("  reply, confirmed (reply)", "mesh/manager/commands.py", "reply"),
    ("  ack the request", "mesh/transport/delivery.py", "ack"),
    ("client: MeshClient.request", "mesh/producer/client.py", "request"),
    ("client: match and decode the reply", "mesh/producer/replies.py", "_on_reply"),
    ("aiormq: read and parse frames", "aiormq/connection.py", "__reader"),
    (
        "consume-only connection: read and parse",
        "mesh/transport/amqp091/protocol.py",
        "data_received",
    ),
    ("aiormq: write frames", "aiormq/connection.py", "__writer"),
)
LEDGER_STAGES = (
    ("Admitter.admit_batch (a batch, one transaction)", "mesh/manager/admission.py", "admit_batch"),
    (
        "  read the view (LedgerStore.read_for_decision)",
        "mesh/ledger/store.py",
        "read_for_decision",
    ),
    ("  decide (AdmissionCore.decide, pure)", "mesh/core/admission.py", "decide"),
    ("    eligibility (the cache's lookup)", "mesh/core/eligibility.py", "lookup"),
    ("    the recorded decision, if any", "mesh/core/decision_memory.py", "earlier_decision"),
    ("    record the decision", "mesh/core/decision_memory.py", "record"),
    ("  apply the operations (LedgerStore.apply)", "mesh/ledger/store.py", "apply"),
    (
        "  of which sqlite3 execute (incl. BEGIN/COMMIT)",
        "~",
        "<method 'execute' of 'sqlite3.Connection' objects>",
    ),
)


def stage_times(
    stats: pstats.Stats, stages: tuple[tuple[str, str, str], ...]
) -> list[tuple[str, float]]:
    """Cumulative seconds per stage (own time for C functions); 0 when never called."""
    table = stats.stats  # type: ignore[attr-defined]
    out = []
    for label, where, function in stages:
        total = sum(
            (tt if where == "~" else ct)
            for (filename, _, name), (_, _, tt, ct, _) in table.items()
            if name == function and (filename == where or filename.endswith(where))
        )
        out.append((label, total))
    return out


async def profile_round(bench: EndToEnd, count: int, concurrency: int) -> None:
    """One more round of ours under cProfile, the event loop (manager and client together)
    and the manager's ledger thread profiled separately; printed as time per admission by
    stage. cProfile inflates every Python call, so read shares, not absolute figures."""
    assert bench.service is not None
    ledger_thread = bench.service.admission.ledger_thread  # the one worker all ledger calls run on
    loop_profile, ledger_profile = cProfile.Profile(), cProfile.Profile()
    await asyncio.wrap_future(ledger_thread.submit(ledger_profile.enable))
    loop_profile.enable()
    result = await bench.ours(count, concurrency)
    loop_profile.disable()
    await asyncio.wrap_future(ledger_thread.submit(ledger_profile.disable))
    print()
    print(
        f"   profiled round of ours: {result.rate:,.0f} req/s under cProfile; time per "
        "admission by stage (cumulative, profiler overhead included)"
    )
    loop_stats, ledger_stats = pstats.Stats(loop_profile), pstats.Stats(ledger_profile)
    loop_total = stage_times(loop_stats, (("", "asyncio/base_events.py", "_run_once"),))[0][1]
    print(f"\n   {'event loop thread':<58}{'µs/adm':>8}  {'share':>6}")
    for label, seconds in stage_times(loop_stats, LOOP_STAGES):
        print(f"   {label:<58}{seconds / count * 1e6:>8,.0f}  {seconds / loop_total:>6.0%}")
    print(f"   {'all of the loop (_run_once)':<58}{loop_total / count * 1e6:>8,.0f}  {1:>6.0%}")
    ledger = stage_times(ledger_stats, LEDGER_STAGES)
    where = "ledger thread (wall, GIL waits included)"
    if not ledger[0][1]:  # an SQLite ledger runs inline on the loop
        ledger, where = stage_times(loop_stats, LEDGER_STAGES), "ledger, inline on the loop"
    print(f"\n   {where:<58}{'µs/adm':>8}  {'share':>6}")
    whole = ledger[0][1] or 1.0  # 0 only if the stage names went stale: shows 0 %, not a crash
    for label, seconds in ledger:
        print(f"   {label:<58}{seconds / count * 1e6:>8,.0f}  {seconds / whole:>6.0%}")


# ---- part B -----------------------------------------------------------------------------------

TARGET_SQLITE_VS_ECHO = 5.0  # SQLite in-core decisions/s over the echo's requests/s, at least
TARGET_POSTGRES_VS_ECHO = 1.5  # PostgreSQL in-core decisions/s over the echo's requests/s

# The fake clock moves this far per request (1,600 requests a second), whatever the batch size,
# so every batch size sees the same workload.
MIXED_STEP_S = 1 / 1_600
MIXED_GRANT_TTL_S = 0.25  # 400 requests: a grant nobody releases expires during the run
MIXED_RELEASE_AFTER_S = 0.05  # until the holder of every other grant releases it
# Between expiry sweeps: every 80 requests, so that the short grants above expire within a
# run. The manager sweeps on its tick (1 s: every few thousand decisions at these rates), so
# this workload pays a sweep's fixed cost far more often than a manager does.
MIXED_SWEEP_EVERY_S = 0.05
MIXED_POLICY = replace(POLICY, grant_ttl_s=MIXED_GRANT_TTL_S)
MIXED_TENANTS = ("acme", "globex", "initech")
SCARCE = 16  # img-eu's GPUs and model slots: a pool that runs out now and then


def mixed_descriptors(now: float) -> list[CapabilityDescriptor]:
    """Four pools: different capabilities, tools, data classes, tenants, regions and limits
    (img-eu's are small enough to run out while grants are held)."""
    base = descriptor(now)
    return [
        base,
        base.model_copy(
            update={
                "pool_id": "code-us",
                "capabilities": [CapabilityRange(name="code.run", version_spec=">=1.0,<2")],
                "tools": [PoolTool(name="code.exec", version="1.0.0", permits=HUGE)],
                "data_classifications": ["public", "internal"],
                "tenant_isolation": TenantIsolation(mode="dedicated", tenants=["acme", "globex"]),
                "regions": ["us-east-1"],
            }
        ),
        base.model_copy(
            update={
                "pool_id": "math-any",
                "capabilities": [CapabilityRange(name="math.solve", version_spec=">=3.0,<4")],
                "tools": [],
                "regions": ["eu-west-1", "us-east-1"],
            }
        ),
        base.model_copy(
            update={
                "pool_id": "img-eu",
                "capabilities": [CapabilityRange(name="image.gen", version_spec=">=1.2,<2")],
                "tools": [PoolTool(name="gpu", version="1.0.0", permits=SCARCE)],
                "data_classifications": ["public"],
                "tenant_isolation": TenantIsolation(mode="shared", tenants=["acme", "initech"]),
                "regions": ["eu-west-1"],
                "model_limits": ModelLimits(
                    context_tokens=32_000, max_output_tokens=4_096, slots=SCARCE
                ),
            }
        ),
    ]


MIXED_LIVE = LiveCapacity(
    {
        (pool, capability): (LiveOffer(version, POOL_AGENTS, free, "B"),)
        for pool, capability, version, free in (
            ("rag-eu", "rag.search", "2.1.0", POOL_AGENTS * AGENT_CONCURRENCY),
            ("rag-eu", "rag.answer", "1.4.0", POOL_AGENTS * AGENT_CONCURRENCY),
            ("code-us", "code.run", "1.3.0", POOL_AGENTS * AGENT_CONCURRENCY),
            ("math-any", "math.solve", "3.2.0", POOL_AGENTS * AGENT_CONCURRENCY),
            ("img-eu", "image.gen", "1.5.0", 64),
        )
    },
    version=1,
)
"""The live agents behind the four pools (img-eu's few)."""


def mixed_shapes(now: float) -> list[TaskRequirements]:
    """Eight requirement shapes over the four pools: capabilities, version ranges, tools,
    sandboxes, data classes and regions differ; one (confidential code) no pool may take."""
    base = requirements(now)
    search = CapabilityRange(name="rag.search", version_spec=">=2.1")

    def shape(capability: CapabilityRange, **update: object) -> TaskRequirements:
        fields = {"capability": capability, "required_tools": [], "needs_sandbox": False}
        return base.model_copy(update={**fields, **update})

    return [
        shape(search, required_tools=base.required_tools, needs_sandbox=True),
        shape(
            CapabilityRange(name="rag.search", version_spec=">=2.0,<2.5"),
            input_classifications=["public"],
            required_tools=[ToolRequirement(name="web-search", permits=1)],
        ),
        shape(
            CapabilityRange(name="rag.answer", version_spec="==1.*"),
            input_classifications=["confidential"],
            regions=["eu-central-1"],
        ),
        shape(
            CapabilityRange(name="code.run", version_spec=">=1.2"),
            required_tools=[ToolRequirement(name="code.exec", version_spec=">=1")],
            needs_sandbox=True,
            regions=["us-east-1"],
        ),
        shape(
            CapabilityRange(name="code.run", version_spec="~=1.0"),
            input_classifications=["confidential"],
            regions=["us-east-1"],
        ),
        shape(
            CapabilityRange(name="math.solve", version_spec=">=3.1"),
            input_classifications=["public"],
            regions=["us-east-1"],
        ),
        shape(CapabilityRange(name="math.solve", version_spec="==3.*")),
        shape(
            CapabilityRange(name="image.gen", version_spec=">=1.2"),
            input_classifications=["public"],
            required_tools=[ToolRequirement(name="gpu")],
            estimated_tokens=2_000,
        ),
    ]


def mixed_requests(
    count: int, now: float, new_id: Callable[[], str] = new_admission_id
) -> list[tuple[AdmissionRequest, str]]:
    """``count`` requests with fresh IDs (time-ordered, as the SDK makes them, unless
    ``new_id`` says otherwise): the shapes in turn, three tenants
    (each pool's tenant rules differ) and five token estimates, so that consecutive requests
    differ in what eligibility and the counters see."""
    shapes = mixed_shapes(now)
    variants = {
        (n, k): shape.model_copy(update={"estimated_tokens": shape.estimated_tokens + 1_000 * k})
        for n, shape in enumerate(shapes)
        for k in range(5)
    }
    return [
        (
            AdmissionRequest(
                admission_id=new_id(),
                requirements=variants[(i % len(shapes), (i // 24) % 5)],
            ),
            MIXED_TENANTS[(i // len(shapes)) % len(MIXED_TENANTS)],
        )
        for i in range(count)
    ]


@dataclass(frozen=True, slots=True)
class StoreRun:
    store: str
    decisions: int
    seconds: float
    outcomes: Counter[str]  # of the timed decisions
    released: int  # grants their holders released during the timed part
    expired: int  # grants the expiry sweeps took back during the timed part
    cpu_seconds: float  # this process's (for PostgreSQL, its server process's is not in it)
    decide_seconds: float  # wall time inside AdmissionCore.decide (DecideClock)

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / self.decisions * 1e6

    @property
    def decide_us(self) -> float:
        return self.decide_seconds / self.decisions * 1e6


REPEATS = {"SQLite": 9, "PostgreSQL": 5}
"""Runs of each target row, each on a fresh store; their median is reported (one run of
0.1-0.3 s is at the mercy of one garbage-collector pass or one neighbour)."""


class MixedRun:
    """The mixed workload on one admitter: per batch, the clock moves on by the batch's
    requests, the batch is decided (``admit_batch``: one ledger transaction), every other
    admitted grant is released by its holder ``MIXED_RELEASE_AFTER_S`` later (the releases
    due by a batch's time settled in that batch's transaction, as the manager's group commit
    settles the releases that queued up with a batch), and every ``MIXED_SWEEP_EVERY_S`` the
    expiry sweep runs."""

    def __init__(self, ledger: LedgerStore, now: float) -> None:
        self.admitter = Admitter(ledger, MIXED_POLICY)
        self.decide_clock = DecideClock(self.admitter.core)
        self.now = self.next_sweep = now
        for pool in mixed_descriptors(now):
            problem = self.admitter.publish_descriptor(pool, now)
            assert problem is None, problem
        self.holders: list[tuple[float, str, int]] = []  # (release at, id, fence), in order
        self.granted = 0

    def run(self, requests: list[tuple[AdmissionRequest, str]], batch: int) -> StoreRun:
        outcomes: Counter[str] = Counter()
        released = expired = 0
        decide_seconds = self.decide_clock.seconds
        start, cpu = time.perf_counter(), time.process_time()
        for at in range(0, len(requests), batch):
            chunk = requests[at : at + batch]
            self.now += MIXED_STEP_S * len(chunk)
            due = []
            while self.holders and self.holders[0][0] <= self.now:
                _, admission_id, fence = self.holders.pop(0)
                due.append((admission_id, fence))
            # The releases due settle in the batch's transaction, as the manager's group
            # commit settles the releases that queued up with a batch of admissions (~8 here
            # with 16 admissions: under the manager's 64 items a batch, so no split).
            admitted = self.admitter.admit_batch(chunk, self.now, MIXED_LIVE, releases=due)
            assert not isinstance(admitted.settled, Exception), admitted.settled
            released += sum(reply.released for reply, _, _ in admitted.settled)
            decided = admitted.decisions
            outcomes.update(d.outcome for d in decided)
            for grant in (d.grant for d in decided if d.grant is not None):
                self.granted += 1
                if self.granted % 2:  # every other grant, counted across batches
                    due_at = self.now + MIXED_RELEASE_AFTER_S
                    self.holders.append((due_at, grant.admission_id, grant.fence))
            if self.now >= self.next_sweep:
                self.next_sweep += MIXED_SWEEP_EVERY_S
                expired += len(self.admitter.expire(self.now))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        decide_seconds = self.decide_clock.seconds - decide_seconds
        return StoreRun(
            "", len(requests), seconds, outcomes, released, expired, cpu, decide_seconds
        )


def in_core(
    store: str,
    ledger: LedgerStore,
    count: int,
    warmup: int,
    batch: int,
    new_id: Callable[[], str] = new_admission_id,
) -> StoreRun:
    """``count`` admissions of the mixed workload straight through an Admitter (no broker),
    ``batch`` per ledger transaction as the manager's group commit decides them, after
    ``warmup`` of the same; the releases and expiry sweeps they cause are timed with them.
    ``new_id`` makes the admission IDs (``bench/ledger_layout.py`` compares kinds)."""
    now = time.time()
    mixed = MixedRun(ledger, now)
    requests = mixed_requests(warmup + count, now, new_id)
    mixed.run(requests[:warmup], batch)
    run = mixed.run(requests[warmup:], batch)
    # The workload is what it claims: some of each outcome, releases and expiries done.
    assert set(run.outcomes) == {"admitted", "rejected", "deferred"}, run.outcomes
    assert run.released and run.expired, (run.released, run.expired)
    return replace(run, store=store)


def median_run(runs: list[StoreRun]) -> StoreRun:
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


def run_part_b(count: int, dsn: str, workdir: Path, batch: int) -> list[StoreRun]:
    """Each store with ``batch`` decisions per transaction (what the manager's group commit
    does with ``batch`` requests in flight; the target rows, medians of REPEATS runs on fresh
    stores), then one per transaction."""
    warmup = min(count // 10, 200)
    print(
        f"B) in-core decisions: Admitter.admit_batch called directly (no broker) on a mixed "
        f"workload — 4 pools, 8 requirement shapes, 3 tenants, a clock moving "
        f"{MIXED_STEP_S * 1e3:g} ms per request, grants of {MIXED_GRANT_TTL_S:g} s of which "
        f"every other one is released after {MIXED_RELEASE_AFTER_S:g} s and the rest expire "
        f"(sweep every {MIXED_SWEEP_EVERY_S:g} s) — {count:,} fresh admission IDs per run "
        f"after {warmup} warm-up ones; the first row of each store is the median of "
        f"{REPEATS['SQLite']} (SQLite) or {REPEATS['PostgreSQL']} (PostgreSQL) runs"
    )
    runs, repeated = [], []
    for n in range(REPEATS["SQLite"]):
        with SqliteLedger(workdir / f"in-core-{n}.sqlite3") as sqlite:
            label = f"SQLite (WAL), {batch} per commit"
            repeated.append(in_core(label, sqlite, count, warmup, batch))
    runs.append(median_run(repeated))
    with SqliteLedger(workdir / "in-core-single.sqlite3") as sqlite:
        runs.append(in_core("SQLite (WAL), 1 per commit", sqlite, count, warmup, 1))

    def postgres(label: str, size: int) -> StoreRun:
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        ledger = PostgresLedger(dsn, schema=schema, connect_timeout_s=5)
        try:
            return in_core(label, ledger, count, warmup, size)
        finally:
            ledger.close()
            with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    try:
        label = f"PostgreSQL, {batch} per commit"
        runs.append(median_run([postgres(label, batch) for _ in range(REPEATS["PostgreSQL"])]))
    except StoreError as exc:
        why = str(exc).splitlines()[0].rstrip(".")
        print(f"   PostgreSQL rows skipped: cannot reach {redact(dsn)} ({why}).")
        return runs
    runs.append(postgres("PostgreSQL, 1 per commit", 1))
    return runs


STORE_TARGETS = (
    ("SQLite", TARGET_SQLITE_VS_ECHO, "sqlite_vs_echo"),
    ("PostgreSQL", TARGET_POSTGRES_VS_ECHO, "postgres_vs_echo"),
)
"""(store, bound over the reference, target name): part B's targets."""


def target_row(runs: list[StoreRun], kind: str) -> StoreRun | None:
    """The store's target row: its first (the batched one, a median of REPEATS runs)."""
    return next((r for r in runs if r.store.startswith(kind)), None)


def print_part_b(runs: list[StoreRun], reference: float | None) -> None:
    """The table; ``reference``: the fair echo's requests/s measured in the same run."""
    print()
    print(
        f"   {'store':<34}{'decisions':>9}  {'adm/rej/def':>13}  {'rel/exp':>9}  {'seconds':>7}"
        f"  {'decisions/s':>11}  {'µs/decision':>11}  {'CPU µs':>6}  {'decide µs':>9}"
        f"  {'÷ echo req/s':>12}"
    )
    for run in runs:
        ratio = f"{run.rate / reference:>11.2f}x" if reference else f"{'-':>12}"
        mix = "/".join(str(run.outcomes[o]) for o in ("admitted", "rejected", "deferred"))
        print(
            f"   {run.store:<34}{run.decisions:>9,}  {mix:>13}  "
            f"{f'{run.released}/{run.expired}':>9}  {run.seconds:>7.2f}  {run.rate:>11,.0f}  "
            f"{run.seconds / run.decisions * 1e6:>11,.0f}  {run.cpu_us:>6,.0f}  "
            f"{run.decide_us:>9,.0f}  {ratio}"
        )
    print(
        "   decide µs: inside AdmissionCore.decide a decision (pure Python, no I/O), part of "
        "µs/decision"
    )
    if reference:
        print(
            f"   reference: {reference:,.0f} requests/s, the faster fair echo's best rate in this"
            " run (or --reference-rate)"
        )
        for kind, bound, _ in STORE_TARGETS:
            found = target_row(runs, kind)
            if found is not None:
                print(
                    f"   ≥ {bound:g}x the reference leaves {kind} {1e6 / (bound * reference):,.0f} "
                    f"µs a decision, all of it; the decision alone took {found.decide_us:,.0f}"
                )


def part_b_report(report: Report, runs: list[StoreRun], reference: float | None) -> None:
    """Part B's figures and, with a reference rate, its two targets."""
    for run in runs:
        report.figure(
            part="B",
            store=run.store,
            decisions=run.decisions,
            value=run.rate,
            unit="decisions/s",
            admitted=run.outcomes["admitted"],
            rejected=run.outcomes["rejected"],
            deferred=run.outcomes["deferred"],
            released=run.released,
            expired=run.expired,
            cpu_us_per_decision=run.cpu_us,
            decide_us_per_decision=run.decide_us,
            reference=reference,
        )
    if reference is None:
        report.skipped.append("store headroom targets: no echo rate to compare with")
        return
    for kind, bound, name in STORE_TARGETS:
        found = target_row(runs, kind)
        if found is None:
            report.skipped.append(f"{name}: no {kind} row")
            continue
        ratio = found.rate / reference
        report.targets.append(
            Target(
                name,
                ratio >= bound,
                f"the {kind} ledger decides the mixed workload at {ratio:.2f}x the echo's "
                f"requests/s ({found.rate:,.0f} vs {reference:,.0f}; target ≥ {bound:g}x)",
                value=found.rate,
                baseline=reference,
                ratio=ratio,
                bound=f">= {bound:g}",
            )
        )


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller budgets (under a minute)")
    parser.add_argument("--amqp-url", default=os.environ.get("MESH_AMQP_URL", c.DEFAULT_AMQP_URL))
    parser.add_argument(
        "--postgres-dsn", default=os.environ.get("MESH_TEST_POSTGRES_DSN", DEFAULT_PG_DSN)
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        action="append",
        help="requests in flight (repeat for several; default 16 and 64)",
    )
    parser.add_argument("--profile", action="store_true", help="profile one more round of ours")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also ours with tracing on, sampler off (needs the otel extra), against off",
    )
    parser.add_argument(
        "--part", choices=("all", "b"), default="all", help="b: part B alone (no broker)"
    )
    parser.add_argument(
        "--reference-rate",
        type=float,
        help="part B's reference in requests/s (default: the faster fair echo's, from part A)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    logging.getLogger("mesh").setLevel(logging.ERROR)
    print(f"process {tune_gc()} (as mesh manager does)")
    for client in ("aio_pika", "aiormq"):  # their failures surface as exceptions too
        logging.getLogger(client).setLevel(logging.CRITICAL)
    count, rounds = (600, 2) if args.quick else (3_000, 3)
    concurrencies = tuple(args.concurrency or (16, 64))

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        end_to_end = None
        if args.part == "all":
            end_to_end = asyncio.run(
                run_part_a(
                    args.amqp_url,
                    count,
                    concurrencies,
                    rounds,
                    args.profile,
                    Path(tmp) / "a",
                    args.tracing,
                )
            )
            print()
        # The reference: the best rate of the run of either fair echo (whichever number in
        # flight): the store must keep up with the faster of the two request/reply paths.
        echo_rate = (
            max(s[path].rate for s in end_to_end.values() for path, _, _ in TARGET_ECHOES)
            if end_to_end
            else None
        )
        reference = args.reference_rate or echo_rate
        runs = run_part_b(count, args.postgres_dsn, Path(tmp) / "b", STORE_BATCH)
        print_part_b(runs, reference)

    report = Report("admission")
    if end_to_end is None:
        report.skipped.append("end-to-end targets: no part A (no broker, or --part b)")
    else:
        for concurrency, summaries in end_to_end.items():
            report.targets += part_a_targets(report, concurrency, summaries)
    part_b_report(report, runs, reference)
    return report.finish(started, args.json)


def part_a_targets(report: Report, concurrency: int, summaries: dict[str, Summary]) -> list[Target]:
    for path, summary in summaries.items():
        report.figure(
            part="A",
            path=path,
            in_flight=concurrency,
            rate=summary.rate,
            p50_ms=summary.p50_ms,
            p99_ms=summary.p99_ms,
            cpu_us=summary.cpu_us,
            decide_us=summary.decide_us if path == "ours" else None,
            admission_allowance_us=None if path == "ours" else allowance_us(summary.cpu_us),
            unit="requests/s (median of rounds)",
            baseline_is=LABELS["echo"],
        )
    ours = summaries["ours"]
    targets = []
    if "traced" in summaries:
        off, on = summaries["untraced"], summaries["traced"]
        ratio = TRACING_PAIR_RATIOS.get(concurrency, on.rate / off.rate)
        targets.append(
            Target(
                f"tracing_sampler_off_at_{concurrency}",
                ratio >= TARGET_TRACING_RATIO,
                f"at {concurrency} in flight tracing with the sampler off runs admissions at "
                f"{ratio:.3f}x the untraced rate (target ≥ {TARGET_TRACING_RATIO:g}x)",
                value=on.rate,
                baseline=off.rate,
                ratio=ratio,
                bound=f">= {TARGET_TRACING_RATIO:g}",
            )
        )
    for path, name, said in TARGET_ECHOES:
        echo = summaries[path]
        throughput, p99 = ours.rate / echo.rate, ours.p99_ms / echo.p99_ms
        targets += [
            Target(
                f"throughput_vs_{name}_at_{concurrency}",
                throughput >= TARGET_THROUGHPUT_RATIO,
                f"at {concurrency} in flight admissions run at {throughput:.2f}x {said} "
                f"throughput (target ≥ {TARGET_THROUGHPUT_RATIO:g}x)",
                value=ours.rate,
                baseline=echo.rate,
                ratio=throughput,
                bound=f">= {TARGET_THROUGHPUT_RATIO:g}",
            ),
            Target(
                f"p99_vs_{name}_at_{concurrency}",
                p99 <= TARGET_P99_RATIO,
                f"at {concurrency} in flight admission p99 is {p99:.2f}x {said} "
                f"({ours.p99_ms:.1f} vs {echo.p99_ms:.1f} ms; target ≤ {TARGET_P99_RATIO:g}x)",
                value=ours.p99_ms,
                baseline=echo.p99_ms,
                ratio=p99,
                bound=f"<= {TARGET_P99_RATIO:g}",
            ),
        ]
    return targets


if __name__ == "__main__":
    sys.exit(main())
