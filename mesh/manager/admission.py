"""Admission: from a producer's requirements to a grant that reserves the whole resource chain.

Theory of operation
-------------------
:class:`Admitter` is synchronous and talks to the ledger store directly (the manager calls
it in a worker thread); time is a parameter. One admission:

1. **Idempotency.** ``requirement_digest(requirements, tenant)`` keys the request with its
   ``admission_id``. A known ID with another digest is ``CONFLICT`` at once; the same digest
   gets the same grant again while its reservation is ACTIVE. A request that reserved nothing
   (deferred, or rejected) is decided afresh when retried: capacity or descriptors may have
   changed, and the ledger guarantees nothing is ever taken twice.
2. **Eligibility** (pure, :mod:`mesh.core.eligibility`) over the latest descriptor of every
   pool, the active epochs and the active policy generation. The record of which rule
   filtered which pool is kept for ``explain``.
3. **Live agents.** Given the registry's :class:`~mesh.core.capacity.LiveCapacity` (the
   manager always gives it), a pool with no live agent whose version of the capability is in
   both the task's range and the descriptor's is skipped (``NO_LIVE_AGENT``), and every
   reservation also takes the pool's ``live_slots:<capability>`` counter, which each batch
   first brings up to the free concurrency of those agents. So a grant needs a slot the
   descriptor allows *and* one a live agent can run; live capacity shrinking revokes
   nothing, it only stops new grants until there is room.
4. **Reserve.** Eligible pools are tried in the one preference order
   (:mod:`mesh.core.ranking`: cost class, then load); ``ledger.prepare`` takes every counter
   (model slot, live slot, sandbox, tool permits, the tenant's token budget) in one
   transaction or nothing. Only shortage moves on to the next pool.
5. **External grants** (resources outside the ledger) are requested in one global fixed order
   (by name), each a short-TTL provisional grant keyed by the admission ID. If any is refused,
   every grant taken so far is released, newest first, and the PREPARING reservation is
   cancelled — counters are conserved.
6. **Activate** by compare-and-set on the fence → an :class:`AdmissionGrant`.

Refusals are values: ``rejected`` when retrying the same request cannot help (no eligible
pool, stale descriptor, conflict), ``deferred`` with ``retry_after_ms`` when capacity may free
up. Expiry (``expire``) moves overdue reservations to EXPIRED under a new fence, so a stale
holder can neither consume nor release a newer grant.

Group commit. :meth:`Admitter.admit_many` decides a batch — whatever queued up while the
previous batch ran — inside one ledger transaction (:meth:`LedgerStore.batch`), each decision
and its record written before the single commit; nothing is replied before that commit. If the
batch's transaction fails, the external grants it took are released and every request is
decided again in a transaction of its own; a request whose own transaction fails gets
``deferred`` / ``LEDGER_UNAVAILABLE`` (retrying the same admission ID is always safe).

Each decision is recorded in the ledger (digest, outcome, the reply and the eligibility record
behind it), so idempotent replies and ``explain`` survive a restart and are shared by every
manager on one ledger; a bounded cache keeps the recent ones in memory.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from mesh.core import ranking
from mesh.core.capacity import LIVE_SLOTS_PREFIX, LiveCapacity, live_slots_resource
from mesh.core.eligibility import (
    MODEL_SLOTS,
    TENANT_TOKENS_PREFIX,
    EligibilityCache,
    EligibilityResult,
    EligibilitySnapshot,
    capacities,
    check_eligibility,
    fallback_pools,
    reservation_items,
    tenant_tokens_resource,
    widening,
)
from mesh.core.pressure import (
    EVICTION_ORDER,
    Holding,
    PressureBoard,
    PressurePolicy,
    Shed,
    evict_order,
    shed_rank,
)
from mesh.core.ranking import Rank
from mesh.errors import StoreError
from mesh.leases import LeaseSigner
from mesh.ledger.model import TENANT_POOL, LedgerReason, Prepared, Refused, Reservation
from mesh.ledger.store import DecisionRow, LedgerStore, Usage
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionReleaseReply,
    AdmissionRequest,
    CapabilityDescriptor,
    TaskRequirements,
    requirement_digest,
)

log = logging.getLogger(__name__)


class ExternalGrantor(Protocol):
    """A resource outside the ledger (a GPU lease, a third-party rate limit…)."""

    name: str

    def request(self, admission_id: str, pool_id: str, ttl_s: float, now: float) -> str | None:
        """A provisional grant ID, or ``None`` if refused. Must be idempotent per admission."""
        ...

    def release(self, admission_id: str, grant_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    prepare_ttl_s: float = 10.0  # PREPARING holds this long at most
    grant_ttl_s: float = 120.0  # an ACTIVE grant lives this long unless released
    active_generation: int = 1  # the policy generation descriptors must carry
    default_tenant_tokens: int = 10_000_000  # a tenant's token budget unless set otherwise
    # An invocation lease (when the manager signs them) expires with its grant, or this long
    # after it was issued if that is sooner.
    lease_ttl_s: float | None = None
    pressure: PressurePolicy = field(default_factory=PressurePolicy)  # shedding, retry times


_NO_DESCRIPTOR = "no_descriptor"
"""In a shadow record: the pool has no live descriptor (the shadow would create it)."""

DECISION_CACHE_SIZE = 4096
"""Recent decisions kept in memory; older ones are read back from the ledger."""


_DECISION_JSON = AdmissionDecision.__pydantic_serializer__  # model_dump_json minus a wrapper

SNAPSHOT_CACHE_SIZE = 1024
"""Eligibility snapshots kept in memory (known to be stored, or read back for a record)."""


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
        return orjson.dumps(record).decode()

    @classmethod
    def from_row(cls, row: DecisionRow) -> DecisionRecord:
        """The record as stored; a snapshot it names is left to resolve (``snapshot`` None)."""
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
        )


@dataclass(slots=True)
class _Batch:
    """What one ``admit_many`` changed outside the ledger transaction, to undo or publish."""

    decided: dict[str, DecisionRecord] = field(default_factory=dict)
    external: list[tuple[ExternalGrantor, str, str]] = field(default_factory=list)
    budgets: set[str] = field(default_factory=set)  # tenants whose budget row it created
    snapshots: dict[str, EligibilitySnapshot] = field(default_factory=dict)  # it stored
    granted: list[str] = field(default_factory=list)  # admission IDs counted on the board
    evicted: list[Eviction] = field(default_factory=list)
    live_written: dict[tuple[str, str], int] = field(default_factory=dict)
    live_checked: tuple[int, int] | None = None  # (live version, descriptors version) written
    misses: list[tuple[str, str]] = field(default_factory=list)  # (pool, reason) deferred


_MISS_REASONS = frozenset({AdmissionReason.CAPACITY, AdmissionReason.NO_LIVE_AGENT})
"""Deferrals that are capacity misses for the pool's scaling policy."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """Admitted work released to make room: ``victim`` (its reservation, now RELEASED) for
    the admission ``for_admission``. The manager revokes the victim's grant as evicted."""

    victim: Reservation
    holding: Holding
    for_admission: str
    at: float

    @property
    def recoverability(self) -> str:
        order = self.holding.evict_order
        return "(unknown)" if order is None else EVICTION_ORDER[order]


@dataclass
class Admitter:
    """Descriptors, eligibility, the ledger and external grants, composed. Not thread-safe:
    the manager serialises calls (the ledger store itself is safe across processes)."""

    ledger: LedgerStore
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    grantors: Sequence[ExternalGrantor] = ()
    # Change these two through publish_descriptor, load_descriptors and set_active_epoch only:
    # the eligibility cache keys on their version.
    descriptors: dict[str, CapabilityDescriptor] = field(default_factory=dict)
    active_epochs: dict[str, int] = field(default_factory=dict)
    decisions: OrderedDict[str, DecisionRecord] = field(default_factory=OrderedDict)
    pressure: PressureBoard = field(init=False)
    rand: Callable[[], float] = random.random  # retry-time jitter (an input, for tests)
    evictions: list[Eviction] = field(default_factory=list)  # committed; drained by the shell
    eligibility_cache: EligibilityCache = field(default_factory=EligibilityCache)
    lease_signer: LeaseSigner | None = None  # signs an invocation lease into every grant
    # pool -> {admission_id: grant expiry}: grants of an older epoch still honoured (the
    # admissions ACTIVE when this manager advanced the pool's epoch), until released or expired
    draining: dict[str, dict[str, float]] = field(default_factory=dict)
    # pool -> a candidate next descriptor every admission is also evaluated against (shadow
    # routing: recorded with the decision, never enforced); in memory only
    shadows: dict[str, CapabilityDescriptor] = field(default_factory=dict)
    _descriptors_version: int = 0  # bumped whenever a descriptor is activated
    _budgets_set: set[str] = field(default_factory=set)
    # Eligibility snapshots by ref: stored in the ledger, or read back from it (bounded).
    _snapshots: dict[str, EligibilitySnapshot] = field(default_factory=dict)
    _batch: _Batch | None = None  # while ``admit_many`` runs
    _live: LiveCapacity | None = None  # the registry's view, while ``admit_many`` runs
    # (pool, live_slots resource) -> the capacity last committed to the ledger
    _live_written: dict[tuple[str, str], int] = field(default_factory=dict)
    _live_checked: tuple[int, int] | None = None  # what _live_written is known to match
    misses: list[tuple[str, str]] = field(default_factory=list)  # committed; drained by shell

    def __post_init__(self) -> None:
        self.pressure = PressureBoard(self.policy.pressure)

    def recover_pressure(self, now: float) -> int:
        """Count the grants the ledger holds (after a restart) on the pressure board: the
        fair shares need to know who holds what. Returns how many were adopted."""
        holding = self.ledger.active()
        rows = self.ledger.decisions([r.admission_id for r in holding])  # one read, not N
        for reservation in holding:
            row = rows.get(reservation.admission_id)
            decided = self._from_row(row) if row is not None else None
            estimate = (decided.estimate if decided else None) or {}
            tenant = _tenant_of(reservation) or (decided.tenant if decided else None)
            rank = shed_rank(
                estimate.get("service_class", "batch"),
                estimate.get("priority", 0),
                self.policy.pressure,
            )
            self.pressure.adopt(
                reservation.admission_id,
                Holding(
                    reservation.pool_id,
                    tenant or "(unknown)",
                    reservation.updated_at or reservation.created_at,
                    rank,
                    evict_order(estimate.get("recoverability")),  # unknown: never evicted
                    _run_of(estimate.get("run_id"), tenant or "(unknown)"),
                ),
            )
        self.observe_usage(now)
        return len(holding)

    def observe_usage(self, now: float, usage: Usage | None = None) -> None:
        """Refresh the board's utilisation from the ledger's counters (every tick: they
        include other managers' grants); ``usage``: a snapshot already read."""
        if usage is None:
            usage = self.ledger.usage()
        slots = {pool: held for (pool, resource), held in usage.items() if resource == MODEL_SLOTS}
        live: dict[str, int] = {}  # what the pool's live agents can run, over its capabilities
        for (pool, resource), (_, capacity) in usage.items():
            if resource.startswith(LIVE_SLOTS_PREFIX):
                live[pool] = live.get(pool, 0) + capacity
        for pool, capacity in live.items():  # stages measure against the smaller capacity
            if pool in slots:
                used, described = slots[pool]
                slots[pool] = (used, min(described, capacity))
        self.pressure.observe_usage(slots, now)

    # ---- descriptors ----------------------------------------------------------------------
    def publish_descriptor(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Make ``descriptor`` its pool's active one; ``None``, or why it was refused."""
        current = self.active_epochs.get(descriptor.pool_id)
        if current is not None and descriptor.descriptor_epoch < current:
            return f"epoch {descriptor.descriptor_epoch} is older than the active {current}"
        if descriptor.expires_at <= now:
            return "the descriptor has already expired"
        body = descriptor.model_dump_json()
        if not self.ledger.save_descriptor(descriptor.pool_id, descriptor.descriptor_epoch, body):
            self.load_descriptors()  # another manager stored a newer epoch meanwhile
            return "a newer epoch of this pool's descriptor is already stored"
        self._activate(descriptor)
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
                    self.pressure.ended(reservation.admission_id, now, completed=False)
                    log.info(
                        "reservation released: its pool moved to a new epoch",
                        extra={"admission_id": reservation.admission_id, "pool_id": pool_id},
                    )
            else:
                allowlist[reservation.admission_id] = reservation.expires_at
        self.draining[pool_id] = allowlist

    def set_shadow(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Shadow ``descriptor`` (a newer epoch than the active one); ``None`` or why not."""
        current = self.active_epochs.get(descriptor.pool_id)
        if current is not None and descriptor.descriptor_epoch <= current:
            return (
                f"a shadow is a candidate next epoch: {descriptor.descriptor_epoch} is not "
                f"newer than the active {current}"
            )
        if descriptor.expires_at <= now:
            return "the descriptor has already expired"
        self.shadows[descriptor.pool_id] = descriptor
        return None

    def _shadow_record(
        self,
        requirements: TaskRequirements,
        tenant: str,
        live: EligibilityResult,
        now: float,
    ) -> dict[str, Any]:
        """How eligibility would differ with the shadow descriptors active (pure)."""
        descriptors = {**self.descriptors, **self.shadows}
        epochs = {**self.active_epochs}
        epochs.update((p, d.descriptor_epoch) for p, d in self.shadows.items())
        shadow = check_eligibility(
            requirements, tenant, descriptors,
            active_epochs=epochs, active_generation=self.policy.active_generation, now=now,
        )  # fmt: skip
        live_rules = {v.pool_id: v.rule for v in live.verdicts}
        pools = [
            {
                "pool_id": v.pool_id,
                "descriptor_epoch": v.descriptor_epoch,
                "live": live_rules.get(v.pool_id, _NO_DESCRIPTOR),
                "shadow": v.rule,
            }
            for v in shadow.verdicts
            if v.pool_id in self.shadows
        ]
        agree = all((p["live"] is None) == (p["shadow"] is None) for p in pools)
        return {"eligible": list(shadow.eligible), "pools": pools, "agree": agree}

    def draining_allowlist(self, pool_id: str, now: float) -> list[str] | None:
        """The admissions whose older-epoch grants the pool's agents still honour, or ``None``
        if this manager did not advance the pool (it does not know the list: say nothing)."""
        allowlist = self.draining.get(pool_id)
        if allowlist is None:
            return None
        for admission_id in [a for a, expires_at in allowlist.items() if expires_at <= now]:
            del allowlist[admission_id]
        return sorted(allowlist)

    def _undrain(self, admission_id: str) -> None:
        for allowlist in self.draining.values():
            allowlist.pop(admission_id, None)

    def load_descriptors(self) -> int:
        """Adopt every stored descriptor newer than ours (at start, and on every tick: other
        managers on the same ledger may have accepted one). Returns how many were adopted."""
        adopted = 0
        for pool_id, epoch, body in self.ledger.descriptors():
            if self.active_epochs.get(pool_id, 0) >= epoch:
                continue
            try:
                self._activate(CapabilityDescriptor.model_validate_json(body))
            except ValueError:
                log.error("a stored descriptor no longer validates", extra={"pool_id": pool_id})
                continue
            adopted += 1
        return adopted

    def _descriptor_state(self) -> int:
        """Changes whenever what eligibility reads of the descriptors does: change
        ``descriptors`` and ``active_epochs`` only through the methods here."""
        return self._descriptors_version

    def set_active_epoch(self, pool_id: str, epoch: int) -> None:
        """Make ``epoch`` the pool's active descriptor epoch (a rollout that moves on before
        its descriptor arrives): descriptors of other epochs are no longer eligible."""
        self._descriptors_version += 1
        self.active_epochs[pool_id] = epoch

    def _activate(self, descriptor: CapabilityDescriptor) -> None:
        self._descriptors_version += 1
        self.descriptors[descriptor.pool_id] = descriptor
        self.active_epochs[descriptor.pool_id] = descriptor.descriptor_epoch
        # Until the next tick reads the ledger's counters, shed against the described slots.
        self.pressure.pool(descriptor.pool_id).capacity = descriptor.model_limits.slots

    def set_tenant_budget(self, tenant: str, tokens: int) -> None:
        self.ledger.set_capacity(TENANT_POOL, tenant_tokens_resource(tenant), tokens)
        self._budgets_set.add(tenant)

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
        if not requests:
            return []
        self._live = live
        try:
            return self._admit_many(requests, now)
        finally:
            self._live = None

    def sync_live(self, live: LiveCapacity, now: float) -> None:
        """Bring the ledger's live-slot capacities up to ``live`` without deciding anything
        (every tick: so the ledger, ``mesh status`` and the pressure stages show the pool's
        live figure even while no admission comes). One transaction, only if one changed."""
        if (live.version, self._descriptors_version) == self._live_checked:
            return
        self._live = live
        try:
            self._in_one_transaction([], now, planned=False)
        finally:
            self._live = None

    def _admit_many(
        self, requests: Sequence[tuple[AdmissionRequest, str]], now: float
    ) -> list[AdmissionDecision]:
        try:
            return self._in_one_transaction(requests, now, planned=True)
        except StoreError as exc:
            if len(requests) == 1:
                log.warning("ledger unavailable", extra={"error": str(exc)})
                return [_unavailable(requests[0][0].admission_id, exc)]
            log.warning(
                "a batch of admissions failed; deciding them one by one",
                extra={"batch": len(requests), "error": str(exc)},
            )
        decisions = []
        for pair in requests:
            try:
                decisions += self._in_one_transaction([pair], now, planned=False)
            except StoreError as exc:
                decisions.append(_unavailable(pair[0].admission_id, exc))
        return decisions

    def _in_one_transaction(
        self, requests: Sequence[tuple[AdmissionRequest, str]], now: float, *, planned: bool
    ) -> list[AdmissionDecision]:
        """``planned``: let the ledger read the IDs' rows up front and write in bulk (its
        fast path); the one-by-one retry after a failed batch takes the plain path."""
        batch = self._batch = _Batch()

        def work() -> list[AdmissionDecision]:
            self._write_live()
            return [self._admit(request, tenant, now) for request, tenant in requests]

        try:
            decisions = self.ledger.batch(
                work, plan=[request.admission_id for request, _ in requests] if planned else ()
            )
        except BaseException:
            for grantor, admission_id, grant_id in reversed(batch.external):
                grantor.release(admission_id, grant_id)  # nothing of the batch was kept
            for admission_id in batch.granted:
                self.pressure.ended(admission_id, now, completed=False)
            for eviction in batch.evicted:  # the victims' releases rolled back with it
                self.pressure.restore(eviction.victim.admission_id, eviction.holding, now)
            raise
        finally:
            self._batch = None
        for admission_id, decided in batch.decided.items():
            self._remember(admission_id, decided)
        self._budgets_set |= batch.budgets
        for ref, snapshot in batch.snapshots.items():
            self._known_snapshot(ref, snapshot)
        self.evictions += batch.evicted
        self._live_written.update(batch.live_written)
        if batch.live_checked is not None:
            self._live_checked = batch.live_checked
        self.misses += batch.misses
        return decisions

    def drain_misses(self) -> list[tuple[str, str]]:
        """``(pool, reason)`` of the capacity deferrals committed since the last call (the
        shell tells the scale planner)."""
        misses, self.misses = self.misses, []
        return misses

    def _live_targets(self, live: LiveCapacity) -> dict[tuple[str, str], int]:
        """The live-slot capacities ``live`` asks of the ledger that it does not hold yet:
        per described pool and capability, the free concurrency of the live agents whose
        version the descriptor's range covers."""
        out = {}
        for pool_id, descriptor in self.descriptors.items():
            for offered in descriptor.capabilities:
                key = (pool_id, live_slots_resource(offered.name))
                free = live.free(pool_id, offered.name, offered.version_spec)
                if self._live_written.get(key) != free:
                    out[key] = free
        return out

    def _write_live(self) -> None:
        """In the current transaction: the ledger's live-slot capacities as the registry
        says (remembered as written once it commits)."""
        live, batch = self._live, self._batch
        if live is None or batch is None:
            return
        checked = (live.version, self._descriptors_version)
        if checked == self._live_checked:
            return  # neither the registry nor the descriptors changed since the last write
        for (pool_id, resource), capacity in sorted(self._live_targets(live).items()):
            self.ledger.set_capacity(pool_id, resource, capacity)
            batch.live_written[(pool_id, resource)] = capacity
        batch.live_checked = checked

    def drain_evictions(self) -> list[Eviction]:
        """The evictions committed since the last call (the shell revokes their grants)."""
        evictions, self.evictions = self.evictions, []
        return evictions

    def _admit(self, request: AdmissionRequest, tenant: str, now: float) -> AdmissionDecision:
        digest = requirement_digest(request.requirements, tenant)
        earlier = self._earlier_decision(request.admission_id, digest)
        if earlier is not None:
            return earlier
        # The verdicts only (the result's own ``now`` may be older): the record keeps ``now``.
        eligibility = self.eligibility_cache.lookup(
            request.requirements,
            tenant,
            self.descriptors,
            state=self._descriptor_state(),
            active_epochs=self.active_epochs,
            active_generation=self.policy.active_generation,
            now=now,
        )
        decision = self._decide(request, tenant, digest, eligibility, now)
        snapshot = self._store_snapshot(eligibility.snapshot())
        shadow = None
        if self.shadows:  # computed and recorded, never enforced
            shadow = self._shadow_record(request.requirements, tenant, eligibility, now)
        decided = DecisionRecord(
            digest, decision, tenant, _estimate(request.requirements),
            snapshot=snapshot, evaluated_at=now, shadow=shadow, eligibility_ref=snapshot.ref,
        )  # fmt: skip
        self._record(decided, now)
        return decision

    def _store_snapshot(self, snapshot: EligibilitySnapshot) -> EligibilitySnapshot:
        """Have the ledger keep ``snapshot`` (in the current transaction) unless it is known
        to; returns it."""
        batch = self._batch
        known = snapshot.ref in self._snapshots
        if known or (batch is not None and snapshot.ref in batch.snapshots):
            return snapshot
        self.ledger.save_eligibility(snapshot.ref, snapshot.body)
        if batch is not None:
            batch.snapshots[snapshot.ref] = snapshot
        else:
            self._known_snapshot(snapshot.ref, snapshot)
        return snapshot

    def _known_snapshot(self, ref: str, snapshot: EligibilitySnapshot) -> None:
        self._snapshots[ref] = snapshot
        if len(self._snapshots) > SNAPSHOT_CACHE_SIZE:
            del self._snapshots[next(iter(self._snapshots))]  # the oldest; stored regardless

    def with_eligibility(self, decided: DecisionRecord) -> DecisionRecord:
        """``decided`` with the eligibility snapshot it names filled in (a record read back
        from the ledger names it only). Call it on the ledger's thread: it may read the
        ledger, and it keeps what it read in this admitter's snapshot cache."""
        ref = decided.eligibility_ref
        if ref is None or decided.snapshot is not None:
            return decided
        snapshot = self._snapshots.get(ref)
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
            self._known_snapshot(ref, snapshot)
        decided.snapshot = snapshot
        return decided

    def _record(self, decided: DecisionRecord, now: float) -> None:
        """Write the decision in the current transaction; cache it once that commits."""
        admission_id = decided.decision.admission_id
        kept = self.ledger.record_decision(
            admission_id, decided.digest, decided.decision.outcome, now, decided.to_json()
        )
        if kept and self._batch is not None:
            self._batch.decided[admission_id] = decided

    def _remember(self, admission_id: str, decided: DecisionRecord) -> None:
        self.decisions[admission_id] = decided
        self.decisions.move_to_end(admission_id)
        while len(self.decisions) > DECISION_CACHE_SIZE:
            self.decisions.popitem(last=False)

    def recorded(self, admission_id: str) -> DecisionRecord | None:
        """The latest decision about ``admission_id``: this batch's, the cache's, or the
        ledger's (made before a restart, or by another manager). One read back from the
        ledger names its eligibility snapshot without it: see :meth:`with_eligibility`."""
        if self._batch is not None and admission_id in self._batch.decided:
            return self._batch.decided[admission_id]
        decided = self.decisions.get(admission_id)
        if decided is not None:
            return decided
        row = self.ledger.decision(admission_id)
        return None if row is None else self._from_row(row)

    @staticmethod
    def _from_row(row: DecisionRow) -> DecisionRecord | None:
        try:
            return DecisionRecord.from_row(row)
        except ValueError:
            log.error(
                "a stored decision no longer validates", extra={"admission": row.admission_id}
            )
            return None

    def explain(self, admission_id: str) -> dict[str, Any] | None:
        """The recorded decision and the eligibility record behind it (``mesh explain``)."""
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

    def _earlier_decision(self, admission_id: str, digest: str) -> AdmissionDecision | None:
        """The answer already given to this admission ID, if it still holds. A reservation
        without a recorded decision (its manager stopped mid-way) is found by ``prepare``."""
        decided = self.recorded(admission_id)
        if decided is None:
            return None
        if decided.digest != digest:
            return _refused(
                admission_id,
                AdmissionReason.CONFLICT,
                "this admission ID was used with other requirements",
            )
        if decided.decision.outcome == "admitted":
            return decided.decision  # the same request: the same grant
        # Rejected or deferred before: nothing was reserved, so decide again — a producer told
        # to retry after ``retry_after_ms`` retries with the same admission ID.
        return None

    def _replay(
        self, reservation: Reservation, now: float, tools: Sequence[str] = ()
    ) -> AdmissionDecision:
        """A decision rebuilt from the ledger alone (after a manager restart)."""
        if reservation.state == "ACTIVE":
            return self._admitted(reservation, [], tools=tools, now=now)
        if reservation.state == "PREPARING" and reservation.expires_at > now:
            # A manager stopped between prepare and activate; the same request finishes it.
            return self._take_external_then_activate(reservation, now, tools=tools)
        return _refused(
            reservation.admission_id,
            AdmissionReason.STALE_FENCE,
            f"this admission is {reservation.state}; a new phase needs a new admission ID",
        )

    def _decide(
        self,
        request: AdmissionRequest,
        tenant: str,
        digest: str,
        eligibility: EligibilityResult,
        now: float,
    ) -> AdmissionDecision:
        denial = eligibility.denial_reason()
        if denial is not None:
            filtered = ", ".join(f"{v.pool_id}: {v.rule}" for v in eligibility.filtered)
            return _refused(request.admission_id, denial, filtered or "no pool is described")
        self._ensure_budget(tenant)
        req = request.requirements
        first: tuple[str, Shed] | None = None  # why the most preferred pool said no
        tried = False
        missed: list[tuple[str, str]] = []  # pools refused for capacity or no live agent
        for pool_id, fallback_for in self._pools(req, eligibility):
            tried = True
            gated = self._gate(pool_id, req, tenant, now)
            if gated is not None:
                first = first or (pool_id, gated)
                if gated.reason == AdmissionReason.NO_LIVE_AGENT:
                    missed.append((pool_id, gated.reason))
                continue
            prepared = self._reserve(request, tenant, digest, pool_id, now)
            if isinstance(prepared, Prepared):
                return self._granted(request, tenant, pool_id, fallback_for, prepared, now)
            if prepared.reason is LedgerReason.CONFLICT:
                return _refused(request.admission_id, AdmissionReason.CONFLICT, prepared.detail)
            first = first or (pool_id, Shed(prepared.reason.value, prepared.detail, 1))
            if prepared.reason is LedgerReason.CAPACITY:
                missed.append((pool_id, AdmissionReason.CAPACITY.value))
            if prepared.reason is LedgerReason.TENANT_BUDGET:
                break  # the budget is the tenant's, whichever pool
        if not tried:  # no primary: nothing for a fallback to stand in for
            return _refused(
                request.admission_id,
                AdmissionReason.NO_ELIGIBLE_POOL,
                "only pools named in allowed_fallbacks are eligible; a fallback stands in for "
                f"an eligible primary pool ({', '.join(eligibility.eligible)})",
            )
        assert first is not None  # every pool tried said why not
        decision = self._deferred(request, tenant, first[0], first[1], now)
        if decision.outcome == "deferred" and self._batch is not None:
            self._batch.misses += missed
        return decision

    def _gate(self, pool_id: str, req: TaskRequirements, tenant: str, now: float) -> Shed | None:
        """Why ``pool_id`` may not take the request before the ledger is asked: no live agent
        for it, or the pool's pressure stage sheds it (``None``: ask the ledger)."""
        return self._no_live_agent(pool_id, req) or self.pressure.check(
            pool_id, tenant, req.service_class, req.priority, req.estimated_duration_s,
            req.deadline, now, _run_of(req.run_id, tenant),
        )  # fmt: skip

    def _reserve(
        self, request: AdmissionRequest, tenant: str, digest: str, pool_id: str, now: float
    ) -> Prepared | Refused:
        """Every counter the request takes in ``pool_id``, or none; short of a slot, once
        more after evicting a recoverable lower-ranked grant if there is one."""
        req = request.requirements
        items = [
            (TENANT_POOL if resource.startswith("tenant_tokens:") else pool_id, resource, n)
            for resource, n in reservation_items(req, tenant)
        ]
        if self._live is not None:
            items.append((pool_id, live_slots_resource(req.capability.name), 1))
        prepared = self._prepare(request, digest, items, pool_id, now)
        if _short_of_slots(prepared) and self._evict_for(request, tenant, pool_id, now):
            prepared = self._prepare(request, digest, items, pool_id, now)
        return prepared

    def _granted(
        self,
        request: AdmissionRequest,
        tenant: str,
        pool_id: str,
        fallback_for: str | None,
        prepared: Prepared,
        now: float,
    ) -> AdmissionDecision:
        """The decision for a reservation the ledger prepared: replayed, activated with it,
        or activated once the external grants are taken."""
        req = request.requirements
        # The tools a lease names (none to name without a signer).
        tools = [t.name for t in req.required_tools] if self.lease_signer else []
        if prepared.replayed:  # reserved before, by a manager that stopped mid-way
            decision = self._replay(prepared.reservation, now, tools)
        elif prepared.reservation.state == "ACTIVE":
            decision = self._admitted(prepared.reservation, [], fallback_for, tools=tools, now=now)
        else:
            decision = self._take_external_then_activate(
                prepared.reservation, now, fallback_for, tools=tools
            )
        if decision.outcome == "admitted":
            self._count_grant(request.admission_id, pool_id, req, tenant, now)
        return decision

    def _no_live_agent(self, pool_id: str, req: TaskRequirements) -> Shed | None:
        """``NO_LIVE_AGENT`` if no live agent of the pool offers the capability at a version in
        both the task's range and the descriptor's (``None``: one does, or no live view)."""
        live = self._live
        if live is None:
            return None
        name = req.capability.name
        described = next(
            (c.version_spec for c in self.descriptors[pool_id].capabilities if c.name == name),
            ">=0",
        )
        if live.agents(pool_id, name, req.capability.version_spec, described) > 0:
            return None
        return Shed(
            AdmissionReason.NO_LIVE_AGENT.value,
            f"{pool_id} has no live agent offering {name} {req.capability.version_spec} "
            f"(its descriptor allows {described}): none registered, or all draining or lost",
            None,
        )

    def _deferred(
        self, request: AdmissionRequest, tenant: str, pool_id: str, why: Shed, now: float
    ) -> AdmissionDecision:
        """A refusal with a retry time from the pool's drain rate (for want of a live agent:
        from the pool's pending scale-up) — or, when coming back cannot meet the deadline,
        ``DEADLINE_UNREACHABLE`` at once."""
        req = request.requirements
        retry_ms = None
        if why.reason == AdmissionReason.NO_LIVE_AGENT:
            retry_ms = self._no_agent_retry_ms(pool_id, req.deadline, now)
        elif why.slots_to_free is not None:
            retry_ms = self.pressure.retry_after_ms(
                pool_id, tenant, why.slots_to_free, req.estimated_duration_s, req.deadline, now,
                self.rand,
            )  # fmt: skip
        if retry_ms is None:
            detail = why.detail
            if why.reason != AdmissionReason.DEADLINE_UNREACHABLE:
                detail = f"{why.detail}; a retry would miss the deadline"
            return AdmissionDecision(
                admission_id=request.admission_id,
                outcome="rejected",
                reason=AdmissionReason.DEADLINE_UNREACHABLE,
                detail=detail[:1000],
                allowed_degradations=list(req.allowed_degradations),
            )
        return AdmissionDecision(
            admission_id=request.admission_id,
            outcome="deferred",
            reason=AdmissionReason(why.reason),
            detail=why.detail[:1000],
            retry_after_ms=retry_ms,
            allowed_degradations=list(req.allowed_degradations),
        )

    def _no_agent_retry_ms(self, pool_id: str, deadline: float | None, now: float) -> int | None:
        """When an agent may be live in ``pool_id``: the scale planner's estimate where the
        pool has a scaling policy, else the default retry time; ``None`` past the deadline."""
        expected_s = self._live.retry_s.get(pool_id) if self._live is not None else None
        if expected_s is None:
            wait_ms = float(self.policy.pressure.retry_default_ms)
        else:
            wait_ms = 1000.0 * expected_s
        wait_ms *= 1.0 + 0.2 * self.rand()  # spread the producers' returns
        if deadline is not None and now + wait_ms / 1000.0 >= deadline:
            return None
        return max(1, round(wait_ms))

    def _prepare(
        self,
        request: AdmissionRequest,
        digest: str,
        items: list[tuple[str, str, int]],
        pool_id: str,
        now: float,
    ) -> Prepared | Refused:
        return self.ledger.prepare(
            request.admission_id, digest, items, self.policy.prepare_ttl_s, now,
            pool_id=pool_id,
            # Nothing outside the ledger to wait for: activate in the same statement batch.
            activate_ttl_s=None if self.grantors else self.policy.grant_ttl_s,
        )  # fmt: skip

    def _evict_for(self, request: AdmissionRequest, tenant: str, pool_id: str, now: float) -> bool:
        """Release one recoverable, lower-ranked grant of the full ``pool_id`` to make room
        for ``request`` (in the current transaction); ``True`` if one was released."""
        req = request.requirements
        rank = shed_rank(req.service_class, req.priority, self.policy.pressure)
        victim_id = self.pressure.victim(pool_id, tenant, rank, now)
        if victim_id is None:
            return False
        victim = self.ledger.get(victim_id)
        if victim is None or victim.state != "ACTIVE":  # ended meanwhile (another manager)
            self.pressure.ended(victim_id, now, completed=False)
            return False
        if isinstance(self.ledger.release(victim_id, victim.fence, now), Refused):
            return False
        holding = self.pressure.ended(victim_id, now, completed=False)
        assert holding is not None and self._batch is not None  # found on the board; in a batch
        self._batch.evicted.append(Eviction(victim, holding, request.admission_id, now))
        log.info(
            "grant evicted",
            extra={"admission_id": victim_id, "pool_id": pool_id, "for": request.admission_id},
        )
        return True

    def _count_grant(
        self, admission_id: str, pool_id: str, req: TaskRequirements, tenant: str, now: float
    ) -> None:
        self.pressure.granted(
            admission_id, pool_id, tenant, now,
            rank=shed_rank(req.service_class, req.priority, self.policy.pressure),
            evict_order=evict_order(req.recoverability),
            run=_run_of(req.run_id, tenant),
        )  # fmt: skip
        if self._batch is not None:
            self._batch.granted.append(admission_id)

    def _pools(
        self, requirements: TaskRequirements, eligibility: EligibilityResult
    ) -> Iterator[tuple[str, str | None]]:
        """The pools to try, in order, as ``(pool_id, the primary it stands in for)``; the
        fallbacks are checked only once every primary is full.

        Primaries — eligible pools the task does not name as fallbacks — come first, in the
        one preference order (:meth:`_by_preference`). Then the task's ``allowed_fallbacks``
        that are eligible, in its order, each only if it gives the task nothing the preferred
        primary would not
        (:func:`~mesh.core.eligibility.widening`). Without an eligible primary, a fallback has
        nothing to stand in for: nothing is tried.
        """
        named = set(requirements.allowed_fallbacks)
        primaries = self._by_preference(
            [p for p in eligibility.eligible if p not in named], requirements
        )
        if not primaries:
            return
        for pool_id in primaries:
            yield pool_id, None
        primary = self.descriptors[primaries[0]]
        for pool_id in fallback_pools(requirements, eligibility, self.descriptors):
            if widening(primary, self.descriptors[pool_id], requirements) is None:
                yield pool_id, primary.pool_id

    def _take_external_then_activate(
        self,
        reservation: Reservation,
        now: float,
        fallback_for: str | None = None,
        *,
        tools: Sequence[str] = (),
    ) -> AdmissionDecision:
        taken: list[tuple[ExternalGrantor, str]] = []
        for grantor in sorted(self.grantors, key=lambda g: g.name):  # one global fixed order
            grant_id = grantor.request(
                reservation.admission_id, reservation.pool_id, self.policy.prepare_ttl_s, now
            )
            if grant_id is None:
                self._compensate(reservation, taken, now)
                return _refused(
                    reservation.admission_id,
                    AdmissionReason.EXTERNAL_GRANT_FAILED,
                    f"{grantor.name} refused; everything taken was released",
                    deferred=True,
                    retry_after_ms=self.policy.pressure.retry_default_ms,
                )
            taken.append((grantor, grant_id))
            if self._batch is not None:
                self._batch.external.append((grantor, reservation.admission_id, grant_id))
        active = self.ledger.activate(
            reservation.admission_id, reservation.fence, self.policy.grant_ttl_s, now
        )
        if isinstance(active, Refused):
            self._compensate(reservation, taken, now)
            return _refused(reservation.admission_id, AdmissionReason.STALE_FENCE, active.detail)
        external = [grant_id for _, grant_id in taken]
        return self._admitted(active, external, fallback_for, tools=tools, now=now)

    def _compensate(
        self, reservation: Reservation, taken: list[tuple[ExternalGrantor, str]], now: float
    ) -> None:
        for grantor, grant_id in reversed(taken):
            grantor.release(reservation.admission_id, grant_id)
            if self._batch is not None:
                self._batch.external.remove((grantor, reservation.admission_id, grant_id))
        self.ledger.release(reservation.admission_id, reservation.fence, now)

    def _admitted(
        self,
        reservation: Reservation,
        external: list[str],
        fallback_for: str | None = None,
        *,
        tools: Sequence[str] = (),
        now: float,
    ) -> AdmissionDecision:
        descriptor = self.descriptors.get(reservation.pool_id)
        epoch = descriptor.descriptor_epoch if descriptor else 1
        lease = None
        if self.lease_signer is not None:
            expires = reservation.expires_at
            if self.policy.lease_ttl_s is not None:
                expires = min(expires, now + self.policy.lease_ttl_s)
            lease = self.lease_signer.sign(
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
            "policy_generation": self.policy.active_generation,
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

    def _ensure_budget(self, tenant: str) -> None:
        """Give a tenant seen for the first time the default budget (in the current
        transaction: remembered only once that commits)."""
        batch = self._batch
        if tenant in self._budgets_set or (batch is not None and tenant in batch.budgets):
            return
        resource = tenant_tokens_resource(tenant)
        if (TENANT_POOL, resource) not in self.ledger.usage():
            self.ledger.set_capacity(TENANT_POOL, resource, self.policy.default_tenant_tokens)
        if batch is not None:
            batch.budgets.add(tenant)
        else:
            self._budgets_set.add(tenant)

    def _by_preference(self, pools: Sequence[str], req: TaskRequirements) -> list[str]:
        """In the one preference order (:func:`mesh.core.ranking.rank`) — the pool's cost
        class for the capability, from its live agents, then its share of model slots in
        use — and then pool ID."""
        if len(pools) < 2:
            return list(pools)  # nothing to order: spare the ledger a read
        usage = self.ledger.usage()
        live, name, wanted = self._live, req.capability.name, req.capability.version_spec

        def key(pool_id: str) -> tuple[Rank, str]:
            used, capacity = usage.get((pool_id, MODEL_SLOTS), (0, 0))
            cost = None if live is None else live.cost_class(pool_id, name, wanted)
            return (ranking.rank(cost, used / capacity if capacity else 1.0), pool_id)

        return sorted(pools, key=key)

    # ---- release and expiry ---------------------------------------------------------------
    def release(self, admission_id: str, fence: int, now: float) -> AdmissionReleaseReply:
        """Settle a phase: the grant's holder gives it back. A stale fence changes nothing."""
        outcome = self.ledger.release(admission_id, fence, now)
        if not isinstance(outcome, Refused):
            self.pressure.ended(admission_id, now, completed=True)
            self._undrain(admission_id)
        if isinstance(outcome, Refused):
            return AdmissionReleaseReply(
                admission_id=admission_id,
                released=False,
                reason=AdmissionReason(outcome.reason.value),
                detail=outcome.detail,
            )
        return AdmissionReleaseReply(admission_id=admission_id, released=True)

    def expire(self, now: float) -> list[Reservation]:
        """Overdue reservations → EXPIRED under a higher fence."""
        expired = self.ledger.expire_due(now)
        for reservation in expired:
            self.pressure.ended(reservation.admission_id, now, completed=False)
            self._undrain(reservation.admission_id)
        return expired


def _tenant_of(reservation: Reservation) -> str | None:
    """The tenant whose token budget a reservation draws on (None if it takes no tokens)."""
    for item in reservation.items:
        if item.pool_id == TENANT_POOL and item.resource.startswith(TENANT_TOKENS_PREFIX):
            return item.resource[len(TENANT_TOKENS_PREFIX) :]
    return None


def _run_of(run_id: str | None, tenant: str) -> str | None:
    """A run's key on the pressure board: run IDs are scoped by tenant."""
    return None if run_id is None else f"{tenant}/{run_id}"


def _short_of_slots(prepared: Prepared | Refused) -> bool:
    """Short of a model slot or a live agent's slot: what evicting a grant of the pool frees."""
    return isinstance(prepared, Refused) and (
        prepared.resource == MODEL_SLOTS or (prepared.resource or "").startswith(LIVE_SLOTS_PREFIX)
    )


def _estimate(requirements: TaskRequirements) -> dict[str, Any]:
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


def _unavailable(admission_id: str, exc: StoreError) -> AdmissionDecision:
    return _refused(
        admission_id,
        AdmissionReason.LEDGER_UNAVAILABLE,
        f"the reservation ledger failed: {exc}; retry with the same admission ID",
        deferred=True,
        retry_after_ms=1_000,
    )


def _refused(
    admission_id: str,
    reason: AdmissionReason,
    detail: str,
    *,
    deferred: bool = False,
    retry_after_ms: int | None = None,
) -> AdmissionDecision:
    return AdmissionDecision(
        admission_id=admission_id,
        outcome="deferred" if deferred else "rejected",
        reason=reason,
        detail=detail[:1000],
        retry_after_ms=retry_after_ms,
    )
