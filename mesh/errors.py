"""One error tree for the mesh, split by whose fault and by layer.

Expected outcomes (a refusal, no capacity, an unknown lease) are *values*
returned by the core, never exceptions. Exceptions are for misuse, for bad
peers, and for I/O that failed.
"""

from __future__ import annotations

from typing import Any


class MeshError(Exception):
    """Root of every error the mesh raises on purpose."""


class LocalProtocolError(MeshError):
    """You used the mesh API in a way it does not allow."""


class RemoteProtocolError(MeshError):
    """A peer sent something that breaks the wire contract."""


class MessageRejected(RemoteProtocolError):
    """A message could not be decoded; carries the reason code it is dead-lettered with."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TransportError(MeshError):
    """Talking to the broker failed."""


class TopologyMissing(TransportError):
    """An exchange the caller only checks (a passive declare) does not exist: whoever owns
    the shared topology — the manager — has not declared it yet."""


class TopologyMismatch(TransportError):
    """A queue exists with other arguments than this version declares (PRECONDITION_FAILED):
    an older mesh, or another tool, declared it. The message names the queue and the fix."""

    @classmethod
    def for_queue(cls, name: str, wanted: str, broker_said: str) -> TopologyMismatch:
        return cls(
            f"queue {name!r} exists with other arguments than this version of the mesh "
            f"declares ({wanted}); the broker said: {broker_said}. An older mesh declared "
            f"it: once it is empty, delete it (rabbitmqctl delete_queue {name!r}, or the "
            "management UI) and start again — docs/architecture.md, 'Queues and their bounds'"
        )


class BrokerUnavailable(TransportError):
    """The broker cannot be reached."""


class PublishFailed(TransportError):
    """The broker did not accept a publish."""


class PublishUnroutable(PublishFailed):
    """The publish matched no queue and came back as returned."""


class PublishNacked(PublishFailed):
    """The broker refused the publish (a bounded queue is full, for instance)."""


class PublishTimeout(PublishFailed):
    """No confirm arrived in time: the message may or may not have been enqueued."""


class RequestTimeout(TransportError):
    """A request to the manager got no reply in time."""


class StoreError(MeshError):
    """The journal store failed."""


class StaleView(StoreError):
    """A decided batch's write found the ledger no longer as the batch read it (another
    manager took a counter, recorded a decision, or released or expired a reservation
    meanwhile): nothing of the batch was kept; decide it again on a fresh view.
    ``admission_id``: the reservation that changed, when it was one (leave it out)."""

    def __init__(self, detail: str, admission_id: str | None = None) -> None:
        super().__init__(detail)
        self.admission_id = admission_id


class TaskFailed(MeshError):
    """A task did not produce a result; ``code`` is the machine-readable reason."""

    def __init__(self, code: str, message: str, *, task_id: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.task_id = task_id


class TaskInputInvalid(TaskFailed):
    """The agent refused the task because its payload violates the capability's input schema."""


class TaskRefused(TaskFailed):
    """The manager would not hand out an agent for the task (see ``code``).
    ``retry_after_ms``: when the manager said asking again could help, how long to wait
    first (for ``NO_AGENT_AVAILABLE``, when it expects a slot to free up); else None."""

    def __init__(
        self, code: str, message: str, *, task_id: str = "", retry_after_ms: int | None = None
    ) -> None:
        super().__init__(code, message, task_id=task_id)
        self.retry_after_ms = retry_after_ms


class TaskTimeout(TaskFailed):
    """The task's result did not arrive before its deadline."""


class AdmissionRefused(TaskRefused):
    """The manager refused to admit the task; ``decision`` is its whole reply (reason code,
    detail, ``retry_after_ms``, allowed degradations, admission ID) for callers that decide
    for themselves: degrade, spill to another service class, queue, or ask for scale-up."""

    def __init__(self, decision: Any, message: str = "") -> None:
        reason = decision.reason.value if decision.reason else "REFUSED"
        super().__init__(
            reason, message or decision.detail or reason, retry_after_ms=decision.retry_after_ms
        )
        self.decision = decision
        self.admission_id: str = decision.admission_id

    @property
    def refusal(self) -> Any:
        """The decision in the one refusal shape (:func:`mesh.wire.refusal_of`), as the
        decision itself gives it (so the error tree imports no wire model)."""
        return self.decision.refusal()


class SubmitDeadlineExceeded(TaskTimeout):
    """``submit`` gave up at the deadline. ``last_reason`` is the reason code of the last
    refusal (``None`` if the task was admitted and its result came too late), ``decision``
    the last reply, ``attempts`` how many admissions were asked for."""

    def __init__(self, message: str, *, last_reason: str | None, decision: Any, attempts: int):
        super().__init__(last_reason or "DEADLINE_EXCEEDED", message)
        self.last_reason = last_reason
        self.decision = decision
        self.attempts = attempts
