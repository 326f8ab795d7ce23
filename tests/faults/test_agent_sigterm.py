"""SIGTERM on an agent under load: readiness off, consumers cancelled, in-flight work finished
and acked, a clean exit within the grace period, no redelivery.

The setting is that of :mod:`tests.faults.test_agent_faults` (whose fixtures and producer this
module reuses): a manager in-process (an SQLite ledger, the ``echo`` pool's descriptor
published), two real ``mesh agent echo`` processes started by the local scaler, and producers
keeping a steady stream of admitted tasks going with ``MeshClient.submit`` (each sleeps
300-600 ms, so each agent holds several at once). Here each agent also serves its HTTP
endpoints on a port of its own, and runs with ``--drain-timeout 5``.

When the victim's heartbeat reports tasks in flight, the scaler scales the pool down to one
with ``remove_first`` = the victim: its process gets ``SIGTERM`` (the CLI's signal handler
starts the drain), and ``SIGKILL`` follows if it is still alive after the pod grace period,
``GRACE_S``. Meanwhile ``/ready`` is polled every 20 ms and the process's exit watched every
20 ms. The test then shows, each with its own assertion:

1. ``/ready`` goes 200 -> 503 -> gone (connection refused), the first non-200 answer within
   ``READY_BOUND_S`` of the SIGTERM;
2. the consumers were cancelled: no task *started* on the victim (``TaskResult.started_at``,
   the agent's wall clock) later than ``CANCEL_MARGIN_S`` after the SIGTERM, although the
   surviving agent kept starting tasks until the victim was gone (work was there to take);
3. every task the victim held at the SIGTERM (its results with ``started_at`` before and
   ``finished_at`` after it) was finished by the victim itself, before it exited, and acked:
   one result each, no ``task redelivered`` line for its ID in any agent's log, and none in
   the run but for the pool tasks the victim had prefetched and handed back unstarted (the
   drain's one deliberate redelivery: they run once, on the survivor), no late duplicate
   reply, no ack failure, no task given up, no result requeued; and
   the broker, polled every 20 ms with a passive declare, counted the pool queue's consumers
   going from 2 to 1 within ``SETTLED_BOUND_S`` of the SIGTERM and before the process exited
   (a cancelled quorum-queue consumer is counted until the deliveries it holds are settled);
4. the process exits with code 0 (``mesh agent`` returns 0 after a drain; a SIGKILL at the
   end of the grace period would be -9) within ``EXIT_BOUND_S`` of the SIGTERM: the
   runtime's drain phase, which waits for ``DrainComplete`` and for its in-flight tasks, is
   bounded by ``drain_timeout_s`` (5 s here); only past it would ``shutdown_grace_s`` (30 s)
   apply, and the log shows neither deadline was hit. The manager's journal shows the victim
   Draining, then Terminated;
5. overall, every task submitted completed exactly once (``Tally.check()``: lost = 0,
   unexpected = 0, one result per task, no failure).
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest
from integration.harness import eventually, http_agent_scaler
from integration.test_rolling_deploy import is_ready, ready_status

from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.local import LocalProcessScaler
from mesh.topology import names

from . import test_agent_faults as faults
from .accounting import Tally
from .test_agent_faults import (
    HEARTBEAT_S,
    LIVE,
    WORKERS,
    Load,
    produce,
    redelivered_ids,
    reported_in_flight,
    two_live_agents,
)

# The fault test's fixtures: the manager in-process, and the producer's client.
manager = faults.manager
client = faults.client

DRAIN_TIMEOUT_S = 5.0  # mesh agent --drain-timeout: DrainComplete and in-flight work, at most
SHUTDOWN_GRACE_S = 30.0  # AgentSettings.shutdown_grace_s (the CLI keeps the default)
GRACE_S = 12.0  # the pod's grace period: the scaler's SIGKILL follows SIGTERM after it
POLL_S = 0.02
HANDED_BACK = re.compile(r"handed back, not started.*?task_id=([0-9a-f]{32})")
READY_BOUND_S = 1.0  # SIGTERM -> first non-200 from /ready (a signal handler and a flag)
CANCEL_MARGIN_S = 0.3  # deliveries already on the wire when the consumer was cancelled
MAX_SLEEP_S = 0.6  # the longest task the producers send
SETTLED_BOUND_S = MAX_SLEEP_S + 0.5  # SIGTERM -> the victim's pool consumer gone (see (3))
EXIT_BOUND_S = DRAIN_TIMEOUT_S + 1.0  # the drain phase's bound, and a margin for the exit


@pytest.fixture
async def scaler_and_ports(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[tuple[LocalProcessScaler, dict[str, int]]]:
    """The scaler, and the HTTP port of each agent it starts."""
    local, ports = http_agent_scaler(
        namespace,
        amqp_url,
        tmp_path / "agents",
        heartbeat_s=HEARTBEAT_S,
        drain_timeout_s=DRAIN_TIMEOUT_S,
        termination_grace_s=GRACE_S,
    )
    yield local, ports
    await local.close()


async def watch_ready(port: int, seen: list[tuple[float, int | None]]) -> None:
    """Poll ``/ready`` every ``POLL_S``; record each change of status with the wall-clock time
    its answer came, until nothing listens any more (``None``)."""
    deadline = time.monotonic() + GRACE_S + 10
    while time.monotonic() < deadline:
        status = await ready_status(port)
        if not seen or seen[-1][1] != status:
            seen.append((time.time(), status))
        if status is None:
            return
        await asyncio.sleep(POLL_S)


async def watch_consumers(amqp_url: str, queue: str, seen: list[tuple[float, int]]) -> None:
    """Poll the consumer count of ``queue`` (a passive declare) every ``POLL_S``; record each
    change with the wall-clock time of its answer. Runs until cancelled."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        while True:
            declared = await channel.declare_queue(queue, passive=True)
            count = int(declared.declaration_result.consumer_count or 0)
            if not seen or seen[-1][1] != count:
                seen.append((time.time(), count))
            await asyncio.sleep(POLL_S)
    finally:
        await connection.close()


async def watch_exit(scaler: LocalProcessScaler, agent_id: str) -> float:
    """The wall-clock time at which the agent's process was seen to have exited."""
    while True:
        if scaler.exit_code(agent_id) is not None:
            return time.time()
        await asyncio.sleep(POLL_S)


async def test_sigterm_under_load_drains_finishes_in_flight_and_exits_without_redelivery(
    amqp_url: str,
    namespace: str,
    manager: ManagerService,
    client: MeshClient,
    scaler_and_ports: tuple[LocalProcessScaler, dict[str, int]],
    tmp_path: Path,
) -> None:
    scaler, ports = scaler_and_ports
    started = time.monotonic()
    victim, survivor = await two_live_agents(manager, client, scaler)
    await eventually(lambda: is_ready(ports[victim]), what=f"{victim}'s /ready")

    load, stop = Load(), asyncio.Event()
    workers = [asyncio.create_task(produce(client, load, stop, w)) for w in range(WORKERS)]
    seen: list[tuple[float, int | None]] = []
    consumers: list[tuple[float, int]] = []
    pool_queue = names.pool_task_queue(namespace, "echo")
    try:
        await eventually(
            lambda: {r.agent_id for rs in load.results.values() for r in rs} >= {victim, survivor},
            timeout_s=30,
            what="both agents serving",
        )
        watcher = asyncio.create_task(watch_ready(ports[victim], seen))
        counter = asyncio.create_task(watch_consumers(amqp_url, pool_queue, consumers))
        await eventually(lambda: [s for _, s in seen] == [200], what=f"{victim}'s /ready watched")
        await eventually(lambda: [n for _, n in consumers] == [2], what="2 pool consumers seen")
        # SIGTERM while its own heartbeat says it holds several tasks.
        await eventually(
            lambda: reported_in_flight(manager, victim) >= 2,
            timeout_s=15,
            what=f"{victim} to hold tasks",
        )
        heartbeat_held = reported_in_flight(manager, victim)
        pid = scaler.pid(victim)
        assert pid is not None
        sigterm_at = time.time()
        await scaler.scale_to("echo", 1, remove_first=victim)  # SIGTERM, SIGKILL after GRACE_S
        assert scaler.terminating("echo") == [victim] and scaler.pods("echo") == [survivor]
        exited_at = await asyncio.wait_for(watch_exit(scaler, victim), GRACE_S + 5)
        await asyncio.wait_for(watcher, 10)
        counter.cancel()
        await asyncio.gather(counter, return_exceptions=True)
        # Keep the stream going on the survivor for a while, then stop.
        after_exit = len(load.submitted)
        await eventually(
            lambda: len(load.submitted) >= after_exit + 2 * WORKERS,
            timeout_s=20,
            what="traffic after the exit",
        )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 40)

    log_dir = tmp_path / "agents"
    victim_log = (log_dir / f"{victim}.log").read_text()
    results = [r for rs in load.results.values() for r in rs]
    exit_s = exited_at - sigterm_at
    from_victim = [r for r in results if r.agent_id == victim]
    from_survivor = [r for r in results if r.agent_id == survivor]
    assert from_victim and from_survivor, Counter(r.agent_id for r in results)

    # (1) Readiness off at once: 200 until the SIGTERM, then 503, then the server is gone.
    assert [s for _, s in seen] == [200, 503, None], seen
    ready_off_s = seen[1][0] - sigterm_at
    assert 0 <= ready_off_s <= READY_BOUND_S, ready_off_s

    # (2) Consumers cancelled: nothing started on the victim after the SIGTERM (and a margin
    # for deliveries already on their way), while the survivor went on starting the tasks
    # submitted meanwhile (there was work to take: without the cancel, the victim's consumer
    # would have had its share of it).
    late_starts = [r.started_at - sigterm_at for r in from_victim]
    assert max(late_starts) <= CANCEL_MARGIN_S, sorted(late_starts)[-5:]
    until = max(exited_at, sigterm_at + CANCEL_MARGIN_S + 1.0)
    window = [r for r in from_survivor if sigterm_at + CANCEL_MARGIN_S < r.started_at < until]
    assert window, "no task started anywhere after the cancel: nothing was left to take"

    # (3) The tasks it held at the SIGTERM: finished there, answered once, acked, not redelivered.
    held = [r for r in from_victim if r.started_at <= sigterm_at < r.finished_at]
    assert held, f"{victim} held nothing at the SIGTERM (heartbeat said {heartbeat_held})"
    by_task_id = {r.task_id: m for m, rs in load.results.items() for r in rs}
    # The one redelivery the drain makes on purpose: a pool task the victim had prefetched
    # but not started goes back to the queue (logged "handed back, not started") and reaches
    # the survivor marked redelivered. Nothing else is redelivered, anywhere.
    handed_back = set(HANDED_BACK.findall(victim_log))
    redelivered = {a: redelivered_ids(log_dir, a) for a in (victim, survivor)}
    assert not redelivered[victim], redelivered
    assert redelivered[survivor] <= handed_back, (redelivered, handed_back)
    assert not handed_back & {r.task_id for r in from_victim}  # never started there
    for agent_id in (victim, survivor):  # nor any other redelivery line, whatever its format
        lines = (log_dir / f"{agent_id}.log").read_text().splitlines()
        other = [
            line
            for line in lines
            if "redelivered" in line and not any(t in line for t in handed_back)
        ]
        assert not other, (agent_id, other[:3])
    for r in held:
        assert r.status == "ok" and len(load.results[by_task_id[r.task_id]]) == 1, r
        assert r.finished_at < exited_at, (r.finished_at - sigterm_at, exited_at - sigterm_at)
    assert client.counters["late_replies"] == 0  # no task answered twice
    # The broker's view: a cancelled consumer of a quorum queue still counts until every
    # delivery it holds is settled (or its channel closes). The pool queue went from 2
    # consumers to 1 once, soon after the SIGTERM and while the victim's process was alive.
    assert [n for _, n in consumers] == [2, 1], consumers
    settled_s = consumers[1][0] - sigterm_at
    assert 0 <= settled_s <= SETTLED_BOUND_S and consumers[1][0] < exited_at, (settled_s, exit_s)
    for line in ("ack failed", "giving up a task", "requeueing the task", "result publish"):
        assert line not in victim_log, line

    # (4) A clean exit, well within the grace period, after the manager let it go.
    assert scaler.exit_code(victim) == 0, scaler.exit_code(victim)  # -9: killed at GRACE_S
    assert exit_s <= EXIT_BOUND_S, exit_s
    assert "manager released every lease" in victim_log  # DrainComplete came
    assert "stopping anyway" not in victim_log  # no drain_timeout_s hit
    assert "did not finish in time" not in victim_log  # no shutdown_grace_s hit
    assert "agent stopped" in victim_log
    journal = SqliteJournal(tmp_path / "journal.sqlite3")
    try:
        moves = [(e.from_state, e.to_state) for e in journal.tail(500, agent_id=victim)]
    finally:
        journal.close()
    entered = [to for _, to in moves]
    assert ("Draining", "Terminated") in moves and entered.count("Terminated") == 1, moves
    assert survivor in manager.core.agents and manager.core.agents[survivor].state in LIVE

    # (5) Every task submitted completed exactly once, none failed.
    tally = Tally()
    tally.attempted = tally.confirmed = len(load.submitted)  # one submit per business ID
    tally.confirmed_ids = set(load.submitted)
    for message, rs in load.results.items():
        for _ in rs:  # no redelivery anywhere: one delivery per result
            tally.delivered(message)
            tally.applied(message)
    assert load.failed == [], load.failed
    assert len(load.submitted) == len(set(load.submitted))
    tally.check()  # lost = 0, unexpected = 0, at most one result per task
    assert all(r.status == "ok" for r in results)

    served = Counter(r.agent_id for r in results)
    print(
        f"\nagent SIGTERM: {len(load.submitted)} tasks, served {dict(served)}; {victim} held "
        f"{len(held)} at the SIGTERM (heartbeat said {heartbeat_held}), all finished by it; "
        f"/ready 503 after {ready_off_s * 1000:.0f} ms, pool consumer gone after "
        f"{settled_s * 1000:.0f} ms, last start on it "
        f"{max(late_starts) * 1000:+.0f} ms, {len(window)} started on {survivor} while it "
        f"drained; exit 0 after {exit_s:.2f} s (bound {EXIT_BOUND_S:.1f} s, grace {GRACE_S:.0f}"
        f" s); redeliveries 0; {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
