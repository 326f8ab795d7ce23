"""The state changes of reservations that exist: activate, release (one or many) and expire.

Each is a compare-and-set on ``(admission_id, state, fence)``; when nothing matched, a read
says why (:class:`~mesh.ledger.model.Refused`). Whatever ends a reservation gives its items
back in the same transaction, only for the rows whose state change happened — so exactly
once. Separate from the writes of fresh reservations (:mod:`mesh.ledger.sql_apply`), which
take counters instead of giving them back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mesh.errors import StoreError
from mesh.ledger.model import LedgerEvent, LedgerReason, Refused, Reservation, ReservationState
from mesh.ledger.sql_rows import (
    DUE_STATES_SQL,
    HOLDING_SQL,
    RES_COLUMNS,
    Db,
    ReservationRows,
    Tables,
    chunks,
)

# Logged under the store's name, where the ledger's other messages are.
log = logging.getLogger("mesh.ledger.store")


class Transitions:
    """The SQL of activate, release and the expiry sweep, one transaction's worth each.

    ``next_fences`` draws fresh fences (the dialect's sequence); ``due_index_clause`` and
    ``due_lock_clause`` are the dialect's additions to the sweep's read (``SqlLedger``)."""

    def __init__(
        self,
        tables: Tables,
        rows: ReservationRows,
        next_fences: Callable[[Db, int], list[int]],
        *,
        due_index_clause: str = "",
        due_lock_clause: str = "",
    ) -> None:
        self._t = tables
        self._rows = rows
        self._next_fences = next_fences
        self.due_sql = (
            f"SELECT admission_id FROM {tables.reservation}{due_index_clause}"
            f" WHERE state IN {DUE_STATES_SQL} AND expires_at <= ?"
            f" ORDER BY admission_id{due_lock_clause}"
        )
        """The expiry sweep's read: the holding reservations due by ``?``, in ID order."""

    def activate(
        self, db: Db, admission_id: str, fence: int, expires_at: float, now: float
    ) -> Reservation | Refused:
        rows = db.execute(
            f"UPDATE {self._t.reservation} SET state = 'ACTIVE', expires_at = ?, updated_at = ?"
            " WHERE admission_id = ? AND fence = ? AND state = 'PREPARING' AND expires_at > ?"
            f" RETURNING {RES_COLUMNS}",
            (expires_at, now, admission_id, fence, now),
        )
        if not rows:
            return self.why_not(db, admission_id, fence, now, "activate")
        (activated,) = self._rows.with_items(db, rows)
        self._rows.append_log(db, now, admission_id, fence, LedgerEvent.ACTIVATED)
        return activated

    def release(self, db: Db, admission_id: str, fence: int, now: float) -> Reservation | Refused:
        rows = db.execute(
            f"UPDATE {self._t.reservation} SET state = 'RELEASED', updated_at = ?"
            f" WHERE admission_id = ? AND fence = ? AND state IN {HOLDING_SQL}"
            f" RETURNING {RES_COLUMNS}",
            (now, admission_id, fence),
        )
        if not rows:
            return self.why_not(db, admission_id, fence, now, "release")
        (released,) = self._rows.with_items(db, rows)
        self.give_back(db, [released])
        self._rows.append_log(db, now, admission_id, fence, LedgerEvent.RELEASED)
        return released

    def release_many(
        self, db: Db, releases: Sequence[tuple[str, int]], now: float
    ) -> list[Reservation | Refused]:
        """Every release at once: one ``UPDATE … FROM (VALUES …)`` per 200 of them (the same
        compare-and-set on state and fence as ``release``), one give-back per counter for all
        of them together, one insert for their log. Each answers as ``release`` would have in
        the given order: the first of two equal releases releases, the second (and any that
        matched nothing) is told why not, read after the update."""
        rows = self._update_by_pairs(
            db,
            "state = 'RELEASED', updated_at = ?",
            list(dict.fromkeys(releases)),
            f"fence = v.column2 AND state IN {HOLDING_SQL}",
            (now,),
        )
        released = {(r.admission_id, r.fence): r for r in self._rows.with_items(db, rows)}
        self.give_back(db, released.values())
        answers: list[Reservation | None] = [released.pop(pair, None) for pair in releases]
        self._rows.append_logs(
            db, now, [(r.admission_id, r.fence) for r in answers if r is not None],
            LedgerEvent.RELEASED,
        )  # fmt: skip
        return [
            self.why_not(db, admission_id, fence, now, "release") if answer is None else answer
            for (admission_id, fence), answer in zip(releases, answers, strict=True)
        ]

    def expire_due(self, db: Db, now: float) -> list[Reservation]:
        due = db.execute(self.due_sql, (now,))
        # Each due row under a fence of its own, ascending in admission-ID order; rows a
        # concurrent release ended meanwhile are left out by the UPDATE's own condition.
        fences = self._next_fences(db, len(due)) if due else []
        rows = self._update_by_pairs(
            db,
            "state = 'EXPIRED', fence = v.column2, updated_at = ?",
            [(str(a), fence) for (a,), fence in zip(due, fences, strict=True)],
            f"state IN {HOLDING_SQL} AND expires_at <= ?",
            (now,),
            (now,),
        )
        expired = self._rows.with_items(db, rows)
        self.give_back(db, expired)
        self._rows.append_logs(
            db, now, [(r.admission_id, r.fence) for r in expired], LedgerEvent.EXPIRED
        )
        if expired:
            log.info("expired %d reservations", len(expired), extra={"now": now})
        return expired

    def give_back(self, db: Db, reservations: Iterable[Reservation]) -> None:
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
        for chunk in chunks(pairs, 200):
            rows += db.execute(
                f"UPDATE {self._t.reservation} SET {assignments}"
                f" FROM (VALUES {', '.join(['(?, ?)'] * len(chunk))}) AS v"
                f" WHERE admission_id = v.column1 AND {condition} RETURNING {RES_COLUMNS}",
                [*set_params, *(value for pair in chunk for value in pair), *condition_params],
            )
        return rows

    def why_not(self, db: Db, admission_id: str, fence: int, now: float, verb: str) -> Refused:
        """Why a compare-and-set on ``admission_id`` at ``fence`` matched nothing."""
        current = self._rows.select(db, admission_id)
        if current is None:
            return Refused(LedgerReason.NOT_FOUND, f"no reservation {admission_id!r}")
        if current.fence != fence:
            why = f"fence {fence} is stale: it is {current.state} at fence {current.fence}"
        elif verb == "activate" and current.state is ReservationState.PREPARING:
            why = f"it expired at {current.expires_at} (now {now})"
        else:
            why = f"it is already {current.state}"
        return Refused(LedgerReason.STALE_FENCE, f"cannot {verb} {admission_id!r}: {why}")
