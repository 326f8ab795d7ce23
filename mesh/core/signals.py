"""Pool signals: per pool, the figures a platform can scale on, from aggregates and ``now``.

Theory of operation
-------------------
A platform that scales a pool (KEDA, an HPA on external metrics, the manager's own scaler)
asks three questions of it: what waits, how fast does work arrive and leave, and what can the
pool take now. The manager already keeps every answer as a running aggregate somewhere — the
pool queue's depth (polled), the line of deferred requests, the ledger's grant counter, the
registry's live capacity and agents by state, the scale planner's target — except the rates.
This module adds those and puts the rest side by side:

* :class:`PoolActivity` counts admission decisions per pool in one-second buckets over a
  sliding window (``window_s``, 60 s by default), plus totals since the manager started. A
  decision is counted for the pool it granted on; a deferral or a rejection for every pool the
  request was eligible for (:func:`decision_pools`: a request eligible for none names no pool
  and is counted for none). Memory: at most ``window_s`` buckets per pool.
* :class:`PoolFigures` is what the shell gathers for one pool from those aggregates.
* :func:`pool_signals` turns figures and activity into one
  :class:`~mesh.wire.status.PoolSignals` per pool at ``now``: O(pools + waiting requests),
  never O(agents).

Pure: no I/O, no clock; ``now`` is the wall-clock time the admission core decides at.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mesh.core.tally import TAKING_WORK
from mesh.wire.admission import AdmissionDecision
from mesh.wire.status import PoolSignals

__all__ = [
    "WINDOW_S",
    "PoolActivity",
    "PoolFigures",
    "decision_pools",
    "pool_signals",
]

WINDOW_S = 60.0
"""The window add and dispatch rates and recent refusals count over."""


@dataclass(slots=True)
class _Bucket:
    second: int
    requests: int = 0
    grants: int = 0
    refusals: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class _Pool:
    buckets: deque[_Bucket] = field(default_factory=deque)
    refusals_total: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Window:
    """One pool's decisions within the window: counts, not yet rates."""

    requests: int = 0
    grants: int = 0
    refusals: Mapping[str, int] = field(default_factory=dict)


class PoolActivity:
    """Admission decisions per pool: one-second buckets over ``window_s``, and totals."""

    __slots__ = ("_pools", "window_s")

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, not {window_s}")
        self.window_s = window_s
        self._pools: dict[str, _Pool] = {}

    @property
    def pools(self) -> frozenset[str]:
        """Every pool a decision was ever counted for."""
        return frozenset(self._pools)

    def record(self, pool_id: str, outcome: str, reason: str | None, at: float) -> None:
        """Count one decision (``admitted``, ``deferred`` or ``rejected``) made at ``at``; a
        refusal by its ``reason``. A decision timed before the newest bucket (a clock that
        stepped back) is counted in the newest."""
        pool = self._pools.get(pool_id)
        if pool is None:
            pool = self._pools[pool_id] = _Pool()
        second = math.floor(at)
        buckets = pool.buckets
        if not buckets or buckets[-1].second < second:
            buckets.append(_Bucket(second))
        bucket = buckets[-1]
        bucket.requests += 1
        if outcome == "admitted":
            bucket.grants += 1
        else:
            code = reason or outcome
            bucket.refusals[code] += 1
            pool.refusals_total[code] += 1
        horizon = second - self.window_s
        while buckets and buckets[0].second <= horizon:
            buckets.popleft()

    def window(self, pool_id: str, now: float) -> Window:
        """The pool's decisions in the window ending at ``now``: every bucket that overlaps
        ``(now - window_s, now]``."""
        pool = self._pools.get(pool_id)
        if pool is None:
            return Window()
        horizon = now - self.window_s
        requests = grants = 0
        refusals: Counter[str] = Counter()
        for bucket in pool.buckets:
            if bucket.second + 1 > horizon and bucket.second <= now:
                requests += bucket.requests
                grants += bucket.grants
                refusals.update(bucket.refusals)
        return Window(requests, grants, dict(sorted(refusals.items())))

    def refusals_total(self, pool_id: str) -> dict[str, int]:
        """The pool's refusals since counting began, by reason."""
        pool = self._pools.get(pool_id)
        return {} if pool is None else dict(sorted(pool.refusals_total.items()))


def decision_pools(
    decision: AdmissionDecision, eligibility: Mapping[str, object] | None
) -> tuple[str, ...]:
    """The pools a decision counts for: the granted pool, or every pool the request was
    eligible for (from its eligibility record's ``eligible``)."""
    if decision.grant is not None:
        return (decision.grant.pool_id,)
    eligible = eligibility.get("eligible") if eligibility else None
    if not isinstance(eligible, list):
        return ()
    return tuple(dict.fromkeys(p for p in eligible if isinstance(p, str)))


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """What the manager knows of one pool now, gathered from its running aggregates."""

    queued: int | None = None  # ready tasks in the pool queue, as last polled
    queued_oldest_s: float | None = None  # the head task's age, when the broker says
    waiting: Sequence[tuple[float, float]] = ()  # (joined_at, due_by) of each place in line
    in_flight: int | None = None  # grants held (the ledger's model-slot counter)
    model_slots: int | None = None  # the descriptor's limit
    live_capacity: int = 0  # free slots of the live agents for admission
    agents: Mapping[str, int] = field(default_factory=dict)  # state -> agents
    desired_replicas: int | None = None


def pool_signals(
    figures: Mapping[str, PoolFigures], activity: PoolActivity, now: float
) -> dict[str, PoolSignals]:
    """Every pool's signals at ``now``: the pools with figures and those with decisions in
    the window, in pool order. A place in line overdue at ``now`` (its request did not come
    back in time) counts for nothing."""
    pools: Iterable[str] = set(figures) | {
        p for p in activity.pools if activity.window(p, now).requests
    }
    return {p: _signals(p, figures.get(p), activity, now) for p in sorted(pools)}


def _signals(
    pool_id: str, figures: PoolFigures | None, activity: PoolActivity, now: float
) -> PoolSignals:
    f = figures or PoolFigures()
    joined = [at for at, due_by in f.waiting if due_by >= now]
    deferred = len(joined)
    oldest_deferred = max(0.0, now - min(joined)) if joined else None
    queued = f.queued or 0
    waits = [w for w in (oldest_deferred, f.queued_oldest_s if queued else None) if w is not None]
    window = activity.window(pool_id, now)
    in_flight = f.in_flight or 0
    return PoolSignals(
        pool_id=pool_id,
        backlog=queued + deferred,
        queued=queued,
        deferred=deferred,
        oldest_wait_s=max(waits, default=0.0),
        oldest_deferred_s=oldest_deferred,
        oldest_queued_s=f.queued_oldest_s if queued else None,
        add_rate=window.requests / activity.window_s,
        dispatch_rate=window.grants / activity.window_s,
        window_s=activity.window_s,
        in_flight=in_flight,
        demand=in_flight + deferred,
        live_capacity=max(0, f.live_capacity),
        model_slots=f.model_slots,
        agents=sum(f.agents.values()),
        agents_ready=sum(n for state, n in f.agents.items() if state in TAKING_WORK),
        desired_replicas=f.desired_replicas,
        refusals=dict(window.refusals),
        refusals_total=activity.refusals_total(pool_id),
    )
