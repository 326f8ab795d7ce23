"""The decision record: what the ledger keeps about an admission ID's latest decision.

One record per ID — the decision, the requirements' estimates, the eligibility it was decided
from (by reference to a shared snapshot) and the places in line a deferral holds — written
as JSON and parsed back by ``mesh explain``, settlement and a restarted manager. Separate from
the decision itself because three readers depend on its format, not on how it was decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from mesh.core.eligibility import EligibilitySnapshot
from mesh.ledger.model import DecisionRow
from mesh.wire.admission import AdmissionDecision, TaskRequirements

__all__ = ["DecisionRecord", "estimate", "parse_record", "remembered_as_kept"]

_DECISION_JSON = AdmissionDecision.__pydantic_serializer__  # model_dump_json minus a wrapper


@dataclass(slots=True)
class DecisionRecord:
    """The latest decision about an admission ID, with what it was decided from.

    The eligibility behind it is a snapshot shared by every request that got the same
    verdicts (stored once, named by ``eligibility_ref``), the time it was evaluated at and,
    with shadow descriptors, the shadow comparison. Records written before snapshots carry the
    eligibility record in full (``inline``)."""

    digest: str
    decision: AdmissionDecision
    tenant: str | None = None
    estimate: dict[str, Any] | None = None  # what settlement compares actual cost with
    snapshot: EligibilitySnapshot | None = None  # None until resolved, for a record read back
    evaluated_at: float | None = None
    shadow: dict[str, Any] | None = None
    eligibility_ref: str | None = None
    inline: dict[str, Any] | None = None
    # The places in line a deferred request holds after this decision, each
    # ``[pool_id, service_class, joined_at, due_by]``: a restarted manager rebuilds its lines
    # from them (AdmissionCore.rejoin_lines), so a place outlives the process that gave it.
    line: list[list[Any]] | None = None

    @property
    def eligibility(self) -> dict[str, Any] | None:
        """The eligibility record as ``mesh explain`` shows it (``None``: not known)."""
        if self.snapshot is None:
            return self.inline
        record = {**self.snapshot.record, "now": self.evaluated_at}
        if self.shadow is not None:
            record["shadow"] = self.shadow
        return record

    def to_json(self) -> str:
        record: dict[str, Any] = {
            "decision": orjson.Fragment(
                _DECISION_JSON.to_json(self.decision, exclude_defaults=True)
            ),
            "tenant": self.tenant,
            "estimate": self.estimate,
        }
        if self.eligibility_ref is not None:
            record["eligibility_ref"] = self.eligibility_ref
            record["evaluated_at"] = self.evaluated_at
            if self.shadow is not None:
                record["shadow"] = self.shadow
        else:
            record["eligibility"] = self.inline
        if self.line:
            record["line"] = self.line
        return orjson.dumps(record).decode()

    @classmethod
    def from_row(cls, row: DecisionRow) -> DecisionRecord:
        """The record as stored; a snapshot it names is left to resolve (``snapshot`` None).
        Raises ``ValueError``, ``KeyError`` or ``TypeError`` for a damaged record (see
        :func:`parse_record`)."""
        record = orjson.loads(row.record)
        return cls(
            row.digest,
            AdmissionDecision.model_validate(record["decision"]),
            tenant=record.get("tenant"),
            estimate=record.get("estimate"),
            evaluated_at=record.get("evaluated_at"),
            shadow=record.get("shadow"),
            eligibility_ref=record.get("eligibility_ref"),
            inline=record.get("eligibility"),
            line=record.get("line"),
        )


def remembered_as_kept(remembered: DecisionRecord | None, row: DecisionRow) -> bool:
    """Whether a decision a manager remembers is the one the ledger keeps (``row``): the
    same outcome for the same requirements. With several managers the ledger's may be newer
    (another manager decided since), and then it is the one that holds."""
    return remembered is not None and (remembered.decision.outcome, remembered.digest) == (
        row.outcome,
        row.digest,
    )


def parse_record(row: DecisionRow) -> DecisionRecord | None:
    """A stored decision record, or ``None`` if it no longer validates (the caller logs)."""
    try:
        return DecisionRecord.from_row(row)
    except (ValueError, KeyError, TypeError):  # not JSON, a field missing, or of another type
        return None


def estimate(requirements: TaskRequirements) -> dict[str, Any]:
    """The requirements' cost estimates and class, kept with the decision for settlement
    and for the pressure board after a restart."""
    return {
        "capability": requirements.capability.name,
        "service_class": requirements.service_class,
        "priority": requirements.priority,
        "recoverability": requirements.recoverability,
        "run_id": requirements.run_id,
        "estimated_tokens": requirements.estimated_tokens,
        "estimated_duration_s": requirements.estimated_duration_s,
        "deadline": requirements.deadline,
    }
