"""One pool model on the real broker: admission grants what live agents can run, both paths
share one count of work, drains wait for it, and admission pressure scales the pool.

* Every agent of a pool killed with SIGKILL: once they are declared lost, ``submit`` is
  refused ``NO_LIVE_AGENT`` (never granted); the pool's scaling policy starts one replica
  (local-process scaler) and the next ``submit`` succeeds.
* A rolling deploy on the admission path: three agents under steady ``submit`` load, each
  drained and replaced in turn; every task runs exactly once, none reaches its deadline, and
  no agent is Terminated while it still runs a task.
* A burst of ``CAPACITY`` deferrals is one scale step per window.
* Live capacity below the descriptor's: the ledger never holds more grants than the live
  figure, and shrinking it revokes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mesh.agent import Agent, AgentRuntime, AgentSettings, capability
from mesh.core.scaling import ScalingPolicy
from mesh.errors import MeshError
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.local import LocalProcessScaler, sample_command
from mesh.topology import Topology
from mesh.wire import (
    AdmissionReason,
    Lease,
    OrchestrationEvent,
    Reason,
    TaskResult,
)

from .harness import FAST_POOL, eventually
from .test_admission import settings_for
from .test_backpressure import echo_descriptor, echo_requirements
from .test_grant_enforcement import send_task

SCHEMA = {"type": "object"}
HEARTBEAT_S = 5.0  # the least `mesh agent` accepts: lost after 15 s of silence


def start_agent_process(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def live_slots(manager: ManagerService) -> tuple[int, int]:
    """(grants held, capacity) of the echo pool's live-slot counter in the ledger."""
    assert manager.admitter is not None
    return manager.admitter.ledger.usage()[("echo", "live_slots:test.echo")]


class RecordingScaler:
    """The scaler port, in memory: what the manager asked for (no processes to run)."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.calls: list[tuple[str, int]] = []

    async def current_replicas(self, deployment: str) -> int | None:
        return self.replicas

    async def scale_to(
        self, deployment: str, replicas: int, *, remove_first: str | None = None
    ) -> None:
        self.calls.append((deployment, replicas))
        self.replicas = replicas

    async def delete_pod(self, deployment: str, pod: str) -> None:
        return None

    async def close(self) -> None:
        return None


@contextlib.asynccontextmanager
async def echo_manager(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    *,
    policy: ScalingPolicy | None = None,
    scaler: Any = None,
    on_log: Any = None,
) -> AsyncIterator[tuple[ManagerService, MeshClient]]:
    pool = dataclasses.replace(FAST_POOL, scaling=(policy,) if policy else ())
    settings = settings_for(amqp_url, namespace, tmp_path, pool=pool)
    manager = ManagerService(settings, scaler=scaler, on_log=on_log)
    await manager.start()
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        assert (await client.publish_descriptor(echo_descriptor(16))).type.endswith("accepted.v1")
        yield manager, client
    finally:
        await client.close()
        await manager.stop()


def echo_runtime(amqp_url: str, namespace: str, agent_id: str, **settings: Any) -> AgentRuntime:
    from mesh.samples import SAMPLES

    return AgentRuntime(
        SAMPLES["echo"](agent_id, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace, **settings),
    )


# ---- (1) no live agent, no grant; the scaler brings one ---------------------------------------
async def test_a_pool_whose_agents_were_killed_is_refused_until_its_policy_starts_one(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    policy = ScalingPolicy("echo", min_replicas=0, max_replicas=2, window_s=1.0, start_s=2.0)
    command = sample_command(namespace, amqp_url, HEARTBEAT_S)
    scaler = LocalProcessScaler(command, log_dir=tmp_path / "agents")
    outside = [  # agents the scaler did not start (its deployment is at 0 replicas)
        start_agent_process(command("echo", f"echo-old-{i}"), tmp_path / f"echo-old-{i}.log")
        for i in range(2)
    ]
    try:
        async with echo_manager(amqp_url, namespace, tmp_path, policy=policy, scaler=scaler) as (
            manager,
            client,
        ):
            old = {"echo-old-0", "echo-old-1"}
            await eventually(lambda: old <= set(manager.core.agents), what="both agents Ready")
            done = await client.submit(echo_requirements(), {"message": "before"}, timeout_s=10)
            assert done.result.agent_id in old

            for proc in outside:
                os.killpg(proc.pid, signal.SIGKILL)
            await eventually(  # 3 silent heartbeat intervals
                lambda: not old & set(manager.core.agents),
                what="both declared lost",
                timeout_s=4 * HEARTBEAT_S + 5,
            )
            assert not [a for a in manager.core.agents if a.startswith("echo")]

            refused = await client.admit(echo_requirements())
            assert (refused.outcome, refused.reason) == ("deferred", AdmissionReason.NO_LIVE_AGENT)
            assert refused.grant is None and refused.retry_after_ms is not None
            assert refused.retry_after_ms <= 1000 * (policy.window_s + policy.start_s) * 1.2

            # The refusal was a capacity miss: one replica, started by the scaler.
            await eventually(lambda: scaler.pods("echo") != [], what="a replica started")
            await eventually(
                lambda: any(a.startswith("echo-") and a not in old for a in manager.core.agents),
                what="the new replica registered",
            )
            after = await client.submit(echo_requirements(), {"message": "after"}, timeout_s=15)
            assert after.result.agent_id == scaler.pods("echo")[0]
            assert len(scaler.pods("echo")) == 1  # one step, not a storm
            assert manager.core.scaling.desired("echo") == 1
    finally:
        for proc in outside:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await scaler.close()


# ---- (2) a rolling deploy on the admission path ----------------------------------------------
class CountingEcho(Agent):
    """Pool ``echo``: sleeps, and counts every execution of every task ID it is given."""

    deployment = "echo"
    executions: Counter[str] = Counter()

    @capability(
        "test.echo", version="1.0.0", input_schema=SCHEMA, output_schema=SCHEMA,
        max_concurrency=2, cost_class="C",
    )  # fmt: skip
    async def echo(self, payload: dict[str, Any]) -> dict[str, Any]:
        type(self).executions[payload["id"]] += 1
        await asyncio.sleep(payload["sleep_ms"] / 1000)
        return {"id": payload["id"]}


@dataclasses.dataclass
class Load:
    """What the producers submitted and what came back."""

    submitted: list[str] = dataclasses.field(default_factory=list)
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    failures: list[str] = dataclasses.field(default_factory=list)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def produce(client: MeshClient, load: Load, worker: int) -> None:
    """Submit echo tasks one after another (each with a 20 s deadline) until told to stop."""
    for n in itertools.count():
        if load.stop.is_set():
            return
        task_id = f"w{worker}-{n}"
        load.submitted.append(task_id)
        payload = {"id": task_id, "sleep_ms": 150 + 50 * (n % 4)}
        try:
            done = await client.submit(
                echo_requirements(deadline=time.time() + 20), payload, timeout_s=20
            )
        except MeshError as exc:
            load.failures.append(f"{task_id}: {type(exc).__name__}: {exc}")
            continue
        load.outcomes[done.output["id"]] += 1


def assert_each_ran_once(executions: Counter[str], submitted: list[str]) -> None:
    assert set(executions) == set(submitted)
    twice = {task: n for task, n in executions.items() if n != 1}
    assert twice == {}, f"executed more than once: {twice}"


async def roll_one(new: AgentRuntime, old: AgentRuntime) -> None:
    await new.start()
    await eventually(lambda: sum(old.in_flight.values()) > 0, what=f"{old.agent_id} busy")
    await old.drain("rolling deploy")
    assert old.stopped.is_set()
    await asyncio.sleep(1.0)


async def test_a_rolling_deploy_on_the_admission_path_runs_every_task_exactly_once(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    CountingEcho.executions = Counter()
    runtimes: dict[str, AgentRuntime] = {}
    terminated_while_running: list[tuple[str, dict[str, int]]] = []
    journal: list[OrchestrationEvent] = []

    def on_log(event: OrchestrationEvent) -> None:
        """The manager's journal, as it writes it: at the moment it says Terminated, the
        agent must be running nothing."""
        journal.append(event)
        if event.kind == "terminated" and event.agent_id in runtimes:
            running = {k: n for k, n in runtimes[event.agent_id].in_flight.items() if n}
            if running:
                terminated_while_running.append((event.agent_id, running))

    def runtime(agent_id: str) -> AgentRuntime:
        runtimes[agent_id] = AgentRuntime(
            CountingEcho(agent_id, heartbeat_interval_s=5.0),
            AgentSettings(amqp_url=amqp_url, namespace=namespace, drain_timeout_s=30),
        )
        return runtimes[agent_id]

    load = Load()
    async with echo_manager(amqp_url, namespace, tmp_path, on_log=on_log) as (_, client):
        for i in range(3):
            await runtime(f"old-{i}").start()
        workers = [asyncio.create_task(produce(client, load, w)) for w in range(5)]
        try:
            await asyncio.sleep(1.5)
            for i in range(3):  # surge one new agent, then drain one old one with work in hand
                await roll_one(runtime(f"new-{i}"), runtimes[f"old-{i}"])
        finally:
            load.stop.set()
            await asyncio.gather(*workers)
        for runtime_ in runtimes.values():
            await runtime_.stop()

    assert load.failures == []
    assert len(load.submitted) >= 30
    assert set(load.outcomes) == set(load.submitted) and set(load.outcomes.values()) == {1}
    assert_each_ran_once(CountingEcho.executions, load.submitted)
    assert terminated_while_running == []
    for i in range(3):  # each old one drained with work in hand, then Terminated
        kinds = [e.kind for e in journal if e.agent_id == f"old-{i}"]
        assert "draining" in kinds and kinds[-1] == "terminated", kinds
    assert sum(r.counters["tasks_ok"] for r in runtimes.values()) == len(load.submitted)


# ---- (3) admission pressure scales, one step per window --------------------------------------
async def test_a_burst_of_capacity_deferrals_is_one_scale_step_per_window(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    policy = ScalingPolicy("echo", min_replicas=1, max_replicas=5, window_s=1.0)
    scaler = RecordingScaler(replicas=1)
    async with echo_manager(amqp_url, namespace, tmp_path, policy=policy, scaler=scaler) as (
        manager,
        client,
    ):
        agent = echo_runtime(amqp_url, namespace, "echo-1")  # 8 at a time
        await agent.start()
        try:
            held = [await client.admit(echo_requirements()) for _ in range(8)]
            assert {d.outcome for d in held} == {"admitted"}
            burst = await asyncio.gather(*(client.admit(echo_requirements()) for _ in range(60)))
            assert {(d.outcome, d.reason) for d in burst} == {
                ("deferred", AdmissionReason.CAPACITY)
            }
            await eventually(lambda: scaler.calls != [], what="a scale step")
            assert scaler.calls == [("echo", 2)]

            # More deferrals while the new replica has not registered: it is pending.
            await asyncio.gather(*(client.admit(echo_requirements()) for _ in range(60)))
            await asyncio.sleep(3 * policy.window_s)
            assert scaler.calls == [("echo", 2)]
            assert manager.core.counters["admission_capacity_misses"] >= 120
        finally:
            await agent.stop()


# ---- (5) live capacity below the descriptor's --------------------------------------------------
async def test_grants_never_exceed_the_live_figure_and_shrinking_it_revokes_nothing(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    async with echo_manager(amqp_url, namespace, tmp_path) as (manager, client):  # 16 slots
        first = echo_runtime(amqp_url, namespace, "echo-1")  # 8 at a time
        second = echo_runtime(amqp_url, namespace, "echo-2")
        await first.start()
        try:
            decisions = await asyncio.gather(
                *(client.admit(echo_requirements(), admission_id=f"a-{i}") for i in range(12))
            )
            assert Counter(d.outcome for d in decisions) == {"admitted": 8, "deferred": 4}
            assert {d.reason for d in decisions if d.grant is None} == {AdmissionReason.CAPACITY}
            assert live_slots(manager) == (8, 8)
            assert manager.admitter is not None
            assert manager.admitter.ledger.usage()[("echo", "model_slots")] == (8, 16)

            async def status_shows_the_counts() -> bool:
                (pool,) = (await client.status()).pools
                shown = (pool.pool_id, pool.live_agents, pool.live_slots, pool.granted,
                         pool.model_slots_granted, pool.model_slots)  # fmt: skip
                return shown == ("echo", 1, 8, 8, 8, 16)

            # What `mesh status` shows: the registry now, the ledger as the last tick read it.
            await eventually(status_shows_the_counts, what="mesh status")

            await second.start()
            # The four deferred ones kept their places in the pool's line: they come first.
            again = await asyncio.gather(
                *(client.admit(echo_requirements(), admission_id=f"a-{i}") for i in range(8, 12))
            )
            assert Counter(d.outcome for d in again) == {"admitted": 4}
            more = await asyncio.gather(
                *(client.admit(echo_requirements(), admission_id=f"b-{i}") for i in range(10))
            )
            assert Counter(d.outcome for d in more) == {"admitted": 4, "deferred": 6}
            assert live_slots(manager) == (16, 16)

            await second.drain("shrink the pool")  # held no task: its grants wait in the queue
            await eventually(lambda: "echo-2" not in manager.core.agents, what="echo-2 gone")
            refused = await client.admit(echo_requirements(), admission_id="c-0")
            assert refused.reason is AdmissionReason.CAPACITY
            await eventually(lambda: live_slots(manager) == (16, 8), what="the live figure")
            active = [r for r in manager.admitter.ledger.active() if r.pool_id == "echo"]
            assert len(active) == 16 and {r.state for r in active} == {"ACTIVE"}
        finally:
            await second.stop()
            await first.stop()


# ---- (4) no credentials, no work ---------------------------------------------------------------
async def bare_task(
    client: MeshClient, topology: Topology, to: str, lease_id: str | None = None
) -> TaskResult:
    """An echo task with no grant (and ``lease_id``, if any), as a producer would send it, to
    agent ``to`` or routing key ``pool.<pool>``; its answer."""
    routing_key = to if to.startswith("pool.") else None
    return await send_task(
        client, topology, to, None, "test.echo", {"message": "who sent me?"},
        lease_id=lease_id, routing_key=routing_key,
    )  # fmt: skip


async def test_a_task_without_a_grant_or_an_issued_lease_is_never_run(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    async with echo_manager(amqp_url, namespace, tmp_path) as (manager, client):
        agent = echo_runtime(amqp_url, namespace, "echo-1")
        other = echo_runtime(amqp_url, namespace, "echo-2")
        await agent.start()
        await other.start()
        try:
            t = manager.topology
            foreign = await client.acquire("test.echo", agent_id="echo-2")  # echo-2's lease
            assert isinstance(foreign, Lease)
            # No credentials at all: NOT_AUTHORIZED. A lease this agent does not know:
            # UNKNOWN_LEASE (a producer may lease again and resend; the task never ran).
            sent = {
                "to the pool queue, no grant": ("pool.echo", None, Reason.NOT_AUTHORIZED),
                "to the agent, no lease": ("echo-1", None, Reason.NOT_AUTHORIZED),
                "a made-up lease": ("echo-1", "not-a-lease", Reason.UNKNOWN_LEASE),
                "another agent's lease": ("echo-1", foreign.lease_id, Reason.UNKNOWN_LEASE),
            }
            answers = {
                what: await bare_task(client, t, to, lease_id)
                for what, (to, lease_id, _) in sent.items()
            }
            for what, answer in answers.items():
                assert isinstance(answer, TaskResult), what
                assert answer.status == "error" and answer.error is not None, what
                assert answer.error.code is sent[what][2], (what, answer.error)
            refused = agent.counters["tasks_without_credentials"]
            assert refused == 4 and agent.counters["tasks_ok"] == 0

            letters = [await client.transport.get_one(t.dead_letter_queue) for _ in range(4)]
            assert sorted(ltr.headers["x-mesh-reason"] for ltr in letters if ltr) == [
                "NOT_AUTHORIZED",
                "NOT_AUTHORIZED",
                "UNKNOWN_LEASE",
                "UNKNOWN_LEASE",
            ]
            sources = sorted(ltr.headers["x-mesh-source-queue"] for ltr in letters if ltr)
            assert sources == sorted(
                [t.pool_task_queue("echo")] + [t.agent_task_queue("echo-1")] * 3
            )

            # The lease path with a lease the manager issued to the agent runs, as always.
            done = await client.run_task("test.echo", {"message": "leased"}, timeout_s=10)
            assert done.output["message"] == "leased"
        finally:
            await other.stop()
            await agent.stop()


async def test_an_agent_may_be_told_to_run_open_tasks(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    async with echo_manager(amqp_url, namespace, tmp_path) as (manager, client):
        agent = echo_runtime(amqp_url, namespace, "echo-open", open_tasks=True)
        await agent.start()
        try:
            answer = await bare_task(client, manager.topology, "echo-open")
            assert isinstance(answer, TaskResult) and answer.status == "ok", answer
        finally:
            await agent.stop()


async def test_an_agent_subscribes_to_its_pool_queue_once_and_again_for_a_newer_epoch(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """The start's subscription and the first epoch announcement race: one subscription, so
    no task prefetched by a replaced consumer comes again marked redelivered. A newer epoch
    (the descriptor published again) subscribes afresh, as it may come with a new queue."""
    async with echo_manager(amqp_url, namespace, tmp_path) as (_, client):
        agent = echo_runtime(amqp_url, namespace, "echo-once")
        await agent.start()
        try:
            await eventually(lambda: agent.core.active_epoch is not None, what="the epoch")
            first = agent.core.active_epoch
            await asyncio.sleep(0.5)  # a second subscription spawned by the event would be done
            assert agent.counters["pool_subscriptions"] == 1, agent.counters
            newer = echo_descriptor(16)
            newer = newer.model_copy(update={"descriptor_epoch": newer.descriptor_epoch + 1})
            accepted = await client.publish_descriptor(newer)
            assert accepted.type.endswith("accepted.v1"), accepted
            await eventually(
                lambda: agent.counters["pool_subscriptions"] == 2, what="a fresh subscription"
            )
            assert agent.core.active_epoch is not None and first is not None
            assert agent.core.active_epoch > first
        finally:
            await agent.stop()
