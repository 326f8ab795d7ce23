"""Executions per task over thousands of tasks while agents and the broker are killed -9.

Issue 18 item 7 found side effects that ran two or three times after a broker kill and after
an agent restarted with the same ID. This test measures it and prints the table: how often
each task's handler ran, and how often its *effect* happened, for handlers that make the
effect directly and for handlers that wrap it in :func:`mesh.agent.once` (a PostgreSQL effect
log the pool's agents share).

The mesh: a manager in-process on the fault suite's own node (SQLite ledger), three agent
processes of ``effects_agent.py`` (pool ``echo``), and producers that keep
:data:`TASKS` tasks going, half through ``submit`` (admission, the pool's quorum queue), half
through ``run_task`` (a lease, the agent's own queue), half of each guarded by ``once``.
Meanwhile, at fixed points of the stream: an agent killed -9 while it holds tasks and
restarted at once with the same ID (as a pod's container is), the broker killed -9 and
started again, a second agent killed and restarted, the broker killed again.

Each business ID is one ``submit`` or ``run_task`` call, never retried by the test (a retry
under a new ID is a new task to the mesh), so every run and every effect logged for an ID is
one execution of one task. Shown:

1. no guarded task's effect happened more than once (the target: zero), while guarded
   handlers did run more than once (the faults bit: redeliveries reached handlers);
2. every ``ok`` answer carries the receipt of an effect that happened for its task;
3. every call ended (an answer or an error), most of them ``ok``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from integration.harness import eventually, start_manager
from integration.test_admission import settings_for
from integration.test_admission_competition import PgSchema
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.core.lifecycle import AgentState
from mesh.errors import MeshError, TaskRefused
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient

from .broker_node import BrokerNode

TASKS = 5_000  # at least 5,000 (issue 18 item 7)
AGENTS = ("fx-1", "fx-2", "fx-3")
SLOTS = 24  # the pool's model slots: three agents of eight
WORKERS = 10  # per path
TIMEOUT_S = 30.0  # per call: covers an agent's restart (its old incarnation lost in ~15 s)
REFUSED_PAUSE_S = 0.5  # a producer's pause after a refusal, before its next task
URL_OPTIONS = "?reconnect_interval=1&heartbeat=5"
LIVE = (AgentState.READY, AgentState.BUSY)
AGENT_SCRIPT = Path(__file__).with_name("effects_agent.py")
# (tasks finished, fault): the stream's fixed points
FAULTS = ((700, "agent"), (1_800, "broker"), (3_000, "agent"), (4_000, "broker"))


@dataclass
class Stream:
    issued: dict[str, tuple[str, bool]] = field(default_factory=dict)  # id -> (path, guarded)
    receipts: dict[str, str] = field(default_factory=dict)  # id -> receipt of its ok answer
    failed: dict[str, str] = field(default_factory=dict)  # id -> what the call raised
    unknown: set[str] = field(default_factory=set)  # failed: an earlier run's outcome unknown
    ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def finished(self) -> int:
        return len(self.receipts) + len(self.failed)


class AgentProcesses:
    """The agent processes, started, killed -9 and restarted under the same ID."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.killed: list[tuple[str, int]] = []

    async def start(self, agent_id: str) -> None:
        out = (self.workdir / f"{agent_id}.out").open("ab")
        self.procs[agent_id] = await asyncio.create_subprocess_exec(
            sys.executable, str(AGENT_SCRIPT), agent_id,
            env=self.env, stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out.close()

    async def kill_and_restart(self, agent_id: str) -> None:
        proc = self.procs[agent_id]
        proc.kill()
        self.killed.append((agent_id, await proc.wait()))
        await self.start(agent_id)

    async def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def agents(
    node: BrokerNode, namespace: str, tmp_path: Path, pg_schema: PgSchema
) -> AsyncIterator[AgentProcesses]:
    processes = agent_processes(node.amqp_url + URL_OPTIONS, namespace, tmp_path, pg_schema)
    yield processes
    await processes.close()


def agent_processes(
    amqp_url: str, namespace: str, tmp_path: Path, pg_schema: PgSchema
) -> AgentProcesses:
    """``effects_agent.py`` processes of ``namespace``, writing their logs under
    ``tmp_path / "effects"`` and sharing an effect log in ``pg_schema``."""
    out = tmp_path / "effects"
    out.mkdir()
    env = {
        **os.environ,
        "MESH_AMQP_URL": amqp_url,
        "MESH_NAMESPACE": namespace,
        "MESH_EFFECTS_DIR": str(out),
        "MESH_EFFECTS_DSN": pg_schema.dsn,
        "MESH_EFFECTS_SCHEMA": pg_schema.schema,
    }
    return AgentProcesses(out, env)


def payload_for(business_id: str, guarded: bool, rng: random.Random) -> dict[str, Any]:
    return {
        "id": business_id,
        "guarded": guarded,
        "before_ms": rng.randint(5, 40),
        "after_ms": rng.randint(5, 40),
    }


async def produce(client: MeshClient, stream: Stream, path: str, worker: int) -> None:
    rng = random.Random(f"{path}-{worker}")
    while (n := next(stream.ids)) < TASKS:
        business_id, guarded = f"t{n}", n % 4 < 2  # submit, run_task alternate; half guarded
        stream.issued[business_id] = (path, guarded)
        payload = payload_for(business_id, guarded, rng)
        try:
            if path == "submit":
                done: Any = await client.submit(echo_requirements(), payload, timeout_s=TIMEOUT_S)
            else:
                done = await client.run_task(
                    "test.echo", payload, version_spec=">=1,<2", timeout_s=TIMEOUT_S
                )
        except MeshError as exc:
            code = getattr(exc, "code", None)
            stream.failed[business_id] = f"{type(exc).__name__}" + (f" {code}" if code else "")
            if "outcome is unknown" in str(exc):  # EffectOutcomeUnknown, in the agent's answer
                stream.unknown.add(business_id)
            if isinstance(exc, TaskRefused):
                # Told no (no free agent while a killed one's slots wait out its loss window):
                # a producer waits before its next task instead of spending task after task
                # on the same answer, so the failed share follows the faults' length, not how
                # fast a refusal comes back (without the pause, 26-47 % of the run_task calls
                # failed in three runs, failing check 3 with and without the change at hand).
                await asyncio.sleep(REFUSED_PAUSE_S)
            continue
        assert done.output["id"] == business_id
        stream.receipts[business_id] = done.output["receipt"]


def counts(out: Path, kind: str) -> tuple[Counter[str], dict[str, set[str]]]:
    """Per business ID: how many lines the agents wrote (runs, or effects), and the second
    field of each (the idempotency key, or the receipt)."""
    lines: Counter[str] = Counter()
    seconds: dict[str, set[str]] = {}
    for path in out.glob(f"{kind}-*.log"):
        for line in path.read_text().splitlines():
            business_id, second, *_ = line.split()
            lines[business_id] += 1
            seconds.setdefault(business_id, set()).add(second)
    return lines, seconds


def table(stream: Stream, runs: Counter[str], effects: Counter[str]) -> tuple[str, dict[str, Any]]:
    rows, figures = [], {}
    head = (
        f"{'path':<9}{'handler':<9}{'tasks':>7}{'ok':>7}{'failed':>8}{'runs>1':>8}"
        f"{'effects>1':>11}{'max':>5}{'unknown':>9}"
    )
    for path, guarded in itertools.product(("submit", "run_task"), (False, True)):
        ids = [i for i, (p, g) in stream.issued.items() if (p, g) == (path, guarded)]
        row = {
            "tasks": len(ids),
            "ok": sum(i in stream.receipts for i in ids),
            "failed": sum(i in stream.failed for i in ids),
            "runs>1": sum(runs[i] > 1 for i in ids),
            "effects>1": sum(effects[i] > 1 for i in ids),
            "max": max((effects[i] for i in ids), default=0),
            # failed because an earlier run's effect started and was never recorded done
            "unknown": sum(i in stream.unknown for i in ids),
        }
        handler = "once" if guarded else "direct"
        figures[f"{path}/{handler}"] = row
        rows.append(
            f"{path:<9}{handler:<9}{row['tasks']:>7}{row['ok']:>7}{row['failed']:>8}"
            f"{row['runs>1']:>8}{row['effects>1']:>11}{row['max']:>5}{row['unknown']:>9}"
        )
    return "\n".join([head, *rows]), figures


@pytest.mark.timeout(300)
async def test_effects_wrapped_in_once_happen_at_most_once_through_agent_and_broker_kills(
    node: BrokerNode, namespace: str, tmp_path: Path, agents: AgentProcesses
) -> None:
    started = time.monotonic()
    url = node.amqp_url + URL_OPTIONS
    manager: ManagerService = await start_manager(settings_for(url, namespace, tmp_path))
    client = await MeshClient.connect(url, namespace=namespace, name="effects-producer")
    stream, workers = Stream(), []
    try:
        accepted = await client.publish_descriptor(echo_descriptor(SLOTS))
        assert accepted.type == "mesh.descriptor-accepted.v1", accepted
        # RabbitMQ 3.10 forgets a quorum queue declared shortly before a kill -9 of its only
        # node (see test_broker_faults); a graceful restart saves the new pool queue's
        # registration, as a few minutes of age would.
        await asyncio.to_thread(node.restart_app)
        for agent_id in AGENTS:
            await agents.start(agent_id)
        await eventually(
            lambda: all(
                (a := manager.core.agents.get(x)) is not None and a.state in LIVE for x in AGENTS
            ),
            timeout_s=60,
            what="three agents Ready",
        )

        workers = [
            asyncio.create_task(produce(client, stream, path, w))
            for path in ("submit", "run_task")
            for w in range(WORKERS)
        ]
        broker_back: list[float] = []
        for at, fault in FAULTS:
            await eventually(
                lambda at=at: stream.finished >= at, timeout_s=180, what=f"{at} tasks finished"
            )
            if fault == "agent":  # the busiest not killed yet, by its own last heartbeat
                victim = max(
                    [x for x in AGENTS if x not in {k for k, _ in agents.killed}],
                    key=lambda x: (
                        (a := manager.core.agents.get(x)) is not None
                        and a.reported_in_flight.get("test.echo", 0)
                    ),
                )
                await agents.kill_and_restart(victim)
            else:
                await asyncio.to_thread(node.kill9)
                await asyncio.sleep(1.0)
                broker_back.append(await asyncio.to_thread(node.start))
        await asyncio.wait_for(asyncio.gather(*workers), 300)
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await agents.close()  # drained while their manager still answers
        await client.close()
        await manager.stop()

    runs, keys = counts(agents.workdir, "runs")
    effects, receipts = counts(agents.workdir, "effects")
    rendered, figures = table(stream, runs, effects)
    failures = Counter(stream.failed.values())
    print(
        f"\nexecutions per task, {len(stream.issued)} tasks, faults {[f for _, f in FAULTS]} "
        f"(agents killed: {agents.killed}; broker back in {[round(s, 1) for s in broker_back]} "
        f"s), {time.monotonic() - started:.0f} s:\n{rendered}\nfailures: {dict(failures)}",
        file=sys.stderr,
    )

    assert len(stream.issued) == TASKS and stream.finished == TASKS  # every call ended
    assert [code for _, code in agents.killed] == [-signal.SIGKILL] * 2
    assert len(broker_back) == 2 and manager.counters["reconnects"] >= 2
    # (1) The target: a guarded effect never happened twice, though guarded handlers did run
    # again (without the redeliveries this test would show nothing).
    guarded = [figures["submit/once"], figures["run_task/once"]]
    assert sum(row["effects>1"] for row in guarded) == 0, rendered
    assert sum(row["runs>1"] for row in guarded) > 0, rendered
    # Each task ran under one idempotency key, however often and wherever it ran.
    assert all(len(k) == 1 for k in keys.values()), {i: k for i, k in keys.items() if len(k) > 1}
    # (2) An ok answer is backed by an effect of its own task.
    unbacked = {i: r for i, r in stream.receipts.items() if r not in receipts.get(i, set())}
    assert unbacked == {}, unbacked
    # (3) Most calls succeeded: the faults cost some calls their answers, not the mesh its work.
    assert len(stream.receipts) >= 0.9 * TASKS, (rendered, failures)
