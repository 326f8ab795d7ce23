"""A task's trip out of the producer and back, shared by the lease and admission paths.

:class:`TaskSender` publishes a task to the tasks exchange, again while the outcome of a
publish is unknown; :func:`output_of` turns the result into the caller's output or a typed
error; :class:`TaskOutcome` and :class:`Submitted` are what the two paths return.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mesh import tracing
from mesh.backoff import Backoff
from mesh.errors import (
    PublishNacked,
    PublishUnroutable,
    TaskFailed,
    TaskInputInvalid,
    TransportError,
)
from mesh.producer.retry import retry_delay_s
from mesh.transport.ports import ClientTransport
from mesh.wire.admission import AdmissionDecision
from mesh.wire.models import AppliedDegradation, Lease, Task, TaskResult
from mesh.wire.reasons import Reason

__all__ = ["Submitted", "TaskOutcome", "TaskSender", "lease_unknown", "output_of"]


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """A finished task: its output, and which agent and lease produced it."""

    output: dict[str, Any]
    result: TaskResult
    lease: Lease


@dataclass(frozen=True, slots=True)
class Submitted:
    """A task done on the admission path: its output, the result, and the admission."""

    output: dict[str, Any]
    result: TaskResult
    decision: AdmissionDecision  # the admitting one (grant, pool, fence)
    attempts: int  # admissions asked for, this one included
    admission_wait_s: float = 0.0  # from the call to the grant (deferrals waited out)

    @property
    def degradations(self) -> list[AppliedDegradation]:
        """What the handler gave up (each allowed by the requirements); empty: full result."""
        return self.result.degradations

    @property
    def missing_evidence(self) -> list[str]:
        """Everything the output does not rest on, over all degradations applied."""
        return [item for d in self.result.degradations for item in d.missing_evidence]


class TaskSender:
    """Publishes tasks to ``exchange`` with replies to ``reply_queue``; each publish asked
    again while its outcome is unknown (``counters["task_publish_retries"]``)."""

    def __init__(
        self,
        transport: ClientTransport,
        exchange: str,
        reply_queue: str,
        counters: Counter[str],
    ) -> None:
        self._transport = transport
        self._exchange = exchange
        self._reply_queue = reply_queue
        self._counters = counters

    async def publish(self, key: str, task: Task, headers: dict[str, Any], deadline: float) -> None:
        """Publish a task to the tasks exchange; a publish whose outcome is unknown (no
        confirm in time, the connection lost mid-publish) is published again until
        ``deadline``. The task may then arrive twice: one task ID and one idempotency key, so
        the agent that answered it answers again from its record, and effects kept with
        :func:`mesh.agent.once` happen once. A nack or a return is an answer: raised."""
        with tracing.send(
            self._exchange, key, conversation_id=task.task_id, task_id=task.task_id
        ) as sent:
            traced = sent.headers(headers)  # one message, one span: the same when sent again
            retries = 0
            while True:
                try:
                    await self._transport.publish(
                        self._exchange,
                        key,
                        task,
                        reply_to=self._reply_queue,
                        correlation_id=task.task_id,
                        headers=traced,
                        persistent=True,
                    )
                    return
                except (PublishNacked, PublishUnroutable):
                    raise
                except TransportError:
                    delay = retry_delay_s(None, retries, Backoff(), random.random)
                    retries += 1
                    if time.time() + delay >= deadline:
                        raise
                    self._counters["task_publish_retries"] += 1
                    await asyncio.sleep(delay)


def lease_unknown(result: TaskResult) -> bool:
    """The agent refused the task at claim for a lease it does not know: not run."""
    return result.error is not None and result.error.code is Reason.UNKNOWN_LEASE


def output_of(result: TaskResult, allowed: Sequence[str] = ()) -> dict[str, Any]:
    """The output of a successful result; a failed one raises TaskInputInvalid / TaskFailed
    with the agent's machine-readable code, and so does one degraded beyond ``allowed``."""
    if result.status == "ok" and result.output is not None:
        widened = sorted({d.kind for d in result.degradations} - set(allowed))
        if widened:
            raise TaskFailed(
                Reason.DEGRADATION_NOT_ALLOWED.value,
                f"agent {result.agent_id} degraded the result by {', '.join(widened)}, "
                f"which the task did not allow; the output is withheld",
                task_id=result.task_id,
            )
        return result.output
    error = result.error
    code = error.code if error else Reason.HANDLER_ERROR
    message = error.message if error else "no output"
    cls = TaskInputInvalid if code is Reason.INPUT_SCHEMA_VIOLATION else TaskFailed
    raise cls(code.value, message, task_id=result.task_id)
