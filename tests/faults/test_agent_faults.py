"""An agent killed with tasks in flight: nothing is lost, nothing completes twice.

A manager runs in-process (the harness's short heartbeat rule, an SQLite ledger, the ``echo``
pool's descriptor published), and two real ``mesh agent echo`` processes, started by the local
scaler, take admitted tasks from the pool's shared quorum queue. Producers keep a steady
stream of tasks going with ``MeshClient.submit`` (each sleeps 300-600 ms, so each agent holds
several at once). When the victim reports tasks in flight in its heartbeat, its process gets
``SIGKILL``: no drain, no ack. The test then shows:

1. every task submitted completes exactly once for the producer (one result per task, no
   failure, no late duplicate reply); the tasks the victim held are redelivered by the broker
   and served by another agent: the surviving agents' logs say ``task redelivered`` for task IDs
   whose single result came from them, and no result came from the victim for those;
2. the manager declares the victim lost (journal: ``-> Terminated``, reason ``no heartbeat``)
   within the bound its heartbeat rule gives: lost after 3 missed 5 s heartbeats (5 s is the
   least an agent accepts), the last one sent at most 5 s before the kill, so between 10 s and
   15 s + one 0.2 s tick after it (asserted: 9.5 s to 19.2 s, for two shared cores);
3. the producer got no result from the victim that was produced after the kill.

The lease path (``run_task``) is not used: a leased task goes to the agent's own queue, which
no other agent consumes, so it cannot be redelivered elsewhere; the pool queue is the path on
which a dead agent's work moves on.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from integration.harness import FAST_POOL, eventually, start_manager
from integration.test_admission import settings_for
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.core.lifecycle import AgentState
from mesh.errors import MeshError
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.local import LocalProcessScaler, sample_command
from mesh.wire import TaskResult

from .accounting import Tally

WORKERS = 8
SLOTS = 8  # the pool's model slots: the ledger admits at most this many at once
HEARTBEAT_S = 5.0  # the agents' interval: the agent refuses less (MIN_HEARTBEAT_INTERVAL_S)
MISSES = FAST_POOL.missed_heartbeats_before_lost
TICK_S = 0.2  # the harness manager's tick
LIVE = (AgentState.READY, AgentState.BUSY)
# Lost once silent for MISSES x HEARTBEAT_S; the last beat came at most HEARTBEAT_S before the
# kill, so detection takes between (MISSES - 1) x HEARTBEAT_S and MISSES x HEARTBEAT_S + tick
# after it. The upper bound gets a generous margin: two shared cores.
DETECT_MIN_S = (MISSES - 1) * HEARTBEAT_S - 0.5
DETECT_MAX_S = MISSES * HEARTBEAT_S + TICK_S + 4.0
REDELIVERED = re.compile(r"task redelivered.*?task_id=([0-9a-f]{32})")


@dataclass
class Load:
    submitted: list[str] = field(default_factory=list)
    results: dict[str, list[TaskResult]] = field(default_factory=dict)  # message -> results
    failed: list[tuple[str, str]] = field(default_factory=list)


async def produce(client: MeshClient, load: Load, stop: asyncio.Event, worker: int) -> None:
    rng = random.Random(worker)
    for n in itertools.count():
        if stop.is_set():
            return
        message = f"w{worker}-{n}"
        load.submitted.append(message)
        try:
            done = await client.submit(
                echo_requirements(),
                {"message": message, "sleep_ms": rng.randint(300, 600)},
                timeout_s=25,
            )
        except MeshError as exc:
            load.failed.append((message, f"{type(exc).__name__}: {exc}"))
            continue
        load.results.setdefault(message, []).append(done.result)
        assert done.output["message"] == message


@pytest.fixture
async def manager(amqp_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[ManagerService]:
    service = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    yield service
    await service.stop()


@pytest.fixture
async def client(
    amqp_url: str, namespace: str, manager: ManagerService
) -> AsyncIterator[MeshClient]:
    mesh_client = await MeshClient.connect(amqp_url, namespace=namespace, name="fault-producer")
    yield mesh_client
    await mesh_client.close()


@pytest.fixture
async def scaler(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[LocalProcessScaler]:
    local = LocalProcessScaler(
        sample_command(namespace, amqp_url, HEARTBEAT_S),
        log_dir=tmp_path / "agents",
        env={"MESH_LOG_FORMAT": "text"},
        termination_grace_s=10,
    )
    yield local
    await local.close()


def reported_in_flight(manager: ManagerService, agent_id: str) -> int:
    agent = manager.core.agents.get(agent_id)
    return 0 if agent is None else agent.reported_in_flight.get("test.echo", 0)


def redelivered_ids(log_dir: Path, agent_id: str) -> set[str]:
    path = log_dir / f"{agent_id}.log"
    return set(REDELIVERED.findall(path.read_text())) if path.exists() else set()


async def two_live_agents(
    manager: ManagerService, client: MeshClient, scaler: LocalProcessScaler
) -> tuple[str, str]:
    """The echo pool described, two echo agents started and Ready: (victim, survivor)."""
    accepted = await client.publish_descriptor(echo_descriptor(SLOTS))
    assert accepted.type == "mesh.descriptor-accepted.v1", accepted
    await scaler.scale_to("echo", 2)
    victim, survivor = scaler.pods("echo")
    await eventually(
        lambda: all(
            (a := manager.core.agents.get(x)) is not None and a.state in LIVE
            for x in (victim, survivor)
        ),
        timeout_s=30,
        what="both agents Ready",
    )
    return victim, survivor


async def serving_and_holding(
    manager: ManagerService, load: Load, victim: str, survivor: str
) -> int:
    """Wait until both agents have served and the victim's heartbeat reports at least two
    tasks in flight; how many it reports."""
    await eventually(
        lambda: {r.agent_id for rs in load.results.values() for r in rs} >= {victim, survivor},
        timeout_s=30,
        what="both agents serving",
    )
    await eventually(
        lambda: reported_in_flight(manager, victim) >= 2,
        timeout_s=15,
        what=f"{victim} to hold tasks",
    )
    return reported_in_flight(manager, victim)


def exactly_once(load: Load, redelivered: dict[str, int] | None = None) -> None:
    """Every task submitted completed exactly once for the producer, none failed;
    ``redelivered``: more deliveries of a task (by message) that the agents logged."""
    tally = Tally()
    tally.attempted = tally.confirmed = len(load.submitted)  # one submit per business ID
    tally.confirmed_ids = set(load.submitted)
    for message, results in load.results.items():
        for _ in results:  # each result: one delivery to the agent that answered, one effect
            tally.delivered(message)
            tally.applied(message)
    for message, times in (redelivered or {}).items():
        for _ in range(times):
            tally.delivered(message)
    assert load.failed == [], load.failed
    assert len(load.submitted) == len(set(load.submitted))
    tally.check()  # lost = 0, unexpected = 0, at most one result per task


def agent_moves(tmp_path: Path, agent_id: str) -> list[Any]:
    """The journal's entries about ``agent_id`` (its lifecycle moves among them)."""
    journal = SqliteJournal(tmp_path / "journal.sqlite3")
    try:
        return journal.tail(500, agent_id=agent_id)
    finally:
        journal.close()


async def test_an_agent_killed_with_tasks_in_flight_loses_none_and_completes_each_once(
    manager: ManagerService, client: MeshClient, scaler: LocalProcessScaler, tmp_path: Path
) -> None:
    started = time.monotonic()
    victim, survivor = await two_live_agents(manager, client, scaler)

    load, stop = Load(), asyncio.Event()
    workers = [asyncio.create_task(produce(client, load, stop, w)) for w in range(WORKERS)]
    try:
        # Kill it while its own heartbeat says it holds several tasks.
        held = await serving_and_holding(manager, load, victim, survivor)
        pid = scaler.pid(victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        submitted_at_kill = len(load.submitted)
        await eventually(lambda: scaler.exit_code(victim) is not None, timeout_s=5, what="death")
        assert scaler.exit_code(victim) == -signal.SIGKILL
        await eventually(
            lambda: victim not in manager.core.agents,
            timeout_s=DETECT_MAX_S + 2,
            what=f"the manager to drop {victim}",
        )
        # Keep the stream going until well after the loss, then stop.
        await eventually(
            lambda: len(load.submitted) >= submitted_at_kill + 3 * WORKERS,
            timeout_s=20,
            what="traffic after the kill",
        )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 40)

    log_dir = tmp_path / "agents"
    others = [a for a in {r.agent_id for rs in load.results.values() for r in rs} if a != victim]
    moved = set().union(*(redelivered_ids(log_dir, a) for a in others))
    by_task_id = {r.task_id: (m, r) for m, rs in load.results.items() for r in rs}

    # (1) Every task completes exactly once, from the producer's point of view; each
    # redelivery an agent logged is one more delivery of that task.
    exactly_once(load, Counter(by_task_id[t][0] if t in by_task_id else t for t in moved))
    assert client.counters["late_replies"] == 0  # no task answered twice
    # The victim's tasks moved on: redelivered by the broker, served once, by another agent.
    assert moved, f"no task was redelivered after killing {victim} holding {held}"
    for task_id in moved:
        message, result = by_task_id[task_id]
        assert result.agent_id != victim and len(load.results[message]) == 1, (message, result)
        # Run again after the kill, and at once: the broker requeues a dead consumer's
        # unacked tasks when its connection drops, without waiting for the manager's verdict.
        assert 0 < result.started_at - killed_at < 5.0, (message, result.started_at - killed_at)

    # (2) The manager declared the victim lost, within the heartbeat rule's bound.
    moves = agent_moves(tmp_path, victim)
    ended = [e for e in moves if e.to_state == AgentState.TERMINATED.value]
    assert len(ended) == 1, [(e.from_state, e.to_state, e.reason) for e in moves]
    assert "no heartbeat" in ended[0].reason, ended[0]
    detection_s = ended[0].at - killed_at
    assert DETECT_MIN_S <= detection_s <= DETECT_MAX_S, detection_s
    assert survivor in manager.core.agents and manager.core.agents[survivor].state in LIVE

    # (3) Nothing from the dead agent after the kill.
    from_victim = [r for rs in load.results.values() for r in rs if r.agent_id == victim]
    assert from_victim, f"{victim} served nothing before the kill"
    assert all(r.finished_at < killed_at for r in from_victim), [
        r.finished_at - killed_at for r in from_victim if r.finished_at >= killed_at
    ]

    served = Counter(r.agent_id for rs in load.results.values() for r in rs)
    print(
        f"\nagent killed: {len(load.submitted)} tasks, {held} held by {victim} at the kill, "
        f"{len(moved)} redelivered and served by {sorted(others)}, served {dict(served)}, "
        f"lost after {detection_s:.2f} s (bound {DETECT_MIN_S:.1f}-{DETECT_MAX_S:.1f} s), "
        f"{time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
