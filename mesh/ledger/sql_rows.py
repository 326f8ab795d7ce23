"""A reservation as a SQL row, and the statements every part of :class:`SqlLedger` shares.

The columns, the items kept as JSON in the row, reading reservations back (with the items of
rows written before that column existed), and appending to the ledger log. Both dialects'
SQL goes through :class:`Db`; the parts that change state (:mod:`mesh.ledger.sql_transitions`,
:mod:`mesh.ledger.sql_apply`) build on these reads and writes rather than repeat them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from mesh.errors import StoreError
from mesh.ledger.model import (
    HOLDING_STATES,
    TRANSITIONS,
    Item,
    LedgerEvent,
    Reservation,
    ReservationState,
)

T = TypeVar("T")

HOLDING_SQL = "(" + ", ".join(f"'{state}'" for state in sorted(HOLDING_STATES)) + ")"
"""The holding states as a SQL list, for ``state IN …``."""
DUE_STATES_SQL = "('PREPARING', 'ACTIVE')"
"""The holding states as the partial index ``ledger_reservation_due`` is defined in both
schemas, word for word: SQLite uses a partial index only for a WHERE term that matches its
definition (with the states in another order it does not, and INDEXED BY fails)."""
RES_COLUMNS = (
    "admission_id, digest, pool_id, state, fence, expires_at, created_at, updated_at, items, epoch"
)
"""A reservation's columns. ``items`` holds its items as compact JSON (:func:`items_json`),
in the row itself: one row per admission rather than one more per item, so an admission
dirties one page fewer. Rows written before that column existed have ``items`` NULL and
their items in the item table, which is read for those rows only."""


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


@functools.lru_cache(maxsize=1024)
def items_json(items: tuple[Item, ...]) -> str:
    """``[[pool_id, resource, amount], ...]``, in the items' (normalised) order."""
    return orjson.dumps([list(item) for item in items]).decode()


@functools.lru_cache(maxsize=1024)
def _items_from_json(text: str) -> tuple[Item, ...]:
    return tuple(Item(str(p), str(r), int(a)) for p, r, a in orjson.loads(text))


class ReservationRows:
    """Reads reservations back from their rows and writes rows and log entries in bulk."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables

    def select(self, db: Db, admission_id: str) -> Reservation | None:
        rows = db.execute(
            f"SELECT {RES_COLUMNS} FROM {self._t.reservation} WHERE admission_id = ?",
            (admission_id,),
        )
        found = self.with_items(db, rows)
        return found[0] if found else None

    def select_many(self, db: Db, ids: Sequence[str]) -> dict[str, Reservation]:
        """The reservations of those of ``ids`` that have one, by admission ID."""
        found: dict[str, Reservation] = {}
        for chunk in chunks(ids, 500):
            rows = db.execute(
                f"SELECT {RES_COLUMNS} FROM {self._t.reservation}"
                f" WHERE admission_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            found.update((r.admission_id, r) for r in self.with_items(db, rows))
        return found

    def holding(self, db: Db) -> list[Reservation]:
        """Every PREPARING or ACTIVE reservation, by fence."""
        sql = f"SELECT {RES_COLUMNS} FROM {self._t.reservation} WHERE state IN {HOLDING_SQL}"
        return self.with_items(db, db.execute(sql))

    def with_items(self, db: Db | None, rows: Sequence[Sequence[Any]]) -> list[Reservation]:
        """Reservations for ``rows`` (``RES_COLUMNS``), by fence, with their items (from the
        row; from the item table for rows written before the ``items`` column). ``db``: None
        when the rows come with their items resolved (as PostgreSQL's functions return them)."""
        if not rows:
            return []
        legacy = [str(row[0]) for row in rows if row[8] is None]
        if legacy and db is None:
            raise StoreError(f"reservations {legacy!r} came without their items")
        items: dict[str, list[Item]] = {i: [] for i in legacy}
        for chunk in chunks(legacy, 500):
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

    def insert(self, db: Db, table: str, columns: str, rows: Sequence[tuple[object, ...]]) -> None:
        """``rows`` into ``table``, 100 to a statement."""
        if not rows:
            return
        marks = "(" + ", ".join("?" * len(rows[0])) + ")"
        for chunk in chunks(rows, 100):
            db.execute(
                f"INSERT INTO {table} ({columns}) VALUES " + ", ".join([marks] * len(chunk)),
                flat(chunk),
            )

    def append_logs(
        self, db: Db, now: float, entries: Sequence[tuple[str, int]], event: LedgerEvent
    ) -> None:
        """One ``event`` for each ``(admission_id, fence)`` of ``entries``, in that order."""
        target = TRANSITIONS[event].target.value
        for chunk in chunks(entries, 100):
            db.execute(
                f"INSERT INTO {self._t.log} (at, admission_id, event, state, fence) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk)),
                [v for a, f in chunk for v in (now, a, event.value, target, f)],
            )

    def append_log(
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


_STATE_OF: dict[object, ReservationState] = {state.value: state for state in ReservationState}
"""A stored state's enum member by dict lookup (the enum's own call is Python code; an
unknown value still goes through it, and raises)."""


def _fence(reservation: Reservation) -> int:
    return reservation.fence


def flat(rows: Iterable[Sequence[object]]) -> list[object]:
    """The rows' values in one list, row after row: one statement's bind parameters."""
    return list(itertools.chain.from_iterable(rows))


def chunks(values: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``values`` in slices of at most ``size`` (bind-parameter limits)."""
    return (values[i : i + size] for i in range(0, len(values), size))
