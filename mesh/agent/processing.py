"""Turning one task into one result, without a broker.

:func:`process_task` is the whole of an agent's per-task logic and never raises
for an expected outcome: every failure is a ``TaskResult`` with status
``"error"`` and a :class:`~mesh.wire.Reason` code, checked in this order:

1. ``CAPABILITY_NOT_HANDLED`` - this agent has no handler for the capability;
2. ``DEADLINE_EXCEEDED`` - the deadline passed before the task started, or the
   handler (including its wait for a concurrency slot) ran past it;
3. ``INPUT_SCHEMA_VIOLATION`` - the payload does not match ``input_schema``;
4. ``HANDLER_ERROR`` - the handler raised (type and message go on the wire, the
   traceback only to the log);
5. ``OUTPUT_SCHEMA_VIOLATION`` - the handler's result cannot be serialised to
   JSON, or, after a JSON round trip (what the producer will receive: a NaN
   becomes ``null``), does not match ``output_schema``.

The handler runs under its capability's ``Semaphore(max_concurrency)``, with the task's
:class:`~mesh.agent.context.TaskContext` as :func:`~mesh.agent.context.current_task`; the
degradations it applied there go into a successful result.
Cancellation (the channel closed under the runtime) propagates untouched: the
task was not acked and the broker redelivers it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from jsonschema.exceptions import ValidationError as SchemaValidationError
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from mesh.agent.base import BoundCapability
from mesh.agent.context import TaskContext, _current
from mesh.wire.models import AppliedDegradation, ErrorInfo, Task, TaskResult
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

_MAX_ERROR_MESSAGE = 2000


class _Refused(Exception):
    """Internal: a task outcome that is an error result, not a bug."""

    def __init__(self, code: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def schema_violation(validator: Validator, instance: Any) -> str | None:
    """The most relevant validation error as one line, or ``None`` if ``instance`` is valid."""
    error: SchemaValidationError | None = best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "<root>"
    return _clip(f"{where}: {error.message}")


async def process_task(
    task: Task,
    capabilities: Mapping[str, BoundCapability],
    *,
    agent_id: str,
    clock: Callable[[], float] = time.time,
    attempt: int = 1,
) -> TaskResult:
    """Run ``task`` on the matching capability and return its result (never raises for it).
    ``attempt``: which delivery of the task this is (the handler's context says it)."""
    started_at = clock()
    try:
        bound = capabilities.get(task.capability)
        if bound is None:
            offered = ", ".join(sorted(capabilities)) or "nothing"
            raise _Refused(
                Reason.CAPABILITY_NOT_HANDLED,
                f"agent {agent_id} does not handle {task.capability} (it offers {offered})",
            )
        context = TaskContext.of(task, attempt)
        output = await _run(task, bound, context, agent_id, clock, started_at)
    except _Refused as refused:
        return _result(task, agent_id, started_at, clock(), error=refused)
    return _result(
        task, agent_id, started_at, clock(), output=output, degradations=context.degradations
    )


async def _run(
    task: Task,
    bound: BoundCapability,
    context: TaskContext,
    agent_id: str,
    clock: Callable[[], float],
    started: float,
) -> dict[str, Any]:
    remaining = None if task.deadline is None else task.deadline - started
    if remaining is not None and remaining <= 0:
        raise _Refused(
            Reason.DEADLINE_EXCEEDED,
            f"the deadline passed {-remaining:.3f} s before the task started",
        )
    violation = schema_violation(bound.spec.input_validator, task.payload)
    if violation is not None:
        raise _Refused(Reason.INPUT_SCHEMA_VIOLATION, f"payload violates input_schema: {violation}")
    try:
        async with asyncio.timeout(remaining):
            async with bound.semaphore:
                outcome = await _call(bound, task.payload, context)
    except TimeoutError:
        raise _Refused(
            Reason.DEADLINE_EXCEEDED,
            f"the handler did not finish within the {remaining:.3f} s left before the deadline",
        ) from None
    if isinstance(outcome, BaseException):
        log.error(
            "task handler raised",
            exc_info=outcome,
            extra={"agent_id": agent_id, "task_id": task.task_id, "capability": task.capability},
        )
        raise _Refused(Reason.HANDLER_ERROR, _clip(f"{type(outcome).__name__}: {outcome}"))
    return _checked_output(bound, outcome)


async def _call(bound: BoundCapability, payload: dict[str, Any], context: TaskContext) -> Any:
    """The handler's return value, or the exception it raised (so a deadline stays distinct)."""
    token = _current.set(context)
    try:
        return await bound.handler(payload)
    except Exception as exc:
        return exc
    finally:
        _current.reset(token)


def _checked_output(bound: BoundCapability, output: Any) -> dict[str, Any]:
    """Validate what the producer will receive: the output after a JSON round trip."""
    if not isinstance(output, dict):
        raise _Refused(
            Reason.OUTPUT_SCHEMA_VIOLATION,
            f"the handler returned {type(output).__name__}, not a JSON object",
        )
    try:
        on_the_wire: dict[str, Any] = orjson.loads(orjson.dumps(output))
    except orjson.JSONEncodeError as exc:
        raise _Refused(
            Reason.OUTPUT_SCHEMA_VIOLATION,
            _clip(f"the handler's output cannot be serialised to JSON: {exc}"),
        ) from None
    violation = schema_violation(bound.spec.output_validator, on_the_wire)
    if violation is not None:
        raise _Refused(
            Reason.OUTPUT_SCHEMA_VIOLATION,
            f"the handler's output violates output_schema: {violation}",
        )
    return on_the_wire


def _result(
    task: Task,
    agent_id: str,
    started_at: float,
    finished_at: float,
    *,
    output: dict[str, Any] | None = None,
    error: _Refused | None = None,
    degradations: list[AppliedDegradation] | None = None,
) -> TaskResult:
    return TaskResult(
        task_id=task.task_id,
        agent_id=agent_id,
        capability=task.capability,
        status="ok" if error is None else "error",
        output=output,
        error=None if error is None else ErrorInfo(code=error.code, message=error.message),
        started_at=started_at,
        finished_at=max(finished_at, started_at),
        degradations=degradations or [],
    )


def _clip(text: str) -> str:
    if len(text) <= _MAX_ERROR_MESSAGE:
        return text
    return text[: _MAX_ERROR_MESSAGE - 15] + "... [truncated]"
