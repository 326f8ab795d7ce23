"""Admission's I/O shell: the ledger store, external grants and the pure admission core.

Theory of operation
-------------------
What to grant is decided by :class:`~mesh.core.admission.AdmissionCore` (sans I/O; its
module docstring has the rules). :class:`Admitter` runs each batch as one ledger
transaction (:meth:`LedgerStore.batch`, group commit):

1. read the view: the counters, the batch's IDs' reservations and recorded decisions, and a
   block of fresh fences (:meth:`LedgerStore.read_for_decision`);
2. have the core decide every request against it;
3. take the external grants (resources outside the ledger) of the requests that need them,
   in one global fixed order (by name), each a short-TTL provisional grant keyed by the
   admission ID; one refused → everything taken for that request is given back, newest
   first, and the core turns it into a deferral;
4. have the store apply the core's ledger operations (:meth:`LedgerStore.apply`) and commit.

Nothing is replied before that commit. If the transaction fails, the external grants it took
are released, the core puts its pressure board back, and the batch is decided again: without
the grant that changed under it (:class:`~mesh.errors.StaleView`: another manager released
it), or one request per transaction; a request whose own transaction fails gets ``deferred``
/ ``LEDGER_UNAVAILABLE`` (retrying the same admission ID is always safe).

Descriptors, releases and expiry are single ledger calls made here, and then told to the
core. Every method runs on one thread (the manager's ledger thread): the core is touched from
nowhere else. Its descriptors, epochs and shadows are replaced rather than changed, so the
status page may read them from the event loop.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mesh.core.admission import AdmissionCore, AdmissionPolicy
from mesh.core.answers import refused
from mesh.core.batch import Batch, Eviction, PendingExternal
from mesh.core.capacity import LiveCapacity
from mesh.core.decision_memory import DECISION_CACHE_SIZE, SNAPSHOT_CACHE_SIZE
from mesh.core.eligibility import EligibilityCache, EligibilitySnapshot, capacities
from mesh.core.eligibility import tenant_tokens_resource as _tenant_tokens_resource
from mesh.core.pressure import PoolPressure, PressureBoard, StageChange
from mesh.core.records import DecisionRecord, parse_record, remembered_as_kept
from mesh.errors import StaleView, StoreError
from mesh.leases import LeaseSigner
from mesh.ledger.model import (
    TENANT_POOL,
    DecisionRow,
    Refused,
    Reservation,
    Usage,
)
from mesh.ledger.store import LedgerStore
from mesh.manager.settlement import Settled, settled_all
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionReleaseReply,
    AdmissionRequest,
    CapabilityDescriptor,
    requirement_digest,
)

__all__ = [
    "DECISION_CACHE_SIZE",
    "SNAPSHOT_CACHE_SIZE",
    "AdmissionPolicy",
    "Admitted",
    "Admitter",
    "DecisionRecord",
    "Eviction",
    "ExternalGrantor",
]

log = logging.getLogger(__name__)

STALE_RETRIES = 3
"""How many times a transaction is decided, on a fresh view each time, while the ledger
changes under it (another manager) before it fails."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """One batch, decided and committed: a decision per request (in order), the record of
    each (``None`` if it was not kept), the capacity misses and evictions it made, and the
    outcome of each release that came with it (in order; see :meth:`Admitter.settle_many`),
    or the ledger's error if they could not be settled."""

    decisions: list[AdmissionDecision]
    records: list[DecisionRecord | None]
    misses: list[tuple[str, str]]
    evictions: list[Eviction]
    settled: list[tuple[AdmissionReleaseReply, bool, str | None]] | StoreError
    # The decisions that gave the grant the ledger already held for their ID (a retried or
    # redelivered request): journaled as replays, not as second grants.
    replayed: frozenset[str] = frozenset()


class ExternalGrantor(Protocol):
    """A resource outside the ledger (a GPU lease, a third-party rate limit…)."""

    name: str

    def request(self, admission_id: str, pool_id: str, ttl_s: float, now: float) -> str | None:
        """A provisional grant ID, or ``None`` if refused. Must be idempotent per admission."""
        ...

    def release(self, admission_id: str, grant_id: str) -> None: ...


@dataclass
class Admitter:
    """The ledger, external grants and the admission core, composed. Not thread-safe: the
    manager calls it from its one ledger thread (the ledger store itself is safe across
    processes)."""

    ledger: LedgerStore
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    grantors: Sequence[ExternalGrantor] = ()
    rand: Callable[[], float] = random.random  # retry-time jitter (an input, for tests)
    core: AdmissionCore = field(init=False)
    # The pressure board's pools as the last observe() left them: a copy of the mapping made
    # on the admitter's thread, which the status page and metrics read from the event loop.
    pools_seen: Mapping[str, PoolPressure] = field(default_factory=dict, init=False)
    # Every stored descriptor's epoch, as the last batch's view read it (LedgerView.epochs).
    stored_epochs: Mapping[str, int] = field(default_factory=dict, init=False)
    # Replayed grants committed since admit_batch last handed them on (Admitted.replayed).
    _replayed: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.core = AdmissionCore(
            self.policy, rand=lambda: self.rand(), external_grants=bool(self.grantors)
        )

    # ---- the core's state, as the manager and tests read it -------------------------------
    @property
    def descriptors(self) -> Mapping[str, CapabilityDescriptor]:
        return self.core.descriptors

    @property
    def active_epochs(self) -> Mapping[str, int]:
        return self.core.active_epochs

    @property
    def shadows(self) -> Mapping[str, CapabilityDescriptor]:
        return self.core.shadows

    @property
    def pressure(self) -> PressureBoard:
        return self.core.pressure

    @property
    def decisions(self) -> OrderedDict[str, DecisionRecord]:
        return self.core.decisions

    @property
    def eligibility_cache(self) -> EligibilityCache:
        return self.core.eligibility_cache

    @property
    def draining(self) -> dict[str, dict[str, float]]:
        return self.core.draining

    @property
    def lease_signer(self) -> LeaseSigner | None:
        return self.core.lease_signer

    @lease_signer.setter
    def lease_signer(self, signer: LeaseSigner | None) -> None:
        self.core.lease_signer = signer

    def recover_pressure(self, now: float) -> int:
        """Count the grants the ledger holds (after a restart) on the pressure board: the
        fair shares need to know who holds what. Returns how many were adopted."""
        holding = self.ledger.active()
        rows = self.ledger.decisions([r.admission_id for r in holding])  # one read, not N
        for reservation in holding:
            row = rows.get(reservation.admission_id)
            self.core.adopt(reservation, self._parsed(row) if row is not None else None, now)
        self.observe_usage(now)
        return len(holding)

    def recover_lines(self, now: float) -> int:
        """Rebuild the admission lines from the ledger's recent deferrals (after a restart):
        a request deferred with a place keeps it, ahead of the requests that first ask after
        the restart. Only deferrals that could still be due are read (the longest retry time
        and the grace). Returns how many places were taken again."""
        pressure = self.core.policy.pressure
        if not (pressure.enabled and pressure.line):
            return 0
        horizon_s = pressure.retry_max_ms / 1000.0 + pressure.line_grace_s
        waiting = []
        for row in self.ledger.deferred_since(now - horizon_s):
            decided = self._parsed(row)
            if decided is not None and decided.line:
                waiting.append((row.admission_id, decided))
        return self.core.rejoin_lines(waiting, now)

    def observe_usage(self, now: float, usage: Usage | None = None) -> None:
        """Refresh the board's utilisation from the ledger's counters (every tick: they
        include other managers' grants); ``usage``: a snapshot already read."""
        self.core.observe_usage(self.ledger.usage() if usage is None else usage, now)

    # ---- descriptors ----------------------------------------------------------------------
    def publish_descriptor(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Make ``descriptor`` its pool's active one; ``None``, or why it was refused."""
        current = self.core.active_epochs.get(descriptor.pool_id)
        if current is not None and descriptor.descriptor_epoch < current:
            return f"epoch {descriptor.descriptor_epoch} is older than the active {current}"
        if descriptor.expires_at <= now:
            return "the descriptor has already expired"
        body = descriptor.model_dump_json()
        if not self.ledger.save_descriptor(descriptor.pool_id, descriptor.descriptor_epoch, body):
            self.load_descriptors()  # another manager stored a newer epoch meanwhile
            return "a newer epoch of this pool's descriptor is already stored"
        self.core.activate(descriptor)
        for resource, capacity in capacities(descriptor).items():
            self.ledger.set_capacity(descriptor.pool_id, resource, capacity)
        if current is not None and descriptor.descriptor_epoch > current:
            self._advance(descriptor.pool_id, now)
        return None

    def _advance(self, pool_id: str, now: float) -> None:
        """The pool moved to a new epoch: reservations not yet ACTIVE are released (they would
        become grants of a retired epoch); the ACTIVE ones go on the draining allowlist — their
        attempts may finish under the old epoch, nothing new starts under it."""
        allowlist: dict[str, float] = {}
        for reservation in self.ledger.active():
            if reservation.pool_id != pool_id:
                continue
            if reservation.state == "PREPARING":
                if not isinstance(
                    self.ledger.release(reservation.admission_id, reservation.fence, now), Refused
                ):
                    self.core.ended(reservation.admission_id, now, completed=False)
                    log.info(
                        "reservation released: its pool moved to a new epoch",
                        extra={"admission_id": reservation.admission_id, "pool_id": pool_id},
                    )
            else:
                allowlist[reservation.admission_id] = reservation.expires_at
        self.core.draining[pool_id] = allowlist

    def set_shadow(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Shadow ``descriptor`` (a newer epoch than the active one); ``None`` or why not."""
        return self.core.set_shadow(descriptor, now)

    def drop_shadow(self, pool_id: str) -> CapabilityDescriptor | None:
        return self.core.drop_shadow(pool_id)

    def draining_allowlist(self, pool_id: str, now: float) -> list[str] | None:
        """The admissions whose older-epoch grants the pool's agents still honour (see
        :meth:`AdmissionCore.draining_allowlist`)."""
        return self.core.draining_allowlist(pool_id, now)

    def load_descriptors(self) -> int:
        """Adopt every stored descriptor newer than ours (at start, and on every tick: other
        managers on the same ledger may have accepted one). Returns how many were adopted."""
        adopted = 0
        for pool_id, epoch, body in self.ledger.descriptors(known=self.core.active_epochs):
            if self.core.active_epochs.get(pool_id, 0) >= epoch:
                continue
            try:
                self.core.activate(CapabilityDescriptor.model_validate_json(body))
            except ValueError:
                log.error("a stored descriptor no longer validates", extra={"pool_id": pool_id})
                continue
            adopted += 1
        return adopted

    def _newer_stored(self) -> bool:
        """Whether the last view saw a stored descriptor newer than the one we hold (or of a
        pool we do not know): another manager's, not loaded yet."""
        active = self.core.active_epochs
        return any(epoch > active.get(pool, 0) for pool, epoch in self.stored_epochs.items())

    def set_active_epoch(self, pool_id: str, epoch: int) -> None:
        """Make ``epoch`` the pool's active descriptor epoch (a rollout that moves on before
        its descriptor arrives): descriptors of other epochs are no longer eligible."""
        self.core.set_active_epoch(pool_id, epoch)

    def set_tenant_budget(self, tenant: str, tokens: int) -> None:
        self.ledger.set_capacity(TENANT_POOL, _tenant_tokens_resource(tenant), tokens)
        self.core.budgets_set.add(tenant)

    # ---- admission ------------------------------------------------------------------------
    def admit(
        self,
        request: AdmissionRequest,
        tenant: str,
        now: float,
        live: LiveCapacity | None = None,
    ) -> AdmissionDecision:
        """Decide one request (one ledger transaction)."""
        (decision,) = self.admit_many([(request, tenant)], now, live)
        return decision

    def admit_many(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        now: float,
        live: LiveCapacity | None = None,
    ) -> list[AdmissionDecision]:
        """Decide ``(request, authenticated tenant)`` pairs in order, in one ledger
        transaction (group commit); one decision each, in the same order.

        ``live``: the registry's live capacity (the manager always passes it). ``None``
        leaves it out — the descriptors and the ledger alone decide, as for a caller that
        tracks no agents (the ledger's own tests and benchmarks)."""
        return self._admit_many(requests, now, live, ())[0]

    def _admit_many(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        now: float,
        live: LiveCapacity | None,
        releases: Sequence[tuple[str, int]],
    ) -> tuple[list[AdmissionDecision], list[Reservation | Refused] | None]:
        """:meth:`admit_many`, with ``releases`` settled in the same transaction after the
        batch's writes; their ledger outcomes, or ``None`` where the batch failed as a whole
        (its requests are then decided one by one, the releases left to the caller)."""
        if not requests:
            return [], None
        try:
            return self._decided(requests, now, live, releases)
        except StoreError as exc:
            if len(requests) == 1:
                log.warning("ledger unavailable", extra={"error": str(exc)})
                return [_unavailable(requests[0][0].admission_id, exc)], None
            log.warning(
                "a batch of admissions failed; deciding them one by one",
                extra={"batch": len(requests), "error": str(exc)},
            )
        decisions = []
        for pair in requests:
            try:
                decisions += self._decided([pair], now, live, ())[0]
            except StoreError as exc:
                decisions.append(_unavailable(pair[0].admission_id, exc))
        return decisions, None

    def _decided(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        now: float,
        live: LiveCapacity | None,
        releases: Sequence[tuple[str, int]],
    ) -> tuple[list[AdmissionDecision], list[Reservation | Refused] | None]:
        """One transaction's decisions, decided again on a fresh view while the ledger
        changed under it (another manager on the same ledger), at most STALE_RETRIES times."""
        for attempt in range(1, STALE_RETRIES + 1):
            try:
                return self._in_one_transaction(requests, now, live, releases)
            except StaleView as stale:
                if stale.admission_id is not None:  # a grant it evicts ended meanwhile
                    self.core.ended(stale.admission_id, now, completed=False)
                if attempt == STALE_RETRIES:
                    raise
                log.info("the ledger changed under a batch; deciding it again",
                         extra={"error": str(stale), "batch": len(requests)})  # fmt: skip
        raise AssertionError("unreachable")

    def admit_batch(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        now: float,
        live: LiveCapacity | None = None,
        releases: Sequence[tuple[str, int]] = (),
    ) -> Admitted:
        """:meth:`admit_many`, with everything the manager does next with the batch taken
        here, on the admitter's thread: the records behind the decisions, the capacity
        misses and the evictions it committed. ``releases`` (``(admission ID, fence)``) are
        settled in the batch's own transaction, after its writes — one commit for both, as
        :meth:`settle_many` would settle them (alone if the batch failed, or had no
        requests)."""
        decisions, released = self._admit_many(requests, now, live, releases)
        unknown = [
            i for i, d in enumerate(decisions) if d.reason is AdmissionReason.NO_ELIGIBLE_POOL
        ]
        if unknown and self._newer_stored() and self.load_descriptors():
            # Another manager on the same ledger accepted a descriptor since our last tick:
            # decide those again with it rather than reject them until the next tick (a
            # rejection is final to a producer). The batch's view says whether one is
            # stored, so a request for a capability nobody offers costs no extra read.
            again = self.admit_many([requests[i] for i in unknown], now, live)
            for i, decision in zip(unknown, again, strict=True):
                decisions[i] = decision
        records = [self.core.decisions.get(d.admission_id) for d in decisions]
        settled: list[tuple[AdmissionReleaseReply, bool, str | None]] | StoreError = []
        if released is not None:
            settled = settled_all(self.ledger, self.core, releases, released, now)
        elif releases:
            try:
                settled = self.settle_many(releases, now)
            except StoreError as exc:  # the releases' callers hear of it; the decisions stand
                settled = exc
        replayed, self._replayed = frozenset(self._replayed), set()
        return Admitted(
            decisions, records, self.drain_misses(), self.drain_evictions(), settled, replayed
        )

    def observe(
        self,
        now: float,
        usage: Usage | None = None,
        *,
        queues: Mapping[str, tuple[int, float | None]] | None = None,
        broker_blocked: bool = False,
    ) -> list[StageChange]:
        """Feed the pressure board one tick's signals — the ledger's counters, each pool
        queue's ``(depth, head age)`` when polled, the broker's alarm — and return the stage
        changes since the last call. Without ``usage`` the counters are read here, on the
        admitter's thread: a snapshot read earlier may predate a batch committed since, and
        would set the board's utilisation below the grants it counts itself (a stale
        ``used`` under a full pool refused one tenant's request as TENANT_FAIR_SHARE)."""
        self.core.observe_usage(self.ledger.usage() if usage is None else usage, now)
        for pool_id, (depth, age) in (queues or {}).items():
            self.core.pressure.observe_queue(pool_id, depth, age, now)
        self.core.pressure.observe_broker(broker_blocked, now)
        self.pools_seen = dict(self.core.pressure.pools)
        return self.core.pressure.drain_changes()

    def sync_live(self, live: LiveCapacity, now: float) -> None:
        """Bring the ledger's live-slot capacities up to ``live`` without deciding anything
        (every tick: so the ledger, ``mesh status`` and the pressure stages show the pool's
        live figure even while no admission comes). One transaction, only if one changed."""
        if self.core.writes_live and not self.core.live_unchanged(live):
            self._in_one_transaction([], now, live)

    def _in_one_transaction(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        now: float,
        live: LiveCapacity | None,
        releases: Sequence[tuple[str, int]] = (),
    ) -> tuple[list[AdmissionDecision], list[Reservation | Refused] | None]:
        taken: list[tuple[ExternalGrantor, str, str]] = []  # every external grant, to undo
        decided: list[Batch] = []

        def work() -> tuple[Batch, list[Reservation | Refused] | None]:
            ids = [request.admission_id for request, _ in requests]
            view = self.ledger.read_for_decision(ids, fences=len(requests))
            self.stored_epochs = view.epochs
            batch = self.core.decide(requests, view, now, live)
            decided.append(batch)
            for pending in list(batch.pending):
                self._take_external(batch, pending, now, taken)
            self.ledger.apply(batch.ops)
            # The last call of the batch (with PostgreSQL it goes with the writes).
            return batch, self.ledger.release_many(releases, now) if releases else None

        try:
            batch, released = self.ledger.batch(work)
        except BaseException:
            for grantor, admission_id, grant_id in reversed(taken):
                grantor.release(admission_id, grant_id)  # nothing of the batch was kept
            if decided:
                self.core.abandoned(decided[0], now)
            raise
        self.core.committed(batch)
        self._replayed |= batch.replayed
        return batch.final(), released

    def _take_external(
        self,
        batch: Batch,
        pending: PendingExternal,
        now: float,
        taken: list[tuple[ExternalGrantor, str, str]],
    ) -> None:
        """Every external grant of one pending request, in the one global order (by name);
        the first refusal gives back what this request took, newest first."""
        admission_id, pool_id = pending.reservation.admission_id, pending.reservation.pool_id
        mine: list[tuple[ExternalGrantor, str, str]] = []
        for grantor in sorted(self.grantors, key=lambda g: g.name):
            grant_id = grantor.request(admission_id, pool_id, self.policy.prepare_ttl_s, now)
            if grant_id is None:
                for earlier, _, earlier_id in reversed(mine):
                    earlier.release(admission_id, earlier_id)
                self.core.settle_external(batch, pending, now, refused_by=grantor.name)
                return
            mine.append((grantor, admission_id, grant_id))
        taken += mine
        self.core.settle_external(batch, pending, now, grant_ids=[g for _, _, g in mine])

    def drain_misses(self) -> list[tuple[str, str]]:
        """``(pool, reason)`` of the capacity deferrals committed since the last call (the
        shell tells the scale planner)."""
        misses, self.core.misses = self.core.misses, []
        return misses

    def drain_evictions(self) -> list[Eviction]:
        """The evictions committed since the last call (the shell revokes their grants)."""
        evictions, self.core.evictions = self.core.evictions, []
        return evictions

    # ---- decisions recorded ---------------------------------------------------------------
    def recorded(self, admission_id: str) -> DecisionRecord | None:
        """The latest decision about ``admission_id``: the ledger's (made here, before a
        restart, or by another manager since), else the cache's. One read back from the
        ledger names its eligibility snapshot without it: see :meth:`with_eligibility`."""
        row = self.ledger.decision(admission_id)
        cached = self.core.decisions.get(admission_id)
        if row is None or remembered_as_kept(cached, row):
            return cached  # its snapshot at hand
        return self._parsed(row)

    def answered_before(self, request: AdmissionRequest, tenant: str) -> AdmissionDecision | None:
        """For a redelivered request (the manager it went to stopped before acking it): the
        deferral or refusal the ledger records for it, to be given again — the answer that
        manager may already have sent — rather than decided anew, which could differ (a grant
        where it had deferred: one request answered twice, differently). ``None``: nothing
        recorded for these requirements, or a grant, which the batch gives again (journaled
        ``replayed``). A recorded deferral may be an earlier attempt's, not this one's: its
        caller then retries once more than it would have."""
        row = self.ledger.decision(request.admission_id)
        if row is None or row.outcome == "admitted":
            return None
        if row.digest != requirement_digest(request.requirements, tenant):
            return None  # another request's: the batch answers CONFLICT
        decided = self._parsed(row)
        return None if decided is None else decided.decision

    @staticmethod
    def _parsed(row: DecisionRow) -> DecisionRecord | None:
        decided = parse_record(row)
        if decided is None:
            log.error(
                "a stored decision no longer validates", extra={"admission": row.admission_id}
            )
        return decided

    def with_eligibility(self, decided: DecisionRecord) -> DecisionRecord:
        """``decided`` with the eligibility snapshot it names filled in (a record read back
        from the ledger names it only); what it read is kept in the core's snapshot cache."""
        ref = decided.eligibility_ref
        if ref is None or decided.snapshot is not None:
            return decided
        snapshot = self.core.snapshots.get(ref)
        if snapshot is None:
            body = self.ledger.eligibility(ref)
            if body is None:
                log.error("a decision names an eligibility snapshot the ledger lacks",
                          extra={"ref": ref})  # fmt: skip
                return decided
            try:
                snapshot = EligibilitySnapshot.parse(ref, body)
            except ValueError as exc:
                log.error("a stored eligibility snapshot is damaged",
                          extra={"ref": ref, "error": str(exc)})  # fmt: skip
                return decided
            self.core.known_snapshot(ref, snapshot)
        decided.snapshot = snapshot
        return decided

    def explain(self, admission_id: str) -> dict[str, Any] | None:
        """The recorded decision and the eligibility record behind it, as plain data (what
        ``mesh explain`` answers is :func:`mesh.manager.admission_records.explain`)."""
        decided = self.recorded(admission_id)
        if decided is None:
            return None
        decided = self.with_eligibility(decided)
        return {
            "decision": decided.decision.model_dump(mode="json"),
            "eligibility": decided.eligibility,
            "tenant": decided.tenant,
            "estimate": decided.estimate,
        }

    # ---- release and expiry ---------------------------------------------------------------
    def release(self, admission_id: str, fence: int, now: float) -> AdmissionReleaseReply:
        """Settle a phase: the grant's holder gives it back. A stale fence changes nothing;
        the same release again (same admission, same fence) answers as the first did."""
        reply, _ = self.settle(admission_id, fence, now)
        return reply

    def settle(
        self, admission_id: str, fence: int, now: float
    ) -> tuple[AdmissionReleaseReply, bool]:
        """:meth:`release`, and whether this call released it (``False``: refused, or
        released before at this very fence — a retry, say after the manager that applied it
        died before answering — which is answered ``released`` again and changes nothing). A
        grant this manager evicted is refused as evicted; after a restart it is not known as
        such, and its holder's release is answered as a retry."""
        reply, released_now, _ = self.settle_many([(admission_id, fence)], now)[0]
        return reply, released_now

    def settle_many(self, releases: Sequence[tuple[str, int]], now: float) -> list[Settled]:
        """:meth:`settle` for releases that arrived together, in one ledger transaction (the
        manager's group commit: one commit shared by all of them), each with the pool it was
        released from when this call released it. The pressure board hears of them only once
        the transaction is kept; if it fails as a whole, each is settled again in a
        transaction of its own."""
        try:
            released = self.ledger.release_many(releases, now)
        except StoreError:
            if len(releases) == 1:
                raise
            released = [self.ledger.release(a, f, now) for a, f in releases]
        return settled_all(self.ledger, self.core, releases, released, now)

    def expire(self, now: float) -> list[Reservation]:
        """Overdue reservations → EXPIRED under a higher fence."""
        expired = self.ledger.expire_due(now)
        for reservation in expired:
            self.core.ended(reservation.admission_id, now, completed=False)
        return expired


def _unavailable(admission_id: str, exc: StoreError) -> AdmissionDecision:
    return refused(
        admission_id,
        AdmissionReason.LEDGER_UNAVAILABLE,
        f"the reservation ledger failed: {exc}; retry with the same admission ID",
        deferred=True,
        retry_after_ms=1_000,
    )
