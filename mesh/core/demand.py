"""What a pool is asked for, and how long a new replica of it takes to start: the two figures
the scale planner needs to take a pool to zero replicas and to bring it back.

Demand
------
A pool's demand is everything that needs one of its agents, now or soon::

    demand = queued + in_flight + deferred + recent capacity misses

* ``queued`` — ready tasks in the pool's task queue (the last poll of its depth);
* ``in_flight`` — work its agents run: leased slots and pool tasks (the registry's one count
  of work, :mod:`mesh.core.heartbeats`), and the grants held for it in the ledger (every
  manager's), which cover tasks on their way to an agent;
* ``deferred`` — requests holding a place in the pool's line (:mod:`mesh.core.places`);
* capacity misses — requests deferred for its capacity or for want of a live agent, each
  counted until its requester is due back (the scale planner's own retry hint).

Queue depth alone is not demand: a task an agent has taken is no longer ready in the queue,
and a request deferred before it became a task is in no queue at all. The admission side's
figures are read by :func:`admission_demand`; the registry's and the misses are the pool
core's own.

Start time
----------
:class:`StartEstimate` keeps, per pool, a smoothed measure of the time from a scale-up to
that pool's first registration accepted after it: the retry time of a request for a pool at
zero replicas. It starts at the policy's ``start_s`` until measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mesh.core.admission import AdmissionCore

__all__ = ["PoolDemand", "StartEstimate", "admission_demand"]

START_SMOOTHING = 0.3
"""How much one new measure of a start moves the estimate (exponential smoothing)."""


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """What admission knows a pool is asked for (the registry's in-flight count aside)."""

    queued: int = 0  # ready tasks in the pool's queue, as last polled
    deferred: int = 0  # requests holding a place in the pool's line
    granted: int = 0  # grants held in the ledger (its model slots in use)

    def total(self) -> int:
        return self.queued + self.deferred + self.granted


def admission_demand(core: AdmissionCore, now: float) -> dict[str, PoolDemand]:
    """Every pool admission knows of, with its queue depth, the places held in its line at
    ``now`` and the grants held. Reads only; call it where the admission core runs."""
    pools = set(core.pressure.pools) | set(core.places.lines)
    demand = {}
    for pool_id in pools:
        pressure = core.pressure.pools.get(pool_id)
        line = core.places.lines.get(pool_id)
        demand[pool_id] = PoolDemand(
            queued=pressure.queue_depth if pressure is not None else 0,
            deferred=line.waiting(now) if line is not None else 0,
            granted=pressure.used if pressure is not None else 0,
        )
    return demand


@dataclass(slots=True)
class StartEstimate:
    """How long a replica of one pool takes from a scale-up to its registration: the policy's
    guess until a start is measured, then a smoothed measure."""

    estimate_s: float
    measured: int = 0  # how many starts were measured
    asked_at: float | None = None  # a scale-up waiting for its first registration

    def asked(self, now: float) -> None:
        """A scale-up was decided at ``now`` (an earlier one still waiting keeps its time)."""
        if self.asked_at is None:
            self.asked_at = now

    def cancelled(self) -> None:
        """Scaled down meanwhile: the registration that follows measures nothing."""
        self.asked_at = None

    def registered(self, now: float) -> float | None:
        """A registration of the pool was accepted at ``now``: the start it measured, if a
        scale-up was waiting for one."""
        if self.asked_at is None:
            return None
        sample = max(0.0, now - self.asked_at)
        self.asked_at = None
        if self.measured == 0:
            self.estimate_s = sample  # a measure beats the guess outright
        else:
            self.estimate_s += START_SMOOTHING * (sample - self.estimate_s)
        self.measured += 1
        return sample
