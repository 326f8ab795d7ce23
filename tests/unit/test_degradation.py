"""Degradation marking: a handler degrades only as its task allows, the result says what
evidence is missing, and the producer refuses a result degraded beyond what it allowed."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from mesh.agent import Agent, DegradationNotAllowed, capability, current_task, process_task
from mesh.errors import LocalProtocolError, TaskFailed
from mesh.producer.tasks import Submitted, output_of
from mesh.samples import EchoAgent
from mesh.wire import AppliedDegradation, Task, TaskResult, decode, encode
from mesh.wire.reasons import Reason

OBJECT = {"type": "object"}
SOURCES = ["wiki", "news", "papers", "forums"]


class Retriever(Agent):
    """Retrieves from every source unless told (by ``quick``) to take two and say so."""

    deployment = "retriever"

    @capability("rag.lookup", version="1.0.0", input_schema=OBJECT, output_schema=OBJECT)
    async def lookup(self, payload: dict[str, Any]) -> dict[str, Any]:
        task = current_task()
        sources = SOURCES
        if payload.get("quick") and task.may_degrade("less_retrieval"):
            sources = SOURCES[:2]
            task.degrade("less_retrieval", missing_evidence=SOURCES[2:3], note="quick")
            task.degrade("less_retrieval", missing_evidence=SOURCES[3:])  # adds up
        if payload.get("force"):
            task.degrade("partial_results", missing_evidence=["everything"])
        return {"sources": sources}


def task(allowed: list[str], **payload: Any) -> Task:
    return Task(
        task_id="t-1",
        capability="rag.lookup",
        payload=payload,
        submitted_at=1000.0,
        allowed_degradations=allowed,  # type: ignore[arg-type]
    )


async def run(t: Task) -> TaskResult:
    return await process_task(t, Retriever("r-1").bind(), agent_id="r-1", clock=lambda: 1000.0)


async def test_an_allowed_degradation_is_marked_with_the_evidence_it_leaves_out() -> None:
    result = await run(task(["less_retrieval"], quick=True))

    assert result.status == "ok"
    assert result.output == {"sources": ["wiki", "news"]}
    assert result.degradations == [
        AppliedDegradation(
            kind="less_retrieval", missing_evidence=["papers", "forums"], note="quick"
        )
    ]
    assert decode(encode(result)) == result  # it travels


async def test_without_permission_the_handler_does_the_full_work_and_marks_nothing() -> None:
    result = await run(task([], quick=True))
    assert result.output == {"sources": SOURCES}
    assert result.degradations == []


async def test_a_degradation_the_task_did_not_allow_fails_the_task_instead_of_passing_quietly() -> (
    None
):
    result = await run(task(["less_retrieval"], force=True))
    assert result.status == "error"
    assert result.error is not None and result.error.code is Reason.HANDLER_ERROR
    assert "DegradationNotAllowed" in result.error.message
    assert "partial_results" in result.error.message
    assert result.degradations == []


def test_outside_a_handler_the_task_allows_nothing_and_has_no_deadline() -> None:
    context = current_task()
    assert context.remaining_s() == float("inf")
    with pytest.raises(DegradationNotAllowed):
        context.degrade("partial_results")


async def test_too_much_evidence_is_a_clear_local_error() -> None:
    class Hoarder(Agent):
        deployment = "hoarder"

        @capability("rag.lookup", version="1.0.0", input_schema=OBJECT, output_schema=OBJECT)
        async def lookup(self, payload: dict[str, Any]) -> dict[str, Any]:
            with pytest.raises(LocalProtocolError, match="partial_results"):
                current_task().degrade("partial_results", missing_evidence=["x"] * 65)
            return {}

    t = task(["partial_results"])
    result = await process_task(t, Hoarder("h-1").bind(), agent_id="h-1")
    assert result.status == "ok" and result.degradations == []


def test_a_result_names_each_kind_of_degradation_once() -> None:
    with pytest.raises(ValidationError, match="distinct"):
        TaskResult(
            task_id="t",
            agent_id="a",
            capability="rag.lookup",
            status="ok",
            output={},
            started_at=1.0,
            finished_at=1.0,
            degradations=[
                AppliedDegradation(kind="partial_results"),
                AppliedDegradation(kind="partial_results"),
            ],
        )


def degraded_result(kind: str) -> TaskResult:
    return TaskResult(
        task_id="t",
        agent_id="rogue-1",
        capability="rag.lookup",
        status="ok",
        output={"sources": []},
        started_at=1.0,
        finished_at=1.0,
        degradations=[AppliedDegradation(kind=kind, missing_evidence=["all"])],  # type: ignore[arg-type]
    )


def test_the_producer_withholds_a_result_degraded_beyond_what_it_allowed() -> None:
    """An agent not using the SDK could degrade anyway: the producer checks again."""
    with pytest.raises(TaskFailed) as refused:
        output_of(degraded_result("partial_results"), allowed=["less_retrieval"])
    assert refused.value.code == Reason.DEGRADATION_NOT_ALLOWED.value
    assert output_of(degraded_result("less_retrieval"), allowed=["less_retrieval"]) == {
        "sources": []
    }


def test_submitted_lists_the_missing_evidence() -> None:
    result = degraded_result("less_retrieval")
    done = Submitted(result.output or {}, result, None, 1)  # type: ignore[arg-type]
    assert [d.kind for d in done.degradations] == ["less_retrieval"]
    assert done.missing_evidence == ["all"]


async def test_the_echo_sample_cuts_its_sleep_to_the_deadline_only_when_allowed() -> None:
    agent = EchoAgent("echo-1").bind()

    def echo_task(allowed: list[str], deadline_in_s: float) -> Task:
        return Task(
            task_id="t",
            capability="test.echo",
            payload={"message": "m", "sleep_ms": 5_000},
            submitted_at=time.time(),
            deadline=time.time() + deadline_in_s,
            allowed_degradations=allowed,  # type: ignore[arg-type]
        )

    cut = await process_task(echo_task(["partial_results"], 0.3), agent, agent_id="echo-1")
    assert cut.status == "ok" and cut.output is not None
    assert cut.output["slept_ms"] < 300
    (applied,) = cut.degradations
    assert applied.kind == "partial_results"
    assert applied.missing_evidence == [
        f"{5_000 - cut.output['slept_ms']} ms of the 5000 ms asked for"
    ]

    late = await process_task(echo_task([], 0.3), agent, agent_id="echo-1")
    assert late.status == "error" and late.error is not None
    assert late.error.code is Reason.DEADLINE_EXCEEDED
