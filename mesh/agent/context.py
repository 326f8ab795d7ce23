"""The task a handler is running, and the degradations it may apply: :func:`current_task`.

A handler keeps its ``async def handler(self, payload) -> dict`` signature; what it needs to
know about the task beyond the payload — the deadline, the degradations the producer allowed —
and the one thing it may report besides its output — which degradation it applied and what
evidence its output therefore lacks — go through a context variable set around the call::

    @capability("rag.search", ...)
    async def search(self, payload):
        task = current_task()
        sources = SOURCES
        if task.remaining_s() < 2.0 and task.may_degrade("less_retrieval"):
            sources, skipped = SOURCES[:2], SOURCES[2:]
            task.degrade("less_retrieval", missing_evidence=[s.name for s in skipped])
        ...

``degrade`` raises :class:`DegradationNotAllowed` for a degradation the task did not allow: the
producer set the bounds, the handler cannot widen them. The runtime copies what was applied
into ``TaskResult.degradations`` (successful results only; an error has no output to qualify).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

from pydantic import ValidationError

from mesh.errors import LocalProtocolError
from mesh.wire.models import AppliedDegradation, Degradation, InvocationLease, Task


class DegradationNotAllowed(LocalProtocolError):
    """A handler asked to apply a degradation its task does not allow."""


@dataclass(slots=True)
class TaskContext:
    """The running task as its handler sees it."""

    task_id: str
    capability: str
    deadline: float | None
    allowed_degradations: frozenset[str]
    applied: dict[str, AppliedDegradation] = field(default_factory=dict)
    lease: InvocationLease | None = None
    """The invocation lease of the task's grant: what the handler presents to the tools it
    calls (each checks it with the manager's public key, :mod:`mesh.leases`)."""
    idempotency_key: str = ""
    """The same on every delivery of this task: ``admission:<id>`` on the admission path (the
    grant's admission ID: ``submit`` sends one task per grant, and retries a lost answer
    under the same one), ``task:<id>`` on the lease path. Key effects by it
    (:func:`mesh.agent.effects.once` does); tasks a producer sends under one grant by hand
    share it."""
    attempt: int = 1
    """Which delivery of the task this is (1: the first; from the broker's delivery count
    on a pool queue, at least 2 when the broker marks it redelivered)."""
    effects_replayed: int = 0  # effects once() answered from their record, not by running

    @classmethod
    def of(cls, task: Task, attempt: int = 1) -> TaskContext:
        key = idempotency_key(task)
        return cls(
            task.task_id,
            task.capability,
            task.deadline,
            frozenset(task.allowed_degradations),
            lease=task.grant.lease if task.grant is not None else None,
            idempotency_key=key,
            attempt=attempt,
        )

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left before the deadline (``inf`` without one)."""
        if self.deadline is None:
            return float("inf")
        return self.deadline - (time.time() if now is None else now)

    def may_degrade(self, kind: Degradation) -> bool:
        return kind in self.allowed_degradations

    def degrade(
        self, kind: Degradation, missing_evidence: Iterable[str] = (), note: str = ""
    ) -> None:
        """Record that the output is degraded by ``kind`` and lacks ``missing_evidence``.
        Called twice for one kind, the evidence adds up and the last note stands."""
        if kind not in self.allowed_degradations:
            allowed = ", ".join(sorted(self.allowed_degradations)) or "none"
            raise DegradationNotAllowed(
                f"task {self.task_id} does not allow {kind!r} (allowed: {allowed})"
            )
        earlier = self.applied.get(kind)
        evidence = [*(earlier.missing_evidence if earlier else ()), *missing_evidence]
        try:
            self.applied[kind] = AppliedDegradation(
                kind=kind, missing_evidence=evidence, note=note or (earlier.note if earlier else "")
            )
        except ValidationError as exc:  # too much evidence, an empty or overlong entry
            raise LocalProtocolError(f"degrade({kind!r}): {exc.errors()[0]['msg']}") from None

    @property
    def degradations(self) -> list[AppliedDegradation]:
        return list(self.applied.values())


def idempotency_key(task: Task) -> str:
    """``admission:<id>`` for a granted task, ``task:<id>`` for a leased one: the same on every
    delivery of one task (and shared by tasks sent under one grant)."""
    return f"admission:{task.grant.admission_id}" if task.grant else f"task:{task.task_id}"


_current: ContextVar[TaskContext] = ContextVar("mesh_current_task")


def current_task() -> TaskContext:
    """The task the calling handler runs. Outside one (a unit test calling the handler
    method directly) a fresh task without a deadline that allows no degradation."""
    try:
        return _current.get()
    except LookupError:
        return TaskContext(task_id="", capability="", deadline=None, allowed_degradations=EMPTY)


EMPTY: frozenset[str] = frozenset()
