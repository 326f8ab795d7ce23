"""What the admission core remembers of earlier decisions, and how it has the ledger keep
new ones.

A retried or redelivered request must get the answer it got before (the same grant, or
``CONFLICT`` for other requirements under its ID). :class:`DecisionMemory` finds that answer
— this batch's, else the ledger view's, else its own bounded cache — and turns each new
decision into a :class:`~mesh.ledger.model.RecordDecision` (and each new eligibility
snapshot into a :class:`~mesh.ledger.model.SaveEligibility`). It is kept apart from deciding
because it knows nothing of pools, counters or pressure: only IDs, digests and records.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mesh.core.answers import refused
from mesh.core.batch import Batch
from mesh.core.eligibility import EligibilitySnapshot
from mesh.core.records import DecisionRecord, parse_record, remembered_as_kept
from mesh.ledger.model import DecisionRow, RecordDecision, SaveEligibility
from mesh.wire.admission import AdmissionDecision, AdmissionReason

__all__ = ["DECISION_CACHE_SIZE", "SNAPSHOT_CACHE_SIZE", "DecisionMemory"]

DECISION_CACHE_SIZE = 4096
"""Recent decisions kept in memory; older ones are read back from the ledger."""

SNAPSHOT_CACHE_SIZE = 1024
"""Eligibility snapshots kept in memory (known to be stored, or read back for a record)."""


@dataclass
class DecisionMemory:
    """Recent decisions by admission ID, and the eligibility snapshots known to be stored."""

    decisions: OrderedDict[str, DecisionRecord] = field(default_factory=OrderedDict)
    # Eligibility snapshots by ref: stored in the ledger, or read back from it (bounded).
    snapshots: dict[str, EligibilitySnapshot] = field(default_factory=dict)

    def earlier_decision(
        self, batch: Batch, admission_id: str, digest: str
    ) -> AdmissionDecision | None:
        """The answer already given to this admission ID, if it still holds. A reservation
        without a recorded decision (its manager stopped mid-way) is found when reserving."""
        decided = self.recorded_for(batch, admission_id)
        if decided is None:
            return None
        if decided.digest != digest:
            return refused(
                admission_id,
                AdmissionReason.CONFLICT,
                "this admission ID was used with other requirements",
            )
        if decided.decision.outcome == "admitted":
            return decided.decision  # the same request: the same grant
        # Rejected or deferred before: nothing was reserved, so decide again — a producer told
        # to retry after ``retry_after_ms`` retries with the same admission ID.
        return None

    def recorded_for(self, batch: Batch, admission_id: str) -> DecisionRecord | None:
        """This batch's decision about ``admission_id``, else the view's, else the cache's.
        The view was read in the batch's transaction: with several managers it may hold a
        decision newer than the one this manager remembers (the pool's shard moved away and
        back, and another manager granted what this one had deferred)."""
        decided = batch.decided.get(admission_id)
        if decided is not None:
            return decided
        row = batch.view.decisions.get(admission_id)
        cached = self.decisions.get(admission_id)
        if row is None or remembered_as_kept(cached, row):
            return cached  # spares parsing the row
        return parse_record(row)

    def record(self, batch: Batch, decided: DecisionRecord, now: float) -> None:
        """Have the ledger keep the decision — unless the ID's recorded decision is for
        another digest (that one stays: this request is the conflict)."""
        admission_id = decided.decision.admission_id
        stored = batch.decided.get(admission_id)
        stored_digest = stored.digest if stored is not None else None
        if stored is None:
            row = batch.view.decisions.get(admission_id)
            stored_digest = row.digest if row is not None else None
        if stored_digest is not None and stored_digest != decided.digest:
            return
        batch.ops.append(
            RecordDecision(
                DecisionRow(
                    admission_id, decided.digest, decided.decision.outcome, now,
                    decided.to_json(),
                )
            )
        )  # fmt: skip
        batch.decided[admission_id] = decided

    def store_snapshot(self, batch: Batch, snapshot: EligibilitySnapshot) -> EligibilitySnapshot:
        """Have the ledger keep ``snapshot`` unless it is known to; returns it."""
        if snapshot.ref not in self.snapshots and snapshot.ref not in batch.snapshots:
            batch.ops.append(SaveEligibility(snapshot.ref, snapshot.body))
            batch.snapshots[snapshot.ref] = snapshot
        return snapshot

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: remember its decisions and snapshots."""
        for admission_id, decided in batch.decided.items():
            self.remember(admission_id, decided)
        for ref, snapshot in batch.snapshots.items():
            self.known_snapshot(ref, snapshot)

    def remember(self, admission_id: str, decided: DecisionRecord) -> None:
        self.decisions[admission_id] = decided
        self.decisions.move_to_end(admission_id)
        while len(self.decisions) > DECISION_CACHE_SIZE:
            self.decisions.popitem(last=False)

    def known_snapshot(self, ref: str, snapshot: EligibilitySnapshot) -> None:
        self.snapshots[ref] = snapshot
        if len(self.snapshots) > SNAPSHOT_CACHE_SIZE:
            del self.snapshots[next(iter(self.snapshots))]  # the oldest; stored regardless
