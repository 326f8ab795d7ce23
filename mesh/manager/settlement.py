"""Settling grants: each release's ledger outcome turned into the reply its holder gets, and
told to the admission core once the transaction that released it is kept.

A release is a compare-and-set on the admission's fence. Three outcomes need more than the
ledger's word, and are told apart here: a stale fence on a grant this manager evicted (its
holder should resubmit), the same release again at the fence that already released it (a
retry, answered ``released`` and changing nothing), and a stale holder (refused).
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh.core.admission import AdmissionCore
from mesh.ledger.model import LedgerReason, Refused, Reservation, ReservationState
from mesh.ledger.store import LedgerStore
from mesh.wire.admission import AdmissionReason, AdmissionReleaseReply

Settled = tuple[AdmissionReleaseReply, bool, str | None]
"""A release's reply, whether this call released it, and the pool it was released from."""


def settled_all(
    ledger: LedgerStore,
    core: AdmissionCore,
    releases: Sequence[tuple[str, int]],
    released: Sequence[Reservation | Refused],
    now: float,
) -> list[Settled]:
    """Each release's reply from its ledger outcome, once the transaction is kept."""
    return [
        _settled(core, a, f, _with_holder(ledger, a, outcome), now)
        for (a, f), outcome in zip(releases, released, strict=True)
    ]


def _with_holder(
    ledger: LedgerStore, admission_id: str, outcome: Reservation | Refused
) -> tuple[Reservation | Refused, Reservation | None]:
    """A release's outcome and, when the fence was stale, the reservation as it stands
    (to tell a retry of a release from a stale holder)."""
    if isinstance(outcome, Refused) and outcome.reason is LedgerReason.STALE_FENCE:
        return outcome, ledger.get(admission_id)
    return outcome, None


def _settled(
    core: AdmissionCore,
    admission_id: str,
    fence: int,
    ledger_side: tuple[Reservation | Refused, Reservation | None],
    now: float,
) -> Settled:
    outcome, held = ledger_side
    if not isinstance(outcome, Refused):
        core.ended(admission_id, now, completed=True)
        reply = AdmissionReleaseReply(admission_id=admission_id, released=True)
        return reply, True, outcome.pool_id
    if outcome.reason is LedgerReason.STALE_FENCE and admission_id in core.evicted:
        outcome = Refused(
            outcome.reason,
            f"{outcome.detail}: the grant was evicted for more urgent work (resubmit it)",
        )
    elif outcome.reason is LedgerReason.STALE_FENCE:
        if held is not None and held.state is ReservationState.RELEASED and held.fence == fence:
            core.ended(admission_id, now, completed=False)  # if this core still counts it
            reply = AdmissionReleaseReply(
                admission_id=admission_id,
                released=True,
                detail=f"already released at fence {fence}: nothing changed",
            )
            return reply, False, None
    reply = AdmissionReleaseReply(
        admission_id=admission_id,
        released=False,
        reason=AdmissionReason(outcome.reason.value),
        detail=outcome.detail,
    )
    return reply, False, None
