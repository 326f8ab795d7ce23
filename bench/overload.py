"""Benchmark of overload: goodput and deadline misses per service class at 1x, 2x and 5x load,
with shedding on, with shedding off, and with a plain bounded queue instead of the mesh.

Run: ``.venv/bin/python bench/overload.py`` (about four minutes on 2 cores; ``--quick``: shorter
windows, about a minute). It prints the tables and the targets with PASS/FAIL, and exits 1 if
one fails. ``--json FILE`` writes every figure and target (``bench/report.py``).

**The work.** Open-loop (Poisson) arrivals at ``load x slots / service time`` per second, drawn
from the same seed in every run of one load (every way sees the same arrivals), a mix of 50 %
interactive, 30 % batch and 20 % speculative tasks, each with a deadline ``--deadline-s`` after
it arrives, for a warm-up and then a measured window. The capacity is the same in every way:
``--slots`` tasks at once (8), each ``--service-ms`` long (400 ms): full load is 20 tasks/s.

**The three ways** (all in this one process, producers on four connections):

* ``on``: the mesh (manager with SQLite ledger, one in-process echo agent with the pool's
  slots), each task ``MeshClient.submit`` — admission, retrying as told, the pool queue, the
  agent, settlement — with ``PressurePolicy()``: staged shedding, priority for interactive
  work, deadline-aware refusals, eviction of recoverable work, the line of deferred requests.
* ``off``: the same mesh with ``PressurePolicy(enabled=False)``: the ledger's exact capacity
  only (first come, first served), a constant 1 s retry time, no eviction, no line.
* ``queue``: what a user would build without this project: producers publish each task
  straight to one classic queue bounded with ``x-max-length`` (``--queue-max``, by default
  the tasks the slots can finish within a deadline: ``slots x (deadline - service) /
  service``) and ``x-overflow: reject-publish``, with publisher confirms and a per-message
  TTL of the task's deadline; a nack is retried with full-jitter exponential backoff (the
  SDK's :class:`~mesh.backoff.Backoff`) until the task could no longer finish in
  time. Consumers with ``prefetch = slots`` on their own connection take each task, drop it
  (ack) if it can no longer finish before its deadline, else work for the service time and
  reply to the producer's exclusive reply queue. aio-pika throughout, as a competent user
  would write it.

**What each task counts as** (arrived in the measured window; every figure is per class):

* **good**: its result came back and the work finished at or before its deadline.
  **Goodput** = good tasks per second of the window.
* **refused early**: not good, and the producer's call ended within the first half of its
  deadline budget (``arrival + deadline_s / 2``) — it was told no (refused, or a retry time
  past its deadline) while it still had time to go elsewhere.
* **missed**: every other task: a result after the deadline, no result by the deadline, a
  producer that kept retrying until the deadline, or a refusal in the second half of the
  budget. **Misses %** = missed / arrived. The miss target reads this figure: refusals early
  are not misses, and the goodput targets keep "refuse everything" from passing.

Also printed per class: the admission wait (arrival to grant, mesh ways) p50 / p99, and the
**starved**: tasks that ended without a grant while a younger task of the same class (and
tenant: there is one) had been admitted before they gave up.

Targets (at 5x): interactive goodput with shedding on is at least 0.9x its own 1x figure and
at least 1.5x the interactive goodput of ``off`` and of ``queue``; at most 1 % of interactive
tasks missed with shedding on; with shedding on no task starved at 2x or 5x.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import orjson
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import DeliveryError
from report import Report, Target, add_json_argument

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.backoff import Backoff
from mesh.core.pressure import PressurePolicy
from mesh.errors import AdmissionRefused, SubmitDeadlineExceeded, TaskFailed
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.producer.retry import retry_delay_s
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.wire import CapabilityDescriptor, CapabilityRange, TaskRequirements
from mesh.wire.admission import local_descriptor

POLICY_GENERATION = 1
ECHO = CapabilityRange(name="test.echo", version_spec=">=1,<2")
MIX = (("interactive", 0.5), ("batch", 0.3), ("speculative", 0.2))
CLASSES = tuple(cls for cls, _ in MIX)
# What losing each class's task mid-way costs: speculative branches can be rebuilt, batch work
# can be retried, interactive work is assumed to have side effects (never evicted).
RECOVERABILITY = {"interactive": "side_effects", "batch": "retryable", "speculative": "rebuildable"}
WAYS = ("on", "off", "queue")
PRODUCERS = 4  # connections the producers share, in every way
MARGIN_S = 0.05  # the queue way's consumers start a task only if it can end this much early
EARLY = 0.5  # a refusal within this share of the deadline budget is early, not a miss
TARGET_VS_1X = 0.9
TARGET_VS_OTHERS = 1.5
TARGET_MISSES = 0.01


def descriptor(slots: int, now: float) -> CapabilityDescriptor:
    return local_descriptor(
        "echo",
        ECHO,
        epoch=1,
        issued_by="bench",
        now=now,
        policy_generation=POLICY_GENERATION,
        ttl_s=3_600,
        slots=slots,
    )


def requirements(service_class: str, service_s: float, deadline: float) -> TaskRequirements:
    return TaskRequirements(
        capability=ECHO,
        task_schema_version="1.0.0",
        result_schema_version="1.0.0",
        input_classifications=["internal"],
        estimated_tokens=10,
        estimated_duration_s=service_s,
        deadline=deadline,
        service_class=service_class,  # type: ignore[arg-type]
        recoverability=RECOVERABILITY[service_class],  # type: ignore[arg-type]
    )


@dataclass(slots=True)
class Outcome:
    """One measured task: its class, when it arrived, was admitted (if known) and ended."""

    service_class: str
    arrived: float
    ended: float
    good: bool
    admitted: float | None = None  # mesh ways: when its grant came
    granted: bool = False  # admitted (its result came too late to say when)
    reason: str = "OK"  # why not good: a reason code, LATE, GAVE_UP:<last reason>


@dataclass
class Run:
    label: str
    way: str
    load: float
    deadline_s: float
    window_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    all_arrivals: int = 0  # warm-up included
    decisions: int = 0  # admission decisions the manager made (every retry is one)
    publishes: int = 0  # queue way: publish attempts (every retry is one)
    evicted: int = 0  # grants taken back from recoverable work for interactive work
    hold_s: float | None = None  # mesh ways: mean time a grant was held (admission to release)

    def of(self, service_class: str | None) -> list[Outcome]:
        return [o for o in self.outcomes if service_class in (None, o.service_class)]

    def good(self, service_class: str | None = None) -> int:
        return sum(o.good for o in self.of(service_class))

    def goodput(self, service_class: str | None = None) -> float:
        return self.good(service_class) / self.window_s if self.window_s else 0.0

    def refused_early(self, service_class: str | None = None) -> int:
        budget = EARLY * self.deadline_s
        return sum(
            1 for o in self.of(service_class) if not o.good and o.ended - o.arrived <= budget
        )

    def missed(self, service_class: str | None = None) -> int:
        mine = self.of(service_class)
        return len(mine) - self.good(service_class) - self.refused_early(service_class)

    def miss_share(self, service_class: str | None = None) -> float:
        n = len(self.of(service_class))
        return self.missed(service_class) / n if n else 0.0

    def waits(self, service_class: str) -> list[float]:
        return sorted(
            o.admitted - o.arrived for o in self.of(service_class) if o.admitted is not None
        )

    def starved(self, service_class: str) -> int:
        """Tasks of the class that ended without a grant after a younger one was admitted."""
        mine = sorted(self.of(service_class), key=lambda o: o.arrived)
        # earliest[i]: the earliest admission among tasks that arrived after mine[i]
        earliest = [float("inf")] * (len(mine) + 1)
        for i in range(len(mine) - 1, -1, -1):
            admitted = mine[i].admitted
            earliest[i] = min(earliest[i + 1], admitted if admitted is not None else float("inf"))
        return sum(
            1
            for i, o in enumerate(mine)
            if o.admitted is None and not o.granted and earliest[i + 1] < o.ended
        )

    def reasons(self, service_class: str | None = None) -> dict[str, int]:
        """Why tasks were not good: reason -> count (missed and refused early alike)."""
        found: dict[str, int] = {}
        for o in self.of(service_class):
            if not o.good:
                found[o.reason] = found.get(o.reason, 0) + 1
        return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass(frozen=True)
class Shape:
    """What every way of one run shares: capacity, deadlines, the arrivals' schedule."""

    slots: int
    service_s: float
    deadline_s: float
    warmup_s: float
    window_s: float
    queue_max: int
    seed: int


async def arrivals(shape: Shape, load: float, start_task: Any) -> list[asyncio.Task[None]]:
    """Start ``start_task(i, cls, measured)`` at Poisson times until the window ends."""
    rng = random.Random(shape.seed)
    rate = load * shape.slots / shape.service_s
    start = time.monotonic()
    window = (start + shape.warmup_s, start + shape.warmup_s + shape.window_s)
    tasks: list[asyncio.Task[None]] = []
    classes, weights = list(CLASSES), [w for _, w in MIX]
    due = start
    while True:
        now = time.monotonic()
        if now >= window[1]:
            break
        cls = rng.choices(classes, weights)[0]
        tasks.append(asyncio.create_task(start_task(len(tasks), cls, window[0] <= now)))
        due += rng.expovariate(rate)  # a schedule, not sleeps: a slow turn does not thin it
        await asyncio.sleep(max(0.0, due - time.monotonic()))
    await asyncio.gather(*tasks)
    return tasks


# ---- the mesh: shedding on and off ---------------------------------------------------------
async def mesh_run(amqp_url: str, workdir: Path, shape: Shape, load: float, way: str) -> Run:
    namespace = f"bench-overload-{uuid.uuid4().hex[:8]}"
    user = urlsplit(amqp_url).username or "guest"  # the broker user is the operator here
    policy = AdmissionPolicy(
        active_generation=POLICY_GENERATION,
        grant_ttl_s=60,
        pressure=PressurePolicy() if way == "on" else PressurePolicy(enabled=False),
    )
    settings = replace(
        ManagerSettings(),
        amqp_url=amqp_url,
        namespace=namespace,
        manager_id=namespace,
        journal_path=workdir / f"{namespace}.journal.sqlite3",
        ledger_url=f"sqlite:{workdir / f'{namespace}.ledger.sqlite3'}",
        operator_user=user,
        admission=policy,
        http_port=None,
        tick_interval_s=0.25,
    )
    manager = ManagerService(settings)
    await manager.start()
    agent = AgentRuntime(
        SAMPLES["echo"]("echo-bench", heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )
    clients = [
        await MeshClient.connect(amqp_url, namespace=namespace, name=f"bench-producer-{i}")
        for i in range(PRODUCERS)
    ]
    run = Run(f"{load:g}x, {way}", way, load, shape.deadline_s, shape.window_s)
    try:
        accepted = await clients[0].publish_descriptor(descriptor(shape.slots, time.time()))
        if accepted.type != "mesh.descriptor-accepted.v1":
            raise RuntimeError(f"descriptor refused: {accepted}")
        await agent.start()  # the descriptor is active: the agent consumes the pool queue
        if agent.counters["pool_subscriptions"] < 1:
            raise RuntimeError("the agent did not subscribe to its pool queue")

        async def start_task(i: int, cls: str, measured: bool) -> None:
            await mesh_task(clients[i % PRODUCERS], cls, shape, run, measured)

        run.all_arrivals = len(await arrivals(shape, load, start_task))
        run.decisions = sum(
            manager.counters[f"admission.{outcome}"]
            for outcome in ("admitted", "rejected", "deferred")
        )
        run.evicted = manager.counters["admissions_evicted"]
        admitter = manager.admitter
        if admitter is not None and "echo" in admitter.pressure.pools:
            run.hold_s = admitter.pressure.pools["echo"].mean_service_s()
    finally:
        await agent.stop()
        for client in clients:
            await client.close()
        await manager.stop()
        await leave_nothing(amqp_url, manager.topology, "echo-bench")
    return run


async def leave_nothing(amqp_url: str, topology: Topology, agent_id: str) -> None:
    """Delete the run's namespace from the broker: its queues and exchanges."""
    transport = await AmqpTransport.connect(amqp_url, name="bench-cleanup")
    try:
        made = topology.manager() + topology.shared() + topology.pool("echo")
        await transport.delete_declared(made + topology.agent_queues(agent_id, 1))
    finally:
        await transport.close()


async def mesh_task(client: MeshClient, cls: str, shape: Shape, run: Run, measured: bool) -> None:
    arrived = time.monotonic()
    deadline = time.time() + shape.deadline_s
    reason = "OK"
    admitted: float | None = None
    granted = False
    try:
        done = await client.submit(
            requirements(cls, shape.service_s, deadline),
            {"message": cls, "sleep_ms": int(shape.service_s * 1000)},
            timeout_s=shape.deadline_s,
        )
        admitted = arrived + done.admission_wait_s
        good = done.result.finished_at <= deadline
        if not good:
            reason = "LATE"
    except AdmissionRefused as exc:
        good, reason = False, exc.code
    except SubmitDeadlineExceeded as exc:
        good, reason = False, f"GAVE_UP:{exc.last_reason or 'RESULT'}"
        # Admitted, and its result did not come in time: the exception carries the grant.
        granted = exc.decision is not None and exc.decision.outcome == "admitted"
    except TaskFailed as exc:
        good, reason = False, exc.code
    if measured:
        ended = time.monotonic()
        run.outcomes.append(Outcome(cls, arrived, ended, good, admitted, granted, reason))


# ---- the bounded queue, without the mesh ---------------------------------------------------
@dataclass
class QueueProducer:
    """One producer connection: a confirming channel and an exclusive reply queue."""

    channel: aio_pika.abc.AbstractChannel
    reply_queue: str
    waiting: dict[str, asyncio.Future[float]] = field(default_factory=dict)

    async def on_reply(self, message: AbstractIncomingMessage) -> None:
        fut = self.waiting.pop(message.correlation_id or "", None)
        if fut is not None and not fut.done():
            fut.set_result(float(orjson.loads(message.body)["finished_at"]))


async def queue_run(amqp_url: str, shape: Shape, load: float) -> Run:
    """The same arrivals through one bounded queue that ``slots`` consumers drain."""
    name = f"bench-overload-{uuid.uuid4().hex[:8]}.tasks"
    run = Run(f"{load:g}x, queue", "queue", load, shape.deadline_s, shape.window_s)
    worker = await aio_pika.connect(amqp_url, client_properties={"connection_name": name})
    connections = [
        await aio_pika.connect(amqp_url, client_properties={"connection_name": f"{name}-p{i}"})
        for i in range(PRODUCERS)
    ]
    try:
        work = await worker.channel()
        await work.set_qos(prefetch_count=shape.slots)
        queue = await work.declare_queue(
            name,
            arguments={"x-max-length": shape.queue_max, "x-overflow": "reject-publish"},
        )

        async def serve(message: AbstractIncomingMessage) -> None:
            deadline_ms = message.headers["deadline-ms"]
            assert isinstance(deadline_ms, int)  # the producers below set it
            deadline = deadline_ms / 1000
            if time.time() + shape.service_s + MARGIN_S > deadline:  # too late to finish: drop
                await message.ack()
                return
            await asyncio.sleep(shape.service_s)
            body = orjson.dumps({"finished_at": time.time()})
            await work.default_exchange.publish(
                aio_pika.Message(body, correlation_id=message.correlation_id),
                routing_key=message.reply_to or "",
            )
            await message.ack()

        await queue.consume(serve)
        producers = []
        for connection in connections:
            channel = await connection.channel(publisher_confirms=True)
            replies = await channel.declare_queue(exclusive=True, auto_delete=True)
            producer = QueueProducer(channel, replies.name)
            await replies.consume(producer.on_reply, no_ack=True)
            producers.append(producer)

        async def start_task(i: int, cls: str, measured: bool) -> None:
            await queue_task(producers[i % PRODUCERS], name, cls, shape, run, measured)

        run.all_arrivals = len(await arrivals(shape, load, start_task))
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        for connection in [*connections, worker]:
            await connection.close()
    return run


async def queue_task(
    producer: QueueProducer, queue: str, cls: str, shape: Shape, run: Run, measured: bool
) -> None:
    """Publish until confirmed (nacks retried with jittered backoff while the task could
    still finish in time), then wait for the result until the deadline."""
    arrived = time.monotonic()
    deadline = time.time() + shape.deadline_s
    task_id = uuid.uuid4().hex
    fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    producer.waiting[task_id] = fut
    reason, good, attempt = "OK", False, 0
    try:
        while True:
            remaining = deadline - time.time()
            if remaining < shape.service_s:
                reason = "GAVE_UP:QUEUE_FULL"
                break
            run.publishes += 1
            try:
                await producer.channel.default_exchange.publish(
                    aio_pika.Message(
                        orjson.dumps({"message": cls}),
                        correlation_id=task_id,
                        reply_to=producer.reply_queue,
                        # In ms as an integer: pamqp sends a float header as 32 bits.
                        headers={"deadline-ms": int(deadline * 1000), "service_class": cls},
                        expiration=remaining,  # the broker drops it once it cannot matter
                    ),
                    routing_key=queue,
                )
            except DeliveryError:  # nacked: the queue is full
                await asyncio.sleep(
                    min(retry_delay_s(None, attempt, Backoff(), random.random), remaining)
                )
                attempt += 1
                continue
            try:
                finished_at = await asyncio.wait_for(fut, max(0.0, deadline - time.time()))
            except TimeoutError:
                reason = "GAVE_UP:RESULT"
                break
            good = finished_at <= deadline
            reason = "OK" if good else "LATE"
            break
    finally:
        producer.waiting.pop(task_id, None)
    if measured:
        run.outcomes.append(Outcome(cls, arrived, time.monotonic(), good, reason=reason))


# ---- the report ----------------------------------------------------------------------------
def print_run(run: Run) -> None:
    asks = (run.decisions or run.publishes) / run.all_arrivals if run.all_arrivals else 0.0
    cells = []
    for cls in CLASSES:
        n = len(run.of(cls))
        cells.append(
            f"{run.goodput(cls):6.1f} {100 * run.miss_share(cls):5.1f}% "
            f"{100 * run.refused_early(cls) / n if n else 0.0:5.1f}%"
        )
    print(
        f"{run.label:<14}{len(run.outcomes):>8}{run.goodput():>9.1f}  "
        + "  ".join(cells)
        + f"{asks:>8.2f}{run.evicted:>6}"
        + (f"{run.hold_s:>7.2f}" if run.hold_s is not None else f"{'-':>7}")
    )


def print_waits(runs: list[Run]) -> None:
    print()
    print("admission wait (arrival to grant, mesh ways) p50 / p99, and the starved")
    print(f"{'run':<14}" + "".join(f"{cls:>28}" for cls in CLASSES) + "   why not good")
    for run in runs:
        cells = []
        for cls in CLASSES:
            waits = run.waits(cls)
            p50, p99 = percentile(waits, 0.5), percentile(waits, 0.99)
            text = "-" if p50 is None or p99 is None else f"{p50:.2f} / {p99:.2f} s"
            cells.append(f"{text}, starved {run.starved(cls)}")
        why = ", ".join(f"{k} {v}" for k, v in list(run.reasons().items())[:4])
        print(f"{run.label:<14}" + "".join(f"{cell:>28}" for cell in cells) + f"   {why}")


def targets(report: Report, runs: dict[tuple[float, str], Run], loads: list[float]) -> None:
    top = max(loads)
    on_1x = runs[(1.0, "on")].goodput("interactive")
    on_top = runs[(top, "on")]
    ours = on_top.goodput("interactive")
    ratio = ours / on_1x if on_1x else 0.0
    report.targets.append(
        Target(
            f"interactive_goodput_at_{top:g}x_vs_1x",
            ratio >= TARGET_VS_1X,
            f"interactive goodput at {top:g}x with shedding is {ours:.1f}/s, {ratio:.2f}x its "
            f"1x figure {on_1x:.1f}/s (target ≥ {TARGET_VS_1X:g}x)",
            value=ours, baseline=on_1x, ratio=ratio, bound=f">= {TARGET_VS_1X:g}",
        )
    )  # fmt: skip
    for other in ("off", "queue"):
        theirs = runs[(top, other)].goodput("interactive")
        ratio = ours / theirs if theirs else float("inf")
        report.targets.append(
            Target(
                f"interactive_goodput_at_{top:g}x_vs_{other}",
                ratio >= TARGET_VS_OTHERS,
                f"interactive goodput at {top:g}x with shedding is {ours:.1f}/s, {ratio:.2f}x "
                f"{other}'s {theirs:.1f}/s (target ≥ {TARGET_VS_OTHERS:g}x)",
                value=ours, baseline=theirs, ratio=ratio, bound=f">= {TARGET_VS_OTHERS:g}",
            )
        )  # fmt: skip
    share = on_top.miss_share("interactive")
    report.targets.append(
        Target(
            f"interactive_misses_at_{top:g}x",
            share <= TARGET_MISSES,
            f"at {top:g}x with shedding {on_top.missed('interactive')} of "
            f"{len(on_top.of('interactive'))} interactive tasks missed their deadline "
            f"({100 * share:.2f} %; target ≤ {100 * TARGET_MISSES:g} %)",
            value=share, bound=f"<= {TARGET_MISSES:g}",
        )
    )  # fmt: skip
    for load in loads:
        if load <= 1.0:
            continue
        run = runs[(load, "on")]
        starved = sum(run.starved(cls) for cls in CLASSES)
        report.targets.append(
            Target(
                f"starved_at_{load:g}x",
                starved == 0,
                f"at {load:g}x with shedding {starved} task(s) starved (target 0)",
                value=starved,
                bound="== 0",
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows (about a minute)")
    parser.add_argument("--amqp-url", default=os.environ.get("MESH_AMQP_URL", c.DEFAULT_AMQP_URL))
    parser.add_argument("--slots", type=int, default=8, help="the pool's model slots")
    parser.add_argument("--service-ms", type=int, default=400, help="each task's work")
    parser.add_argument("--deadline-s", type=float, default=2.0, help="after arrival")
    parser.add_argument("--queue-max", type=int, help="the queue way's x-max-length")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--loads", default="1,2,5", help="loads to run (the targets need 1 and 5)")
    parser.add_argument("--ways", default=",".join(WAYS), help="ways to run: on,off,queue")
    add_json_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("mesh").setLevel(logging.CRITICAL)
    for name in ("aio_pika", "aiormq"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    service_s = args.service_ms / 1000
    warmup_s, window_s = (1.5, 4.0) if args.quick else (3.0, 12.0)
    queue_max = args.queue_max or max(
        1, int(args.slots * (args.deadline_s - service_s) / service_s)
    )
    shape = Shape(args.slots, service_s, args.deadline_s, warmup_s, window_s, queue_max, args.seed)
    loads = [float(x) for x in args.loads.split(",")]
    ways = [w for w in WAYS if w in args.ways.split(",")]
    started = time.perf_counter()
    print(
        f"overload: {args.slots} slots, {args.service_ms} ms per task (full load "
        f"{args.slots / service_s:.0f} tasks/s), deadline {args.deadline_s:g} s, window "
        f"{window_s:g} s after {warmup_s:g} s warm-up; queue way: x-max-length {queue_max}"
    )
    print(
        "per class: goodput/s, missed %, refused early %"
        f" (early: within {EARLY:g} of the deadline budget)"
    )
    print(
        f"{'run':<14}{'arrived':>8}{'good/s':>9}  "
        + "  ".join(f"{cls:^20}" for cls in CLASSES)
        + f"{'asks':>8}{'evict':>6}{'hold s':>7}"
    )
    runs: dict[tuple[float, str], Run] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        for load in loads:
            for way in ways:
                if way == "queue":
                    run = asyncio.run(queue_run(args.amqp_url, shape, load))
                else:
                    run = asyncio.run(mesh_run(args.amqp_url, Path(tmp), shape, load, way))
                runs[(load, way)] = run
                print_run(run)
    print_waits(list(runs.values()))
    report = Report("overload")
    for (load, way), run in runs.items():
        for cls in (None, *CLASSES):
            n = len(run.of(cls))
            report.figure(
                run=run.label,
                way=way,
                load=load,
                service_class=cls or "all",
                arrived=n,
                good=run.good(cls),
                value=run.goodput(cls),
                unit="tasks completed before their deadline per second",
                missed=run.missed(cls),
                miss_share=run.miss_share(cls),
                refused_early=run.refused_early(cls),
                starved=run.starved(cls) if cls else None,
                why_not_good=run.reasons(cls),
            )
    if {1.0, 5.0} <= set(loads) and ways == list(WAYS):
        targets(report, runs, loads)
    else:
        report.skipped.append("targets: they need loads 1 and 5 and every way")
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
