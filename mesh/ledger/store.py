"""The ledger's one behavioural contract (:class:`LedgerStore`) and the SQL that keeps it.

Theory of operation
-------------------

The store is the admission path's linearisation point: every operation is **one database
transaction**, and the decision is whatever that transaction committed. Time is always a
parameter (``now``, Unix seconds); nothing here reads a clock.

Counters. Each ``(pool_id, resource)`` has a row ``(capacity, used)``. ``prepare`` takes every
item with a *conditional increment*::

    UPDATE capacity SET used = used + n
     WHERE pool_id = ? AND resource = ? AND used + n <= capacity

The check and the write are one statement on one row, so whoever commits first wins the last
unit and the loser's ``WHERE`` no longer matches — no read-then-write window, no separate
lock. Items are taken in the one global order ``(pool_id, resource)``
(:func:`~mesh.ledger.model.normalize_items`); a miss rolls the whole transaction back, so a
request takes all of its items or none. A resource without a row has capacity 0. Releases
and expiries give the items back in the same order, in the same transaction as the state
change, and only for rows whose state change actually happened — so exactly once.

State changes are compare-and-sets on ``(admission_id, state, fence)``: ``UPDATE reservation
SET state = ... WHERE admission_id = ? AND fence = ? AND state IN (...)``. If nothing matched,
a read says why (:class:`~mesh.ledger.model.Refused`). Expiry gives a new fence from the
global sequence, so an old fence never matches again.

Idempotency. ``prepare`` first inserts the reservation row (``ON CONFLICT DO NOTHING``): a
concurrent ``prepare`` of the same admission ID waits on that key until the first commits,
then reads it and replays the same decision (or CONFLICT for another digest). A caller that
got a :class:`~mesh.errors.StoreError` (outcome unknown, e.g. the connection broke at
COMMIT) simply calls ``prepare`` again with the same ID and digest.

Every state change also appends a row to ``ledger_log`` (append-only), from which
:func:`~mesh.ledger.model.replay` rebuilds each admission's state and fence.

Group commit. ``batch(work)`` runs every call ``work`` makes in **one** write transaction: the
manager decides all the admissions that queued up while the previous batch ran, then commits
once (one fsync, one lock hand-off, one round trip for BEGIN/COMMIT). Each call inside still
takes all of its items or none — an operation that refuses rolls back to its own savepoint —
and nothing is visible to anyone else before the batch commits. If the transaction fails,
every call in it failed; the caller decides them again one by one (a PostgreSQL deadlock
between two managers' batches is such a failure, so a batch is never retried blindly).

Planned batches. ``batch(work, plan=ids)`` is for a batch that is mostly ``prepare`` of
fresh admission IDs (the manager's admissions). It reads the planned IDs' reservations and
recorded decisions in two statements up front, then decides each ``prepare`` in memory:
counters are read once per batch and checked there, fences are drawn as a block, and the new
rows (reservations, log entries, decisions) are written at the end as a few multi-row
statements, before COMMIT. The counters are still taken by conditional increments — one per
counter per batch, with the batch's total — so if anything moved a counter under the batch
(another manager on PostgreSQL), the ``WHERE`` misses, the batch fails as a whole, and the
caller decides again one by one. Any other call inside a planned batch first writes what is
pending and then runs as usual, so the batch still reads its own writes. About 12 statements
per admission become about 12 per batch, which is what makes group commit pay on SQLite and
saves round trips on PostgreSQL (whose unplanned batches go further: two round trips in
all, see :mod:`mesh.ledger.postgres`).

Decisions. ``record_decision`` keeps the latest decision about an admission ID (its digest,
outcome and a JSON record: the reply and the eligibility behind it), written in the same
transaction as the reservation it describes, so ``mesh explain`` and idempotent replies
survive a restart and are shared by every manager on the ledger. The eligibility behind a
decision is the same for every request that got the same verdicts, so a record names it by
content address and ``save_eligibility`` keeps each snapshot once (``ON CONFLICT DO
NOTHING``: two managers writing the same one agree).

:class:`SqlLedger` holds all of this once; the two stores supply a connection, a transaction,
the fence sequence and their DDL.
"""

from __future__ import annotations

import abc
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

import orjson

from mesh.errors import LocalProtocolError, StaleView, StoreError
from mesh.ledger.model import (
    HOLDING_STATES,
    TRANSITIONS,
    Activate,
    DecisionRow,
    Item,
    LedgerEvent,
    LedgerLogRow,
    LedgerOp,
    LedgerReason,
    LedgerView,
    Prepared,
    RecordDecision,
    Refused,
    Release,
    Reservation,
    ReservationState,
    Reserve,
    SaveEligibility,
    SetCapacity,
    Usage,
    check_ttl,
    default_pool,
    normalize_items,
    replay,
    shortage,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
__all__ = ["DecisionRow", "LedgerStore", "SqlLedger", "Usage"]  # the first and last: model's

_HOLDING = "(" + ", ".join(f"'{state}'" for state in sorted(HOLDING_STATES)) + ")"
# The holding states as the partial index ``ledger_reservation_due`` is defined in both
# schemas, word for word: SQLite uses a partial index only for a WHERE term that matches its
# definition (with the states in another order it does not, and INDEXED BY fails).
_DUE_STATES = "('PREPARING', 'ACTIVE')"
_RES_COLUMNS = (
    "admission_id, digest, pool_id, state, fence, expires_at, created_at, updated_at, items, epoch"
)
"""A reservation's columns. ``items`` holds its items as compact JSON (:func:`items_json`),
in the row itself: one row per admission rather than one more per item, so an admission
dirties one page fewer. Rows written before that column existed have ``items`` NULL and
their items in the item table, which is read for those rows only."""


@functools.lru_cache(maxsize=1024)
def items_json(items: tuple[Item, ...]) -> str:
    """``[[pool_id, resource, amount], ...]``, in the items' (normalised) order."""
    return orjson.dumps([list(item) for item in items]).decode()


@functools.lru_cache(maxsize=1024)
def _items_from_json(text: str) -> tuple[Item, ...]:
    return tuple(Item(str(p), str(r), int(a)) for p, r, a in orjson.loads(text))


class LedgerStore(Protocol):
    """The reservation ledger. Synchronous; each call is one transaction (call it from a
    thread, e.g. ``asyncio.to_thread``). Expected refusals are values, failures raise
    :class:`~mesh.errors.StoreError`."""

    def set_capacity(self, pool_id: str, resource: str, capacity: int) -> None:
        """Create or change a counter's capacity; ``used`` is kept (it may exceed it)."""
        ...

    def prepare(
        self,
        admission_id: str,
        digest: str,
        items: Iterable[tuple[str, str, int]],
        ttl_s: float,
        now: float,
        *,
        pool_id: str | None = None,
        activate_ttl_s: float | None = None,
        descriptor_epoch: int | None = None,
    ) -> Prepared | Refused:
        """Take every item (all or nothing) and hold them PREPARING until ``now + ttl_s``.
        With ``activate_ttl_s`` (nothing outside the ledger to wait for), a fresh reservation
        is then activated in the same transaction, ACTIVE until ``now + activate_ttl_s``.
        ``descriptor_epoch``: the pool's epoch it is granted under, kept with it so a replay
        reports the same grant."""
        ...

    def activate(
        self, admission_id: str, fence: int, ttl_s: float, now: float
    ) -> Reservation | Refused:
        """PREPARING → ACTIVE (until ``now + ttl_s``) if ``fence`` is current and unexpired."""
        ...

    def release(self, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        """PREPARING|ACTIVE → RELEASED if ``fence`` is current; the items are given back."""
        ...

    def release_many(
        self, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        """:meth:`release` for each ``(admission_id, fence)``, in order, in one transaction
        (one commit for all: the manager's group commit of releases). Each outcome is what
        :meth:`release` would have returned; if the transaction fails, none is kept. Inside
        a :meth:`batch` they settle in the batch's transaction; with PostgreSQL, in a batch
        that has not begun one (read, decide, apply), it must be the batch's last call: the
        batch's writes and the releases go as one statement."""
        ...

    def expire_due(self, now: float) -> list[Reservation]:
        """Every PREPARING|ACTIVE reservation due at ``now`` → EXPIRED with a new fence."""
        ...

    def get(self, admission_id: str) -> Reservation | None: ...

    def active(self) -> list[Reservation]:
        """Every PREPARING or ACTIVE reservation, by fence (recovery after a restart)."""
        ...

    def usage(self) -> Usage:
        """``{(pool_id, resource): (used, capacity)}`` for every counter."""
        ...

    def save_descriptor(self, pool_id: str, epoch: int, body: str) -> bool:
        """Keep a pool's descriptor (JSON) unless a newer epoch is stored; True if kept."""
        ...

    def descriptors(self, known: Mapping[str, int] | None = None) -> list[tuple[str, int, str]]:
        """``(pool_id, epoch, body)`` of every stored descriptor: what a (re)starting manager,
        or another manager on the same ledger, loads. ``known``: the epochs the caller
        holds; then only descriptors of a newer epoch (or another pool) are returned, and
        only their bodies are read."""
        ...

    def log(self, after_seq: int = 0) -> list[LedgerLogRow]:
        """The ledger log's entries after ``after_seq``, oldest first."""
        ...

    def batch(self, work: Callable[[], T], *, plan: Sequence[str] = ()) -> T:
        """Run ``work``, and every ledger call it makes on this thread, in one transaction.
        ``plan``: the admission IDs ``work`` is about to ``prepare`` (a planned batch, see
        the module docstring); the outcome of every call is the same either way."""
        ...

    def read_for_decision(self, admission_ids: Sequence[str], fences: int) -> LedgerView:
        """What a batch about ``admission_ids`` is decided from (:class:`LedgerView`), with
        ``fences`` fresh fences drawn for it and every stored descriptor's epoch. Call it
        inside :meth:`batch`, then :meth:`apply` the decided operations in the same
        transaction."""
        ...

    def apply(self, ops: Sequence[LedgerOp]) -> None:
        """Write a decided batch's operations in their order, as one transaction (or as part
        of the open batch). Counters are still taken by conditional increments: if one moved
        under the batch, or a decision was recorded meanwhile for another digest, this raises
        :class:`StoreError`; if a reservation to release or activate is no longer as the batch
        saw it, :class:`~mesh.errors.StaleView` — nothing is kept either way."""
        ...

    def record_decision(
        self, admission_id: str, digest: str, outcome: str, at: float, record: str
    ) -> bool:
        """Keep the latest decision about ``admission_id`` — unless one is stored for another
        digest (that one stays: the other request is a conflict). True if kept."""
        ...

    def decision(self, admission_id: str) -> DecisionRow | None: ...

    def deferred_since(self, since: float) -> list[DecisionRow]:
        """The recorded decisions that are deferrals made at ``since`` or later, oldest
        first: what a restarted manager rebuilds its admission lines from."""
        ...

    def save_eligibility(self, ref: str, body: str) -> None:
        """Keep an eligibility snapshot (JSON) under its content address ``ref``, once: a
        decision record names it instead of repeating it. Keeping one again changes nothing."""
        ...

    def eligibility(self, ref: str) -> str | None:
        """The snapshot stored under ``ref``, if any."""
        ...

    def decisions(self, admission_ids: Sequence[str]) -> dict[str, DecisionRow]:
        """The recorded decisions of these admissions, in one read (those that have one)."""
        ...

    def maintain(self) -> None:
        """Housekeeping off the commit path (SQLite: a WAL checkpoint); call it periodically."""
        ...

    def replay_log(self) -> dict[str, tuple[ReservationState, int]]:
        """Each admission's ``(state, fence)`` rebuilt from the log alone."""
        ...

    def close(self) -> None: ...


class Db(Protocol):
    """What the shared SQL needs from a connection inside a transaction (``?`` placeholders)."""

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...

    def changed(self, sql: str, params: Sequence[object] = ()) -> int:
        """Run a write and say how many rows it inserted or changed (where only that count
        is needed: SQLite answers it without the work ``RETURNING`` does)."""
        ...

    def changed_many(self, sql: str, rows: Sequence[Sequence[object]]) -> int:
        """Run one write once per row of parameters, in order, and say how many rows they
        changed in all (SQLite: one prepared statement stepped per row, no Python between)."""
        ...


class _Rollback(Exception):
    """Raised inside a transaction to roll it back and return ``outcome`` instead."""

    def __init__(self, outcome: Refused) -> None:
        super().__init__(outcome.detail)
        self.outcome = outcome


# The log rows of a planned prepare, as (event, state entered), spelled out once.
_PREPARED = ((LedgerEvent.PREPARED.value, TRANSITIONS[LedgerEvent.PREPARED].target.value),)
_PREPARED_ACTIVATED = (
    *_PREPARED,
    (LedgerEvent.ACTIVATED.value, TRANSITIONS[LedgerEvent.ACTIVATED].target.value),
)


@dataclass(slots=True)
class _Plan:
    """A planned batch: what it has read, and what it will write before COMMIT."""

    planned: int  # how many prepares the caller announced (the size of a fence block)
    known: dict[str, Reservation | None]  # reservations by admission ID; None: there is none
    decisions: dict[str, DecisionRow | None]  # recorded decisions, the batch's own included
    # (used, capacity) of each counter as this transaction sees it, pending takes included;
    # None: no row (capacity 0)
    counters: dict[tuple[str, str], tuple[int, int] | None] = field(default_factory=dict)
    taken: dict[tuple[str, str], int] = field(default_factory=dict)  # not yet written
    fences: list[int] = field(default_factory=list)  # drawn, not yet used (reversed)
    reservations: list[tuple[object, ...]] = field(default_factory=list)
    log: list[tuple[object, ...]] = field(default_factory=list)
    recorded: dict[str, tuple[str, str, str, float, str]] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)  # eligibility: ref -> body
    prepared: int = 0

    @property
    def pending(self) -> bool:
        return bool(self.taken or self.reservations or self.log or self.recorded or self.snapshots)


@dataclass(frozen=True, slots=True)
class Tables:
    """The ledger's table names, already qualified and quoted for the dialect."""

    capacity: str
    reservation: str
    item: str
    log: str
    descriptor: str
    decision: str
    eligibility: str


class SqlLedger(abc.ABC):
    """:class:`LedgerStore` over SQL that SQLite (3.35+) and PostgreSQL both accept."""

    # Appended to the expiry sweep's SELECT: PostgreSQL locks the due rows and skips rows a
    # concurrent release or sweep holds (they are dealt with by that transaction).
    _due_lock_clause = ""
    # After the reservation table in the sweep's SELECT: SQLite names the due index, since
    # left to itself it reads the whole table in primary-key order to save sorting the few
    # due rows (a sweep then costs O(every reservation ever kept)).
    _due_index_clause = ""

    def __init__(self, tables: Tables) -> None:
        self._t = tables
        self._lock = threading.Lock()  # one transaction at a time on the one connection
        # While ``batch`` runs: its open transaction, and the thread that may use it.
        self._batch_db: Db | None = None
        self._batch_thread: int | None = None
        self._plan: _Plan | None = None  # while a planned batch runs

    # ---- what a dialect provides ---------------------------------------------------------
    @abc.abstractmethod
    def _transaction(self, work: Callable[[Db], T], *, write: bool, retry: bool = True) -> T:
        """Run ``work`` in one transaction: commit on return, roll back and re-raise on any
        exception; database errors become :class:`StoreError`. With ``retry`` a dialect may
        run ``work`` again after a deadlock or serialization failure."""

    @abc.abstractmethod
    def _next_fence(self, db: Db) -> int:
        """The next value of the global fence sequence."""

    def _next_fences(self, db: Db, count: int) -> list[int]:
        """``count`` values of the fence sequence, ascending (a dialect may draw them at once)."""
        return [self._next_fence(db) for _ in range(count)]

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def maintain(self) -> None:  # noqa: B027 - optional for a dialect
        """Nothing to do by default."""

    def _open_batch(self) -> Db | None:
        """The batch transaction, if this thread is running one."""
        if self._batch_db is not None and self._batch_thread == threading.get_ident():
            return self._batch_db
        return None

    def _write(self, work: Callable[[Db], T]) -> T:
        db = self._open_batch()
        if db is not None:
            self._settle_plan(db, forget=True)
            return work(db)
        with self._lock:
            return self._transaction(work, write=True)

    def _atomic(self, work: Callable[[Db], T]) -> T | Refused:
        """Like ``_write``, but a :class:`_Rollback` inside rolls back (to the operation's own
        savepoint inside a batch) and returns its refusal."""
        db = self._open_batch()
        if db is None:
            try:
                return self._write(work)
            except _Rollback as rollback:
                return rollback.outcome
        self._settle_plan(db, forget=True)
        db.execute("SAVEPOINT ledger_op")
        try:
            result = work(db)
        except _Rollback as rollback:
            db.execute("ROLLBACK TO SAVEPOINT ledger_op")
            db.execute("RELEASE SAVEPOINT ledger_op")
            return rollback.outcome
        db.execute("RELEASE SAVEPOINT ledger_op")
        return result

    def _read(self, work: Callable[[Db], T]) -> T:
        db = self._open_batch()
        if db is not None:
            self._settle_plan(db, forget=False)
            return work(db)
        with self._lock:
            return self._transaction(work, write=False)

    def batch(self, work: Callable[[], T], *, plan: Sequence[str] = ()) -> T:
        if self._open_batch() is not None:
            return work()  # already inside this thread's batch

        def run(db: Db) -> T:
            self._batch_db, self._batch_thread = db, threading.get_ident()
            try:
                if plan:
                    self._plan = self._read_plan(db, plan)
                result = work()
                if self._plan is not None:
                    self._flush_plan(db, self._plan)
                return result
            finally:
                self._batch_db = self._batch_thread = None
                self._plan = None

        with self._lock:
            return self._transaction(run, write=True, retry=False)

    # ---- the contract ----------------------------------------------------------------------
    def set_capacity(self, pool_id: str, resource: str, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise LocalProtocolError(f"capacity must be an int >= 0, got {capacity!r}")
        sql = (
            f"INSERT INTO {self._t.capacity} (pool_id, resource, capacity, used)"
            " VALUES (?, ?, ?, 0) ON CONFLICT (pool_id, resource)"
            " DO UPDATE SET capacity = excluded.capacity"
        )
        self._write(lambda db: db.execute(sql, (pool_id, resource, capacity)))

    def prepare(
        self,
        admission_id: str,
        digest: str,
        items: Iterable[tuple[str, str, int]],
        ttl_s: float,
        now: float,
        *,
        pool_id: str | None = None,
        activate_ttl_s: float | None = None,
        descriptor_epoch: int | None = None,
    ) -> Prepared | Refused:
        check_ttl(ttl_s, now)
        if activate_ttl_s is not None:
            check_ttl(activate_ttl_s, now)
        wanted = normalize_items(items)
        pool = pool_id if pool_id is not None else default_pool(wanted)

        expires_at = now + (ttl_s if activate_ttl_s is None else activate_ttl_s)
        db = self._open_batch()
        if db is not None and self._plan is not None:
            return self._prepare_planned(
                db, self._plan, admission_id, digest, pool, wanted, expires_at, now,
                activate_ttl_s is not None, descriptor_epoch,
            )  # fmt: skip
        activate = activate_ttl_s is not None
        return self._atomic(
            lambda db: self._prepare(
                db, admission_id, digest, pool, wanted, expires_at, now, activate, descriptor_epoch
            )
        )

    def activate(
        self, admission_id: str, fence: int, ttl_s: float, now: float
    ) -> Reservation | Refused:
        check_ttl(ttl_s, now)
        return self._atomic(lambda db: self._activate(db, admission_id, fence, now + ttl_s, now))

    def release(self, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        return self._atomic(lambda db: self._release(db, admission_id, fence, now))

    def release_many(
        self, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        if len(releases) <= 1:  # a transaction of its own anyway
            return [self.release(a, f, now) for a, f in releases]
        return self._write(lambda db: self._release_many(db, releases, now))

    def expire_due(self, now: float) -> list[Reservation]:
        return self._write(lambda db: self._expire_due(db, now))

    def get(self, admission_id: str) -> Reservation | None:
        return self._read(lambda db: self._select(db, admission_id))

    def active(self) -> list[Reservation]:
        sql = f"SELECT {_RES_COLUMNS} FROM {self._t.reservation} WHERE state IN {_HOLDING}"
        return self._read(lambda db: self._with_items(db, db.execute(sql)))

    def save_descriptor(self, pool_id: str, epoch: int, body: str) -> bool:
        t = self._t.descriptor
        sql = (
            f"INSERT INTO {t} (pool_id, epoch, body) VALUES (?, ?, ?)"
            f" ON CONFLICT (pool_id) DO UPDATE SET epoch = excluded.epoch, body = excluded.body"
            f" WHERE excluded.epoch >= {t}.epoch"
        )
        self._write(lambda db: db.execute(sql, (pool_id, epoch, body)))
        stored = self._read(
            lambda db: db.execute(f"SELECT epoch FROM {t} WHERE pool_id = ?", (pool_id,))
        )
        return bool(stored) and int(stored[0][0]) == epoch

    def descriptors(self, known: Mapping[str, int] | None = None) -> list[tuple[str, int, str]]:
        table = self._t.descriptor

        def read(db: Db) -> list[tuple[Any, ...]]:
            if known is None:
                return db.execute(f"SELECT pool_id, epoch, body FROM {table} ORDER BY pool_id")
            # Epochs first (a few bytes a pool), bodies only of the newer ones.
            newer = [p for p, epoch in self._epochs(db).items() if epoch > known.get(p, 0)]
            rows: list[tuple[Any, ...]] = []
            for chunk in _chunks(sorted(newer), 500):
                rows += db.execute(
                    f"SELECT pool_id, epoch, body FROM {table}"
                    f" WHERE pool_id IN ({', '.join('?' * len(chunk))}) ORDER BY pool_id",
                    chunk,
                )
            return rows

        return [(str(p), int(e), str(b)) for p, e, b in self._read(read)]

    def _epochs(self, db: Db) -> dict[str, int]:
        """Every stored descriptor's epoch, by pool."""
        rows = db.execute(f"SELECT pool_id, epoch FROM {self._t.descriptor}")
        return {str(pool): int(epoch) for pool, epoch in rows}

    def read_for_decision(self, admission_ids: Sequence[str], fences: int) -> LedgerView:
        ids = list(dict.fromkeys(admission_ids))

        def read(db: Db) -> LedgerView:
            reservations = self._select_many(db, ids)
            counters = {
                (str(p), str(r)): (int(u), int(c))
                for p, r, u, c in db.execute(
                    f"SELECT pool_id, resource, used, capacity FROM {self._t.capacity}"
                )
            }
            return LedgerView(
                counters=counters,
                reservations=reservations,
                decisions=self._select_decisions(db, ids) if ids else {},
                fences=tuple(self._next_fences(db, fences)) if fences else (),
                epochs=self._epochs(db),
            )

        return self._write(read) if fences else self._read(read)

    def apply(self, ops: Sequence[LedgerOp]) -> None:
        if ops:
            self._write(lambda db: self._apply(db, ops))

    def _apply(self, db: Db, ops: Sequence[LedgerOp]) -> None:
        """Fresh reservations, decisions and snapshots are gathered and written as a few
        multi-row statements (as a planned batch's are); a release or activation first writes
        what is gathered, so every operation sees the ones before it."""
        rows = _Plan(planned=0, known={}, decisions={})
        capacity_sql = (
            f"INSERT INTO {self._t.capacity} (pool_id, resource, capacity, used)"
            " VALUES (?, ?, ?, 0) ON CONFLICT (pool_id, resource)"
            " DO UPDATE SET capacity = excluded.capacity"
        )
        for op in ops:
            if _gather(rows, op):
                continue
            if isinstance(op, SetCapacity):
                db.execute(capacity_sql, (op.pool_id, op.resource, op.capacity))
            elif isinstance(op, Release | Activate):
                if rows.pending:
                    self._flush_plan(db, rows)
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
            self._flush_plan(db, rows)

    def record_decision(
        self, admission_id: str, digest: str, outcome: str, at: float, record: str
    ) -> bool:
        db, plan = self._open_batch(), self._plan
        if db is not None and plan is not None:
            mine = plan.recorded.get(admission_id)  # recorded earlier in this batch
            stored_digest: str | None
            if mine is not None:
                stored_digest = mine[1]
            else:
                if admission_id not in plan.decisions:
                    plan.decisions[admission_id] = self._select_decision(db, admission_id)
                stored = plan.decisions[admission_id]
                stored_digest = None if stored is None else stored.digest
            if stored_digest is not None and stored_digest != digest:
                return False
            plan.recorded[admission_id] = (admission_id, digest, outcome, at, record)
            return True
        row = (admission_id, digest, outcome, at, record)
        return self._write(lambda db: self._upsert_decisions(db, [row])) == 1

    def _upsert_decisions(self, db: Db, rows: Sequence[tuple[object, ...]]) -> int:
        """Write decision rows; a row for an ID stored with another digest is not kept. Returns
        how many were kept."""
        t, kept = self._t.decision, 0
        for chunk in _chunks(rows, 100):
            kept += db.changed(  # a row whose digest differs is not updated: not counted
                f"INSERT INTO {t} (admission_id, digest, outcome, decided_at, record) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk))
                + " ON CONFLICT (admission_id) DO UPDATE SET outcome = excluded.outcome,"
                " decided_at = excluded.decided_at, record = excluded.record"
                f" WHERE {t}.digest = excluded.digest",
                _flat(chunk),
            )
        return kept

    def save_eligibility(self, ref: str, body: str) -> None:
        db, plan = self._open_batch(), self._plan
        if db is not None and plan is not None:
            plan.snapshots[ref] = body  # written with the batch's other rows
            return
        self._write(lambda db: self._insert_snapshots(db, [(ref, body)]))

    def _insert_snapshots(self, db: Db, rows: Sequence[tuple[object, ...]]) -> None:
        for chunk in _chunks(rows, 100):
            db.execute(
                f"INSERT INTO {self._t.eligibility} (ref, body) VALUES "
                + ", ".join(["(?, ?)"] * len(chunk))
                + " ON CONFLICT (ref) DO NOTHING",
                _flat(chunk),
            )

    def eligibility(self, ref: str) -> str | None:
        plan = self._plan
        if plan is not None and ref in plan.snapshots and self._open_batch():
            return plan.snapshots[ref]
        sql = f"SELECT body FROM {self._t.eligibility} WHERE ref = ?"
        rows = self._read(lambda db: db.execute(sql, (ref,)))
        return str(rows[0][0]) if rows else None

    def decision(self, admission_id: str) -> DecisionRow | None:
        plan = self._plan
        if plan is not None and self._open_batch():
            mine = plan.recorded.get(admission_id)  # this batch's own write comes first
            if mine is not None:
                return DecisionRow(*mine)
            if admission_id in plan.decisions:
                return plan.decisions[admission_id]
        return self._read(lambda db: self._select_decision(db, admission_id))

    def decisions(self, admission_ids: Sequence[str]) -> dict[str, DecisionRow]:
        return self._read(lambda db: self._select_decisions(db, admission_ids))

    def deferred_since(self, since: float) -> list[DecisionRow]:
        # Served by the partial index on decided_at over the deferred rows alone.
        sql = (
            f"SELECT admission_id, digest, outcome, decided_at, record FROM {self._t.decision}"
            " WHERE outcome = 'deferred' AND decided_at >= ? ORDER BY decided_at"
        )
        rows = self._read(lambda db: db.execute(sql, (since,)))
        return [DecisionRow(str(a), str(d), str(o), float(t), str(r)) for a, d, o, t, r in rows]

    def _select_decision(self, db: Db, admission_id: str) -> DecisionRow | None:
        rows = self._select_decisions(db, [admission_id])
        return rows.get(admission_id)

    def _select_decisions(self, db: Db, ids: Sequence[str]) -> dict[str, DecisionRow]:
        found: dict[str, DecisionRow] = {}
        for chunk in _chunks(ids, 500):
            for a, d, o, at, r in db.execute(
                f"SELECT admission_id, digest, outcome, decided_at, record FROM {self._t.decision}"
                f" WHERE admission_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            ):
                found[str(a)] = DecisionRow(str(a), str(d), str(o), float(at), str(r))
        return found

    def usage(self) -> Usage:
        sql = f"SELECT pool_id, resource, used, capacity FROM {self._t.capacity}"
        rows = self._read(lambda db: db.execute(sql))
        return {(str(p), str(r)): (int(u), int(c)) for p, r, u, c in rows}

    def log(self, after_seq: int = 0) -> list[LedgerLogRow]:
        sql = (
            f"SELECT seq, at, admission_id, event, state, fence FROM {self._t.log}"
            " WHERE seq > ? ORDER BY seq"
        )
        rows = self._read(lambda db: db.execute(sql, (after_seq,)))
        return [
            LedgerLogRow(int(s), float(a), str(i), LedgerEvent(e), ReservationState(st), int(f))
            for s, a, i, e, st, f in rows
        ]

    def replay_log(self) -> dict[str, tuple[ReservationState, int]]:
        return replay(self.log())

    # ---- one transaction each ------------------------------------------------------------
    def _prepare(
        self,
        db: Db,
        admission_id: str,
        digest: str,
        pool_id: str,
        items: tuple[Item, ...],
        expires_at: float,
        now: float,
        activate: bool = False,
        descriptor_epoch: int | None = None,
    ) -> Prepared | Refused:
        """With ``activate`` the reservation passes PREPARING → ACTIVE inside this one
        transaction: nobody can see it in between, so its row is written once, as ACTIVE
        (no compare-and-set needed), and the log records both transitions."""
        # Insert first: a fresh ID (the common case) costs no read. On a known ID — or a
        # concurrent prepare of it that committed first (we waited on its key) — the insert
        # does nothing and the fence drawn for it is simply skipped (a harmless gap).
        fence = self._next_fence(db)
        state = ReservationState.ACTIVE if activate else ReservationState.PREPARING
        inserted = db.changed(
            f"INSERT INTO {self._t.reservation} ({_RES_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (admission_id) DO NOTHING",
            (admission_id, digest, pool_id, state.value, fence, expires_at, now, now,
             items_json(items), descriptor_epoch),
        )  # fmt: skip
        if inserted:
            self._take(db, items)
            events = (
                [LedgerEvent.PREPARED, LedgerEvent.ACTIVATED]
                if activate
                else [LedgerEvent.PREPARED]
            )
            self._append_log(db, now, admission_id, fence, *events)
            reservation = Reservation(
                admission_id, digest, pool_id, state, fence, items, expires_at, now, now,
                descriptor_epoch,
            )  # fmt: skip
            return Prepared(reservation, replayed=False)
        existing = self._select(db, admission_id)
        if existing is None:
            raise StoreError(f"reservation {admission_id!r} conflicted but is not there")
        return self._known(existing, admission_id, digest)

    @staticmethod
    def _known(existing: Reservation, admission_id: str, digest: str) -> Prepared | Refused:
        """``prepare`` of an admission ID that already has a reservation."""
        if existing.digest != digest:
            return Refused(
                LedgerReason.CONFLICT,
                f"admission {admission_id!r} is already reserved for requirement digest "
                f"{existing.digest!r}, not {digest!r}",
            )
        return Prepared(existing, replayed=True)

    def _take(self, db: Db, items: tuple[Item, ...]) -> None:
        for pool_id, resource, amount in items:
            if not self._increment(db, pool_id, resource, amount):
                key = (pool_id, resource)
                raise _Rollback(shortage(pool_id, resource, amount, self._counters(db, [key])[key]))

    def _increment(self, db: Db, pool_id: str, resource: str, amount: int) -> bool:
        """The conditional increment (module docstring); False if it would pass capacity."""
        return db.changed(self._increment_sql, (amount, pool_id, resource, amount)) == 1

    @property
    def _increment_sql(self) -> str:
        return (
            f"UPDATE {self._t.capacity} SET used = used + ?"
            " WHERE pool_id = ? AND resource = ? AND used + ? <= capacity"
        )

    def _increment_all(self, db: Db, totals: Sequence[tuple[tuple[str, str], int]]) -> bool:
        """Every conditional increment of a planned batch, ``totals`` in the one global order;
        False if one would pass capacity (the caller fails the batch: all roll back). One
        statement per counter, in that order, so two writers lock rows in the same order (one
        ``UPDATE … FROM (VALUES …)`` for all of them measured slower on SQLite), run as one
        ``changed_many``: every row must change."""
        rows = [(n, pool, resource, n) for (pool, resource), n in totals]
        return db.changed_many(self._increment_sql, rows) == len(rows)

    def _counters(
        self, db: Db, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], tuple[int, int] | None]:
        """``(used, capacity)`` of each counter in one read; ``None``: no row (capacity 0)."""
        found: dict[tuple[str, str], tuple[int, int] | None] = dict.fromkeys(keys)
        rows = db.execute(
            f"SELECT pool_id, resource, used, capacity FROM {self._t.capacity}"
            f" WHERE (pool_id, resource) IN (VALUES {', '.join(['(?, ?)'] * len(keys))})",
            _flat(keys),
        )
        found.update(((str(p), str(r)), (int(u), int(c))) for p, r, u, c in rows)
        return found

    # ---- a planned batch (module docstring) -------------------------------------------------
    def _read_plan(self, db: Db, ids: Sequence[str]) -> _Plan:
        ids = list(dict.fromkeys(ids))
        known: dict[str, Reservation | None] = dict.fromkeys(ids)
        known.update(self._select_many(db, ids))
        decisions: dict[str, DecisionRow | None] = dict.fromkeys(ids)
        decisions.update(self._select_decisions(db, ids))
        return _Plan(planned=len(ids), known=known, decisions=decisions)

    def _prepare_planned(
        self,
        db: Db,
        plan: _Plan,
        admission_id: str,
        digest: str,
        pool_id: str,
        items: tuple[Item, ...],
        expires_at: float,
        now: float,
        activate: bool,
        descriptor_epoch: int | None,
    ) -> Prepared | Refused:
        """``_prepare``'s outcome, decided against the plan's view; the rows wait for the
        flush. Nothing is written before the checks pass, so a refusal needs no savepoint."""
        if admission_id not in plan.known:  # not announced in the plan: read it now
            plan.known[admission_id] = self._select(db, admission_id)
        existing = plan.known[admission_id]
        if existing is not None:
            return self._known(existing, admission_id, digest)
        missing = [(p, r) for p, r, _ in items if (p, r) not in plan.counters]
        if missing:  # the batch's first request of this shape: one read for all its counters
            plan.counters.update(self._counters(db, missing))
        counters = []
        for pool, resource, amount in items:
            key = (pool, resource)
            counter = plan.counters[key]
            if counter is None or counter[0] + amount > counter[1]:
                return shortage(pool, resource, amount, counter)
            counters.append((key, amount, counter))
        for key, amount, (used, capacity) in counters:
            plan.counters[key] = (used + amount, capacity)
            plan.taken[key] = plan.taken.get(key, 0) + amount
        if not plan.fences:
            block = max(plan.planned - plan.prepared, 1)
            plan.fences = sorted(self._next_fences(db, block), reverse=True)
        fence = plan.fences.pop()
        plan.prepared += 1
        state = ReservationState.ACTIVE if activate else ReservationState.PREPARING
        plan.reservations.append(
            (admission_id, digest, pool_id, state.value, fence, expires_at, now, now,
             items_json(items), descriptor_epoch)
        )  # fmt: skip
        for event, target in _PREPARED_ACTIVATED if activate else _PREPARED:
            plan.log.append((now, admission_id, event, target, fence))
        reservation = Reservation(
            admission_id, digest, pool_id, state, fence, items, expires_at, now, now,
            descriptor_epoch,
        )  # fmt: skip
        plan.known[admission_id] = reservation
        return Prepared(reservation, replayed=False)

    def _settle_plan(self, db: Db, *, forget: bool) -> None:
        """Before any other call inside a planned batch: write what is pending; before a
        write, also forget what the plan read (that call may change it)."""
        plan = self._plan
        if plan is None:
            return
        if plan.pending:
            # The batch's decisions stay readable from the plan once written.
            plan.decisions.update((a, DecisionRow(*row)) for a, row in plan.recorded.items())
            self._flush_plan(db, plan)
        if forget:
            plan.counters.clear()
            plan.known.clear()

    def _flush_plan(self, db: Db, plan: _Plan) -> None:
        # Counters first, in the one global order, each by the batch's total: the same
        # conditional increment as ``_take``, so a counter moved under the batch fails it.
        if plan.taken and not self._increment_all(db, sorted(plan.taken.items())):
            raise StaleView(
                "a counter changed under a batch (another writer); decide its calls again"
                " one by one"
            )
        plan.taken.clear()
        self._insert_rows(db, self._t.reservation, _RES_COLUMNS, plan.reservations)
        self._insert_rows(db, self._t.log, "at, admission_id, event, state, fence", plan.log)
        plan.reservations, plan.log = [], []
        # Before the records naming them; in key order, so two managers writing the same new
        # snapshots (after a descriptor change) cannot wait on each other's in opposite order.
        self._insert_snapshots(db, sorted(plan.snapshots.items()))
        plan.snapshots.clear()
        rows = list(plan.recorded.values())
        if self._upsert_decisions(db, rows) != len(rows):
            raise StaleView(
                "a decision of this batch was recorded meanwhile for another digest"
                " (another manager); decide its calls again one by one"
            )
        plan.recorded.clear()

    def _insert_rows(
        self, db: Db, table: str, columns: str, rows: Sequence[tuple[object, ...]]
    ) -> None:
        if not rows:
            return
        marks = "(" + ", ".join("?" * len(rows[0])) + ")"
        for chunk in _chunks(rows, 100):
            db.execute(
                f"INSERT INTO {table} ({columns}) VALUES " + ", ".join([marks] * len(chunk)),
                _flat(chunk),
            )

    def _give_back(self, db: Db, reservations: Iterable[Reservation]) -> None:
        totals: dict[tuple[str, str], int] = {}
        for reservation in reservations:
            for pool_id, resource, amount in reservation.items:
                totals[(pool_id, resource)] = totals.get((pool_id, resource), 0) + amount
        rows = [(n, pool, resource, n) for (pool, resource), n in sorted(totals.items())]
        given = db.changed_many(
            f"UPDATE {self._t.capacity} SET used = used - ?"
            " WHERE pool_id = ? AND resource = ? AND used >= ?",
            rows,
        )
        if given != len(rows):
            short = ", ".join(f"{pool}/{resource} by {n}" for n, pool, resource, _ in rows)
            raise StoreError(f"a counter holds less than it is to give back ({short})")

    def _activate(
        self, db: Db, admission_id: str, fence: int, expires_at: float, now: float
    ) -> Reservation | Refused:
        rows = db.execute(
            f"UPDATE {self._t.reservation} SET state = 'ACTIVE', expires_at = ?, updated_at = ?"
            " WHERE admission_id = ? AND fence = ? AND state = 'PREPARING' AND expires_at > ?"
            f" RETURNING {_RES_COLUMNS}",
            (expires_at, now, admission_id, fence, now),
        )
        if not rows:
            return self._why_not(db, admission_id, fence, now, "activate")
        (activated,) = self._with_items(db, rows)
        self._append_log(db, now, admission_id, fence, LedgerEvent.ACTIVATED)
        return activated

    def _release(self, db: Db, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        rows = db.execute(
            f"UPDATE {self._t.reservation} SET state = 'RELEASED', updated_at = ?"
            f" WHERE admission_id = ? AND fence = ? AND state IN {_HOLDING}"
            f" RETURNING {_RES_COLUMNS}",
            (now, admission_id, fence),
        )
        if not rows:
            return self._why_not(db, admission_id, fence, now, "release")
        (released,) = self._with_items(db, rows)
        self._give_back(db, [released])
        self._append_log(db, now, admission_id, fence, LedgerEvent.RELEASED)
        return released

    def _release_many(
        self, db: Db, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        """Every release at once: one ``UPDATE … FROM (VALUES …)`` per 200 of them (the same
        compare-and-set on state and fence as ``_release``), one give-back per counter for all
        of them together, one insert for their log. Each answers as ``release`` would have in
        the given order: the first of two equal releases releases, the second (and any that
        matched nothing) is told why not, read after the update."""
        rows = self._update_by_pairs(
            db,
            "state = 'RELEASED', updated_at = ?",
            list(dict.fromkeys(releases)),
            f"fence = v.column2 AND state IN {_HOLDING}",
            (now,),
        )
        released = {(r.admission_id, r.fence): r for r in self._with_items(db, rows)}
        self._give_back(db, released.values())
        answers: list[Reservation | None] = [released.pop(pair, None) for pair in releases]
        self._append_logs(
            db, now, [(r.admission_id, r.fence) for r in answers if r is not None],
            LedgerEvent.RELEASED,
        )  # fmt: skip
        return [
            self._why_not(db, admission_id, fence, now, "release") if answer is None else answer
            for (admission_id, fence), answer in zip(releases, answers, strict=True)
        ]

    @property
    def _due_sql(self) -> str:
        """The expiry sweep's read: the holding reservations due by ``?``, in ID order."""
        return (
            f"SELECT admission_id FROM {self._t.reservation}{self._due_index_clause}"
            f" WHERE state IN {_DUE_STATES} AND expires_at <= ?"
            f" ORDER BY admission_id{self._due_lock_clause}"
        )

    def _expire_due(self, db: Db, now: float) -> list[Reservation]:
        due = db.execute(self._due_sql, (now,))
        # Each due row under a fence of its own, ascending in admission-ID order; rows a
        # concurrent release ended meanwhile are left out by the UPDATE's own condition.
        fences = self._next_fences(db, len(due)) if due else []
        rows = self._update_by_pairs(
            db,
            "state = 'EXPIRED', fence = v.column2, updated_at = ?",
            [(str(a), fence) for (a,), fence in zip(due, fences, strict=True)],
            f"state IN {_HOLDING} AND expires_at <= ?",
            (now,),
            (now,),
        )
        expired = self._with_items(db, rows)
        self._give_back(db, expired)
        self._append_logs(
            db, now, [(r.admission_id, r.fence) for r in expired], LedgerEvent.EXPIRED
        )
        if expired:
            log.info("expired %d reservations", len(expired), extra={"now": now})
        return expired

    def _update_by_pairs(
        self,
        db: Db,
        assignments: str,
        pairs: Sequence[tuple[str, int]],
        condition: str,
        set_params: Sequence[Any],
        condition_params: Sequence[Any] = (),
    ) -> list[tuple[Any, ...]]:
        """``UPDATE reservation SET <assignments> FROM (VALUES (id, fence), …) AS v WHERE
        admission_id = v.column1 AND <condition>``, 200 pairs a statement (``v.column2`` is
        each row's fence): the updated rows' columns."""
        rows: list[tuple[Any, ...]] = []
        for chunk in _chunks(pairs, 200):
            rows += db.execute(
                f"UPDATE {self._t.reservation} SET {assignments}"
                f" FROM (VALUES {', '.join(['(?, ?)'] * len(chunk))}) AS v"
                f" WHERE admission_id = v.column1 AND {condition} RETURNING {_RES_COLUMNS}",
                [*set_params, *(value for pair in chunk for value in pair), *condition_params],
            )
        return rows

    def _why_not(self, db: Db, admission_id: str, fence: int, now: float, verb: str) -> Refused:
        current = self._select(db, admission_id)
        if current is None:
            return Refused(LedgerReason.NOT_FOUND, f"no reservation {admission_id!r}")
        if current.fence != fence:
            why = f"fence {fence} is stale: it is {current.state} at fence {current.fence}"
        elif verb == "activate" and current.state is ReservationState.PREPARING:
            why = f"it expired at {current.expires_at} (now {now})"
        else:
            why = f"it is already {current.state}"
        return Refused(LedgerReason.STALE_FENCE, f"cannot {verb} {admission_id!r}: {why}")

    # ---- rows --------------------------------------------------------------------------------
    def _select(self, db: Db, admission_id: str) -> Reservation | None:
        rows = db.execute(
            f"SELECT {_RES_COLUMNS} FROM {self._t.reservation} WHERE admission_id = ?",
            (admission_id,),
        )
        found = self._with_items(db, rows)
        return found[0] if found else None

    def _select_many(self, db: Db, ids: Sequence[str]) -> dict[str, Reservation]:
        """The reservations of those of ``ids`` that have one, by admission ID."""
        found: dict[str, Reservation] = {}
        for chunk in _chunks(ids, 500):
            rows = db.execute(
                f"SELECT {_RES_COLUMNS} FROM {self._t.reservation}"
                f" WHERE admission_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            found.update((r.admission_id, r) for r in self._with_items(db, rows))
        return found

    def _with_items(self, db: Db | None, rows: Sequence[Sequence[Any]]) -> list[Reservation]:
        """Reservations for ``rows`` (``_RES_COLUMNS``), by fence, with their items (from the
        row; from the item table for rows written before the ``items`` column). ``db``: None
        when the rows come with their items resolved (as PostgreSQL's functions return them)."""
        if not rows:
            return []
        legacy = [str(row[0]) for row in rows if row[8] is None]
        if legacy and db is None:
            raise StoreError(f"reservations {legacy!r} came without their items")
        items: dict[str, list[Item]] = {i: [] for i in legacy}
        for chunk in _chunks(legacy, 500):
            marks = ", ".join("?" * len(chunk))
            assert db is not None  # checked above
            for admission_id, pool_id, resource, amount in db.execute(
                f"SELECT admission_id, pool_id, resource, amount FROM {self._t.item}"
                f" WHERE admission_id IN ({marks}) ORDER BY pool_id, resource",
                chunk,
            ):
                items[str(admission_id)].append(Item(str(pool_id), str(resource), int(amount)))
        state_of = _STATE_OF
        found = [
            Reservation(
                str(a), str(d), str(p), state_of.get(s) or ReservationState(s), int(f),
                _items_from_json(i) if i is not None else tuple(items[str(a)]),
                float(e), float(c), float(u), None if epoch is None else int(epoch),
            )
            for a, d, p, s, f, e, c, u, i, epoch in rows
        ]  # fmt: skip
        found.sort(key=_fence)
        return found

    def _append_logs(
        self, db: Db, now: float, entries: Sequence[tuple[str, int]], event: LedgerEvent
    ) -> None:
        """One ``event`` for each ``(admission_id, fence)`` of ``entries``, in that order."""
        target = TRANSITIONS[event].target.value
        for chunk in _chunks(entries, 100):
            db.execute(
                f"INSERT INTO {self._t.log} (at, admission_id, event, state, fence) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk)),
                [v for a, f in chunk for v in (now, a, event.value, target, f)],
            )

    def _append_log(
        self, db: Db, now: float, admission_id: str, fence: int, *events: LedgerEvent
    ) -> None:
        db.execute(
            f"INSERT INTO {self._t.log} (at, admission_id, event, state, fence) VALUES "
            + ", ".join(["(?, ?, ?, ?, ?)"] * len(events)),
            [
                value
                for event in events
                for value in (
                    now,
                    admission_id,
                    event.value,
                    TRANSITIONS[event].target.value,
                    fence,
                )
            ],
        )


def _gather(rows: _Plan, op: LedgerOp) -> bool:
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


_STATE_OF: dict[object, ReservationState] = {state.value: state for state in ReservationState}
"""A stored state's enum member by dict lookup (the enum's own call is Python code; an
unknown value still goes through it, and raises)."""


def _fence(reservation: Reservation) -> int:
    return reservation.fence


def _flat(rows: Iterable[Sequence[object]]) -> list[object]:
    """The rows' values in one list, row after row: one statement's bind parameters."""
    return list(itertools.chain.from_iterable(rows))


def _chunks(values: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``values`` in slices of at most ``size`` (bind-parameter limits)."""
    return (values[i : i + size] for i in range(0, len(values), size))
