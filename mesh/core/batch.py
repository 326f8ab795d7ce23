"""One batch of admissions as the core decides it, before the shell commits it.

:class:`Batch` carries the view's counters as this batch has changed them, the ledger
operations that make its decisions true, and everything the core keeps (or undoes) once the
shell says whether the transaction committed. Its parts — a grant held (:class:`Held`), a
grant evicted (:class:`Eviction`), a request waiting on external grants
(:class:`PendingExternal`) — are values every room of the decision reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh.core.capacity import LiveCapacity, live_slots_resource
from mesh.core.eligibility import TENANT_TOKENS_PREFIX, EligibilitySnapshot, reservation_items
from mesh.core.pressure import EVICTION_ORDER, Holding
from mesh.core.records import DecisionRecord
from mesh.ledger.model import (
    TENANT_POOL,
    Item,
    LedgerOp,
    LedgerView,
    Refused,
    Reservation,
    normalize_built,
    shortage,
)
from mesh.wire.admission import AdmissionDecision, AdmissionRequest, TaskRequirements

__all__ = ["Batch", "Eviction", "Held", "PendingExternal", "grant_items"]


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


def grant_items(
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
