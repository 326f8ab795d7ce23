"""An agent frozen (``SIGSTOP``) longer than its heartbeat window: declared lost, its work moves
on, and when it wakes its late results are fenced out.

Two real ``mesh agent echo`` processes take admitted tasks from the pool's queue while
producers keep a stream of ``submit`` calls going (each task sleeps 300-600 ms). The victim is
frozen past the manager's rule (3 missed 5 s heartbeats), then gets ``SIGCONT``. Its AMQP
heartbeat is the default (60 s), so the broker alone would keep its connection — and the tasks
it holds — through the freeze; the manager, which has the management API, closes the lost
agent's connections, and the broker redelivers at once. The test shows:

1. every task completes exactly once for the producer: no failure, no second result, and no
   *late* reply — the woken agent asked the manager whether it had been declared lost (its
   log: ``registered=False``) and withheld the results of the handlers it held (``result
   withheld``), or had them cancelled with its closed connection meanwhile; without the
   fence those results went out after the reconnect and the producer counted them as late
   replies;
2. the manager declared the victim lost once (journal: ``-> Terminated``, ``no heartbeat``);
3. the tasks the victim held were redelivered and served by the survivor, once each, while
   the victim was still frozen (after the manager had declared it lost);
4. the woken victim noticed its own silence (one ``silent long enough`` line), registered
   again, and served tasks after it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from integration.harness import eventually, management_url, start_manager
from integration.test_admission import settings_for

from mesh.core.lifecycle import AgentState
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.local import LocalProcessScaler

from .test_agent_faults import (
    HEARTBEAT_S,
    MISSES,
    WORKERS,
    Load,
    agent_moves,
    client,
    exactly_once,
    produce,
    redelivered_ids,
    scaler,
    serving_and_holding,
    two_live_agents,
)

__all__ = ["client", "scaler"]  # fixtures, used by name

FREEZE_S = MISSES * HEARTBEAT_S + 3.0  # past the manager's rule (and its tick)


@pytest.fixture
async def manager(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> AsyncIterator[ManagerService]:
    url = management_url(management_api, amqp_url)
    service = await start_manager(settings_for(amqp_url, namespace, tmp_path, management_url=url))
    yield service
    await service.stop()


def log_lines(log_dir: Path, agent_id: str, needle: str) -> list[str]:
    path = log_dir / f"{agent_id}.log"
    text = path.read_text() if path.exists() else ""
    return [line for line in text.splitlines() if needle in line]


async def test_a_frozen_agent_is_declared_lost_and_its_late_results_are_fenced_out(
    manager: ManagerService, client: MeshClient, scaler: LocalProcessScaler, tmp_path: Path
) -> None:
    victim, survivor = await two_live_agents(manager, client, scaler)
    log_dir = tmp_path / "agents"
    load, stop = Load(), asyncio.Event()
    workers = [asyncio.create_task(produce(client, load, stop, w)) for w in range(WORKERS)]
    pid = scaler.pid(victim)
    assert pid is not None
    try:
        await serving_and_holding(manager, load, victim, survivor)
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            await eventually(
                lambda: victim not in manager.core.agents,
                timeout_s=FREEZE_S + 5,
                what=f"the manager to declare {victim} lost",
            )
            lost_at = time.time()
            await asyncio.sleep(max(0.0, frozen_at + FREEZE_S - time.time()))
        finally:
            os.kill(pid, signal.SIGCONT)
        woke_at = time.time()
        await eventually(
            lambda: (
                (a := manager.core.agents.get(victim)) is not None
                and a.state in (AgentState.READY, AgentState.BUSY)
            ),
            timeout_s=30,
            what=f"{victim} registered again",
        )
        await eventually(
            lambda: any(
                r.agent_id == victim and r.started_at > woke_at
                for rs in load.results.values()
                for r in rs
            ),
            timeout_s=30,
            what=f"{victim} serving again",
        )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 40)

    # (1) Exactly once for the producer; nothing late.
    exactly_once(load)
    assert client.counters["late_replies"] == 0, "a fenced result reached the producer"
    # It asked, and was told it was not registered — or (the answer overtaken by its
    # re-registration) registered only since a moment ago: younger than its claims.
    told = log_lines(log_dir, victim, "asked the manager after a silence")
    assert told, f"{victim} did not ask the manager after its silence"
    assert not log_lines(log_dir, victim, "still registered"), "it took itself for not lost"
    withheld = log_lines(log_dir, victim, "result withheld")
    print(
        f"froze {victim} for {FREEZE_S:g} s holding tasks; on waking it asked, was told it had "
        f"been declared lost, and withheld {len(withheld)} result(s) (the rest of its handlers "
        f"were cancelled with the closed connection); {len(load.submitted)} tasks, each "
        "answered once"
    )

    # (2) Declared lost once.
    moves = agent_moves(tmp_path, victim)
    lost = [e for e in moves if e.to_state == AgentState.TERMINATED.value]
    assert len(lost) == 1 and "no heartbeat" in lost[0].reason, [
        (e.from_state, e.to_state, e.reason) for e in moves
    ]

    # (3) Its tasks moved on to the survivor and were served once there.
    moved = redelivered_ids(log_dir, survivor)
    assert moved, "nothing the victim held was redelivered"
    by_task_id = {r.task_id: (m, r) for m, rs in load.results.items() for r in rs}
    for task_id in moved:
        message, result = by_task_id[task_id]
        assert result.agent_id == survivor and len(load.results[message]) == 1
        assert lost_at - 1.0 < result.started_at < woke_at, "redelivered on the loss, frozen"
    assert manager.counters["agent_connections_closed"] >= 1

    # (4) It knew it had been silent, once, and no result of its came from before it woke
    # for a task started before the freeze.
    assert len(log_lines(log_dir, victim, "silent long enough")) == 1
    assert not [
        r
        for rs in load.results.values()
        for r in rs
        if r.agent_id == victim and r.started_at < frozen_at and r.finished_at > frozen_at
    ]
