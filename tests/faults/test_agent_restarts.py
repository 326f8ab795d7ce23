"""An agent killed -9 and restarted at once under its own ID, five times, under load on both
paths (issue 47): a container restarted under its pod name.

A manager in-process (with the management API, so it fences lost incarnations), two agent
processes of ``effects_agent.py`` (pool ``echo``), and producers that keep ``submit``
(admission, the pool's quorum queue) and ``run_task`` (leases, the agents' own quorum queues)
calls going. ``fx-1`` is killed and started again under its ID five times; each time the
manager still counts the killed incarnation, so the new process waits (``AGENT_ID_IN_USE``)
until the old one is declared lost, and must take nothing meanwhile. Tasks queued for the
killed incarnation under its leases are refused ``UNKNOWN_LEASE`` by its successor (never the
permanent ``NOT_AUTHORIZED``) and ``run_task`` leases again.

Shown, and printed: every call answered ok (0 lost, 0 refused), no task run twice by one
process, the seconds from each kill to the new incarnation's acceptance.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from integration.harness import eventually, management_url, start_manager
from integration.test_admission import settings_for
from integration.test_admission_competition import PgSchema
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.core.lifecycle import AgentState
from mesh.errors import MeshError
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient

from .test_effects_once import AgentProcesses, agent_processes

RESTARTS = 5
WORKERS = 2  # per path
TIMEOUT_S = 60.0  # per call: a restart keeps the agent's ID busy ~15 s (its old one's window)
LIVE = (AgentState.READY, AgentState.BUSY)


@pytest.fixture
async def restartable(
    amqp_url: str, namespace: str, tmp_path: Path, pg_schema: PgSchema
) -> AsyncIterator[AgentProcesses]:
    processes = agent_processes(amqp_url, namespace, tmp_path, pg_schema)
    yield processes
    await processes.close()


async def call_until(
    client: MeshClient, path: str, stop: asyncio.Event, ids: Any, results: dict[str, str]
) -> None:
    while not stop.is_set():
        business_id = f"{path}-{next(ids)}"
        payload = {"id": business_id, "guarded": False, "before_ms": 20, "after_ms": 20}
        try:
            if path == "submit":
                done: Any = await client.submit(echo_requirements(), payload, timeout_s=TIMEOUT_S)
            else:
                done = await client.run_task("test.echo", payload, timeout_s=TIMEOUT_S)
            assert done.output["id"] == business_id
            results[business_id] = "ok"
        except MeshError as exc:
            results[business_id] = f"{type(exc).__name__} {getattr(exc, 'code', '')}: {exc}"


def runs_by_process(out: Path) -> Counter[tuple[str, str]]:
    """(process, business ID) -> handler runs, from the agents' run logs (one per process)."""
    runs: Counter[tuple[str, str]] = Counter()
    for log in out.glob("runs-*.log"):
        for line in log.read_text().splitlines():
            runs[(log.stem, line.split()[0])] += 1
    return runs


def accepted(manager: ManagerService, agent_id: str, not_incarnation: str) -> bool:
    agent = manager.core.agents.get(agent_id)
    return agent is not None and agent.incarnation != not_incarnation and agent.state in LIVE


@pytest.mark.timeout(600)
async def test_an_agent_killed_and_restarted_under_its_id_five_times_loses_and_refuses_nothing(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    management_api: Any,
    restartable: AgentProcesses,
) -> None:
    manager = await start_manager(
        settings_for(
            amqp_url,
            namespace,
            tmp_path,
            management_url=management_url(management_api, amqp_url),
        )
    )
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="restarts-producer")
    results: dict[str, str] = {}
    stop, ids = asyncio.Event(), itertools.count()
    workers: list[asyncio.Task[None]] = []
    waits: list[float] = []
    try:
        published = await client.publish_descriptor(echo_descriptor(16))
        assert published.type.endswith("accepted.v1"), published
        for agent_id in ("fx-1", "fx-2"):
            await restartable.start(agent_id)
        await eventually(
            lambda: all(accepted(manager, a, "") for a in ("fx-1", "fx-2")),
            timeout_s=30,
            what="both agents Ready",
        )
        workers = [
            asyncio.create_task(call_until(client, path, stop, ids, results))
            for path in ("submit", "run_task")
            for _ in range(WORKERS)
        ]
        for _ in range(RESTARTS):
            await eventually(lambda: len(results) >= 20, what="load before the kill")
            await eventually(
                lambda: manager.core.agents["fx-1"].in_flight > 0,
                timeout_s=30,
                poll_s=0.02,
                what="fx-1 holding work when it is killed",
            )
            old = manager.core.agents["fx-1"].incarnation
            killed = time.monotonic()
            await restartable.kill_and_restart("fx-1")
            await eventually(
                lambda o=old: accepted(manager, "fx-1", o),  # type: ignore[misc]
                timeout_s=45,
                what="the restarted fx-1 accepted",
            )
            waits.append(time.monotonic() - killed)
            results_before = len(results)
            await eventually(
                lambda n=results_before: len(results) >= n + 10,  # type: ignore[misc]
                timeout_s=30,
                what="load after the restart",
            )
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 120)
        await client.close()
        await manager.stop()

    failed = {k: v for k, v in results.items() if v != "ok"}
    runs = runs_by_process(restartable.workdir)
    twice_in_one = sorted(key for key, n in runs.items() if n > 1)
    by_task = Counter(task for _, task in runs.elements())
    twice = sum(1 for n in by_task.values() if n > 1)
    refused = [v for v in failed.values() if "NOT_AUTHORIZED" in v]
    print(
        f"\nrestarts: sent {len(results)}, completed {len(results) - len(failed)}, "
        f"failed {len(failed)} (NOT_AUTHORIZED {len(refused)}), executed twice {twice} "
        f"(by one process {len(twice_in_one)}), restarted fx-1 accepted after "
        f"{[round(w, 1) for w in waits]} s, lease retries "
        f"{client.counters['run_task_lease_retries']}"
    )
    assert failed == {}, list(failed.items())[:5]
    assert twice_in_one == []
    assert len(waits) == RESTARTS
