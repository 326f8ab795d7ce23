"""``mesh demo``: the whole mesh on one machine, against the local broker.

It starts the manager as a real process with the local-process scaler standing
in for Kubernetes: the manager scales each sample deployment to its
``min_replicas`` by starting ``mesh agent`` processes, and keeps them there.
The demo publishes a capability descriptor for each sample pool (as the
operator), follows the orchestration events, and runs a producer on the main
path: ``MeshClient.submit`` asks for admission by capability and version range,
waits as told when deferred, and sends each admitted task to its pool's shared
queue. Half-way through it drains the agent holding the most work (no task is
lost or run twice; while that pool has no live agent its admissions are deferred
``NO_LIVE_AGENT``; the scaler replaces it), and ends with a summary that counts
each task's executions. The manager runs in its own session, so Ctrl-C reaches
only the demo, which then stops the manager; the manager drains its agents
before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import orjson

from mesh import constants as c
from mesh import tracing
from mesh.errors import (
    AdmissionRefused,
    MeshError,
    RequestTimeout,
    SubmitDeadlineExceeded,
    TaskFailed,
)
from mesh.manager.admission import AdmissionPolicy
from mesh.producer import MeshClient
from mesh.topology.specs import BindingSpec, Declarations
from mesh.transport import Delivery
from mesh.transport.addresses import first_url
from mesh.wire import (
    AdmissionDecision,
    CapabilityDescriptor,
    CapabilityRange,
    OrchestrationEvent,
    Refusal,
    TaskRequirements,
    decode,
)
from mesh.wire.admission import local_descriptor

SHOWN_EVENTS = {
    "manager_started",
    "registered",
    "ready",
    "refused",
    "draining",
    "terminated",
    "lost",
    "version_drift",
    "manager_stalled",
    "scale",
}

# (capability, version range, payload, what to print)
JOBS: list[tuple[str, str, dict[str, Any]]] = [
    ("math.evaluate", ">=1,<2", {"expression": "2 * (3 + 4) ** 2"}),
    ("math.evaluate", ">=1,<2", {"expression": "sqrt(144) + 7 // 2"}),
    ("text.stats", "~=1.2", {"text": "The quick brown fox jumps over the lazy dog. Twice!"}),
    ("math.evaluate", ">=1", {"expression": "round(22 / 7, 4)"}),
    ("test.echo", ">=1", {"message": "hello mesh", "sleep_ms": 400}),
    ("text.stats", ">=1.0", {"text": "Agents announce capabilities. Producers ask by range."}),
    ("test.echo", ">=1", {"message": "slow one", "sleep_ms": 1200}),
]
# Every BAD_EVERY-th task violates math.evaluate's input schema on purpose: the producer
# gets a typed INPUT_SCHEMA_VIOLATION error, and the agent keeps serving.
BAD_JOB: tuple[str, str, dict[str, Any]] = ("math.evaluate", ">=1", {"expr": "1 + 1"})
BAD_EVERY = 25


@dataclass(frozen=True, slots=True)
class DemoSettings:
    amqp_url: str = c.DEFAULT_AMQP_URL
    namespace: str = c.DEFAULT_NAMESPACE
    duration_s: float = 30.0
    concurrency: int = 4
    producer_only: bool = False
    work_dir: Path = Path(".mesh/demo")
    # deployment (= sample) -> replicas the manager keeps
    replicas: tuple[tuple[str, int], ...] = (("calc", 2), ("textstats", 1), ("echo", 1))
    heartbeat_interval_s: float = 5.0
    http_port: int = 8090  # the manager's status page; another free port if this one is taken

    @property
    def agent_count(self) -> int:
        return sum(n for _, n in self.replicas)

    @property
    def operator(self) -> str:
        """The demo's broker user, which the manager takes descriptors from."""
        return urlsplit(first_url(self.amqp_url)).username or "guest"

    def descriptor(self, pool: str, now: float) -> CapabilityDescriptor:
        """What the operator allows ``pool``: its sample's capability, more model slots than
        its agents can run (so the live figure is what binds), a day to live. The epoch is
        the time, so a rerun on the same ledger is a newer epoch."""
        return local_descriptor(
            pool,
            CapabilityRange(name=CAPABILITIES[pool], version_spec=">=1"),
            epoch=int(now),
            issued_by=self.operator,
            now=now,
            policy_generation=AdmissionPolicy().active_generation,
            ttl_s=86_400,
        )

    def scaling_file(self) -> dict[str, Any]:
        capabilities = CAPABILITIES
        return {
            "deployments": [
                {
                    "deployment": name,
                    "capabilities": [capabilities[name]],
                    "min_replicas": n,
                    "max_replicas": n + 1,
                    "window_s": 5,
                    "scale_down_idle_s": 600,
                    "start_s": 3,  # a local process registers in a second or two
                }
                for name, n in self.replicas
            ]
        }


CAPABILITIES = {"calc": "math.evaluate", "textstats": "text.stats", "echo": "test.echo"}
POOLS = {capability: pool for pool, capability in CAPABILITIES.items()}


def requirements(capability: str, spec: str) -> TaskRequirements:
    """A demo task's requirements: the capability and range, nothing the pools do not give."""
    return TaskRequirements(
        capability=CapabilityRange(name=capability, version_spec=spec),
        task_schema_version="1.0.0",
        result_schema_version="1.0.0",
        input_classifications=["internal"],
        estimated_tokens=200,
        estimated_duration_s=0.5,
        service_class="interactive",
    )


@dataclass
class Tally:
    submitted: int = 0
    succeeded: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    deferred: Counter[str] = field(default_factory=Counter)  # waited, then asked again
    by_agent: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def accounted(self) -> int:
        return self.succeeded + sum(self.errors.values()) + sum(self.refused.values())


class Processes:
    """Child processes of the demo, each logging to its own file."""

    def __init__(self, settings: DemoSettings) -> None:
        self.settings = settings
        self.log_dir = settings.work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []

    def start(self, name: str, *args: str) -> None:
        s = self.settings
        cmd = [
            sys.executable,
            "-m",
            "mesh",
            "--amqp-url",
            s.amqp_url,
            "--namespace",
            s.namespace,
            *args,
        ]
        log_file = (self.log_dir / f"{name}.log").open("ab")
        self._files.append(log_file)
        self.children[name] = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self, name: str) -> bool:
        proc = self.children.get(name)
        return proc is not None and proc.poll() is None

    async def stop(self, name: str, timeout_s: float) -> int | None:
        proc = self.children.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, timeout_s)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        return proc.returncode

    def close(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in self._files:
            f.close()


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {text}", flush=True)


async def run_demo(settings: DemoSettings) -> int:
    client = await MeshClient.connect(
        settings.amqp_url, namespace=settings.namespace, name="mesh-demo"
    )
    procs = Processes(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        say(_tracing_said())
        await _follow_events(client)
        agent_names = await _start_mesh(settings, procs, client, stop)
        if agent_names is None:
            return 1
        tally = Tally()
        await _produce(settings, client, agent_names, tally, stop)
        await _report(client, tally)
        await _shutdown(settings, procs)
        lost = tally.submitted - tally.accounted
        return 0 if lost == 0 else 1
    finally:
        procs.close()
        await client.close()


def _tracing_said() -> str:
    """Whether this run is traced; the children inherit the ``OTEL_*`` environment."""
    if tracing.tracer() is not None:
        return "traces: on, from every process of the demo (see docs/tracing.md)"
    return (
        "traces: off (with agent-mesh[otel]: OTEL_TRACES_EXPORTER=otlp "
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 mesh demo; docs/tracing.md)"
    )


async def _follow_events(client: MeshClient) -> None:
    topo = client.topology
    queue = f"{topo.namespace}.demo-events.{os.getpid()}"
    await client.transport.declare_reply_queue(queue)
    await client.transport.declare(
        Declarations(bindings=(BindingSpec(queue, topo.events_exchange, f"{c.RK_LOG}.#"),))
    )

    async def show(delivery: Delivery) -> None:
        ev = decode(delivery.body)
        if isinstance(ev, OrchestrationEvent) and ev.kind in SHOWN_EVENTS:
            move = f"{ev.from_state} → {ev.to_state}" if ev.to_state else ""
            if ev.kind == "scale":
                move = f"{ev.detail.get('deployment')} → {ev.detail.get('replicas')} replica(s)"
            who = ev.agent_id or "manager"
            say(f"[event] {ev.kind:<16} {who:<14} {move:<26} {ev.reason}")

    await client.transport.consume(queue, show, no_ack=True)


def _free_port(preferred: int) -> int:
    """``preferred`` if nothing listens there, else a port the OS says is free now."""
    for port in (preferred, 0):
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise MeshError("no free TCP port for the manager's status page")


def management_url_for(amqp_url: str) -> str:
    """The RabbitMQ management API next to an AMQP broker: same host and credentials, :15672."""
    parts = urlsplit(first_url(amqp_url))
    user = parts.username or "guest"
    password = parts.password or "guest"
    return f"http://{user}:{password}@{parts.hostname or '127.0.0.1'}:15672"


async def _start_mesh(
    s: DemoSettings, procs: Processes, client: MeshClient, stop: asyncio.Event
) -> list[str] | None:
    if s.producer_only:
        say(f"producer only: using the mesh already running in namespace {s.namespace!r}")
    else:
        scaling = s.work_dir / "scaling.json"
        scaling.write_bytes(orjson.dumps(s.scaling_file(), option=orjson.OPT_INDENT_2))
        plan = ", ".join(f"{n} x {name}" for name, n in s.replicas)
        say(f"starting the manager with the local-process scaler ({plan})")
        say(f"process logs: {procs.log_dir}/")
        say(f"orchestration log: mesh log --journal {s.work_dir / 'orchestration.sqlite3'}")
        port = _free_port(s.http_port)
        procs.start(
            "manager",
            "manager",
            "--journal", str(s.work_dir / "orchestration.sqlite3"),
            "--ledger", f"sqlite:{s.work_dir / 'ledger.sqlite3'}",
            "--scaler", "local",
            "--scaling", str(scaling),
            "--agent-log-dir", str(procs.log_dir),
            "--agent-heartbeat-interval", str(s.heartbeat_interval_s),
            "--http-port", str(port),
            "--management-url", management_url_for(s.amqp_url),
            "--operator-user", s.operator,
        )  # fmt: skip
        say(
            f"status page: http://127.0.0.1:{port}/ (metrics at /metrics; "
            f"`mesh top --url http://127.0.0.1:{port}/` in another terminal)"
        )
    try:
        await _wait_for(lambda: _manager_answers(client), 20, stop)
    except TimeoutError:
        say("the manager did not answer within 20 s; see its log above")
        return None
    if not await _publish_descriptors(s, client):  # producer only: as the operator too
        return None
    wanted = 1 if s.producer_only else s.agent_count
    names: list[str] = []

    async def all_ready() -> bool:
        status = await client.status()
        names[:] = sorted(a.agent_id for a in status.agents if a.state in ("Ready", "Busy"))
        return len(names) >= wanted

    try:
        await _wait_for(all_ready, 45, stop)
    except TimeoutError:
        say("agents did not become Ready within 45 s; see their logs in " + str(procs.log_dir))
        return None
    say(f"every agent is Ready: {', '.join(names)}")
    return [] if s.producer_only else names


async def _publish_descriptors(s: DemoSettings, client: MeshClient) -> bool:
    """As the operator: a descriptor for each sample pool (its bounded task queue comes with
    it), so producers can submit by admission."""
    now = time.time()
    for pool, _ in s.replicas:
        reply = await client.publish_descriptor(s.descriptor(pool, now))
        if isinstance(reply, Refusal):
            say(f"the descriptor of pool {pool} was refused: {reply.reason}: {reply.detail}")
            return False
    say(f"descriptors published for pools {', '.join(pool for pool, _ in s.replicas)}")
    return True


async def _manager_answers(client: MeshClient) -> bool:
    try:
        await client.status(timeout_s=1.0)
    except RequestTimeout:
        return False
    return True


async def _wait_for(check: Any, timeout_s: float, stop: asyncio.Event) -> None:
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if await check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.3)
    raise TimeoutError


async def _produce(
    s: DemoSettings,
    client: MeshClient,
    agent_names: list[str],
    tally: Tally,
    stop: asyncio.Event,
) -> None:
    jobs = itertools.cycle(JOBS)
    rng = random.Random(7)
    say(
        f"producer: {s.concurrency} tasks at a time"
        + (f" for {s.duration_s:g} s" if s.duration_s else "")
    )

    def deferred(decision: AdmissionDecision) -> bool:
        tally.deferred[decision.reason.value if decision.reason else "?"] += 1
        return True  # wait as told (retry_after_ms, with jittered backoff) and ask again

    async def worker() -> None:
        while not stop.is_set():
            tally.submitted += 1
            bad = tally.submitted % BAD_EVERY == 0
            capability, spec, payload = BAD_JOB if bad else next(jobs)
            started = time.perf_counter()
            try:
                done = await client.submit(
                    requirements(capability, spec), payload, timeout_s=20, on_deferred=deferred
                )
            except (AdmissionRefused, SubmitDeadlineExceeded) as exc:
                tally.refused[exc.code] += 1
                say(f"  refused  {capability:<14} {exc.code}: {exc.message[:90]}")
                await asyncio.sleep(0.5)
                continue
            except TaskFailed as exc:
                tally.errors[exc.code] += 1
                note = " (sent on purpose)" if bad else ""
                say(f"  error    {capability:<14} {exc.code}{note}: {exc.message[:90]}")
                continue
            except MeshError as exc:  # no manager answer, broker trouble: count it, go on
                tally.errors[type(exc).__name__] += 1
                say(f"  error    {capability:<14} {type(exc).__name__}: {str(exc)[:90]}")
                await asyncio.sleep(0.5)
                continue
            ms = (time.perf_counter() - started) * 1000
            tally.succeeded += 1
            tally.latencies_ms.append(ms)
            tally.by_agent[done.result.agent_id] += 1
            say(
                f"  ok       {capability:<14} on {done.result.agent_id:<12} {ms:6.0f} ms  "
                f"{_brief(done.output)}"
            )
            await asyncio.sleep(rng.uniform(0.1, 0.4))

    workers = [asyncio.create_task(worker()) for _ in range(s.concurrency)]
    drain_at = time.monotonic() + s.duration_s / 2 if s.duration_s else None
    end_at = time.monotonic() + s.duration_s if s.duration_s else None
    victim: str | None = None
    while not stop.is_set() and (end_at is None or time.monotonic() < end_at):
        if agent_names and drain_at and victim is None and time.monotonic() >= drain_at:
            victim = await _drain_a_busy_agent(client)
        await asyncio.sleep(0.1 if victim is None and drain_at else 0.2)
    stop.set()
    say("producer: stopping; waiting for tasks in flight")
    await asyncio.gather(*workers, return_exceptions=True)
    if victim:
        status = await client.status()
        now = sorted(a.agent_id for a in status.agents)
        gone = "has left" if victim not in now else "is still finishing its drain"
        say(f"{victim} {gone}; the scaler keeps the replicas: {', '.join(now)}")


async def _drain_a_busy_agent(client: MeshClient) -> str | None:
    """Drain the agent with the most work in flight (both paths: the manager's one count),
    once one has any; ``None`` while none has."""
    status = await client.status()
    busy = [a for a in status.agents if a.state == "Busy" and a.in_flight > 0]
    if not busy:
        return None
    victim = max(busy, key=lambda a: (a.in_flight, a.agent_id)).agent_id
    reply = await client.drain(victim, "demo: showing a graceful drain under load")
    if isinstance(reply, Refusal):
        say(f"drain of {victim} refused: {reply.reason}")
    else:
        say(
            f"draining {victim} with {reply.in_flight} task(s) in flight: they finish there, "
            "its pool's new tasks go to the others (or wait for its replacement)"
        )
    return victim


def _brief(output: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in output.items())
    return text if len(text) <= 70 else text[:67] + "..."


async def _report(client: MeshClient, tally: Tally) -> None:
    lat = sorted(tally.latencies_ms)
    print()
    print("summary")
    print(f"  tasks submitted   {tally.submitted}")
    print(f"  completed once    {tally.succeeded}")
    for code, n in sorted(tally.errors.items()):
        print(f"  typed error       {n} x {code}")
    if tally.errors:
        print(f"                    (every {BAD_EVERY}th task is a bad payload, sent on purpose)")
    for code, n in sorted(tally.refused.items()):
        print(f"  refused           {n} x {code}")
    for code, n in sorted(tally.deferred.items()):
        print(f"  deferred          {n} x {code} (waited as told, then admitted or refused)")
    print(f"  lost              {tally.submitted - tally.accounted}")
    # A task run twice answers twice: its second result reaches a caller already gone.
    print(f"  executed twice    {client.counters['duplicate_results']}")
    if lat:
        p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
        print(
            f"  latency           p50 {statistics.median(lat):.0f} ms · p95 {p95:.0f} ms · "
            f"max {lat[-1]:.0f} ms"
        )
    for agent, n in sorted(tally.by_agent.items()):
        print(f"  {agent:<17} {n} task(s)")
    with contextlib.suppress(RequestTimeout):
        from mesh.render import render_status

        print()
        print(render_status(await client.status()))
    print()


async def _shutdown(s: DemoSettings, procs: Processes) -> None:
    if s.producer_only:
        return
    say("shutting down: the manager drains its agents, then stops")
    code = await procs.stop("manager", 60)
    if code != 0:
        say(f"the manager exited with code {code}; see {procs.log_dir / 'manager.log'}")
    say(f"done. The orchestration log: mesh log --journal {s.work_dir / 'orchestration.sqlite3'}")
