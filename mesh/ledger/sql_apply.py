"""Writing a decided batch: the operations the admission core returns, in one transaction.

Fresh reservations, their log rows, decision records and eligibility snapshots are gathered
into :class:`PendingRows` and written as a few multi-row statements; their counters are taken
by one conditional increment per counter, with the batch's total, in the one global order —
so a counter that moved under the batch (another manager) makes the increment miss and the
batch fail (:class:`~mesh.errors.StaleView`). Releases and activations are written where they
stand, by the dialect's own state changes, after what was gathered before them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mesh.errors import StaleView
from mesh.ledger.model import (
    TRANSITIONS,
    Activate,
    LedgerEvent,
    LedgerOp,
    RecordDecision,
    Refused,
    Release,
    Reservation,
    ReservationState,
    Reserve,
    SaveEligibility,
    SetCapacity,
)
from mesh.ledger.sql_records import Records
from mesh.ledger.sql_rows import RES_COLUMNS, Db, ReservationRows, Tables, items_json

# The log rows of a fresh reservation, as (event, state entered), spelled out once.
_PREPARED = ((LedgerEvent.PREPARED.value, TRANSITIONS[LedgerEvent.PREPARED].target.value),)
_PREPARED_ACTIVATED = (
    *_PREPARED,
    (LedgerEvent.ACTIVATED.value, TRANSITIONS[LedgerEvent.ACTIVATED].target.value),
)

Settle = Callable[[Db, str, int, float], Reservation | Refused]
"""A release: ``(db, admission_id, fence, now)``."""
Activation = Callable[[Db, str, int, float, float], Reservation | Refused]
"""An activation: ``(db, admission_id, fence, expires_at, now)``."""


@dataclass(slots=True)
class PendingRows:
    """A decided batch's fresh rows, gathered to be written together."""

    taken: dict[tuple[str, str], int] = field(default_factory=dict)  # counter -> total taken
    reservations: list[tuple[object, ...]] = field(default_factory=list)
    log: list[tuple[object, ...]] = field(default_factory=list)
    recorded: dict[str, tuple[str, str, str, float, str]] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)  # eligibility: ref -> body

    @property
    def pending(self) -> bool:
        return bool(self.taken or self.reservations or self.log or self.recorded or self.snapshots)


def gather(rows: PendingRows, op: LedgerOp) -> bool:
    """Add a fresh reservation, a decision or a snapshot of a decided batch to ``rows`` (the
    rows written together at its flush); False for the operations written where they stand
    (capacities, releases, activations)."""
    if isinstance(op, Reserve):
        r = op.reservation
        for pool, resource, amount in r.items:
            rows.taken[(pool, resource)] = rows.taken.get((pool, resource), 0) + amount
        rows.reservations.append(
            (r.admission_id, r.digest, r.pool_id, r.state.value, r.fence, r.expires_at,
             r.created_at, r.updated_at or r.created_at, items_json(r.items), r.descriptor_epoch)
        )  # fmt: skip
        active = r.state is ReservationState.ACTIVE
        for event, target in _PREPARED_ACTIVATED if active else _PREPARED:
            rows.log.append((r.created_at, r.admission_id, event, target, r.fence))
    elif isinstance(op, RecordDecision):
        row = op.row
        rows.recorded[row.admission_id] = (
            row.admission_id, row.digest, row.outcome, row.decided_at, row.record
        )  # fmt: skip
    elif isinstance(op, SaveEligibility):
        rows.snapshots[op.ref] = op.body
    else:
        return False
    return True


class BatchWriter:
    """Writes a decided batch's operations in their order, inside the caller's transaction.

    ``release`` and ``activate`` are the dialect's state changes (PostgreSQL's are a call of
    a server-side function each), used for the operations written where they stand."""

    def __init__(
        self,
        tables: Tables,
        rows: ReservationRows,
        records: Records,
        *,
        release: Settle,
        activate: Activation,
    ) -> None:
        self._t = tables
        self._rows = rows
        self._records = records
        self._release = release
        self._activate = activate
        self._capacity_sql = (
            f"INSERT INTO {tables.capacity} (pool_id, resource, capacity, used)"
            " VALUES (?, ?, ?, 0) ON CONFLICT (pool_id, resource)"
            " DO UPDATE SET capacity = excluded.capacity"
        )
        self._increment_sql = (
            f"UPDATE {tables.capacity} SET used = used + ?"
            " WHERE pool_id = ? AND resource = ? AND used + ? <= capacity"
        )

    def set_capacity(self, db: Db, pool_id: str, resource: str, capacity: int) -> None:
        """Create or change a counter's capacity; ``used`` is kept."""
        db.execute(self._capacity_sql, (pool_id, resource, capacity))

    def apply(self, db: Db, ops: Sequence[LedgerOp]) -> None:
        """Fresh reservations, decisions and snapshots are gathered and written as a few
        multi-row statements; a release or activation first writes what is gathered, so
        every operation sees the ones before it."""
        rows = PendingRows()
        for op in ops:
            if gather(rows, op):
                continue
            if isinstance(op, SetCapacity):
                self.set_capacity(db, op.pool_id, op.resource, op.capacity)
            elif isinstance(op, Release | Activate):
                if rows.pending:
                    self.flush(db, rows)
                outcome = (
                    self._release(db, op.admission_id, op.fence, op.at)
                    if isinstance(op, Release)
                    else self._activate(db, op.admission_id, op.fence, op.expires_at, op.at)
                )
                if isinstance(outcome, Refused):
                    raise StaleView(
                        f"reservation {op.admission_id!r} changed under the batch: "
                        f"{outcome.detail}",
                        op.admission_id,
                    )
        if rows.pending:
            self.flush(db, rows)

    def flush(self, db: Db, rows: PendingRows) -> None:
        """Write the gathered rows and empty ``rows``."""
        # Counters first, in the one global order, each by the batch's total: a counter
        # moved under the batch fails it.
        if rows.taken and not self.increment_all(db, sorted(rows.taken.items())):
            raise StaleView(
                "a counter changed under a batch (another writer); decide its calls again"
                " one by one"
            )
        rows.taken.clear()
        self._rows.insert(db, self._t.reservation, RES_COLUMNS, rows.reservations)
        self._rows.insert(db, self._t.log, "at, admission_id, event, state, fence", rows.log)
        rows.reservations, rows.log = [], []
        # Before the records naming them; in key order, so two managers writing the same new
        # snapshots (after a descriptor change) cannot wait on each other's in opposite order.
        self._records.insert_snapshots(db, sorted(rows.snapshots.items()))
        rows.snapshots.clear()
        recorded = list(rows.recorded.values())
        if self._records.upsert_decisions(db, recorded) != len(recorded):
            raise StaleView(
                "a decision of this batch was recorded meanwhile for another digest"
                " (another manager); decide its calls again one by one"
            )
        rows.recorded.clear()

    def increment_all(self, db: Db, totals: Sequence[tuple[tuple[str, str], int]]) -> bool:
        """The conditional increment ``used = used + n WHERE used + n <= capacity`` of every
        counter of ``totals``, in the one global order; False if one would pass capacity (the
        caller fails the batch: all roll back). One statement per counter, in that order, so
        two writers lock rows in the same order (one ``UPDATE … FROM (VALUES …)`` for all of
        them measured slower on SQLite), run as one ``changed_many``: every row must change."""
        rows = [(n, pool, resource, n) for (pool, resource), n in totals]
        return db.changed_many(self._increment_sql, rows) == len(rows)
