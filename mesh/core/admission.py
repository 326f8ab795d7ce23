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

The core composes rooms, each with one job: :mod:`~mesh.core.rollout` (active descriptors,
epochs, shadows), :mod:`~mesh.core.decision_memory` (earlier decisions and their records),
:mod:`~mesh.core.places` (the lines of deferred requests), :mod:`~mesh.core.held` (grants on
the pressure board, eviction), :mod:`~mesh.core.pool_order` (which pools to try) and
:mod:`~mesh.core.answers` (the decisions as a producer receives them); the batch they all
write is :mod:`~mesh.core.batch`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mesh.core.answers import admitted, refused, retry_or_reject
from mesh.core.batch import Batch, Eviction, PendingExternal, grant_items
from mesh.core.capacity import LiveCapacity
from mesh.core.decision_memory import DecisionMemory
from mesh.core.eligibility import (
    EligibilityCache,
    EligibilityResult,
    EligibilitySnapshot,
    tenant_tokens_resource,
)
from mesh.core.held import HeldGrants, run_of, short_of_slots
from mesh.core.live_slots import LiveSlots, no_live_agent, staged_slots
from mesh.core.places import LINE_REASONS, Places
from mesh.core.policy.retry_times import no_agent_retry_ms
from mesh.core.pool_order import pools_to_try
from mesh.core.pressure import PressureBoard, PressurePolicy, Shed
from mesh.core.records import DecisionRecord, estimate
from mesh.core.rollout import Rollout
from mesh.ledger.model import (
    TENANT_POOL,
    Activate,
    LedgerReason,
    LedgerView,
    Refused,
    Release,
    Reservation,
    ReservationState,
    Reserve,
    SetCapacity,
    Usage,
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

__all__ = ["AdmissionCore", "AdmissionPolicy"]


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


@dataclass
class AdmissionCore:
    """Descriptors, eligibility, live capacity, pressure and the ledger's view, composed into
    decisions. Not thread-safe: its owner calls it from one thread."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    rand: Callable[[], float] = lambda: 0.5  # retry-time jitter in [0, 1) (the shell's input)
    external_grants: bool = False  # the shell takes external grants for every admission
    lease_signer: LeaseSigner | None = None  # signs an invocation lease into every grant
    # Change descriptors and epochs through activate, set_active_epoch and the shadow
    # methods only: the eligibility cache keys on the rollout's version.
    rollout: Rollout = field(default_factory=Rollout)
    memory: DecisionMemory = field(default_factory=DecisionMemory)
    pressure: PressureBoard = field(init=False)
    grants: HeldGrants = field(init=False)  # grants on the pressure board; eviction
    places: Places = field(init=False)  # per pool: the line of requests deferred for capacity
    evictions: list[Eviction] = field(default_factory=list)  # committed; drained by the shell
    misses: list[tuple[str, str]] = field(default_factory=list)  # committed; drained by shell
    eligibility_cache: EligibilityCache = field(default_factory=EligibilityCache)
    budgets_set: set[str] = field(default_factory=set)
    live_slots: LiveSlots = field(default_factory=LiveSlots)  # what was written of them
    # Each batch first brings the ledger's live-slot capacities up to the live snapshot it is
    # given. Off with several managers: each pool's owner writes them, fenced by its shard
    # lease (mesh.manager.live_share), and every manager decides against what is written.
    writes_live: bool = True

    def __post_init__(self) -> None:
        self.pressure = PressureBoard(self.policy.pressure)
        self.grants = HeldGrants(self.pressure)
        self.places = Places(self.pressure, self.rand)

    # ---- the rooms' state, as the shell and tests read it ---------------------------------
    @property
    def descriptors(self) -> Mapping[str, CapabilityDescriptor]:
        return self.rollout.descriptors

    @property
    def active_epochs(self) -> Mapping[str, int]:
        return self.rollout.active_epochs

    @property
    def shadows(self) -> Mapping[str, CapabilityDescriptor]:
        return self.rollout.shadows

    @property
    def draining(self) -> dict[str, dict[str, float]]:
        return self.rollout.draining

    @property
    def decisions(self) -> OrderedDict[str, DecisionRecord]:
        return self.memory.decisions

    @property
    def snapshots(self) -> dict[str, EligibilitySnapshot]:
        return self.memory.snapshots

    @property
    def evicted(self) -> OrderedDict[str, float]:
        return self.grants.evicted

    # ---- descriptors ----------------------------------------------------------------------
    def activate(self, descriptor: CapabilityDescriptor) -> None:
        """Make ``descriptor`` its pool's active one (the shell has stored it)."""
        self.rollout.activate(descriptor)
        # Until the next usage observation, shed against the described slots.
        self.pressure.pool(descriptor.pool_id).capacity = descriptor.model_limits.slots

    def set_active_epoch(self, pool_id: str, epoch: int) -> None:
        """Make ``epoch`` the pool's active descriptor epoch (a rollout that moves on before
        its descriptor arrives): descriptors of other epochs are no longer eligible."""
        self.rollout.set_active_epoch(pool_id, epoch)

    def set_shadow(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Shadow ``descriptor`` (a newer epoch than the active one); ``None`` or why not."""
        return self.rollout.set_shadow(descriptor, now)

    def drop_shadow(self, pool_id: str) -> CapabilityDescriptor | None:
        return self.rollout.drop_shadow(pool_id)

    def draining_allowlist(self, pool_id: str, now: float) -> list[str] | None:
        """The admissions whose older-epoch grants the pool's agents still honour, or ``None``
        if this manager did not advance the pool (it does not know the list: say nothing)."""
        return self.rollout.draining_allowlist(pool_id, now)

    # ---- state restored and observed ------------------------------------------------------
    def known_snapshot(self, ref: str, snapshot: EligibilitySnapshot) -> None:
        self.memory.known_snapshot(ref, snapshot)

    def rejoin_lines(self, waiting: Iterable[tuple[str, DecisionRecord]], now: float) -> int:
        """Rebuild the lines from the records of deferred requests (after a restart); how
        many places were taken again (:meth:`mesh.core.places.Places.rejoin`)."""
        return self.places.rejoin(waiting, now)

    def ended(self, admission_id: str, now: float, *, completed: bool) -> None:
        """A grant is over (released by its holder, expired, or found gone)."""
        self.grants.ended(admission_id, now, completed=completed)
        self.rollout.ended(admission_id)

    def adopt(self, reservation: Reservation, decided: DecisionRecord | None, now: float) -> None:
        """Count a grant the ledger holds (after a restart) on the pressure board: the fair
        shares need to know who holds what, and an eviction its fence."""
        self.grants.adopt(reservation, decided)

    def observe_usage(self, usage: Usage, now: float) -> None:
        """Refresh the board's utilisation from the ledger's counters (every tick: they
        include other managers' grants)."""
        self.pressure.observe_usage(staged_slots(usage), now)

    # ---- deciding -------------------------------------------------------------------------
    def live_unchanged(self, live: LiveCapacity) -> bool:
        """True if the ledger's live-slot capacities already match ``live``."""
        return self.live_slots.unchanged(live, self.rollout.version)

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
            self.live_slots.write(batch, live, self.descriptors, self.rollout.version)
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
            self.grants.count(batch, active, pending.request.requirements, pending.tenant, now)
        batch.decisions[pending.index] = decision
        decided = DecisionRecord(
            pending.digest, decision, pending.tenant, estimate(pending.request.requirements),
            snapshot=pending.snapshot, evaluated_at=now, shadow=pending.shadow,
            eligibility_ref=pending.snapshot.ref if pending.snapshot else None,
        )  # fmt: skip
        self.memory.record(batch, decided, now)
        return decision

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: keep what it decided."""
        self.memory.committed(batch)
        self.budgets_set |= batch.budgets
        self.grants.committed(batch)
        self.evictions += batch.evicted
        self.live_slots.committed(batch)
        self.misses += batch.misses
        self.places.committed(batch)

    def abandoned(self, batch: Batch, now: float) -> None:
        """Nothing of ``batch`` was kept: put the pressure board and the lines back."""
        self.grants.abandoned(batch, now)
        self.places.abandoned(batch)

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
        earlier = self.memory.earlier_decision(batch, request.admission_id, digest)
        if earlier is not None:
            if earlier.outcome == "admitted":
                batch.replayed.add(request.admission_id)
            return earlier
        # The verdicts only (the result's own ``now`` may be older): the record keeps ``now``.
        eligibility = self.eligibility_cache.lookup(
            request.requirements,
            tenant,
            self.descriptors,
            state=self.rollout.version,
            active_epochs=self.active_epochs,
            active_generation=self.policy.active_generation,
            now=now,
        )
        snapshot = self.memory.store_snapshot(batch, eligibility.snapshot())
        shadow = None
        if self.shadows:  # computed and recorded, never enforced
            shadow = self.rollout.shadow_record(
                request.requirements, tenant, eligibility, now, self.policy.active_generation
            )
        decision = self._decide(batch, index, request, tenant, digest, eligibility, now, live)
        if decision is None:  # waits for external grants: recorded once settled
            batch.pending[-1].snapshot, batch.pending[-1].shadow = snapshot, shadow
            return None
        if decision.outcome != "deferred":
            self.places.leave(batch, request.admission_id)
        elif decision.position is None:  # deferred for another reason (shed, fair share…)
            self.places.keep_places(batch, request, tenant, decision.retry_after_ms, now)
        decided = DecisionRecord(
            digest, decision, tenant, estimate(request.requirements),
            snapshot=snapshot, evaluated_at=now, shadow=shadow, eligibility_ref=snapshot.ref,
            line=self.places.held_by(request) if decision.outcome == "deferred" else None,
        )  # fmt: skip
        self.memory.record(batch, decided, now)
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
        for pool_id, fallback_for in pools_to_try(
            req, eligibility, batch.counters, live, self.descriptors
        ):
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
            behind = self.places.behind_the_line(batch, pool_id, request, tenant, now, live)
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
        if why.reason in LINE_REASONS and self.places.on():
            return self.places.in_line(batch, request, tenant, pool_id, why, now, live)
        return self._deferred(request, tenant, pool_id, why, now, live)

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
            if admission_id not in self.grants.held:  # granted by a manager that stopped mid-way
                self.grants.count(batch, known, request.requirements, tenant, now)
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
            self.grants.count(batch, active, request.requirements, tenant, now)
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
        items = grant_items(request.requirements, tenant, pool_id, live)
        short = batch.take(items)
        if short_of_slots(short) and self.grants.evict_for(batch, request, tenant, pool_id, now):
            short = batch.take(items)
        if short is not None:
            return short
        descriptor = self.descriptors.get(pool_id)
        return Reservation(
            request.admission_id, digest, pool_id, ReservationState.ACTIVE, batch.fences.pop(),
            items, now + self.policy.grant_ttl_s, now, now,
            descriptor.descriptor_epoch if descriptor is not None else None,
        )  # fmt: skip

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
        self.grants.count(batch, reservation, request.requirements, tenant, now)
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
        return no_live_agent(pool_id, req, live, self.descriptors) or self.pressure.check(
            pool_id, tenant, req.service_class, req.priority, req.estimated_duration_s,
            req.deadline, now, run_of(req.run_id, tenant),
        )  # fmt: skip

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
            retry_ms = no_agent_retry_ms(
                expected_s, now, req.deadline, self.policy.pressure, self.rand
            )
        elif why.slots_to_free is not None:
            retry_ms = self.pressure.retry_after_ms(
                pool_id, tenant, why.slots_to_free, req.estimated_duration_s, req.deadline, now,
                self.rand,
            )  # fmt: skip
        return retry_or_reject(request, why, retry_ms)

    def _admitted(
        self,
        reservation: Reservation,
        external: list[str],
        fallback_for: str | None = None,
        *,
        tools: Sequence[str] = (),
        now: float,
    ) -> AdmissionDecision:
        return admitted(
            reservation, external, fallback_for, tools=tools, now=now,
            descriptors=self.descriptors, policy_generation=self.policy.active_generation,
            lease_signer=self.lease_signer, lease_ttl_s=self.policy.lease_ttl_s,
        )  # fmt: skip

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
