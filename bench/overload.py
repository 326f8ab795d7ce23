"""Benchmark of overload: goodput at full load, 2x and 5x, with shedding on and off.

Run: ``.venv/bin/python bench/overload.py`` (``--quick``: shorter windows, about a minute).
It prints one row per run and the target with PASS/FAIL, and exits 1 if it fails.

The mesh: a manager in this process (SQLite ledger), one ``echo`` pool of ``--slots`` model
slots served by one in-process echo agent (the sample: it sleeps ``--service-ms`` and answers),
producers on four connections. Each task is ``MeshClient.submit`` with a deadline
``--deadline-s`` after it arrives: admission (retrying as told), the pool queue, the agent,
settlement. Arrivals are open-loop (Poisson) at ``load x slots / service time`` per second, a
mix of 50 % interactive, 30 % batch and 20 % speculative tasks, for a warm-up and then a
measured window. **Goodput** is the number of tasks that arrived in the window and completed
within their deadline, per second of the window. Also printed: admission decisions per task
(every retry is one: the load refusals put on the manager) and the median time from arrival
to a final refusal ("no after": how long a producer waited to learn it will not be served) and
the grants evicted.

Per service class it also prints the **admission wait** (arrival to grant, of the tasks
admitted) at p50 and p99, and the **starved**: tasks that ended without a grant while a task
of the same class (and tenant: the bench has one) that arrived *later* had been admitted
before they gave up — a request overtaken by a younger one.

Runs, all in this one process and run: full load (1x) with shedding on (the reference), then
2x and 5x with shedding on (``PressurePolicy()``: staged shedding, measured retry times,
deadline prediction, fair shares, the line of deferred requests), with shedding on but the
line off (``line=False``: each freed slot goes to whoever asks first), and with shedding off
(``PressurePolicy(enabled=False)``: the ledger's exact capacity only, a constant 1 s retry
time). Targets: with shedding on, goodput at 2x and 5x stays at least 0.8x the goodput at
full load; with the line, no task is starved at 2x or 5x, and the interactive admission wait's
p99 stays within the deadline. The line-off rows are there to show those targets can fail.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from report import Report, Target, add_json_argument

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.pressure import PressurePolicy
from mesh.errors import AdmissionRefused, SubmitDeadlineExceeded, TaskFailed
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.wire import CapabilityDescriptor, CapabilityRange, TaskRequirements
from mesh.wire.admission import local_descriptor

TARGET_GOODPUT_RATIO = 0.8
POLICY_GENERATION = 1
ECHO = CapabilityRange(name="test.echo", version_spec=">=1,<2")
MIX = (("interactive", 0.5), ("batch", 0.3), ("speculative", 0.2))
# What losing each class's task mid-way costs: speculative branches can be rebuilt, batch work
# can be retried, interactive work is assumed to have side effects (never evicted).
RECOVERABILITY = {"interactive": "side_effects", "batch": "retryable", "speculative": "rebuildable"}


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
    """One measured task: its class, when it arrived, was admitted (if it was) and ended."""

    service_class: str
    arrived: float
    admitted: float | None  # None: not admitted, or admitted at a time not known (granted)
    ended: float
    granted: bool = False  # admitted (its result came too late to say when)


@dataclass
class Run:
    label: str
    load: float
    shedding: bool
    line: bool = True
    outcomes: list[Outcome] = field(default_factory=list)
    arrived: int = 0
    good: int = 0  # arrived in the window, completed within the deadline
    late: int = 0  # completed after the deadline
    refused: dict[str, int] = field(default_factory=dict)  # final reason -> count
    window_s: float = 0.0
    refusal_s: list[float] = field(default_factory=list)  # arrival to a final refusal
    all_arrivals: int = 0  # warm-up included
    decisions: int = 0  # admission decisions the manager made (every retry is one)
    evicted: int = 0  # grants taken back from rebuildable/retryable work for interactive work

    @property
    def goodput(self) -> float:
        return self.good / self.window_s if self.window_s else 0.0

    def waits(self, service_class: str) -> list[float]:
        return sorted(
            o.admitted - o.arrived
            for o in self.outcomes
            if o.service_class == service_class and o.admitted is not None
        )

    def starved(self, service_class: str) -> int:
        """Tasks of the class that ended without a grant after a younger one was admitted."""
        mine = sorted(
            (o for o in self.outcomes if o.service_class == service_class),
            key=lambda o: o.arrived,
        )
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


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_run(
    amqp_url: str,
    workdir: Path,
    *,
    load: float,
    shedding: bool,
    line: bool,
    slots: int,
    service_s: float,
    deadline_s: float,
    warmup_s: float,
    window_s: float,
    rng: random.Random,
) -> Run:
    namespace = f"bench-overload-{uuid.uuid4().hex[:8]}"
    user = urlsplit(amqp_url).username or "guest"  # the broker user is the operator here
    policy = AdmissionPolicy(
        active_generation=POLICY_GENERATION,
        grant_ttl_s=60,
        pressure=PressurePolicy(line=line) if shedding else PressurePolicy(enabled=False),
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
        for i in range(4)
    ]
    label = f"{load:g}x, " + (("line" if line else "no line") if shedding else "shedding off")
    run = Run(label, load, shedding, line, window_s=window_s)
    try:
        accepted = await clients[0].publish_descriptor(descriptor(slots, time.time()))
        if accepted.type != "mesh.descriptor-accepted.v1":
            raise RuntimeError(f"descriptor refused: {accepted}")
        await agent.start()  # the descriptor is active: the agent consumes the pool queue
        if agent.counters["pool_subscriptions"] < 1:
            raise RuntimeError("the agent did not subscribe to its pool queue")
        rate = load * slots / service_s
        start = time.monotonic()
        window = (start + warmup_s, start + warmup_s + window_s)
        tasks: list[asyncio.Task[None]] = []
        i = 0
        while True:
            now = time.monotonic()
            if now >= window[1]:
                break
            measured = window[0] <= now
            cls = rng.choices([m[0] for m in MIX], [m[1] for m in MIX])[0]
            tasks.append(
                asyncio.create_task(
                    one_task(clients[i % 4], cls, service_s, deadline_s, run, measured)
                )
            )
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        run.all_arrivals = len(tasks)
        run.decisions = sum(
            manager.counters[f"admission.{outcome}"]
            for outcome in ("admitted", "rejected", "deferred")
        )
        run.evicted = manager.counters["admissions_evicted"]
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


async def one_task(
    client: MeshClient, cls: str, service_s: float, deadline_s: float, run: Run, measured: bool
) -> None:
    arrived = time.monotonic()
    deadline = time.time() + deadline_s
    reason = "OK"
    admitted: float | None = None
    granted = False
    try:
        done = await client.submit(
            requirements(cls, service_s, deadline),
            {"message": cls, "sleep_ms": int(service_s * 1000)},
            timeout_s=deadline_s,
        )
        admitted = arrived + done.admission_wait_s
        if done.result.finished_at <= deadline:
            good = True
        else:
            good, reason = False, "LATE"
    except AdmissionRefused as exc:
        good, reason = False, exc.code
    except SubmitDeadlineExceeded as exc:
        good, reason = False, f"GAVE_UP:{exc.last_reason or 'RESULT'}"
        # Admitted, and its result did not come in time: the exception carries the grant.
        granted = exc.decision is not None and exc.decision.outcome == "admitted"
    except TaskFailed as exc:
        good, reason = False, exc.code
    if not measured:
        return
    run.outcomes.append(Outcome(cls, arrived, admitted, time.monotonic(), granted))
    run.arrived += 1
    if good:
        run.good += 1
    else:
        run.late += reason == "LATE"
        run.refused[reason] = run.refused.get(reason, 0) + 1
        run.refusal_s.append(time.monotonic() - arrived)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows (about a minute)")
    parser.add_argument("--amqp-url", default=os.environ.get("MESH_AMQP_URL", c.DEFAULT_AMQP_URL))
    parser.add_argument("--slots", type=int, default=8, help="the pool's model slots")
    parser.add_argument("--service-ms", type=int, default=400, help="each task's work")
    parser.add_argument("--deadline-s", type=float, default=2.0, help="after arrival")
    parser.add_argument("--seed", type=int, default=20261130)
    add_json_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("mesh").setLevel(logging.CRITICAL)
    for name in ("aio_pika", "aiormq"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warmup_s, window_s = (2.0, 6.0) if args.quick else (3.0, 15.0)
    service_s = args.service_ms / 1000
    # (load, shedding, line)
    plan = [
        (1.0, True, True),
        (2.0, True, True),
        (2.0, True, False),
        (2.0, False, False),
        (5.0, True, True),
        (5.0, True, False),
        (5.0, False, False),
    ]
    started = time.perf_counter()
    print(
        f"overload: pool of {args.slots} slots, {args.service_ms} ms per task "
        f"(full load {args.slots / service_s:.0f} tasks/s), deadline {args.deadline_s:g} s, "
        f"window {window_s:g} s after {warmup_s:g} s warm-up"
    )
    print(
        f"{'run':<22}{'arrived':>9}{'good':>7}{'goodput/s':>11}{'vs 1x':>8}"
        f"{'asks/task':>11}{'no after':>10}{'evicted':>9}  refusals"
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        for load, shedding, line in plan:
            run = asyncio.run(
                one_run(
                    args.amqp_url, Path(tmp), load=load, shedding=shedding, line=line,
                    slots=args.slots,
                    service_s=service_s, deadline_s=args.deadline_s, warmup_s=warmup_s,
                    window_s=window_s, rng=random.Random(args.seed),
                )
            )  # fmt: skip
            runs.append(run)
            full = runs[0].goodput
            ratio = run.goodput / full if full else float("nan")
            refusals = ", ".join(f"{k} {v}" for k, v in sorted(run.refused.items()))
            asks = run.decisions / run.all_arrivals if run.all_arrivals else 0.0
            told = f"{statistics.median(run.refusal_s):.2f} s" if run.refusal_s else "-"
            print(
                f"{run.label:<22}{run.arrived:>9}{run.good:>7}{run.goodput:>11.1f}"
                f"{ratio:>7.2f}x{asks:>11.2f}{told:>10}{run.evicted:>9}  {refusals or '-'}"
            )
    print()
    print("admission wait (arrival to grant) per class, p50 / p99, and the starved")
    print(f"{'run':<22}" + "".join(f"{cls:>30}" for cls, _ in MIX))
    for run in runs:
        cells = []
        for cls, _ in MIX:
            waits = run.waits(cls)
            p50, p99 = percentile(waits, 0.5), percentile(waits, 0.99)
            text = "-" if p50 is None or p99 is None else f"{p50:.2f} / {p99:.2f} s"
            cells.append(f"{text}, starved {run.starved(cls)}")
        print(f"{run.label:<22}" + "".join(f"{cell:>30}" for cell in cells))
    full = runs[0].goodput
    report = Report("overload")
    for run in runs:
        report.figure(
            run=run.label,
            load=run.load,
            shedding=run.shedding,
            line=run.line,
            arrived=run.arrived,
            good=run.good,
            value=run.goodput,
            baseline=full,
            ratio=run.goodput / full if full else None,
            unit="tasks completed before their deadline per second (baseline: 1x, line)",
            starved={cls: run.starved(cls) for cls, _ in MIX},
        )
    for run in runs[1:]:
        if not (run.shedding and run.line):
            continue
        starved = sum(run.starved(cls) for cls, _ in MIX)
        report.targets.append(
            Target(
                f"starved_at_{run.load:g}x",
                starved == 0,
                f"at {run.load:g}x with the line, {starved} task(s) starved (target 0)",
                value=starved,
                bound="== 0",
            )
        )
        p99 = percentile(run.waits("interactive"), 0.99)
        report.targets.append(
            Target(
                f"interactive_wait_p99_at_{run.load:g}x",
                p99 is not None and p99 <= args.deadline_s,
                f"at {run.load:g}x with the line, the interactive admission wait's p99 is "
                + (f"{p99:.2f} s" if p99 is not None else "unmeasured")
                + f" (target ≤ the {args.deadline_s:g} s deadline)",
                value=p99,
                bound=f"<= {args.deadline_s:g}",
            )
        )
        ratio = run.goodput / full if full else 0.0
        report.targets.append(
            Target(
                f"goodput_at_{run.load:g}x_vs_1x",
                ratio >= TARGET_GOODPUT_RATIO,
                f"goodput at {run.load:g}x with shedding is {ratio:.2f}x full load's "
                f"(target ≥ {TARGET_GOODPUT_RATIO:g}x)",
                value=run.goodput,
                baseline=full,
                ratio=ratio,
                bound=f">= {TARGET_GOODPUT_RATIO:g}",
            )
        )
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
