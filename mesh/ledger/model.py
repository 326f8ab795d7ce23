"""The reservation ledger's values: states, the transition table, reservations and outcomes.

Pure data, no I/O: the stores (:mod:`mesh.ledger.sqlite`, :mod:`mesh.ledger.postgres`) and
the tests' in-memory model share these definitions, and a sans-I/O core may import them.

Theory of operation
-------------------

A reservation holds every counted resource an admission needs (model slots, sandboxes, tool
permits, tenant token budgets) as a list of :class:`Item` ``(pool_id, resource, amount)``.
It lives through the states of :data:`TRANSITIONS`::

    (none) --prepared--> PREPARING --activated--> ACTIVE --released--> RELEASED
                             |  \\--released--> RELEASED       \\--expired--> EXPIRED
                             \\--expired--> EXPIRED

RELEASED and EXPIRED are final. Moving to PREPARING takes every item's counter; moving to
RELEASED or EXPIRED gives them all back, exactly once. So at any instant
``used == sum(amount of items of PREPARING and ACTIVE reservations)`` per counter.

Every reservation carries a **fence** from one global, strictly increasing sequence. It is
assigned when the reservation is prepared, kept when it is activated or released, and replaced
by a *new, higher* fence when the reservation expires — so a stale holder presenting the old
fence can neither activate nor release what the expiry sweep already took back.

Expected results are values: :class:`Prepared` or :class:`Refused` (with a
:class:`LedgerReason`). Exceptions are for misuse (:class:`mesh.errors.LocalProtocolError`)
and for a store that failed (:class:`mesh.errors.StoreError`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Final, NamedTuple

from mesh.errors import LocalProtocolError, StoreError
from mesh.wire.reasons import Reason

TENANT_POOL: Final = "*"
"""The pseudo pool of counters shared across pools (tenant budgets)."""
TENANT_TOKENS_PREFIX: Final = "tenant_tokens:"
"""Resources named ``tenant_tokens:<tenant>`` are tenant budgets: a miss is TENANT_BUDGET."""


class ReservationState(StrEnum):
    """Where a reservation is in its life (stable strings, stored as they are)."""

    PREPARING = "PREPARING"
    ACTIVE = "ACTIVE"
    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"


HOLDING_STATES: Final = frozenset({ReservationState.PREPARING, ReservationState.ACTIVE})
"""States whose items are counted in ``used``."""
FINAL_STATES: Final = frozenset({ReservationState.RELEASED, ReservationState.EXPIRED})


class LedgerEvent(StrEnum):
    """A state change, as written to the append-only ledger log."""

    PREPARED = "prepared"
    ACTIVATED = "activated"
    RELEASED = "released"
    EXPIRED = "expired"


class Transition(NamedTuple):
    sources: frozenset[ReservationState | None]  # None: no reservation yet
    target: ReservationState
    new_fence: bool  # True when the transition assigns a fresh, higher fence


TRANSITIONS: Final[Mapping[LedgerEvent, Transition]] = {
    LedgerEvent.PREPARED: Transition(frozenset({None}), ReservationState.PREPARING, True),
    LedgerEvent.ACTIVATED: Transition(
        frozenset({ReservationState.PREPARING}), ReservationState.ACTIVE, False
    ),
    LedgerEvent.RELEASED: Transition(HOLDING_STATES, ReservationState.RELEASED, False),
    LedgerEvent.EXPIRED: Transition(HOLDING_STATES, ReservationState.EXPIRED, True),
}
"""Every state change of the ledger, in one table (the stores' SQL follows it)."""


LedgerReason = Reason
"""Why the ledger refused: ``CONFLICT``, ``CAPACITY``, ``TENANT_BUDGET``, ``STALE_FENCE`` or
``NOT_FOUND`` (:data:`LEDGER_REASONS`), members of the one reason enum
(:class:`~mesh.wire.reasons.Reason`); this name is kept for one version."""

LEDGER_REASONS = frozenset(
    {Reason.CONFLICT, Reason.CAPACITY, Reason.TENANT_BUDGET, Reason.STALE_FENCE, Reason.NOT_FOUND}
)
"""What the ledger itself refuses with."""


class Item(NamedTuple):
    """``amount`` units of ``resource`` in pool ``pool_id`` (``"*"`` for tenant budgets)."""

    pool_id: str
    resource: str
    amount: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """One admission's hold on its resources, as the store has it."""

    admission_id: str
    digest: str
    pool_id: str
    state: ReservationState
    fence: int
    items: tuple[Item, ...]
    expires_at: float
    created_at: float
    updated_at: float | None = None  # the last state change (release, expiry…), when known
    descriptor_epoch: int | None = None  # the pool's epoch it was granted under (None: older row)

    @property
    def holding(self) -> bool:
        """True while the items are counted (PREPARING or ACTIVE)."""
        return self.state in HOLDING_STATES


@dataclass(frozen=True, slots=True)
class Prepared:
    """A reservation taken for an admission (or, ``replayed``, the one it already held)."""

    reservation: Reservation
    replayed: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """The ledger said no; nothing changed."""

    reason: LedgerReason
    detail: str
    resource: str | None = None  # the resource that ran short (CAPACITY, TENANT_BUDGET)


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """The latest decision recorded about an admission ID."""

    admission_id: str
    digest: str
    outcome: str
    decided_at: float
    record: str  # JSON, written and read by the admission core


Usage = dict[tuple[str, str], tuple[int, int]]
"""``{(pool_id, resource): (used, capacity)}``: every counter, as the store holds it."""


@dataclass(frozen=True, slots=True)
class LedgerView:
    """What a batch of admissions is decided from, read in the batch's own transaction.

    ``counters``: every counter; ``reservations`` and ``decisions``: those the batch's
    admission IDs already have; ``fences``: fresh values of the fence sequence, ascending,
    one for each reservation the batch may create (an unused one is a harmless gap);
    ``epochs``: every stored descriptor's epoch by pool, so that a batch that found no pool
    for a request learns in the same read whether another manager stored a descriptor it has
    not loaded yet (and only then reads the descriptors)."""

    counters: Mapping[tuple[str, str], tuple[int, int]]
    reservations: Mapping[str, Reservation]
    decisions: Mapping[str, DecisionRow]
    fences: tuple[int, ...] = ()
    epochs: Mapping[str, int] = field(default_factory=dict)


# ---- what a decided batch asks the store to write, in order, in its one transaction --------
@dataclass(frozen=True, slots=True)
class SetCapacity:
    """Create a counter, or change its capacity (``used`` is kept)."""

    pool_id: str
    resource: str
    capacity: int


@dataclass(frozen=True, slots=True)
class Reserve:
    """Write a fresh reservation as it is (its fence drawn for the batch) and take its items'
    counters; the log gets ``prepared`` (and ``activated``, for an ACTIVE one)."""

    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Activate:
    """PREPARING → ACTIVE until ``expires_at``, if ``fence`` is still current (a reservation
    a manager prepared and stopped before activating)."""

    admission_id: str
    fence: int
    expires_at: float
    at: float


@dataclass(frozen=True, slots=True)
class Release:
    """PREPARING|ACTIVE → RELEASED if ``fence`` is still current; the items are given back."""

    admission_id: str
    fence: int
    at: float


@dataclass(frozen=True, slots=True)
class RecordDecision:
    """Keep the latest decision about an admission ID (see ``LedgerStore.record_decision``)."""

    row: DecisionRow


@dataclass(frozen=True, slots=True)
class SaveEligibility:
    """Keep an eligibility snapshot under its content address, once."""

    ref: str
    body: str


LedgerOp = SetCapacity | Reserve | Activate | Release | RecordDecision | SaveEligibility
"""One write of a decided batch (:meth:`mesh.ledger.store.LedgerStore.apply`)."""


@dataclass(frozen=True, slots=True)
class LedgerLogRow:
    """One row of the append-only ledger log."""

    seq: int
    at: float
    admission_id: str
    event: LedgerEvent
    state: ReservationState
    fence: int


def normalize_items(items: Iterable[tuple[str, str, int]]) -> tuple[Item, ...]:
    """Items in the ledger's one global order, ``(pool_id, resource)``, duplicates summed.

    Every store takes counters in this order, so two transactions never wait on each other's
    rows in opposite orders. (Requests of one shape ask for the same items: the result is
    remembered per items tuple.)
    """
    key = tuple(items)
    for raw in key:  # only exact types may use the memo (True == 1 and 1.0 == 1 as keys)
        if type(raw) is not tuple or len(raw) != 3:
            return _normalize(key)
        if type(raw[0]) is not str or type(raw[1]) is not str or type(raw[2]) is not int:
            return _normalize(key)
    return _normalized(key)


def normalize_built(items: tuple[tuple[str, str, int], ...]) -> tuple[Item, ...]:
    """:func:`normalize_items` for items whose exact types hold by construction — built from
    validated wire models, whose integers are exact ``int`` — straight to the memo, without
    the per-item type check that keeps ``True`` and ``1.0`` from sharing an entry with ``1``."""
    return _normalized(items)


@lru_cache(maxsize=4096)
def _normalized(items: tuple[tuple[str, str, int], ...]) -> tuple[Item, ...]:
    return _normalize(items)


def _normalize(items: Iterable[tuple[str, str, int]]) -> tuple[Item, ...]:
    totals: dict[tuple[str, str], int] = {}
    for raw in items:
        pool_id, resource, amount = raw
        # Exact types first (the common case, cheap); anything else is checked in full.
        if not (type(pool_id) is str and type(resource) is str and type(amount) is int):
            _check_item(raw)
        if not pool_id or not resource or amount <= 0:
            _check_item(raw)
        key = (pool_id, resource)
        totals[key] = totals.get(key, 0) + amount
    return tuple([Item(p, r, n) for (p, r), n in sorted(totals.items())])


def _check_item(raw: tuple[str, str, int]) -> None:
    """Raise :class:`LocalProtocolError` saying what is wrong with ``raw``, if anything."""
    pool_id, resource, amount = raw
    if not isinstance(pool_id, str) or not pool_id:
        raise LocalProtocolError(f"an item needs a non-empty pool_id, got {raw!r}")
    if not isinstance(resource, str) or not resource:
        raise LocalProtocolError(f"an item needs a non-empty resource, got {raw!r}")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise LocalProtocolError(f"an item's amount must be a positive int, got {raw!r}")


def default_pool(items: tuple[Item, ...]) -> str:
    """The reservation's pool when none is given: the first item's pool that is not ``"*"``."""
    return next((item.pool_id for item in items if item.pool_id != TENANT_POOL), TENANT_POOL)


def shortage_reason(resource: str) -> LedgerReason:
    """TENANT_BUDGET for a tenant token budget, CAPACITY for anything else."""
    if resource.startswith(TENANT_TOKENS_PREFIX):
        return LedgerReason.TENANT_BUDGET
    return LedgerReason.CAPACITY


def shortage(pool_id: str, resource: str, amount: int, counter: tuple[int, int] | None) -> Refused:
    """The refusal for ``amount`` of a counter ``(used, capacity)`` that cannot give it
    (``None``: the counter has no row, capacity 0)."""
    if counter is not None:
        used, capacity = counter
        left = f"{max(capacity - used, 0)} of {capacity} left"
    else:
        left = "no capacity is configured"
    return Refused(
        shortage_reason(resource), f"{pool_id}/{resource}: needs {amount}, {left}", resource
    )


def check_ttl(ttl_s: float, now: float) -> None:
    """Misuse guard shared by the stores: a TTL must be positive and time finite."""
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise LocalProtocolError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    if not math.isfinite(now):
        raise LocalProtocolError(f"now must be finite Unix seconds, got {now!r}")


def replay(entries: Iterable[LedgerLogRow]) -> dict[str, tuple[ReservationState, int]]:
    """Each admission's ``(state, fence)`` rebuilt from the log alone, checking every step
    against :data:`TRANSITIONS`; an impossible step means a corrupt log (StoreError)."""
    states: dict[str, tuple[ReservationState, int]] = {}
    for entry in sorted(entries, key=lambda e: e.seq):
        current = states.get(entry.admission_id)
        transition = TRANSITIONS[entry.event]
        source = current[0] if current else None
        fence_ok = (
            current is None
            or (transition.new_fence and entry.fence > current[1])
            or (not transition.new_fence and entry.fence == current[1])
        )
        if source not in transition.sources or entry.state != transition.target or not fence_ok:
            raise StoreError(
                f"ledger log entry {entry.seq} ({entry.event} {entry.admission_id!r} to "
                f"{entry.state} at fence {entry.fence}) does not follow {current!r}"
            )
        states[entry.admission_id] = (entry.state, entry.fence)
    return states
