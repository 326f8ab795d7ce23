"""What the mesh's spans say: their names and attributes, as pure functions of the messages.

Attribute names follow the OpenTelemetry semantic conventions where one exists
(``messaging.*`` for RabbitMQ, ``gen_ai.*`` for an agent's run, ``error.type``) and are
``mesh.*`` otherwise; an attribute whose value is not known is left out, never invented.
docs/tracing.md lists them.
"""

from __future__ import annotations

from typing import Any, Final

from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
)
from mesh.wire.models import (
    AcquireRequest,
    LeaseGranted,
    Message,
    Refusal,
    Released,
    ReleaseRequest,
    TaskResult,
)

__all__ = [
    "DEFERRED_EVENT",
    "decision_attributes",
    "deferral_attributes",
    "messaging_attributes",
    "reply_attributes",
    "request_span",
    "result_attributes",
]

DEFERRED_EVENT: Final = "mesh.admission.deferred"
MESSAGING_SYSTEM: Final = "rabbitmq"
DEFAULT_EXCHANGE_NAME: Final = "amq.default"

Attributes = dict[str, Any]


def messaging_attributes(
    exchange: str, routing_key: str, operation: str, conversation_id: str | None
) -> Attributes:
    """A RabbitMQ message's ``messaging.*`` attributes (``operation``: send, process)."""
    attributes: Attributes = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.destination.name": exchange or DEFAULT_EXCHANGE_NAME,
        "messaging.rabbitmq.destination.routing_key": routing_key,
    }
    if conversation_id is not None:
        attributes["messaging.message.conversation_id"] = conversation_id
    return attributes


def request_span(message: Message) -> tuple[str, Attributes] | None:
    """The manager's span for a request (its name and attributes), or ``None``: a request
    that is not part of a task's life (status, find, an operator's) gets none."""
    if isinstance(message, AdmissionRequest):
        capability = message.requirements.capability
        return f"admission {capability.name}", {
            "mesh.capability": capability.name,
            "mesh.capability.version_spec": capability.version_spec,
            "mesh.admission_id": message.admission_id,
            "mesh.service_class": message.requirements.service_class,
        }
    if isinstance(message, AcquireRequest):
        return f"acquire {message.capability}", {
            "mesh.capability": message.capability,
            "mesh.capability.version_spec": message.version_spec,
        }
    if isinstance(message, AdmissionRelease):
        return "release admission", {
            "mesh.admission_id": message.admission_id,
            "mesh.fence": message.fence,
        }
    if isinstance(message, ReleaseRequest):
        return "release lease", {"mesh.lease_id": message.lease_id}
    return None


def decision_attributes(decision: AdmissionDecision) -> Attributes:
    """What a person asks of an admission decision first: decided how, why, where."""
    attributes: Attributes = {
        "mesh.admission_id": decision.admission_id,
        "mesh.admission.decision": decision.outcome,
    }
    if decision.reason is not None:
        attributes["mesh.admission.reason"] = decision.reason.value
    if decision.retry_after_ms is not None:
        attributes["mesh.retry_after_ms"] = decision.retry_after_ms
    if decision.position is not None:
        attributes["mesh.line.position"] = decision.position
    if decision.allowed_degradations:
        attributes["mesh.allowed_degradations"] = list(decision.allowed_degradations)
    grant = decision.grant
    if grant is not None:
        attributes["mesh.pool"] = grant.pool_id
        attributes["mesh.descriptor_epoch"] = grant.descriptor_epoch
        attributes["mesh.fence"] = grant.fence
        if grant.fallback_for is not None:
            attributes["mesh.fallback"] = True
            attributes["mesh.fallback_for"] = grant.fallback_for
    return attributes


def reply_attributes(reply: Message) -> Attributes:
    """What the manager's reply to a traced request says, as its span's attributes."""
    if isinstance(reply, AdmissionDecision):
        return decision_attributes(reply)
    if isinstance(reply, LeaseGranted):
        lease = reply.lease
        return {
            "mesh.lease.outcome": "granted",
            "mesh.lease_id": lease.lease_id,
            "mesh.agent_id": lease.agent_id,
        }
    if isinstance(reply, Refusal):
        attributes: Attributes = {"mesh.refusal.reason": reply.reason.value}
        if reply.retry_after_ms is not None:
            attributes["mesh.retry_after_ms"] = reply.retry_after_ms
        return attributes
    if isinstance(reply, AdmissionReleaseReply):
        attributes = {"mesh.released": reply.released}
        if reply.reason is not None:
            attributes["mesh.admission.reason"] = reply.reason.value
        return attributes
    if isinstance(reply, Released):
        return {"mesh.released": True}
    return {}


def deferral_attributes(decision: AdmissionDecision, attempt: int) -> Attributes:
    """A deferral the producer waits out: the event on its ``submit`` span."""
    attributes: Attributes = {
        "mesh.admission_id": decision.admission_id,
        "mesh.admission.decision": decision.outcome,
        "mesh.attempt": attempt,
    }
    if decision.reason is not None:
        attributes["mesh.admission.reason"] = decision.reason.value
    if decision.retry_after_ms is not None:
        attributes["mesh.retry_after_ms"] = decision.retry_after_ms
    if decision.position is not None:
        attributes["mesh.line.position"] = decision.position
    return attributes


def result_attributes(result: TaskResult) -> Attributes:
    """An agent's answer, on its ``invoke_agent`` span."""
    attributes: Attributes = {"mesh.task.status": result.status}
    if result.error is not None:
        attributes["error.type"] = result.error.code.value
    if result.degradations:
        attributes["mesh.degradations"] = [d.kind for d in result.degradations]
    return attributes
