"""What the admission path writes down and tells: its journal entries, its events on the grant
feed, and ``mesh explain``'s answer — pure functions of what was decided."""

from __future__ import annotations

from typing import Any

from mesh import constants as c
from mesh.core.events import LogEntry
from mesh.core.pressure import StageChange
from mesh.manager.admission import Admitter, Eviction
from mesh.wire.admission import ExplainReply
from mesh.wire.events import OrchestrationEvent


def explain(admitter: Admitter, admission_id: str) -> ExplainReply:
    """What ``mesh explain`` answers: the recorded decision (with its eligibility) and the
    reservation as the ledger holds it now. Runs where the admitter runs."""
    record = admitter.recorded(admission_id)
    if record is not None:
        record = admitter.with_eligibility(record)
    reservation = admitter.ledger.get(admission_id)
    held = (
        None
        if reservation is None
        else {
            "state": reservation.state,
            "fence": reservation.fence,
            "pool_id": reservation.pool_id,
            "expires_at": reservation.expires_at,
            "created_at": reservation.created_at,
            "updated_at": reservation.updated_at,
            # When it stopped holding: released by its holder, or expired by the sweep.
            "released_at": None if reservation.holding else reservation.updated_at,
            "items": [list(item) for item in reservation.items],
        }
    )
    if record is None:
        return ExplainReply(admission_id=admission_id, found=held is not None, reservation=held)
    return ExplainReply(
        admission_id=admission_id,
        found=True,
        decision=record.decision,
        eligibility=record.eligibility,
        reservation=held,
        tenant=record.tenant,
    )


def eviction_entry(eviction: Eviction) -> LogEntry:
    """The journal entry of a grant taken back for more urgent work."""
    victim = eviction.victim
    return LogEntry(
        at=eviction.at,
        kind="admission_evicted",
        reason=f"{victim.pool_id}: fence {victim.fence} released for {eviction.for_admission}",
        detail={
            "admission_id": victim.admission_id,
            "pool_id": victim.pool_id,
            "fence": victim.fence,
            "tenant": eviction.holding.tenant,
            "for_admission": eviction.for_admission,
        },
    )


def stage_change_entry(change: StageChange) -> LogEntry:
    """The journal entry of a pool's shedding stage changing, with when and why."""
    return LogEntry(
        at=change.at,
        kind="pressure_stage",
        reason=f"{change.pool_id}: {change.old.name} -> {change.new.name} ({change.cause})",
        detail={
            "pool_id": change.pool_id,
            "from": change.old.name,
            "to": change.new.name,
            "cause": change.cause,
        },
    )


def revocation_event(
    pool_id: str,
    admission_id: str,
    fence: int,
    state: str,
    now: float,
    evicted: bool = False,
    security: str | None = None,
) -> OrchestrationEvent:
    """The ``grant_revoked`` event telling a pool's agents that grants of ``admission_id`` up
    to ``fence`` are void (``evicted``: taken back for more urgent work, so its agent stops it
    if running; ``security``: the operator's reason for a revocation). Published on the
    events exchange as ``grant.<pool>.<admission>``."""
    detail: dict[str, Any] = {"admission_id": admission_id, "pool_id": pool_id, "fence": fence}
    if evicted:
        detail["evicted"] = True
    if security is not None:
        detail["security"] = security
    return OrchestrationEvent(
        at=now,
        kind=c.EVENT_GRANT_REVOKED,
        to_state=state,
        reason=f"fence {fence}" + (" (evicted)" if evicted else ""),
        detail=detail,
    )
