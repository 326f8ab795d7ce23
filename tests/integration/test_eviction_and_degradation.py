"""Eviction by recoverability and degradation marking, on the real broker.

A real manager (SQLite ledger), a real echo agent on the pool queue and real producers
(``MeshClient.submit``): an interactive request takes a slot back from rebuildable work — never
from work with side effects — the agent stops the evicted handler, its producer resubmits; a
task allowed ``partial_results`` finishes by its deadline and says what it left out.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from mesh.core.pressure import PressurePolicy
from mesh.errors import AdmissionRefused, SubmitDeadlineExceeded, TaskFailed
from mesh.producer import MeshClient, Submitted
from mesh.wire import AdmissionDecision

from .harness import eventually
from .test_backpressure import PoolMesh, echo_requirements, pool_mesh

SLOTS = 4
LONG_MS = 4_000
# Stages by signals only, so the pool can be filled with speculative work for the test.
NO_STAGES = PressurePolicy(thresholds=(1.0, 1.0, 1.0))


async def fill_pool(
    mesh: PoolMesh, amqp_url: str, recoverabilities: list[str]
) -> tuple[list[asyncio.Task[Submitted]], list[MeshClient], list[list[AdmissionDecision]]]:
    """One speculative submit per entry, in order (each admitted before the next), each on its
    own client; returns the submits, their clients and the refusals each one saw."""
    submits, clients, refusals = [], [], []
    for i, recoverability in enumerate(recoverabilities):
        client = await mesh.client(amqp_url, f"spec-{i}")
        seen: list[AdmissionDecision] = []
        submits.append(
            asyncio.create_task(
                client.submit(
                    echo_requirements("speculative", recoverability=recoverability),
                    {"message": f"spec-{i}", "sleep_ms": LONG_MS},
                    timeout_s=30.0,
                    on_deferred=lambda d, seen=seen: seen.append(d) or True,  # type: ignore[misc]
                )
            )
        )
        clients.append(client)
        refusals.append(seen)
        await eventually(
            lambda n=i + 1: mesh.ledger_holding()[0] == n,  # type: ignore[misc]
            what=f"{i + 1} slots held",
        )
    await eventually(
        lambda: mesh.agents[0].in_flight.get("test.echo", 0) == len(recoverabilities),
        what="every task running",
    )
    return submits, clients, refusals


def evictions(mesh: PoolMesh, recoverability: str) -> float:
    value = mesh.manager.observer.metrics.registry.get_sample_value(
        "mesh_evictions_total", {"pool": "echo", "recoverability": recoverability}
    )
    return value or 0.0


async def test_an_interactive_task_evicts_rebuildable_work_and_the_victim_is_resubmitted(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=SLOTS, agents=1, pressure=NO_STAGES
    ) as mesh:
        kinds = ["side_effects", "rebuildable", "side_effects", "rebuildable"]
        submits, clients, refusals = await fill_pool(mesh, amqp_url, kinds)
        assert mesh.ledger_holding() == (SLOTS, SLOTS, SLOTS)

        started = time.monotonic()
        urgent = await mesh.producer.submit(
            echo_requirements("interactive"), {"message": "urgent", "sleep_ms": 50}, timeout_s=10
        )
        took = time.monotonic() - started

        # Admitted at once, not after the long tasks: one attempt, well before they end.
        assert urgent.attempts == 1 and took < LONG_MS / 1000 / 2, took
        # The victim is the youngest rebuildable task (spec-3); its handler was stopped while
        # running, its producer told EVICTED (never a silent loss) and it asked again.
        victim = 3
        await eventually(lambda: clients[victim].counters["evicted"] == 1, what="victim told")
        evicted = [d for d in refusals[victim] if d.reason and d.reason.value == "EVICTED"]
        assert len(evicted) == 1 and "while running" in evicted[0].detail
        assert mesh.agents[0].counters["tasks_evicted"] == 1
        assert evictions(mesh, "rebuildable") == 1.0
        journal = mesh.manager._journal
        assert journal is not None
        (entry,) = journal.query(kinds=["admission_evicted"], limit=None)
        assert entry.detail["for_admission"] == urgent.decision.admission_id

        results = await asyncio.wait_for(asyncio.gather(*submits), timeout=30)
        # Every task finished; only the victim needed more than one admission.
        assert [r.output["message"] for r in results] == [f"spec-{i}" for i in range(4)]
        assert [r.attempts > 1 for r in results] == [False, False, False, True]
        assert [c.counters["evicted"] for c in clients] == [0, 0, 0, 1]
        assert mesh.agents[0].counters["tasks_evicted"] == 1
        assert evictions(mesh, "side_effects") == 0.0
        await eventually(lambda: mesh.ledger_holding() == (0, 0, SLOTS), what="all slots back")


async def test_work_with_side_effects_is_never_evicted_the_interactive_task_is_refused_in_time(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=SLOTS, agents=1, pressure=NO_STAGES
    ) as mesh:
        submits, clients, _ = await fill_pool(mesh, amqp_url, ["side_effects"] * SLOTS)

        # Not evicting anything, the pool has no slot for it before its deadline (submit
        # sends it): refused at once rather than deferred until the producer gives up.
        with pytest.raises(AdmissionRefused) as refused:
            await mesh.producer.submit(
                echo_requirements("interactive"), {"message": "urgent"}, timeout_s=1.5
            )

        reason = refused.value.decision.reason
        assert reason is not None and reason.value == "DEADLINE_UNREACHABLE", reason
        assert mesh.agents[0].counters["tasks_evicted"] == 0
        assert evictions(mesh, "side_effects") == 0.0
        results = await asyncio.wait_for(asyncio.gather(*submits), timeout=30)
        assert all(r.attempts == 1 for r in results)
        assert all(c.counters["evicted"] == 0 for c in clients)


async def test_a_task_allowed_partial_results_meets_its_deadline_and_marks_what_is_missing(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=SLOTS, agents=1
    ) as mesh:
        started = time.time()
        done = await mesh.producer.submit(
            echo_requirements(
                "interactive", deadline=started + 1.0, allowed_degradations=["partial_results"]
            ),
            {"message": "hurry", "sleep_ms": 3_000},
        )

        assert time.time() < started + 1.0  # by the deadline, not after the 3 s asked for
        assert done.output["slept_ms"] < 1_000
        (applied,) = done.degradations
        assert applied.kind == "partial_results"
        assert done.missing_evidence == [
            f"{3_000 - done.output['slept_ms']} ms of the 3000 ms asked for"
        ]

        # Not allowed: the agent does the full work and the deadline passes.
        with pytest.raises((SubmitDeadlineExceeded, TaskFailed)):
            await mesh.producer.submit(
                echo_requirements("interactive", deadline=time.time() + 1.0),
                {"message": "hurry", "sleep_ms": 3_000},
            )
