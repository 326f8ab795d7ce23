"""A manager killed -9 and restarted at once under overload: the admission line outlives it
(issue 47, fault test 4).

One ``mesh manager`` process (SQLite ledger, ``--admission-capacity descriptor``: the echo
pool's descriptor alone bounds it, at :data:`SLOTS`), one SDK echo agent and one producer.
The producer calls ``submit`` at a steady rate above what the pool serves (one tenant, one
class, the same time limit each), so a line forms; the manager is killed with ``kill -9``
while it is long and started again at once, on the same ledger, while the calls go on.

Shown, and printed: no call that arrived earlier gave up while one that arrived later (same
tenant and class: all of them) was admitted first; every call admitted ran to its result;
places were taken again at the restart. With the line in memory alone the restarted manager
gave the freed slots to newcomers while the requests deferred before the kill waited for
their retry time, and some of those then missed their deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
from integration.harness import eventually
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.agent import AgentRuntime, AgentSettings
from mesh.errors import AdmissionRefused, SubmitDeadlineExceeded
from mesh.manager.journal import SqliteJournal
from mesh.producer import MeshClient
from mesh.samples import SAMPLES

SLOTS = 2
SERVICE_MS = 300  # each task's run: the pool serves SLOTS / 0.3 s ≈ 6.7 calls/s
ARRIVAL_EVERY_S = 0.1  # 10 calls/s: 1.5 times what it serves
TIME_LIMIT_S = 6.0  # each call's (the same for all, so the earlier one is due first)
KILL_AFTER_S = 5.0  # of load: a line of a dozen or more by then
LOAD_S = 14.0


@dataclass
class Call:
    """One ``submit``: when it was made, and when it was admitted or gave up (wall time)."""

    n: int
    arrived: float
    admitted_at: float | None = None
    gave_up_at: float | None = None
    why: str = ""
    positions: list[int] = field(default_factory=list)  # its places in line, as told


class Manager:
    """``mesh manager`` in a process of its own, killed and started again on one ledger."""

    def __init__(self, amqp_url: str, namespace: str, tmp: Path) -> None:
        self.amqp_url, self.namespace, self.tmp = amqp_url, namespace, tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[IO[bytes]] = []

    @property
    def journal(self) -> Path:
        return self.tmp / "journal.sqlite3"

    def start(self) -> None:
        self.logs.append((self.tmp / f"manager-{len(self.logs)}.log").open("wb"))
        flags = {
            "--manager-id": "m0",
            "--journal": str(self.journal),
            "--ledger": f"sqlite:{self.tmp / 'ledger.sqlite3'}",
            "--admission-capacity": "descriptor",
            "--http-port": "-1",
            "--operator-user": "guest",  # the test's producer publishes the descriptor
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mesh", "manager", *(x for f in flags.items() for x in f)],
            env={**os.environ, "MESH_AMQP_URL": self.amqp_url, "MESH_NAMESPACE": self.namespace},
            stdout=subprocess.DEVNULL,
            stderr=self.logs[-1],
        )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for log in self.logs:
            log.close()

    def places_recovered(self) -> int:
        """What the restarted manager logged it took again (its ``descriptors loaded``)."""
        text = (self.tmp / f"manager-{len(self.logs) - 1}.log").read_text(errors="replace")
        for line in text.splitlines():
            if "descriptors loaded from the ledger" in line:
                return int(json.loads(line)["places_in_line"])
        return -1

    def admissions(self) -> int:
        journal = SqliteJournal(self.journal)
        try:
            return sum(
                1 for e in journal.query(kinds=["admission"], limit=None) if e.reason == "admitted"
            )
        finally:
            journal.close()


@pytest.fixture
def manager(amqp_url: str, namespace: str, tmp_path: Path) -> Iterator[Manager]:
    started = Manager(amqp_url, namespace, tmp_path)
    started.start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def mesh(
    manager: Manager, amqp_url: str, namespace: str
) -> AsyncIterator[tuple[MeshClient, AgentRuntime]]:
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="line-producer")
    agent = AgentRuntime(
        SAMPLES["echo"]("echo-1", heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )
    try:
        # `mesh manager` runs policy generation 1 (the sample descriptor says 7).
        descriptor = echo_descriptor(SLOTS).model_copy(update={"policy_generation": 1})

        async def described() -> bool:
            try:
                reply = await producer.publish_descriptor(descriptor)
            except Exception:  # the manager still starting: no answer yet
                return False
            return reply.type == "mesh.descriptor-accepted.v1"

        await eventually(described, timeout_s=30, what="the echo pool described")
        await agent.start()
        await eventually(
            lambda: agent.counters["pool_subscriptions"] >= 1, what="echo-1 consumes the pool"
        )
        yield producer, agent
    finally:
        await agent.stop()
        await producer.close()


async def one_call(client: MeshClient, call: Call) -> None:
    def on_deferred(decision: object) -> bool:
        position = getattr(decision, "position", None)
        if position is not None:
            call.positions.append(position)
        return True

    try:
        done = await client.submit(
            echo_requirements(),
            {"message": f"m-{call.n}", "sleep_ms": SERVICE_MS},
            timeout_s=TIME_LIMIT_S,
            on_deferred=on_deferred,
        )
        call.admitted_at = call.arrived + done.admission_wait_s
    except (AdmissionRefused, SubmitDeadlineExceeded) as exc:
        call.gave_up_at = time.time()
        call.why = f"{type(exc).__name__}: {exc}"[:200]


def overtaken(calls: list[Call]) -> list[tuple[int, int]]:
    """``(earlier, later)``: a call that gave up, and one that arrived after it and was
    admitted before it gave up (same tenant and class: all of them here)."""
    admitted = [c for c in calls if c.admitted_at is not None]
    return [
        (a.n, b.n)
        for a in calls
        if a.gave_up_at is not None
        for b in admitted
        if b.arrived > a.arrived and b.admitted_at is not None and b.admitted_at < a.gave_up_at
    ]


@pytest.mark.timeout(180)
async def test_no_earlier_request_gives_up_while_a_later_one_is_admitted_across_a_restart(
    manager: Manager, mesh: tuple[MeshClient, AgentRuntime]
) -> None:
    producer, _ = mesh
    calls: list[Call] = []
    running: list[asyncio.Task[None]] = []
    started = time.monotonic()
    killed = False
    restarted_at = 0.0
    while time.monotonic() - started < LOAD_S:
        if not killed and time.monotonic() - started >= KILL_AFTER_S:
            waiting = sum(1 for c in calls if c.admitted_at is None and c.gave_up_at is None)
            await asyncio.to_thread(manager.kill9)
            manager.start()  # at once, on the same ledger
            restarted_at, killed = time.time(), True
            print(f"\nmanager killed -9 with {waiting} calls waiting; started again")
        call = Call(len(calls), time.time())
        calls.append(call)
        running.append(asyncio.create_task(one_call(producer, call)))
        await asyncio.sleep(ARRIVAL_EVERY_S)
    await asyncio.wait_for(asyncio.gather(*running), TIME_LIMIT_S + 30)

    admitted = [c for c in calls if c.admitted_at is not None]
    gave_up = [c for c in calls if c.gave_up_at is not None]
    placed_before = [
        c for c in admitted if c.positions and c.arrived < restarted_at < c.admitted_at
    ]
    recovered = manager.places_recovered()
    after = [c.admitted_at for c in admitted if c.admitted_at and c.admitted_at > restarted_at]
    flowing_s = min(after) - restarted_at if after else float("inf")
    passed_by = overtaken(calls)
    print(
        f"line across a restart: sent {len(calls)}, admitted {len(admitted)}, gave up "
        f"{len(gave_up)}, lost {len(calls) - len(admitted) - len(gave_up)}; places taken again "
        f"at the restart {recovered}; admitted after the restart having waited in line before "
        f"it {len(placed_before)}; earlier calls that gave up while a later one was admitted "
        f"{len({a for a, _ in passed_by})} ({len(passed_by)} pairs); admitting again "
        f"{flowing_s:.2f} s after the restart"
    )
    assert len(admitted) + len(gave_up) == len(calls)  # every call answered
    assert gave_up, "no call gave up: the load was not over what the pool serves"
    assert recovered > 0, "the restarted manager took no place again"
    assert placed_before, "no call deferred before the kill was admitted after it"
    assert passed_by == [], [
        (calls[a].why, round(calls[b].admitted_at or 0, 2) - round(calls[a].gave_up_at or 0, 2))
        for a, b in passed_by[:5]
    ]
