"""One refusal shape: whatever reply says no, as a :class:`~mesh.wire.models.Refusal`.

The wire keeps each reply's own message type (an admission decision, a release reply, a
registration refusal, a task result with an error, a plain refusal), so that no peer written
against ``schemas/`` breaks; all of them say no with the same three things — a
:class:`~mesh.wire.reasons.Reason` (the one enum), a free-text detail and, where coming back
later can help, ``retry_after_ms``. :func:`refusal_of` gives that one shape for any of them,
so a caller handles every "no" in one place::

    refusal = refusal_of(reply)
    if refusal is not None:
        back_off(refusal.retry_after_ms) if refusal.retry_after_ms else give_up(refusal.reason)
"""

from __future__ import annotations

from mesh.wire.admission import AdmissionDecision, AdmissionReleaseReply
from mesh.wire.models import Message, Refusal, RegistrationRefused, TaskResult


def refusal_of(message: Message) -> Refusal | None:
    """``message`` as a :class:`Refusal` if it says no (``None`` if it says yes: an admitted
    decision, a release done, a successful result, or any other reply)."""
    if isinstance(message, Refusal):
        return message
    if isinstance(message, AdmissionDecision):
        return message.refusal()
    if isinstance(message, AdmissionReleaseReply):
        if message.released or message.reason is None:
            return None
        return Refusal(reason=message.reason, detail=message.detail)
    if isinstance(message, RegistrationRefused):
        return Refusal(reason=message.reason, detail=message.detail)
    if isinstance(message, TaskResult) and message.error is not None:
        return Refusal(reason=message.error.code, detail=message.error.message)
    return None
