"""Pressure: staged load shedding, tenant fair shares and retry times that mean something.

Theory of operation
-------------------
Each pool has a **stage**, the answer to "how much of its capacity is spoken for, and is the
work draining?". As pressure rises, work is shed in a fixed order, cheapest to lose first:

=====================  =====================================================================
``NORMAL``             everything is admitted (capacity permitting)
``SHED_SPECULATIVE``   speculative branches and low-priority fan-out (batch work at
                       priority <= ``low_priority``, when set) are refused
``PAUSE_BATCH``        deferrable batch work is deferred as well
``TIGHTEN``            every tenant is held to its fair share of the pool
``REJECT_INTERACTIVE`` new interactive requests are refused too
=====================  =====================================================================

The stage comes from two sources, and the higher one wins:

* **Utilisation** (exact: the ledger's model-slot counter as this manager last saw it, moved
  by its own grants and releases in between). Each stage has an integer slot limit,
  ``floor(threshold * capacity)``, at least 1 (an idle small pool admits anything): a
  request of a shed class is admitted only while its grant keeps the pool at or below its
  class's limit — exactly, on every admission, whatever the stage says.
* **Signals** read on each tick: the oldest task in the pool's queue has waited longer than
  ``queue_age_s`` (agents are not keeping up with what was granted: one stage up), or the broker
  has raised a memory or disk alarm (publishers are blocked: ``REJECT_INTERACTIVE``).

**The stage holds still.** A pool at a steady but jittery load must not flap between stages
(each change is journaled and counted). The stage rises to what the state calls for, straight
there; it steps down only once the *lowered* thresholds (``threshold - hysteresis``) have
called for a lower stage for ``min_dwell_s`` without a break; and it changes at most once per
``min_dwell_s`` — except into ``REJECT_INTERACTIVE`` for a broker alarm, at once. What the
gate refuses does not hold still: a stage entered for utilisation sheds nothing by itself —
each class is refused at its exact limit, so a slot below batch's limit is batch's the moment
it is free, however high a jittery load last pushed the stage (a held stage refusing it would
leave that slot idle: at steady full load batch work was never admitted). A stage entered on
a signal (queue age, broker alarm) sheds its classes for as long as it is held: the signal
says the counters are not the whole truth.

Which work is which (``shed_rank``): speculative tasks and low-priority batch fan-out go first
(rank 0), then batch (rank 1), then interactive (rank 2).

**Eviction** (``policy.evict``). Shedding refuses new work; once a pool is full, an
interactive request may also take a slot back from admitted work — but only from work that
declared itself recoverable (``recoverability`` ``rebuildable`` or ``retryable``) and ranks
below it, and only for a tenant still below its fair share (or from its own work). The victim
is the cheapest to lose: rebuildable before retryable, lower rank first, and among those the
most recently granted (the least likely to have started, the least work thrown away). Work
with external side effects of unknown outcome, waiting on human approval or near a commit is
never a victim. The shell releases the victim's reservation in the same ledger transaction and
revokes its grant as ``evicted``: its agent drops it (or stops it) and its producer resubmits.

**Fair shares.** A tenant's fair share of a pool is ``ceil(capacity / n)``, ``n`` counting the
tenants holding grants there or asking within ``demand_window_s``. Once the pool is busy (from
``SHED_SPECULATIVE``'s utilisation on), a tenant at or over its share takes another slot only
while one stays free for every other active tenant still below its share; at ``TIGHTEN`` it
takes none. Refusals say ``TENANT_FAIR_SHARE``. One tenant's burst can fill an idle pool, but
once the pool is busy, the slots that free up go to the tenants below their share.

**Runs.** A task may name the orchestration run it belongs to (``run_id``, scoped by tenant).
From ``TIGHTEN`` on, each run is held to ``ceil(capacity / active runs)`` of the pool, so one
run's fan-out cannot take every slot its tenant is entitled to (``RUN_CONCURRENCY``). Tasks
without a run are held by their tenant's share alone.

**Retry times** are computed, never constant: the pool's drain rate is ``capacity / mean service
time``, the service time being how long grants were held (admission to release, measured here
over the last ``service_window`` releases: the real distribution, not the producer's estimate,
which serves only until the first release). A refused request waits for the slots its class
needs freed plus the same tenant's refused requests still waiting to come back (tenants
queue behind their own waiting requests, not behind another's burst)::

    wait = (slots_to_free + competitors) / drain_rate

clamped to ``[retry_min_ms, retry_max_ms]`` and spread uniformly over ``wait * (1 ± jitter)``
so refused producers do not come back in step. A request whose deadline cannot be met
(now + the wait, or the queue ahead, + its service time) is refused up front with
``DEADLINE_UNREACHABLE`` instead of being told to come back in vain.

Every stage change is kept (:class:`StageChange`: pool, from, to, when, why) for the journal
and the metrics. ``PressurePolicy(enabled=False)`` turns all of this off: no stages, no fair
shares, no deadline prediction, a constant retry time — the baseline ``bench/overload.py``
compares against.

Pure: time and randomness are parameters; nothing here does I/O. This module keeps the
board — every pool's counters, holders, waiting requests and the stage it holds; the policies
it asks (which stage the state calls for, which victim, which retry time) are functions in
:mod:`mesh.core.policy`, one module each.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mesh.core.policy.retry_times import line_retry_ms, refusal_retry_ms
from mesh.core.policy.settings import PressurePolicy, Stage
from mesh.core.policy.stages import RANK_STOPS_AT, shed_rank, stage_called_for, stage_limits
from mesh.core.policy.victims import EVICTION_ORDER, choose_victim, evict_order
from mesh.core.tally import move_count

# The policies live in mesh.core.policy, one module each; these names stay importable here.
__all__ = [
    "EVICTION_ORDER",
    "Holding",
    "PoolPressure",
    "PressureBoard",
    "PressurePolicy",
    "Shed",
    "Stage",
    "StageChange",
    "evict_order",
    "shed_rank",
]


@dataclass(frozen=True, slots=True)
class Holding:
    """A grant on the board: where, whose, since when, and how cheaply it could be evicted."""

    pool_id: str
    tenant: str
    since: float
    rank: int = 1
    evict_order: int | None = None  # None: never evicted; lower: evicted first
    run: str | None = None  # "<tenant>/<run_id>", when the task names its run


class _Youngest:
    """Evictable grants of one kind (one pool, eviction order and rank; or the same for one
    tenant), youngest first: a heap keyed by ``-since`` with lazy removal. An ended grant's
    entry is marked dead and dropped when it reaches the top, or when dead entries outnumber
    the live ones (compaction), so each grant costs O(log n) to add and O(1) amortised to
    remove, and the youngest is found without looking at the others."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[list[Any]] = []  # [-since, seq, admission_id, alive]
        self.live = 0

    def push(self, entry: list[Any]) -> None:
        heapq.heappush(self.heap, entry)
        self.live += 1

    def dropped(self) -> None:
        """One of its entries was marked dead."""
        self.live -= 1
        if len(self.heap) > 2 * self.live + 32:
            self.heap = [e for e in self.heap if e[3]]
            heapq.heapify(self.heap)

    def youngest(self) -> str | None:
        heap = self.heap
        while heap and not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


@dataclass(frozen=True, slots=True)
class StageChange:
    pool_id: str
    old: Stage
    new: Stage
    at: float
    cause: str  # what moved it: "utilisation 7/8", "queue age 6.2 s", "broker alarm", ...


@dataclass(frozen=True, slots=True)
class Shed:
    """Why the pressure gate refused a request."""

    reason: str  # an AdmissionReason value: SHED, TENANT_FAIR_SHARE, DEADLINE_UNREACHABLE
    detail: str
    slots_to_free: int | None  # before this request's class is admitted; None: never in time


@dataclass(slots=True)
class PoolPressure:
    """What one pool's stage is made of."""

    capacity: int = 0
    used: int = 0
    queue_depth: int = 0
    oldest_age_s: float = 0.0
    blocked: bool = False
    stage: Stage = Stage.NORMAL
    since: float = 0.0  # when ``stage`` was entered (0: never changed)
    source: str = "utilisation"  # what called for ``stage``: utilisation, queue age, blocked
    lower_since: float | None = None  # since when a lower stage has been called for
    service_s: deque[float] = field(default_factory=deque)
    service_sum: float = 0.0
    holders: dict[str, int] = field(default_factory=dict)  # tenant -> grants held
    demand: dict[str, float] = field(default_factory=dict)  # tenant -> last asked
    runs: dict[str, int] = field(default_factory=dict)  # run -> grants held
    run_demand: dict[str, float] = field(default_factory=dict)  # run -> last asked
    # tenant -> when its refused requests were told to come back (those still ahead wait)
    waiting: dict[str, list[float]] = field(default_factory=dict)
    # Evictable grants youngest first, by (evict order, rank), and by tenant then the same:
    # the victim is found without a walk over the pool's grants.
    evictable: dict[tuple[int, int], _Youngest] = field(default_factory=dict)
    evictable_of: dict[str, dict[tuple[int, int], _Youngest]] = field(default_factory=dict)
    # The stage limits and the lowered ones, computed once per (capacity, policy): the first
    # are checked on every admission, both on every grant and release.
    _limits: tuple[int, int, int] = (0, 0, 0)
    _lowered: tuple[int, int, int] = (0, 0, 0)
    _limits_capacity: int = -1
    _limits_policy: PressurePolicy | None = None

    def limits(self, policy: PressurePolicy) -> tuple[int, int, int]:
        """Slots in use at which SHED_SPECULATIVE, PAUSE_BATCH and TIGHTEN begin."""
        if self._limits_capacity != self.capacity or self._limits_policy is not policy:
            self._compute_limits(policy)
        return self._limits

    def lowered_limits(self, policy: PressurePolicy) -> tuple[int, int, int]:
        """The same at ``threshold - hysteresis``: below these a stage may step down."""
        if self._limits_capacity != self.capacity or self._limits_policy is not policy:
            self._compute_limits(policy)
        return self._lowered

    def _compute_limits(self, policy: PressurePolicy) -> None:
        self._limits, self._lowered = stage_limits(self.capacity, policy)
        self._limits_capacity, self._limits_policy = self.capacity, policy

    def limit(self, stage: Stage, policy: PressurePolicy) -> int:
        """Slots in use at which ``stage`` begins (by utilisation alone)."""
        if stage is Stage.REJECT_INTERACTIVE:
            return self.capacity
        return self.limits(policy)[stage - 1]

    def mean_service_s(self) -> float | None:
        return self.service_sum / len(self.service_s) if self.service_s else None


@dataclass
class PressureBoard:
    """Every pool's pressure, as one manager sees it. Not thread-safe (one caller)."""

    policy: PressurePolicy = field(default_factory=PressurePolicy)
    pools: dict[str, PoolPressure] = field(default_factory=dict)
    changes: list[StageChange] = field(default_factory=list)  # drained by the shell
    _holdings: dict[str, Holding] = field(default_factory=dict)
    # admission ID -> its entry in the pool's eviction heaps (evictable holdings only)
    _entries: dict[str, list[Any]] = field(default_factory=dict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def pool(self, pool_id: str) -> PoolPressure:
        found = self.pools.get(pool_id)
        if found is None:
            found = self.pools[pool_id] = PoolPressure()
        return found

    # ---- inputs --------------------------------------------------------------------------
    def observe_usage(self, slots: dict[str, tuple[int, int]], now: float) -> None:
        """The ledger's model-slot counters ``{pool: (used, capacity)}`` (every tick: they
        include other managers' grants)."""
        for pool_id, (used, capacity) in slots.items():
            p = self.pool(pool_id)
            p.used, p.capacity = used, capacity
            self._restage(pool_id, p, now)

    def observe_queue(
        self, pool_id: str, depth: int, oldest_age_s: float | None, now: float
    ) -> None:
        p = self.pool(pool_id)
        p.queue_depth = depth
        if oldest_age_s is not None:
            p.oldest_age_s = oldest_age_s
        self._restage(pool_id, p, now)

    def observe_broker(self, blocked: bool, now: float) -> None:
        for pool_id, p in self.pools.items():
            p.blocked = blocked
            self._restage(pool_id, p, now)

    def granted(
        self,
        admission_id: str,
        pool_id: str,
        tenant: str,
        now: float,
        *,
        rank: int = 1,
        evict_order: int | None = None,
        run: str | None = None,
    ) -> None:
        self._hold(admission_id, Holding(pool_id, tenant, now, rank, evict_order, run), now)

    def adopt(self, admission_id: str, holding: Holding) -> None:
        """A grant found in the ledger at start (the counters already include it)."""
        if admission_id not in self._holdings:
            self._holdings[admission_id] = holding
            self._count(self.pool(holding.pool_id), holding, +1)
            self._index(admission_id, holding)

    def ended(self, admission_id: str, now: float, *, completed: bool) -> Holding | None:
        """A grant released (``completed``: its hold time is a service-time sample), expired
        or evicted. Returns what was held (``None``: nothing known)."""
        held = self._holdings.pop(admission_id, None)
        if held is None:
            return None
        p = self.pool(held.pool_id)
        p.used = max(0, p.used - 1)
        self._count(p, held, -1)
        self._unindex(admission_id, held, p)
        if completed:
            sample = max(0.0, now - held.since)
            p.service_s.append(sample)
            p.service_sum += sample
            if len(p.service_s) > self.policy.service_window:
                p.service_sum -= p.service_s.popleft()
        self._restage(held.pool_id, p, now)
        return held

    def restore(self, admission_id: str, holding: Holding, now: float) -> None:
        """Undo ``ended`` (the transaction that evicted it rolled back)."""
        self._hold(admission_id, holding, now)

    def _hold(self, admission_id: str, holding: Holding, now: float) -> None:
        if admission_id in self._holdings:
            return  # an idempotent replay of a grant already counted
        self._holdings[admission_id] = holding
        p = self.pool(holding.pool_id)
        p.used += 1
        self._count(p, holding, +1)
        self._index(admission_id, holding)
        self._restage(holding.pool_id, p, now)

    @staticmethod
    def _count(p: PoolPressure, holding: Holding, delta: int) -> None:
        """Move the per-tenant (and per-run) grant counts of ``p`` by ``delta``."""
        move_count(p.holders, holding.tenant, delta)
        if holding.run is not None:
            move_count(p.runs, holding.run, delta)

    def _index(self, admission_id: str, holding: Holding) -> None:
        """Put an evictable grant into its pool's eviction heaps (the pool's, its tenant's)."""
        if holding.evict_order is None:
            return
        p = self.pool(holding.pool_id)
        entry = [-holding.since, next(self._seq), admission_id, True]
        self._entries[admission_id] = entry
        kind = (holding.evict_order, holding.rank)
        for heaps in (p.evictable, p.evictable_of.setdefault(holding.tenant, {})):
            heap = heaps.get(kind)
            if heap is None:
                heap = heaps[kind] = _Youngest()
            heap.push(entry)

    def _unindex(self, admission_id: str, holding: Holding, p: PoolPressure) -> None:
        entry = self._entries.pop(admission_id, None)
        if entry is None or holding.evict_order is None:
            return
        entry[3] = False
        kind = (holding.evict_order, holding.rank)
        own = p.evictable_of[holding.tenant]
        for heaps in (p.evictable, own):
            heap = heaps[kind]
            heap.dropped()
            if heap.live == 0:
                del heaps[kind]
        if not own:
            del p.evictable_of[holding.tenant]

    def victim(self, pool_id: str, tenant: str, rank: int, now: float) -> str | None:
        """The grant a request of ``rank`` from ``tenant`` may evict from the full
        ``pool_id``, or ``None``: see *Eviction* above. Only interactive requests evict.

        The cheapest to lose is the first non-empty kind in (evict order, rank) order and
        its youngest grant; a tenant at or over its share may only take back its own. The
        cost is O(kinds), a handful, whatever the number of grants held."""
        p = self.pool(pool_id)
        if not (self.policy.enabled and self.policy.evict) or rank < 2 or p.blocked:
            return None
        below_share = p.holders.get(tenant, 0) < self.fair_share(pool_id, tenant, now)
        return choose_victim(rank, below_share, p.evictable, p.evictable_of.get(tenant, {}))

    # ---- the gate ------------------------------------------------------------------------
    def check(
        self,
        pool_id: str,
        tenant: str,
        service_class: str,
        priority: int,
        estimated_duration_s: float,
        deadline: float | None,
        now: float,
        run: str | None = None,
    ) -> Shed | None:
        """May this request take a slot in ``pool_id`` now? ``None``: go ahead (the ledger
        still decides whether a slot is free). Records the tenant's (and run's) demand."""
        p = self.pool(pool_id)
        if not self.policy.enabled or p.capacity <= 0:
            return None  # off, or no capacity known yet: the ledger alone decides
        p.demand[tenant] = now
        if run is not None:
            p.run_demand[run] = now
        rank = shed_rank(service_class, priority, self.policy)
        stops_at = RANK_STOPS_AT[rank]
        stage = p.stage
        limit = p.limit(stops_at, self.policy)
        if self._signalled(p) >= stops_at or (rank < 2 and p.used + 1 > limit):
            what = ("speculative and low-priority work", "batch work", "new interactive work")
            return Shed(
                "SHED",
                f"{pool_id} is at stage {stage.name} (utilisation {p.used}/{p.capacity}): "
                f"{what[rank]} is shed",
                slots_to_free=p.used + 1 - limit,
            )
        signalled = self._signalled(p)
        unfair = self._over_share(pool_id, p, tenant, signalled, now) or self._run_over_share(
            pool_id, p, run, signalled, now
        )
        if unfair is not None:
            return unfair
        if deadline is not None:
            finish = now + self._queue_wait_s(p) + self._service_s(p, estimated_duration_s)
            if finish > deadline:
                return Shed(
                    "DEADLINE_UNREACHABLE",
                    f"{pool_id} would finish it in about {finish - now:.2f} s, after its "
                    f"deadline in {deadline - now:.2f} s",
                    slots_to_free=None,
                )
        return None

    def retry_after_ms(
        self,
        pool_id: str,
        tenant: str,
        slots_to_free: int,
        estimated_duration_s: float,
        deadline: float | None,
        now: float,
        rand: Callable[[], float],
    ) -> int | None:
        """When to come back after a refusal from ``pool_id`` that needs ``slots_to_free``
        slots freed; ``None`` when the deadline would pass first. Remembers the answer, so
        the tenant's next refused request is told to wait behind this one while it waits:
        each tenant queues behind its own waiting requests only, so a bursting tenant's
        crowd does not push back a tenant that asks now and then."""
        if not self.policy.enabled:
            return self.policy.retry_default_ms
        p = self.pool(pool_id)
        ahead = [at for at in p.waiting.get(tenant, ()) if at > now]
        service_s = self._service_s(p, estimated_duration_s)
        retry_ms = refusal_retry_ms(
            slots_to_free, len(ahead), p.capacity, service_s, now, deadline, self.policy, rand
        )
        if retry_ms is not None:
            ahead.append(now + retry_ms / 1000.0)
        p.waiting[tenant] = ahead
        return retry_ms

    def class_room(self, pool_id: str, service_class: str, priority: int) -> int | None:
        """How many more grants of this class the pool's stage lets in now (batch and
        speculative work stop short of full); ``None``: no limit short of the counters."""
        if not self.policy.enabled:
            return None
        rank = shed_rank(service_class, priority, self.policy)
        if rank == 2:
            return None
        p = self.pool(pool_id)
        stops_at = RANK_STOPS_AT[rank]
        if self._signalled(p) >= stops_at:
            return 0
        return max(0, p.limit(stops_at, self.policy) - p.used)

    def line_retry_ms(
        self,
        pool_id: str,
        position: int,
        free: int,
        estimated_duration_s: float,
        deadline: float | None,
        now: float,
        rand: Callable[[], float],
        *,
        joining: bool = False,
    ) -> int | None:
        """When a request at ``position`` in the pool's line (``free`` slots free now) should
        come back: once the ``position - free`` grants before its turn have ended at the
        pool's drain rate; ``None`` when the deadline would pass first — for a request
        ``joining`` the line, with ``line_join_slack`` of the wait to spare
        (:func:`mesh.core.policy.retry_times.line_retry_ms`)."""
        p = self.pool(pool_id)
        return line_retry_ms(
            position,
            free,
            p.capacity,
            self._service_s(p, estimated_duration_s),
            self._queue_wait_s(p),
            now,
            deadline,
            self.policy,
            rand,
            joining=joining,
        )

    def fair_share(self, pool_id: str, tenant: str, now: float) -> int:
        return max(
            1, math.ceil(self.pool(pool_id).capacity / len(self._active(pool_id, tenant, now)))
        )

    def _active(self, pool_id: str, tenant: str, now: float) -> set[str]:
        """Tenants holding grants in the pool or asking for one lately, and ``tenant``."""
        p = self.pool(pool_id)
        recent = now - self.policy.demand_window_s
        return {t for t, at in p.demand.items() if at >= recent} | set(p.holders) | {tenant}

    def _over_share(
        self, pool_id: str, p: PoolPressure, tenant: str, stage: Stage, now: float
    ) -> Shed | None:
        """A busy pool keeps a slot free for every other tenant below its fair share; at
        ``TIGHTEN`` a tenant at its share gets no more. When the pool is full, the ledger's
        ``CAPACITY`` says it better."""
        busy = stage >= Stage.SHED_SPECULATIVE or p.used + 1 > p.limit(
            Stage.SHED_SPECULATIVE, self.policy
        )
        if not busy or p.used >= p.capacity:
            return None
        active = self._active(pool_id, tenant, now)
        share = max(1, math.ceil(p.capacity / len(active)))
        held = p.holders.get(tenant, 0)
        if held < share:
            return None
        tight = stage >= Stage.TIGHTEN or p.used + 1 > p.limit(Stage.TIGHTEN, self.policy)
        owed = sum(1 for other in active - {tenant} if p.holders.get(other, 0) < share)
        if not tight and p.capacity - p.used - 1 >= owed:
            return None
        return Shed(
            "TENANT_FAIR_SHARE",
            f"{pool_id} is busy and this tenant already holds {held} of its {p.capacity} "
            f"slots (fair share {share}; {owed} other tenant(s) below theirs)",
            slots_to_free=1,
        )

    def _run_over_share(
        self, pool_id: str, p: PoolPressure, run: str | None, stage: Stage, now: float
    ) -> Shed | None:
        """From ``TIGHTEN`` on, a run holding ``ceil(capacity / active runs)`` gets no more."""
        if run is None:
            return None
        tight = stage >= Stage.TIGHTEN or p.used + 1 > p.limit(Stage.TIGHTEN, self.policy)
        if not tight:
            return None
        recent = now - self.policy.demand_window_s
        active = {r for r, at in p.run_demand.items() if at >= recent} | set(p.runs) | {run}
        share = max(1, math.ceil(p.capacity / len(active)))
        held = p.runs.get(run, 0)
        if held < share:
            return None
        return Shed(
            "RUN_CONCURRENCY",
            f"{pool_id} is at stage {max(stage, Stage.TIGHTEN).name}: run {run} holds {held} "
            f"of its {p.capacity} slots (its share among {len(active)} active runs: {share})",
            slots_to_free=1,
        )

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _signalled(p: PoolPressure) -> Stage:
        """The stage the gate sheds by as a whole: the pool's, when a signal called for it;
        for utilisation, none (each class is refused at its exact limit instead)."""
        return p.stage if p.source != "utilisation" else Stage.NORMAL

    @staticmethod
    def _service_s(p: PoolPressure, estimate_s: float) -> float:
        measured = p.mean_service_s()
        return measured if measured is not None else estimate_s

    def _queue_wait_s(self, p: PoolPressure) -> float:
        """How long a task granted now waits behind the tasks queued before it."""
        if p.queue_depth <= 0 or p.capacity <= 0:
            return 0.0
        service = p.mean_service_s()
        return p.queue_depth * service / p.capacity if service else 0.0

    def _stage_of(self, p: PoolPressure, lowered: bool = False) -> tuple[Stage, str]:
        """The stage the pool's state calls for now, and which source calls for it;
        ``lowered``: by the lowered thresholds (those a stage steps down at)."""
        policy = self.policy
        return stage_called_for(
            used=p.used,
            capacity=p.capacity,
            limits=p.lowered_limits(policy) if lowered else p.limits(policy),
            blocked=p.blocked,
            queue_depth=p.queue_depth,
            oldest_age_s=p.oldest_age_s,
            policy=policy,
        )

    def _cause(self, p: PoolPressure, source: str) -> str:
        """What put the pool in its stage, worded for the journal."""
        return {
            "off": "shedding is off",
            "blocked": "broker alarm: publishers blocked",
            "queue age": f"oldest queued task waited {p.oldest_age_s:.1f} s",
        }.get(source, f"utilisation {p.used}/{p.capacity}")

    def _restage(self, pool_id: str, p: PoolPressure, now: float) -> None:
        """Move the pool's stage as its state calls for, holding still in between: up to the
        stage called for (straight there, however many stages that is), down only to the
        stage the lowered thresholds (``threshold - hysteresis``) call for once they have
        called for it for ``min_dwell_s``; and neither sooner than ``min_dwell_s`` after the
        last change — except into ``REJECT_INTERACTIVE`` for a broker alarm (publishers
        are blocked: at once). Admission still refuses each class at its exact utilisation
        limit (:meth:`check`), so holding a stage never admits more than the limits allow."""
        policy = self.policy
        up, source = self._stage_of(p)
        if up > p.stage:
            p.lower_since = None
            if source != "blocked" and now - p.since < policy.min_dwell_s:
                return  # rose just now: the per-class limits already refuse what they must
            self._change(pool_id, p, up, now, self._cause(p, source), source)
            return
        if p.stage is Stage.NORMAL:  # nothing lower to step down to
            p.lower_since = None
            return
        down, source = self._stage_of(p, lowered=True)
        if down >= p.stage:
            p.lower_since = None
            return
        if p.lower_since is None:
            p.lower_since = now
        if now - p.lower_since < policy.min_dwell_s or now - p.since < policy.min_dwell_s:
            return
        self._change(pool_id, p, down, now, self._cause(p, source), source)

    def _change(
        self, pool_id: str, p: PoolPressure, stage: Stage, now: float, cause: str, source: str
    ) -> None:
        self.changes.append(StageChange(pool_id, p.stage, stage, now, cause))
        p.stage, p.since, p.lower_since, p.source = stage, now, None, source

    def drain_changes(self) -> list[StageChange]:
        changes, self.changes = self.changes, []
        return changes
