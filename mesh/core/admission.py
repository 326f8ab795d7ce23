"""The admission decision, sans I/O: requests and a view of the ledger in, decisions and
ledger operations out.

Theory of operation
-------------------
:class:`AdmissionCore` decides a batch of ``(request, authenticated tenant)`` pairs from
what it is given — a :class:`~mesh.ledger.model.LedgerView` (the counters, the batch's IDs'
reservations and recorded decisions, fences drawn for it) read in the batch's own
transaction, the registry's :class:`~mesh.core.capacity.LiveCapacity`, and its own state (the
active descriptors, the pressure board, recent decisions) — and returns a :class:`Batch`: one
decision per request and the :data:`~mesh.ledger.model.LedgerOp` list that makes them true.
It reads no store, no clock and no randomness of its own (``now`` and ``rand`` are inputs);
the shell (:class:`mesh.manager.admission.Admitter`) reads the view, asks this core, takes any
external grants, and has the store :meth:`~mesh.ledger.store.LedgerStore.apply` the
operations in that same transaction. Nothing is kept before the commit: the shell then calls
:meth:`AdmissionCore.committed` (or :meth:`AdmissionCore.abandoned`, which puts the pressure
board back).

One admission:

1. **Idempotency.** ``requirement_digest(requirements, tenant)`` keys the request with its
   ``admission_id``. A known ID with another digest is ``CONFLICT``; the same digest gets the
   same grant again while its reservation is ACTIVE. A request that reserved nothing
   (deferred or rejected) is decided afresh when retried.
2. **Eligibility** (pure, :mod:`mesh.core.eligibility`) over the active descriptors, epochs
   and policy generation; the record of which rule filtered which pool is kept for
   ``explain``.
3. **Live agents.** A pool with no live agent whose version of the capability is in both the
   task's range and the descriptor's is skipped (``NO_LIVE_AGENT``); every reservation also
   takes the pool's ``live_slots:<capability>`` counter, which each batch first brings up to
   the live agents' free concurrency (:class:`~mesh.ledger.model.SetCapacity`).
4. **Reserve.** Eligible pools are tried in the one preference order (:mod:`mesh.core.ranking`:
   cost class, then load). A reservation takes every counter (model slot, live slot,
   sandbox, tool permits, the tenant's token budget) or none, checked against the view's
   counters as this batch has changed them; short of a slot, a recoverable lower-ranked grant
   of the pool may be evicted (a :class:`~mesh.ledger.model.Release`) to make room.
5. **External grants** (resources outside the ledger) are the shell's: a request that needs
   them comes back as a :class:`PendingExternal`, and :meth:`AdmissionCore.settle_external`
   turns it into a grant (its reservation written ACTIVE) or a refusal (nothing written).

The store takes the counters by conditional increments when it applies the batch, so a view
that another manager made stale fails the batch as a whole rather than over-granting; the
shell then decides again (:class:`~mesh.errors.StaleView`: without the stale grant) or one
request at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson

from mesh.core import ranking
from mesh.core.capacity import (
    LIVE_SLOTS_PREFIX,
    LiveCapacity,
    described_free,
    live_slots_resource,
)
from mesh.core.eligibility import (
    MODEL_SLOTS,
    TENANT_TOKENS_PREFIX,
    EligibilityCache,
    EligibilityResult,
    EligibilitySnapshot,
    check_eligibility,
    fallback_pools,
    reservation_items,
    tenant_tokens_resource,
    widening,
)
from mesh.core.line import PoolLine
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
from mesh.ledger.model import (
    TENANT_POOL,
    Activate,
    DecisionRow,
    Item,
    LedgerOp,
    LedgerReason,
    LedgerView,
    RecordDecision,
    Refused,
    Release,
    Reservation,
    ReservationState,
    Reserve,
    SaveEligibility,
    SetCapacity,
    Usage,
    normalize_built,
    shortage,
)
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRequest,
    CapabilityDescriptor,
    TaskRequirements,
    requirement_digest,
)

if TYPE_CHECKING:  # only its type: signing is the shell's key, handed in
    from mesh.leases import LeaseSigner


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    prepare_ttl_s: float = 10.0  # an external grant is asked for this long at first
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

SNAPSHOT_CACHE_SIZE = 1024
"""Eligibility snapshots kept in memory (known to be stored, or read back for a record)."""

_DECISION_JSON = AdmissionDecision.__pydantic_serializer__  # model_dump_json minus a wrapper

_MISS_REASONS = frozenset({AdmissionReason.CAPACITY, AdmissionReason.NO_LIVE_AGENT})
"""Deferrals that are capacity misses for the pool's scaling policy."""


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


@dataclass(frozen=True, slots=True)
class Held:
    """A grant this core made or adopted, as the ledger holds it (to evict it by fence)."""

    fence: int
    items: tuple[Item, ...]
    expires_at: float


@dataclass(slots=True)
class PendingExternal:
    """A request that is granted once the shell has taken every external grant for it.

    ``reservation``: as it will be written (ACTIVE), its counters already counted in the
    batch; ``stored``: it is a PREPARING reservation already in the ledger (a manager
    stopped between prepare and activate), to activate rather than write."""

    index: int  # the request's place in the batch
    request: AdmissionRequest
    tenant: str
    digest: str
    reservation: Reservation
    fallback_for: str | None
    tools: tuple[str, ...]
    stored: bool
    snapshot: EligibilitySnapshot | None
    shadow: dict[str, Any] | None


@dataclass(slots=True)
class Batch:
    """One batch as decided: its decisions, the ledger operations behind them, and what the
    core will keep (or undo) once the shell says whether they committed."""

    view: LedgerView
    counters: dict[tuple[str, str], tuple[int, int]]  # the view's, as this batch changed them
    fences: list[int]  # the view's unused fences, next last
    decisions: list[AdmissionDecision | None] = field(default_factory=list)  # None: pending
    ops: list[LedgerOp] = field(default_factory=list)
    pending: list[PendingExternal] = field(default_factory=list)
    decided: dict[str, DecisionRecord] = field(default_factory=dict)
    reserved: dict[str, Reservation] = field(default_factory=dict)  # written by this batch
    held: dict[str, Held] = field(default_factory=dict)  # granted by this batch
    budgets: set[str] = field(default_factory=set)  # tenants whose budget row it creates
    snapshots: dict[str, EligibilitySnapshot] = field(default_factory=dict)  # it stores
    granted: list[str] = field(default_factory=list)  # admission IDs counted on the board
    evicted: list[Eviction] = field(default_factory=list)
    live_written: dict[tuple[str, str], int] = field(default_factory=dict)
    live_checked: tuple[int, int] | None = None  # (live version, descriptors version) written
    misses: list[tuple[str, str]] = field(default_factory=list)  # (pool, reason) deferred
    line_marks: dict[str, int] = field(default_factory=dict)  # per pool: undo to here
    # Admission IDs answered with the grant the ledger already holds for them (a retried or
    # redelivered request), not granted by this batch.
    replayed: set[str] = field(default_factory=set)

    def take(self, items: tuple[Item, ...]) -> Refused | None:
        """Take every item from the batch's counters, or none (the first shortage)."""
        counters = self.counters
        for pool_id, resource, amount in items:
            counter = counters.get((pool_id, resource))
            if counter is None or counter[0] + amount > counter[1]:
                return shortage(pool_id, resource, amount, counter)
        for pool_id, resource, amount in items:
            used, capacity = counters[(pool_id, resource)]
            counters[(pool_id, resource)] = (used + amount, capacity)
        return None

    def give_back(self, items: tuple[Item, ...]) -> None:
        for pool_id, resource, amount in items:
            counter = self.counters.get((pool_id, resource))
            if counter is not None:
                self.counters[(pool_id, resource)] = (max(counter[0] - amount, 0), counter[1])

    def final(self) -> list[AdmissionDecision]:
        """The decisions, once every pending request is settled."""
        assert not self.pending, "settle every PendingExternal first"
        return [d for d in self.decisions if d is not None]


@dataclass
class AdmissionCore:
    """Descriptors, eligibility, live capacity, pressure and the ledger's view, composed into
    decisions. Not thread-safe: its owner calls it from one thread."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    rand: Callable[[], float] = lambda: 0.5  # retry-time jitter in [0, 1) (the shell's input)
    external_grants: bool = False  # the shell takes external grants for every admission
    lease_signer: LeaseSigner | None = None  # signs an invocation lease into every grant
    # Replaced, never changed in place (readers on other threads see one version or the
    # next); change them through activate, set_active_epoch and the shadow methods only: the
    # eligibility cache keys on their version.
    descriptors: Mapping[str, CapabilityDescriptor] = field(default_factory=dict)
    active_epochs: Mapping[str, int] = field(default_factory=dict)
    # pool -> a candidate next descriptor every admission is also evaluated against (shadow
    # routing: recorded with the decision, never enforced); in memory only
    shadows: Mapping[str, CapabilityDescriptor] = field(default_factory=dict)
    decisions: OrderedDict[str, DecisionRecord] = field(default_factory=OrderedDict)
    pressure: PressureBoard = field(init=False)
    evictions: list[Eviction] = field(default_factory=list)  # committed; drained by the shell
    misses: list[tuple[str, str]] = field(default_factory=list)  # committed; drained by shell
    eligibility_cache: EligibilityCache = field(default_factory=EligibilityCache)
    # pool -> {admission_id: grant expiry}: grants of an older epoch still honoured (the
    # admissions ACTIVE when this manager advanced the pool's epoch), until released or expired
    draining: dict[str, dict[str, float]] = field(default_factory=dict)
    held: dict[str, Held] = field(default_factory=dict)  # grants made or adopted, by ID
    # Grants this core took back (evicted), recent ones: their holder's release is refused
    # as such, not answered as a retried release (bounded; not kept across a restart).
    evicted: OrderedDict[str, float] = field(default_factory=OrderedDict)
    descriptors_version: int = 0  # bumped whenever a descriptor is activated
    budgets_set: set[str] = field(default_factory=set)
    # Eligibility snapshots by ref: stored in the ledger, or read back from it (bounded).
    snapshots: dict[str, EligibilitySnapshot] = field(default_factory=dict)
    # (pool, live_slots resource) -> the capacity last committed to the ledger
    live_written: dict[tuple[str, str], int] = field(default_factory=dict)
    live_checked: tuple[int, int] | None = None  # what live_written is known to match
    # Each batch first brings the ledger's live-slot capacities up to the live snapshot it is
    # given. Off with several managers: each pool's owner writes them, fenced by its shard
    # lease (mesh.manager.live_share), and every manager decides against what is written.
    writes_live: bool = True
    lines: dict[str, PoolLine] = field(default_factory=dict)  # per pool: deferred for capacity

    def __post_init__(self) -> None:
        self.pressure = PressureBoard(self.policy.pressure)

    # ---- descriptors ----------------------------------------------------------------------
    def activate(self, descriptor: CapabilityDescriptor) -> None:
        """Make ``descriptor`` its pool's active one (the shell has stored it)."""
        self.descriptors_version += 1
        self.descriptors = {**self.descriptors, descriptor.pool_id: descriptor}
        self.active_epochs = {**self.active_epochs, descriptor.pool_id: descriptor.descriptor_epoch}
        # Until the next usage observation, shed against the described slots.
        self.pressure.pool(descriptor.pool_id).capacity = descriptor.model_limits.slots

    def set_active_epoch(self, pool_id: str, epoch: int) -> None:
        """Make ``epoch`` the pool's active descriptor epoch (a rollout that moves on before
        its descriptor arrives): descriptors of other epochs are no longer eligible."""
        self.descriptors_version += 1
        self.active_epochs = {**self.active_epochs, pool_id: epoch}

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
        self.shadows = {**self.shadows, descriptor.pool_id: descriptor}
        return None

    def drop_shadow(self, pool_id: str) -> CapabilityDescriptor | None:
        dropped = self.shadows.get(pool_id)
        self.shadows = {p: d for p, d in self.shadows.items() if p != pool_id}
        return dropped

    def draining_allowlist(self, pool_id: str, now: float) -> list[str] | None:
        """The admissions whose older-epoch grants the pool's agents still honour, or ``None``
        if this manager did not advance the pool (it does not know the list: say nothing)."""
        allowlist = self.draining.get(pool_id)
        if allowlist is None:
            return None
        for admission_id in [a for a, expires_at in allowlist.items() if expires_at <= now]:
            del allowlist[admission_id]
        return sorted(allowlist)

    # ---- grants ending and adopted --------------------------------------------------------
    def ended(self, admission_id: str, now: float, *, completed: bool) -> None:
        """A grant is over (released by its holder, expired, or found gone)."""
        self.pressure.ended(admission_id, now, completed=completed)
        self.held.pop(admission_id, None)
        for allowlist in self.draining.values():
            allowlist.pop(admission_id, None)

    def adopt(self, reservation: Reservation, decided: DecisionRecord | None, now: float) -> None:
        """Count a grant the ledger holds (after a restart) on the pressure board: the fair
        shares need to know who holds what, and an eviction its fence."""
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
        self.held[reservation.admission_id] = Held(
            reservation.fence, reservation.items, reservation.expires_at
        )

    def observe_usage(self, usage: Usage, now: float) -> None:
        """Refresh the board's utilisation from the ledger's counters (every tick: they
        include other managers' grants)."""
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

    # ---- deciding -------------------------------------------------------------------------
    def live_unchanged(self, live: LiveCapacity) -> bool:
        """True if the ledger's live-slot capacities already match ``live``."""
        return (live.version, self.descriptors_version) == self.live_checked

    def decide(
        self,
        requests: Sequence[tuple[AdmissionRequest, str]],
        view: LedgerView,
        now: float,
        live: LiveCapacity | None = None,
    ) -> Batch:
        """Decide ``(request, authenticated tenant)`` pairs in order against ``view``.

        ``live``: the registry's live capacity (the manager always gives it); ``None`` leaves
        it out — the descriptors and the ledger alone decide, as for a caller that tracks no
        agents (the ledger's own tests and benchmarks). With no requests, the batch only
        brings the ledger's live-slot capacities up to ``live``."""
        batch = Batch(view, dict(view.counters), sorted(view.fences, reverse=True))
        if live is not None and self.writes_live:
            self._write_live(batch, live)
        for index, (request, tenant) in enumerate(requests):
            batch.decisions.append(self._admit(batch, index, request, tenant, now, live))
        return batch

    def settle_external(
        self,
        batch: Batch,
        pending: PendingExternal,
        now: float,
        *,
        grant_ids: Sequence[str] = (),
        refused_by: str | None = None,
    ) -> AdmissionDecision:
        """The decision for a pending request once the shell took its external grants
        (``grant_ids``) or one was refused (``refused_by``: the grantor; the shell has given
        back what it took)."""
        batch.pending.remove(pending)
        r = pending.reservation
        decision: AdmissionDecision
        if refused_by is not None:
            if pending.stored:  # cancel the PREPARING reservation: counters are conserved
                batch.ops.append(Release(r.admission_id, r.fence, now))
            decision = refused(
                r.admission_id,
                AdmissionReason.EXTERNAL_GRANT_FAILED,
                f"{refused_by} refused; everything taken was released",
                deferred=True,
                retry_after_ms=self.policy.pressure.retry_default_ms,
            )
        else:
            expires_at = now + self.policy.grant_ttl_s
            active = replace(r, state=ReservationState.ACTIVE, expires_at=expires_at)
            if pending.stored:
                batch.ops.append(Activate(r.admission_id, r.fence, expires_at, now))
            else:
                batch.ops.append(Reserve(active))
                batch.reserved[r.admission_id] = active
            decision = self._admitted(
                active, list(grant_ids), pending.fallback_for, tools=pending.tools, now=now
            )
            self._count_grant(batch, active, pending.request.requirements, pending.tenant, now)
        batch.decisions[pending.index] = decision
        decided = DecisionRecord(
            pending.digest, decision, pending.tenant, _estimate(pending.request.requirements),
            snapshot=pending.snapshot, evaluated_at=now, shadow=pending.shadow,
            eligibility_ref=pending.snapshot.ref if pending.snapshot else None,
        )  # fmt: skip
        self._record(batch, decided, now)
        return decision

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: keep what it decided."""
        for admission_id, decided in batch.decided.items():
            self._remember(admission_id, decided)
        self.budgets_set |= batch.budgets
        for ref, snapshot in batch.snapshots.items():
            self.known_snapshot(ref, snapshot)
        for eviction in batch.evicted:
            self.held.pop(eviction.victim.admission_id, None)
            self.evicted[eviction.victim.admission_id] = eviction.at
            while len(self.evicted) > DECISION_CACHE_SIZE:
                self.evicted.popitem(last=False)
        self.held.update(batch.held)
        self.evictions += batch.evicted
        self.live_written.update(batch.live_written)
        if batch.live_checked is not None:
            self.live_checked = batch.live_checked
        self.misses += batch.misses
        for pool_id in batch.line_marks:
            self.lines[pool_id].forget_undo()

    def abandoned(self, batch: Batch, now: float) -> None:
        """Nothing of ``batch`` was kept: put the pressure board and the lines back."""
        for admission_id in batch.granted:
            self.pressure.ended(admission_id, now, completed=False)
        for eviction in batch.evicted:  # the victims' releases rolled back with it
            self.pressure.restore(eviction.victim.admission_id, eviction.holding, now)
        for pool_id, mark in batch.line_marks.items():
            self.lines[pool_id].undo(mark)

    def _write_live(self, batch: Batch, live: LiveCapacity) -> None:
        """The ledger's live-slot capacities as the registry says: per described pool and
        capability, the free concurrency of the live agents whose version the descriptor's
        range covers (only those that changed since the last committed write)."""
        checked = (live.version, self.descriptors_version)
        if checked == self.live_checked:
            return  # neither the registry nor the descriptors changed since the last write
        targets = {
            key: free
            for key, free in described_free(self.descriptors, live, self.descriptors).items()
            if self.live_written.get(key) != free
        }
        for (pool_id, resource), capacity in sorted(targets.items()):
            batch.ops.append(SetCapacity(pool_id, resource, capacity))
            used = batch.counters.get((pool_id, resource), (0, 0))[0]
            batch.counters[(pool_id, resource)] = (used, capacity)
            batch.live_written[(pool_id, resource)] = capacity
        batch.live_checked = checked

    def _admit(
        self,
        batch: Batch,
        index: int,
        request: AdmissionRequest,
        tenant: str,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision | None:
        digest = requirement_digest(request.requirements, tenant)
        earlier = self._earlier_decision(batch, request.admission_id, digest)
        if earlier is not None:
            if earlier.outcome == "admitted":
                batch.replayed.add(request.admission_id)
            return earlier
        # The verdicts only (the result's own ``now`` may be older): the record keeps ``now``.
        eligibility = self.eligibility_cache.lookup(
            request.requirements,
            tenant,
            self.descriptors,
            state=self.descriptors_version,
            active_epochs=self.active_epochs,
            active_generation=self.policy.active_generation,
            now=now,
        )
        snapshot = self._store_snapshot(batch, eligibility.snapshot())
        shadow = None
        if self.shadows:  # computed and recorded, never enforced
            shadow = self._shadow_record(request.requirements, tenant, eligibility, now)
        decision = self._decide(batch, index, request, tenant, digest, eligibility, now, live)
        if decision is None:  # waits for external grants: recorded once settled
            batch.pending[-1].snapshot, batch.pending[-1].shadow = snapshot, shadow
            return None
        if decision.outcome != "deferred":
            self._leave_lines(batch, request.admission_id)
        elif decision.position is None:  # deferred for another reason (shed, fair share…)
            self._keep_places(batch, request, tenant, decision.retry_after_ms, now)
        decided = DecisionRecord(
            digest, decision, tenant, _estimate(request.requirements),
            snapshot=snapshot, evaluated_at=now, shadow=shadow, eligibility_ref=snapshot.ref,
            line=self._places(request) if decision.outcome == "deferred" else None,
        )  # fmt: skip
        self._record(batch, decided, now)
        return decision

    def _decide(
        self,
        batch: Batch,
        index: int,
        request: AdmissionRequest,
        tenant: str,
        digest: str,
        eligibility: EligibilityResult,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision | None:
        denial = eligibility.denial_reason()
        if denial is not None:
            filtered = ", ".join(f"{v.pool_id}: {v.rule}" for v in eligibility.filtered)
            return refused(request.admission_id, denial, filtered or "no pool is described")
        self._ensure_budget(batch, tenant)
        req = request.requirements
        first: tuple[str, Shed] | None = None  # why the most preferred pool said no
        tried = False
        missed: list[tuple[str, str]] = []  # pools refused for capacity or no live agent
        for pool_id, fallback_for in self._pools(req, eligibility, batch.counters, live):
            tried = True
            gated = self._gate(pool_id, req, tenant, now, live)
            if gated is not None:
                first = first or (pool_id, gated)
                if gated.reason == AdmissionReason.NO_LIVE_AGENT:
                    missed.append((pool_id, gated.reason))
                continue
            known = batch.reserved.get(request.admission_id) or batch.view.reservations.get(
                request.admission_id
            )
            if known is not None:  # reserved before (a manager stopped mid-way)
                return self._known(batch, index, request, tenant, digest, known, now)
            behind = self._behind_the_line(batch, pool_id, request, tenant, now, live)
            if behind is not None:
                first = first or (pool_id, behind)
                missed.append((pool_id, AdmissionReason.CAPACITY.value))
                continue
            reserved = self._reserve(batch, request, tenant, digest, pool_id, now, live)
            if isinstance(reserved, Reservation):
                return self._granted(
                    batch, index, request, tenant, digest, reserved, fallback_for, now
                )
            first = first or (pool_id, Shed(reserved.reason.value, reserved.detail, 1))
            if reserved.reason is LedgerReason.CAPACITY:
                missed.append((pool_id, AdmissionReason.CAPACITY.value))
            if reserved.reason is LedgerReason.TENANT_BUDGET:
                break  # the budget is the tenant's, whichever pool
        if not tried:  # no primary: nothing for a fallback to stand in for
            return refused(
                request.admission_id,
                AdmissionReason.NO_ELIGIBLE_POOL,
                "only pools named in allowed_fallbacks are eligible; a fallback stands in for "
                f"an eligible primary pool ({', '.join(eligibility.eligible)})",
            )
        assert first is not None  # every pool tried said why not
        decision = self._not_now(batch, request, tenant, first[0], first[1], now, live)
        if decision.outcome == "deferred":
            batch.misses += missed
        return decision

    def _not_now(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        pool_id: str,
        why: Shed,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision:
        """Why the most preferred pool said no, as a decision: for want of capacity (the
        counters', or what its stage leaves its class) with a place in its line when lines
        are on, else with a retry time."""
        if why.reason in _LINE_REASONS and self._lines_on():
            return self._in_line(batch, request, tenant, pool_id, why, now, live)
        return self._deferred(request, tenant, pool_id, why, now, live)

    # ---- the line (mesh.core.line) -----------------------------------------------------------
    def _lines_on(self) -> bool:
        """Lines are part of pressure handling: off with it (``enabled=False``) or alone."""
        return self.policy.pressure.enabled and self.policy.pressure.line

    def _line(self, batch: Batch, pool_id: str) -> PoolLine:
        line = self.lines.get(pool_id)
        if line is None:
            line = self.lines[pool_id] = PoolLine(max_waiting=self.policy.pressure.line_max)
        batch.line_marks.setdefault(pool_id, line.mark())
        return line

    def _room(
        self,
        batch: Batch,
        pool_id: str,
        req: TaskRequirements,
        tenant: str,
        live: LiveCapacity | None,
    ) -> int:
        """How many grants shaped like ``req`` the pool's counters hold room for now: the
        binding counter decides (slots, sandboxes, a tool…); the tenant's budget is its own."""
        room: int | None = None
        for item_pool, resource, amount in self._items(req, tenant, pool_id, live):
            if item_pool != pool_id:
                continue
            used, capacity = batch.counters.get((item_pool, resource), (0, 0))
            fits = max(0, capacity - used) // amount
            room = fits if room is None else min(room, fits)
        return room or 0

    def _class_room(
        self,
        batch: Batch,
        pool_id: str,
        req: TaskRequirements,
        tenant: str,
        live: LiveCapacity | None,
    ) -> int:
        """The room for ``req``: its counters', within what the pool's stage leaves its class
        (batch and speculative work stop short of full)."""
        free = self._room(batch, pool_id, req, tenant, live)
        staged = self.pressure.class_room(pool_id, req.service_class, req.priority)
        return free if staged is None else min(free, staged)

    def _behind_the_line(
        self,
        batch: Batch,
        pool_id: str,
        request: AdmissionRequest,
        tenant: str,
        now: float,
        live: LiveCapacity | None,
    ) -> Shed | None:
        """``CAPACITY`` when at least as many requests wait ahead of this one in the pool's
        line as there is room for: that room is theirs while they are due back."""
        if not self._lines_on() or pool_id not in self.lines:
            return None
        line = self._line(batch, pool_id)
        if not line:
            return None
        req = request.requirements
        cls = req.service_class
        ahead = line.ahead(request.admission_id, tenant, cls, now)
        free = self._class_room(batch, pool_id, req, tenant, live)
        if ahead == 0 or ahead < free:
            return None
        return Shed(
            AdmissionReason.CAPACITY.value,
            f"{ahead} request(s) wait ahead of this one in {pool_id}'s line for {cls} work and "
            f"there is room for {free}: room goes to the head of the line first",
            1,
        )

    def _in_line(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        pool_id: str,
        why: Shed,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision:
        """A deferral for capacity with a place in ``pool_id``'s line: its position, and a
        retry time from that position and the pool's drain rate; the place is kept until
        then plus ``line_grace_s``. A retry that would miss the deadline: rejected."""
        req = request.requirements
        line = self._line(batch, pool_id)
        ahead = line.ahead(request.admission_id, tenant, req.service_class, now)
        free = self._class_room(batch, pool_id, req, tenant, live)
        joining = request.admission_id not in line
        retry_ms = self.pressure.line_retry_ms(
            pool_id, ahead + 1, free, req.estimated_duration_s, req.deadline, now, self.rand,
            joining=joining,
        )  # fmt: skip
        if retry_ms is None:
            return AdmissionDecision(
                admission_id=request.admission_id,
                outcome="rejected",
                reason=AdmissionReason.DEADLINE_UNREACHABLE,
                detail=f"{why.detail}; its turn would come after the deadline"[:1000],
                allowed_degradations=list(req.allowed_degradations),
            )
        due_by = now + retry_ms / 1000.0 + self.policy.pressure.line_grace_s
        placed = line.join(request.admission_id, tenant, req.service_class, now, due_by)
        detail = why.detail
        if placed:
            detail = f"{detail}; place {ahead + 1} in {pool_id}'s line, kept until {due_by:.1f}"
        return AdmissionDecision(
            admission_id=request.admission_id,
            outcome="deferred",
            reason=AdmissionReason(why.reason),
            detail=detail[:1000],
            retry_after_ms=retry_ms,
            position=ahead + 1 if placed else None,
            allowed_degradations=list(req.allowed_degradations),
        )

    def _keep_places(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        retry_after_ms: int | None,
        now: float,
    ) -> None:
        """A request in a line deferred for another reason (its class shed for a while, its
        tenant at its share) keeps its place for its retry time and the grace: a younger
        request of its class and tenant must not overtake it meanwhile."""
        due_by = now + (retry_after_ms or 0) / 1000.0 + self.policy.pressure.line_grace_s
        cls = request.requirements.service_class
        for pool_id, line in self.lines.items():
            if request.admission_id in line:
                batch.line_marks.setdefault(pool_id, line.mark())
                line.join(request.admission_id, tenant, cls, now, due_by)

    def _places(self, request: AdmissionRequest) -> list[list[Any]] | None:
        """The places ``request`` holds in the lines, as its decision record keeps them: pool,
        class, when it joined, until when it is kept, and the request's deadline."""
        deadline = request.requirements.deadline
        places = [
            [pool_id, w.service_class, w.joined_at, w.due_by, deadline]
            for pool_id, line in self.lines.items()
            if (w := line.get(request.admission_id)) is not None
        ]
        return places or None

    def rejoin_lines(self, waiting: Iterable[tuple[str, DecisionRecord]], now: float) -> int:
        """Rebuild the lines from the records of deferred requests (after a restart): each
        place is taken again with the time it was first taken, so a request deferred before
        the restart stays ahead of one that first asks after it. A holder could not come back
        while no manager was there to hear it (its retry waits in the queue): a place is kept
        at least ``line_grace_s`` from ``now`` — unless its request's deadline has passed.
        Returns how many places were taken."""
        if not self._lines_on():
            return 0
        grace = self.policy.pressure.line_grace_s
        places = sorted(
            (float(joined_at), admission_id, decided.tenant or "", pool_id, cls, float(due_by))
            for admission_id, decided in waiting
            for pool_id, cls, joined_at, due_by, *more in decided.line or ()
            if not more or more[0] is None or float(more[0]) > now
        )
        for joined_at, admission_id, tenant, pool_id, cls, due_by in places:
            line = self.lines.get(pool_id)
            if line is None:
                line = self.lines[pool_id] = PoolLine(max_waiting=self.policy.pressure.line_max)
            line.join(admission_id, tenant, cls, joined_at, max(due_by, now + grace))
        for line in self.lines.values():
            line.forget_undo()
        return len(places)

    def _leave_lines(self, batch: Batch, admission_id: str) -> None:
        for pool_id, line in self.lines.items():
            if admission_id in line:
                batch.line_marks.setdefault(pool_id, line.mark())
                line.leave(admission_id)

    def _known(
        self,
        batch: Batch,
        index: int,
        request: AdmissionRequest,
        tenant: str,
        digest: str,
        known: Reservation,
        now: float,
    ) -> AdmissionDecision | None:
        """The decision for an admission ID the ledger already has a reservation for: the
        same grant, the activation a stopped manager did not get to, or why neither."""
        admission_id = request.admission_id
        if known.digest != digest:
            return refused(
                admission_id,
                AdmissionReason.CONFLICT,
                f"admission {admission_id!r} is already reserved for requirement digest "
                f"{known.digest!r}, not {digest!r}",
            )
        tools = self._tools(request.requirements)
        if any(p.reservation.admission_id == admission_id for p in batch.pending):
            return refused(
                admission_id,
                AdmissionReason.LEDGER_UNAVAILABLE,
                "the same admission is being decided in this batch; retry with the same "
                "admission ID",
                deferred=True,
                retry_after_ms=self.policy.pressure.retry_default_ms,
            )
        if known.state is ReservationState.ACTIVE:
            decision = self._admitted(known, [], tools=tools, now=now)
            if admission_id not in self.held:  # granted by a manager that stopped mid-way
                self._count_grant(batch, known, request.requirements, tenant, now)
            batch.replayed.add(admission_id)  # granted before: not a second grant
            return decision
        if known.state is ReservationState.PREPARING and known.expires_at > now:
            if self.external_grants:
                batch.pending.append(
                    PendingExternal(
                        index, request, tenant, digest, known, None, tools, True, None, None
                    )
                )
                return None
            expires_at = now + self.policy.grant_ttl_s
            batch.ops.append(Activate(admission_id, known.fence, expires_at, now))
            active = replace(known, state=ReservationState.ACTIVE, expires_at=expires_at)
            decision = self._admitted(active, [], tools=tools, now=now)
            self._count_grant(batch, active, request.requirements, tenant, now)
            return decision
        return refused(
            admission_id,
            AdmissionReason.STALE_FENCE,
            f"this admission is {known.state}; a new phase needs a new admission ID",
        )

    def _reserve(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        digest: str,
        pool_id: str,
        now: float,
        live: LiveCapacity | None,
    ) -> Reservation | Refused:
        """A fresh reservation taking every counter the request needs in ``pool_id``, or
        the first shortage; short of a slot, once more after evicting a recoverable
        lower-ranked grant if there is one."""
        items = self._items(request.requirements, tenant, pool_id, live)
        short = batch.take(items)
        if _short_of_slots(short) and self._evict_for(batch, request, tenant, pool_id, now):
            short = batch.take(items)
        if short is not None:
            return short
        descriptor = self.descriptors.get(pool_id)
        return Reservation(
            request.admission_id, digest, pool_id, ReservationState.ACTIVE, batch.fences.pop(),
            items, now + self.policy.grant_ttl_s, now, now,
            descriptor.descriptor_epoch if descriptor is not None else None,
        )  # fmt: skip

    @staticmethod
    def _items(
        req: TaskRequirements, tenant: str, pool_id: str, live: LiveCapacity | None
    ) -> tuple[Item, ...]:
        """Every counter a grant of ``req`` in ``pool_id`` takes, and how much of each."""
        raw = [
            (TENANT_POOL if resource.startswith(TENANT_TOKENS_PREFIX) else pool_id, resource, n)
            for resource, n in reservation_items(req, tenant)
        ]
        if live is not None:
            raw.append((pool_id, live_slots_resource(req.capability.name), 1))
        return normalize_built(tuple(raw))  # names and validated ints: exact types

    def _granted(
        self,
        batch: Batch,
        index: int,
        request: AdmissionRequest,
        tenant: str,
        digest: str,
        reservation: Reservation,
        fallback_for: str | None,
        now: float,
    ) -> AdmissionDecision | None:
        """The grant of a fresh reservation, or (external grants to take first) pending."""
        tools = self._tools(request.requirements)
        if self.external_grants:
            batch.pending.append(
                PendingExternal(
                    index, request, tenant, digest, reservation, fallback_for, tools, False,
                    None, None,
                )
            )  # fmt: skip
            return None
        batch.ops.append(Reserve(reservation))
        batch.reserved[reservation.admission_id] = reservation
        decision = self._admitted(reservation, [], fallback_for, tools=tools, now=now)
        self._count_grant(batch, reservation, request.requirements, tenant, now)
        return decision

    def _tools(self, req: TaskRequirements) -> tuple[str, ...]:
        """The tools a lease names (none to name without a signer)."""
        return tuple(t.name for t in req.required_tools) if self.lease_signer else ()

    def _gate(
        self,
        pool_id: str,
        req: TaskRequirements,
        tenant: str,
        now: float,
        live: LiveCapacity | None,
    ) -> Shed | None:
        """Why ``pool_id`` may not take the request before its counters are asked: no live
        agent for it, or the pool's pressure stage sheds it (``None``: ask the counters)."""
        return self._no_live_agent(pool_id, req, live) or self.pressure.check(
            pool_id, tenant, req.service_class, req.priority, req.estimated_duration_s,
            req.deadline, now, _run_of(req.run_id, tenant),
        )  # fmt: skip

    def _no_live_agent(
        self, pool_id: str, req: TaskRequirements, live: LiveCapacity | None
    ) -> Shed | None:
        """``NO_LIVE_AGENT`` if no live agent of the pool offers the capability at a version in
        both the task's range and the descriptor's (``None``: one does, or no live view)."""
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
        self,
        request: AdmissionRequest,
        tenant: str,
        pool_id: str,
        why: Shed,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision:
        """A refusal with a retry time from the pool's drain rate (for want of a live agent:
        from the pool's pending scale-up) — or, when coming back cannot meet the deadline,
        ``DEADLINE_UNREACHABLE`` at once."""
        req = request.requirements
        retry_ms = None
        if why.reason == AdmissionReason.NO_LIVE_AGENT:
            expected_s = live.retry_s.get(pool_id) if live is not None else None
            retry_ms = self._no_agent_retry_ms(expected_s, req.deadline, now)
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

    def _no_agent_retry_ms(
        self, expected_s: float | None, deadline: float | None, now: float
    ) -> int | None:
        """When an agent may be live: the scale planner's estimate (``expected_s``) where
        the pool has a scaling policy, else the default retry time; ``None`` past the
        deadline."""
        if expected_s is None:
            wait_ms = float(self.policy.pressure.retry_default_ms)
        else:
            wait_ms = 1000.0 * expected_s
        wait_ms *= 1.0 + 0.2 * self.rand()  # spread the producers' returns
        if deadline is not None and now + wait_ms / 1000.0 >= deadline:
            return None
        return max(1, round(wait_ms))

    def _evict_for(
        self, batch: Batch, request: AdmissionRequest, tenant: str, pool_id: str, now: float
    ) -> bool:
        """Release one recoverable, lower-ranked grant of the full ``pool_id`` to make room
        for ``request``; ``True`` if one was released (in the batch's counters and ops)."""
        req = request.requirements
        rank = shed_rank(req.service_class, req.priority, self.policy.pressure)
        victim_id = self.pressure.victim(pool_id, tenant, rank, now)
        if victim_id is None:
            return False
        held = batch.held.get(victim_id) or self.held.get(victim_id)
        if held is None or held.expires_at <= now:  # not a grant this core knows, or overdue
            self.pressure.ended(victim_id, now, completed=False)
            return False
        batch.ops.append(Release(victim_id, held.fence, now))
        batch.give_back(held.items)
        holding = self.pressure.ended(victim_id, now, completed=False)
        assert holding is not None  # the board named it
        victim = Reservation(
            victim_id, "", pool_id, ReservationState.RELEASED, held.fence, held.items,
            held.expires_at, now, now,
        )  # fmt: skip
        batch.evicted.append(Eviction(victim, holding, request.admission_id, now))
        batch.held.pop(victim_id, None)
        return True

    def _count_grant(
        self,
        batch: Batch,
        reservation: Reservation,
        req: TaskRequirements,
        tenant: str,
        now: float,
    ) -> None:
        self.pressure.granted(
            reservation.admission_id, reservation.pool_id, tenant, now,
            rank=shed_rank(req.service_class, req.priority, self.policy.pressure),
            evict_order=evict_order(req.recoverability),
            run=_run_of(req.run_id, tenant),
        )  # fmt: skip
        batch.granted.append(reservation.admission_id)
        batch.held[reservation.admission_id] = Held(
            reservation.fence, reservation.items, reservation.expires_at
        )

    def _pools(
        self,
        requirements: TaskRequirements,
        eligibility: EligibilityResult,
        counters: Mapping[tuple[str, str], tuple[int, int]],
        live: LiveCapacity | None,
    ) -> Iterator[tuple[str, str | None]]:
        """The pools to try, in order, as ``(pool_id, the primary it stands in for)``; the
        fallbacks are checked only once every primary is full.

        Primaries — eligible pools the task does not name as fallbacks — come first, in the
        one preference order (:func:`by_preference`). Then the task's ``allowed_fallbacks``
        that are eligible, in its order, each only if it gives the task nothing the preferred
        primary would not (:func:`~mesh.core.eligibility.widening`). Without an eligible
        primary, a fallback has nothing to stand in for: nothing is tried.
        """
        named = set(requirements.allowed_fallbacks)
        primaries = by_preference(
            [p for p in eligibility.eligible if p not in named], requirements, counters, live
        )
        if not primaries:
            return
        for pool_id in primaries:
            yield pool_id, None
        primary = self.descriptors[primaries[0]]
        for pool_id in fallback_pools(requirements, eligibility, self.descriptors):
            if widening(primary, self.descriptors[pool_id], requirements) is None:
                yield pool_id, primary.pool_id

    def _admitted(
        self,
        reservation: Reservation,
        external: list[str],
        fallback_for: str | None = None,
        *,
        tools: Sequence[str] = (),
        now: float,
    ) -> AdmissionDecision:
        # The epoch it was granted under, so a replay reports the same grant; rows written
        # before reservations kept it report the pool's current epoch.
        epoch = reservation.descriptor_epoch
        if epoch is None:
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

    def _ensure_budget(self, batch: Batch, tenant: str) -> None:
        """Give a tenant seen for the first time the default budget."""
        if tenant in self.budgets_set or tenant in batch.budgets:
            return
        key = (TENANT_POOL, tenant_tokens_resource(tenant))
        if key not in batch.counters:
            capacity = self.policy.default_tenant_tokens
            batch.ops.append(SetCapacity(*key, capacity))
            batch.counters[key] = (0, capacity)
        batch.budgets.add(tenant)

    # ---- decisions recorded ---------------------------------------------------------------
    def _earlier_decision(
        self, batch: Batch, admission_id: str, digest: str
    ) -> AdmissionDecision | None:
        """The answer already given to this admission ID, if it still holds. A reservation
        without a recorded decision (its manager stopped mid-way) is found when reserving."""
        decided = self._recorded_for(batch, admission_id)
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

    def _recorded_for(self, batch: Batch, admission_id: str) -> DecisionRecord | None:
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

    def _record(self, batch: Batch, decided: DecisionRecord, now: float) -> None:
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

    def _remember(self, admission_id: str, decided: DecisionRecord) -> None:
        self.decisions[admission_id] = decided
        self.decisions.move_to_end(admission_id)
        while len(self.decisions) > DECISION_CACHE_SIZE:
            self.decisions.popitem(last=False)

    def _store_snapshot(self, batch: Batch, snapshot: EligibilitySnapshot) -> EligibilitySnapshot:
        """Have the ledger keep ``snapshot`` unless it is known to; returns it."""
        if snapshot.ref not in self.snapshots and snapshot.ref not in batch.snapshots:
            batch.ops.append(SaveEligibility(snapshot.ref, snapshot.body))
            batch.snapshots[snapshot.ref] = snapshot
        return snapshot

    def known_snapshot(self, ref: str, snapshot: EligibilitySnapshot) -> None:
        self.snapshots[ref] = snapshot
        if len(self.snapshots) > SNAPSHOT_CACHE_SIZE:
            del self.snapshots[next(iter(self.snapshots))]  # the oldest; stored regardless

    def _shadow_record(
        self,
        requirements: TaskRequirements,
        tenant: str,
        live: EligibilityResult,
        now: float,
    ) -> dict[str, Any]:
        """How eligibility would differ with the shadow descriptors active."""
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


def by_preference(
    pools: Sequence[str],
    req: TaskRequirements,
    counters: Mapping[tuple[str, str], tuple[int, int]],
    live: LiveCapacity | None,
) -> list[str]:
    """``pools`` in the one preference order (:func:`mesh.core.ranking.rank`) — the pool's
    cost class for the capability, from its live agents, then its share of model slots in
    use — and then pool ID."""
    if len(pools) < 2:
        return list(pools)
    name, wanted = req.capability.name, req.capability.version_spec

    def key(pool_id: str) -> tuple[Rank, str]:
        used, capacity = counters.get((pool_id, MODEL_SLOTS), (0, 0))
        cost = None if live is None else live.cost_class(pool_id, name, wanted)
        return (ranking.rank(cost, used / capacity if capacity else 1.0), pool_id)

    return sorted(pools, key=key)


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


def _tenant_of(reservation: Reservation) -> str | None:
    """The tenant whose token budget a reservation draws on (None if it takes no tokens)."""
    for item in reservation.items:
        if item.pool_id == TENANT_POOL and item.resource.startswith(TENANT_TOKENS_PREFIX):
            return item.resource[len(TENANT_TOKENS_PREFIX) :]
    return None


def _run_of(run_id: str | None, tenant: str) -> str | None:
    """A run's key on the pressure board: run IDs are scoped by tenant."""
    return None if run_id is None else f"{tenant}/{run_id}"


# Deferrals that give a place in the pool's line: want of room, the counters' or the stage's.
_LINE_REASONS = frozenset({AdmissionReason.CAPACITY.value, AdmissionReason.SHED.value})


def _short_of_slots(refused: Refused | None) -> bool:
    """Short of a model slot or a live agent's slot: what evicting a grant of the pool frees."""
    return refused is not None and (
        refused.resource == MODEL_SLOTS or (refused.resource or "").startswith(LIVE_SLOTS_PREFIX)
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
