"""Admission decisions as a producer receives them: a grant (with its invocation lease), a
refusal, or a deferral with its retry time.

Pure builders of :class:`~mesh.wire.admission.AdmissionDecision` values, kept apart from the
deciding so every refusal of the same kind reads the same, whichever room of the core made
it. What the retry time is comes from :mod:`mesh.core.policy.retry_times`; these only say it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mesh.core.pressure import Shed
from mesh.ledger.model import Reservation
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRequest,
    CapabilityDescriptor,
)

if TYPE_CHECKING:  # only its type: signing is the shell's key, handed in
    from mesh.leases import LeaseSigner

__all__ = ["admitted", "deferred", "past_deadline", "refused", "retry_or_reject"]


def refused(
    admission_id: str,
    reason: AdmissionReason,
    detail: str,
    *,
    deferred: bool = False,
    retry_after_ms: int | None = None,
) -> AdmissionDecision:
    """A refusal as a decision: ``rejected``, or ``deferred`` with a retry time."""
    return AdmissionDecision(
        admission_id=admission_id,
        outcome="deferred" if deferred else "rejected",
        reason=reason,
        detail=detail[:1000],
        retry_after_ms=retry_after_ms,
    )


def past_deadline(request: AdmissionRequest, detail: str) -> AdmissionDecision:
    """``DEADLINE_UNREACHABLE`` at once: coming back later could not meet the deadline."""
    return AdmissionDecision(
        admission_id=request.admission_id,
        outcome="rejected",
        reason=AdmissionReason.DEADLINE_UNREACHABLE,
        detail=detail[:1000],
        allowed_degradations=list(request.requirements.allowed_degradations),
    )


def deferred(
    request: AdmissionRequest,
    reason: AdmissionReason,
    detail: str,
    retry_ms: int,
    position: int | None = None,
) -> AdmissionDecision:
    """Come back after ``retry_ms`` (``position``: the request's place in the pool's line)."""
    return AdmissionDecision(
        admission_id=request.admission_id,
        outcome="deferred",
        reason=reason,
        detail=detail[:1000],
        retry_after_ms=retry_ms,
        position=position,
        allowed_degradations=list(request.requirements.allowed_degradations),
    )


def retry_or_reject(
    request: AdmissionRequest, why: Shed, retry_ms: int | None
) -> AdmissionDecision:
    """A deferral for ``why`` with its retry time — or, when there is none (coming back cannot
    meet the deadline), ``DEADLINE_UNREACHABLE``."""
    if retry_ms is None:
        detail = why.detail
        if why.reason != AdmissionReason.DEADLINE_UNREACHABLE:
            detail = f"{why.detail}; a retry would miss the deadline"
        return past_deadline(request, detail)
    return deferred(request, AdmissionReason(why.reason), why.detail, retry_ms)


def admitted(
    reservation: Reservation,
    external: list[str],
    fallback_for: str | None = None,
    *,
    tools: Sequence[str] = (),
    now: float,
    descriptors: Mapping[str, CapabilityDescriptor],
    policy_generation: int,
    lease_signer: LeaseSigner | None,
    lease_ttl_s: float | None,
) -> AdmissionDecision:
    """The grant of ``reservation`` (and the ``external`` grants taken for it), with an
    invocation lease when there is a signer: it expires with the grant, or ``lease_ttl_s``
    after ``now`` if that is sooner."""
    # The epoch it was granted under, so a replay reports the same grant; rows written
    # before reservations kept it report the pool's current epoch.
    epoch = reservation.descriptor_epoch
    if epoch is None:
        descriptor = descriptors.get(reservation.pool_id)
        epoch = descriptor.descriptor_epoch if descriptor else 1
    lease = None
    if lease_signer is not None:
        expires = reservation.expires_at
        if lease_ttl_s is not None:
            expires = min(expires, now + lease_ttl_s)
        lease = lease_signer.sign(
            admission_id=reservation.admission_id,
            pool_id=reservation.pool_id,
            fence=reservation.fence,
            descriptor_epoch=epoch,
            tools=tools,
            issued_at=now,
            expires_at=expires,
        )
    grant = {
        "admission_id": reservation.admission_id,
        "pool_id": reservation.pool_id,
        "descriptor_epoch": epoch,
        "policy_generation": policy_generation,
        "fence": reservation.fence,
        "grant_ids": [f"ledger:{reservation.admission_id}:{reservation.fence}", *external],
        "expires_at": reservation.expires_at,
        "fallback_for": fallback_for,
        "lease": lease,
    }
    # One validation of the whole decision, the grant inside it (validated all the same).
    return AdmissionDecision.model_validate(
        {"admission_id": reservation.admission_id, "outcome": "admitted", "grant": grant}
    )
