"""The ledger's one behavioural contract (:class:`LedgerStore`) and the SQL store that keeps it.

Theory of operation
-------------------

The store is the admission path's linearisation point: every operation is **one database
transaction**, and the decision is whatever that transaction committed. Time is always a
parameter (``now``, Unix seconds); nothing here reads a clock.

Decided batches. The manager decides admissions against a view of the ledger
(``read_for_decision``: the counters, the batch's IDs' reservations and recorded decisions,
a block of fresh fences) and has the store ``apply`` the operations the pure admission core
returned (:data:`~mesh.ledger.model.LedgerOp`). A fresh reservation takes its counters by a
*conditional increment*, one per counter with the batch's total::

    UPDATE capacity SET used = used + n
     WHERE pool_id = ? AND resource = ? AND used + n <= capacity

The check and the write are one statement on one row, so whoever commits first wins the last
unit; if a counter moved under the batch (another manager), the ``WHERE`` misses and the
batch fails as a whole (:class:`~mesh.errors.StaleView`), to be decided again on a fresh
view. Counters are taken in the one global order ``(pool_id, resource)``
(:func:`~mesh.ledger.model.normalize_items`). A resource without a row has capacity 0.
Releases and expiries give the items back in the same order, in the same transaction as the
state change, and only for rows whose state change actually happened — so exactly once.

State changes are compare-and-sets on ``(admission_id, state, fence)``: ``UPDATE reservation
SET state = ... WHERE admission_id = ? AND fence = ? AND state IN (...)``. If nothing matched,
a read says why (:class:`~mesh.ledger.model.Refused`). Expiry gives a new fence from the
global sequence, so an old fence never matches again.

Every state change also appends a row to ``ledger_log`` (append-only), from which
:func:`~mesh.ledger.model.replay` rebuilds each admission's state and fence.

Group commit. ``batch(work)`` runs every call ``work`` makes in **one** write transaction: the
manager decides all the admissions that queued up while the previous batch ran, then commits
once (one fsync, one lock hand-off, one round trip for BEGIN/COMMIT). Nothing is visible to
anyone else before the batch commits. If the transaction fails, every call in it failed; the
caller decides them again one by one (a PostgreSQL deadlock between two managers' batches is
such a failure, so a batch is never retried blindly). A caller that got a
:class:`~mesh.errors.StoreError` (outcome unknown, e.g. the connection broke at COMMIT)
decides the same admission IDs again: the view then shows what was kept.

Decisions. A decision record keeps the latest decision about an admission ID (its digest,
outcome and a JSON record: the reply and the eligibility behind it), written in the same
transaction as the reservation it describes, so ``mesh explain`` and idempotent replies
survive a restart and are shared by every manager on the ledger. The eligibility behind a
decision is the same for every request that got the same verdicts, so a record names it by
content address and each snapshot is kept once (``ON CONFLICT DO NOTHING``: two managers
writing the same one agree).

:class:`SqlLedger` holds all of this once, in parts with one job each: the rows
(:mod:`mesh.ledger.sql_rows`), the state changes of existing reservations
(:mod:`mesh.ledger.sql_transitions`), a decided batch's writes (:mod:`mesh.ledger.sql_apply`)
and the records besides reservations (:mod:`mesh.ledger.sql_records`). The two stores supply a
connection, a transaction, the fence sequence and their DDL.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, Self, TypeVar

from mesh.errors import LocalProtocolError
from mesh.ledger.model import (
    DecisionRow,
    LedgerEvent,
    LedgerLogRow,
    LedgerOp,
    LedgerView,
    Refused,
    Reservation,
    ReservationState,
    Usage,
    check_ttl,
    replay,
)
from mesh.ledger.sql_apply import BatchWriter
from mesh.ledger.sql_records import Records
from mesh.ledger.sql_rows import Db, ReservationRows, Tables
from mesh.ledger.sql_transitions import Transitions

T = TypeVar("T")
__all__ = ["DecisionRow", "LedgerStore", "SqlLedger", "Usage"]  # the first and last: model's


class LedgerStore(Protocol):
    """The reservation ledger. Synchronous; each call is one transaction (call it from a
    thread, e.g. ``asyncio.to_thread``). Expected refusals are values, failures raise
    :class:`~mesh.errors.StoreError`."""

    def set_capacity(self, pool_id: str, resource: str, capacity: int) -> None:
        """Create or change a counter's capacity; ``used`` is kept (it may exceed it)."""
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

    def batch(self, work: Callable[[], T]) -> T:
        """Run ``work``, and every ledger call it makes on this thread, in one transaction."""
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


class SqlLedger(abc.ABC):
    """:class:`LedgerStore` over SQL that SQLite (3.35+) and PostgreSQL both accept: the
    transactions and batches here, the SQL in the parts it is composed of."""

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
        self._rows = ReservationRows(tables)
        self._records = Records(tables)
        self._transitions = Transitions(
            tables, self._rows, self._next_fences,
            due_index_clause=self._due_index_clause, due_lock_clause=self._due_lock_clause,
        )  # fmt: skip
        self._writer = BatchWriter(
            tables, self._rows, self._records,
            release=self._release, activate=self._transitions.activate,
        )  # fmt: skip

    # ---- what a dialect provides ---------------------------------------------------------
    @abc.abstractmethod
    def _transaction(self, work: Callable[[Db], T], *, write: bool, retry: bool = True) -> T:
        """Run ``work`` in one transaction: commit on return, roll back and re-raise on any
        exception; database errors become :class:`StoreError`. With ``retry`` a dialect may
        run ``work`` again after a deadlock or serialization failure."""

    @abc.abstractmethod
    def _next_fences(self, db: Db, count: int) -> list[int]:
        """``count`` values of the global fence sequence, ascending."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def maintain(self) -> None:  # noqa: B027 - optional for a dialect
        """Nothing to do by default."""

    def _release(self, db: Db, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        """One release inside ``db``'s transaction (a dialect may do it its own way)."""
        return self._transitions.release(db, admission_id, fence, now)

    def _expire_due(self, db: Db, now: float) -> list[Reservation]:
        """The expiry sweep inside ``db``'s transaction (a dialect may do it its own way)."""
        return self._transitions.expire_due(db, now)

    # ---- transactions and batches ----------------------------------------------------------
    def _open_batch(self) -> Db | None:
        """The batch transaction, if this thread is running one."""
        if self._batch_db is not None and self._batch_thread == threading.get_ident():
            return self._batch_db
        return None

    def _write(self, work: Callable[[Db], T]) -> T:
        db = self._open_batch()
        if db is not None:
            return work(db)
        with self._lock:
            return self._transaction(work, write=True)

    def _read(self, work: Callable[[Db], T]) -> T:
        db = self._open_batch()
        if db is not None:
            return work(db)
        with self._lock:
            return self._transaction(work, write=False)

    def batch(self, work: Callable[[], T]) -> T:
        if self._open_batch() is not None:
            return work()  # already inside this thread's batch

        def run(db: Db) -> T:
            self._batch_db, self._batch_thread = db, threading.get_ident()
            try:
                return work()
            finally:
                self._batch_db = self._batch_thread = None

        with self._lock:
            return self._transaction(run, write=True, retry=False)

    # ---- the contract ----------------------------------------------------------------------
    def set_capacity(self, pool_id: str, resource: str, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise LocalProtocolError(f"capacity must be an int >= 0, got {capacity!r}")
        self._write(lambda db: self._writer.set_capacity(db, pool_id, resource, capacity))

    def activate(
        self, admission_id: str, fence: int, ttl_s: float, now: float
    ) -> Reservation | Refused:
        check_ttl(ttl_s, now)
        return self._write(
            lambda db: self._transitions.activate(db, admission_id, fence, now + ttl_s, now)
        )

    def release(self, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        return self._write(lambda db: self._release(db, admission_id, fence, now))

    def release_many(
        self, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        if len(releases) <= 1:  # a transaction of its own anyway
            return [self.release(a, f, now) for a, f in releases]
        return self._write(lambda db: self._transitions.release_many(db, releases, now))

    def expire_due(self, now: float) -> list[Reservation]:
        return self._write(lambda db: self._expire_due(db, now))

    def get(self, admission_id: str) -> Reservation | None:
        return self._read(lambda db: self._rows.select(db, admission_id))

    def active(self) -> list[Reservation]:
        return self._read(self._rows.holding)

    def save_descriptor(self, pool_id: str, epoch: int, body: str) -> bool:
        self._write(lambda db: self._records.save_descriptor(db, pool_id, epoch, body))
        return self._read(lambda db: self._records.descriptor_epoch(db, pool_id)) == epoch

    def descriptors(self, known: Mapping[str, int] | None = None) -> list[tuple[str, int, str]]:
        return self._read(lambda db: self._records.descriptors(db, known))

    def read_for_decision(self, admission_ids: Sequence[str], fences: int) -> LedgerView:
        ids = list(dict.fromkeys(admission_ids))

        def read(db: Db) -> LedgerView:
            reservations = self._rows.select_many(db, ids)
            counters = {
                (str(p), str(r)): (int(u), int(c))
                for p, r, u, c in db.execute(
                    f"SELECT pool_id, resource, used, capacity FROM {self._t.capacity}"
                )
            }
            return LedgerView(
                counters=counters,
                reservations=reservations,
                decisions=self._records.decisions(db, ids) if ids else {},
                fences=tuple(self._next_fences(db, fences)) if fences else (),
                epochs=self._records.epochs(db),
            )

        return self._write(read) if fences else self._read(read)

    def apply(self, ops: Sequence[LedgerOp]) -> None:
        if ops:
            self._write(lambda db: self._writer.apply(db, ops))

    def record_decision(
        self, admission_id: str, digest: str, outcome: str, at: float, record: str
    ) -> bool:
        row = (admission_id, digest, outcome, at, record)
        return self._write(lambda db: self._records.upsert_decisions(db, [row])) == 1

    def decision(self, admission_id: str) -> DecisionRow | None:
        return self.decisions([admission_id]).get(admission_id)

    def decisions(self, admission_ids: Sequence[str]) -> dict[str, DecisionRow]:
        return self._read(lambda db: self._records.decisions(db, admission_ids))

    def deferred_since(self, since: float) -> list[DecisionRow]:
        return self._read(lambda db: self._records.deferred_since(db, since))

    def save_eligibility(self, ref: str, body: str) -> None:
        self._write(lambda db: self._records.insert_snapshots(db, [(ref, body)]))

    def eligibility(self, ref: str) -> str | None:
        return self._read(lambda db: self._records.eligibility(db, ref))

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
