"""A ledger written by the version that kept items in ``ledger_item`` opens and works.

Since reservations carry their items as JSON in their own row (``items``), a store of an
earlier version gains the column when opened; its old reservations — ``items`` NULL, items in
``ledger_item`` — are read, released and expired with their items as before, and counters
given back exactly. The earlier shape is made here from a current store by dropping the column
and writing one reservation the old way (the same rows the earlier version wrote).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from mesh.ledger import LedgerStore, SqliteLedger
from mesh.ledger.model import Item, Prepared, Refused, ReservationState
from mesh.ledger.sqlite import EARLIER_ID_TABLES

from .conftest import LedgerFactory
from .helpers import prepare
from .test_ledger_contract import prepared, reservation, used

NOW = 1_000.0
OLD_ITEMS = (
    Item("*", "tenant_tokens:acme", 300),
    Item("pool-a", "model_slots", 1),
    Item("pool-a", "tool:search", 2),
)


def _raw(
    factory: LedgerFactory, location: str, statements: list[tuple[str, tuple[Any, ...]]]
) -> list[list[tuple[Any, ...]]]:
    """Run SQL on the store's tables directly, as the earlier version's writes."""
    if factory.kind == "sqlite":
        conn = sqlite3.connect(location, isolation_level=None)
        try:
            rows = [conn.execute(sql, params).fetchall() for sql, params in statements]
        finally:
            conn.close()
        return rows
    assert factory.dsn is not None
    with psycopg.connect(factory.dsn, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{location}"')
        out = []
        for sql, params in statements:
            cursor = conn.execute(sql.replace("?", "%s"), params)
            out.append(cursor.fetchall() if cursor.description else [])
        return out


def _earlier_version_store(factory: LedgerFactory) -> str:
    """A store in the earlier shape: no ``items`` column, one ACTIVE reservation ``old-1``
    (fence 1) whose items are rows of ``ledger_item`` and whose counters are taken."""
    location = factory.fresh()
    store = factory.open(location)
    store.set_capacity("pool-a", "model_slots", 2)
    store.set_capacity("pool-a", "tool:search", 4)
    store.set_capacity("*", "tenant_tokens:acme", 1_000)
    store.close()
    statements: list[tuple[str, tuple[Any, ...]]] = [
        ("ALTER TABLE ledger_reservation DROP COLUMN items", ()),
        ("ALTER TABLE ledger_reservation DROP COLUMN epoch", ()),
        (
            "INSERT INTO ledger_reservation (admission_id, digest, pool_id, state, fence,"
            " expires_at, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            ("old-1", "sha256:old", "pool-a", "ACTIVE", 1, NOW + 60, NOW, NOW),
        ),
        *(
            (
                "INSERT INTO ledger_item (admission_id, pool_id, resource, amount)"
                " VALUES (?, ?, ?, ?)",
                ("old-1", *item),
            )
            for item in OLD_ITEMS
        ),
        *(
            (
                "UPDATE ledger_capacity SET used = used + ? WHERE pool_id = ? AND resource = ?",
                (item.amount, item.pool_id, item.resource),
            )
            for item in OLD_ITEMS
        ),
    ]
    if factory.kind == "sqlite":
        statements.append(("UPDATE ledger_fence SET last = 1", ()))
    else:
        statements.append(("SELECT setval('ledger_fence', 1)", ()))
    _raw(factory, location, statements)
    return location


def test_an_earlier_version_store_reads_and_releases_its_old_reservations(
    ledger_factory: LedgerFactory,
) -> None:
    store: LedgerStore = ledger_factory.open(_earlier_version_store(ledger_factory))

    old = store.get("old-1")
    assert old is not None and old.state is ReservationState.ACTIVE
    assert old.items == OLD_ITEMS
    assert old.descriptor_epoch is None  # not recorded then: reported as the pool's current
    assert [r.admission_id for r in store.active()] == ["old-1"]
    assert used(store, "pool-a", "tool:search") == 2

    released = reservation(store.release("old-1", old.fence, NOW + 1))
    assert released.state is ReservationState.RELEASED and released.items == OLD_ITEMS
    assert {key: use for key, (use, _) in store.usage().items()} == {
        ("*", "tenant_tokens:acme"): 0,
        ("pool-a", "model_slots"): 0,
        ("pool-a", "tool:search"): 0,
    }


def test_an_earlier_version_store_expires_old_reservations_and_writes_new_ones_in_the_row(
    ledger_factory: LedgerFactory,
) -> None:
    location = _earlier_version_store(ledger_factory)
    store = ledger_factory.open(location)

    new = prepared(
        prepare(
            store,
            "new-1",
            "sha256:new",
            [("pool-a", "model_slots", 1)],
            30.0,
            NOW,
            descriptor_epoch=2,
        )
    )
    assert store.get("new-1") == new and new.descriptor_epoch == 2
    assert new.fence > 1  # the old reservation's fence is not reused
    assert used(store, "pool-a", "model_slots") == 2

    expired = store.expire_due(NOW + 61)  # both are overdue by then
    assert {r.admission_id: r.items for r in expired} == {
        "old-1": OLD_ITEMS,
        "new-1": (Item("pool-a", "model_slots", 1),),
    }
    assert all(use == 0 for use, _ in store.usage().values())

    rows = _raw(
        ledger_factory,
        location,
        [
            ("SELECT items FROM ledger_reservation WHERE admission_id = ?", ("new-1",)),
            ("SELECT count(*) FROM ledger_item WHERE admission_id = ?", ("new-1",)),
        ],
    )
    assert rows == [[('[["pool-a","model_slots",1]]',)], [(0,)]]


def test_a_new_sqlite_file_has_the_items_column(tmp_path: Path) -> None:
    SqliteLedger(tmp_path / "new.sqlite3").close()
    conn = sqlite3.connect(tmp_path / "new.sqlite3")
    try:
        columns = conn.execute("PRAGMA table_info(ledger_reservation)").fetchall()
    finally:
        conn.close()
    assert "items" in {column[1] for column in columns}


def _without_rowid(path: Path) -> set[str]:
    """The names of the file's tables created ``WITHOUT ROWID``."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall()
    finally:
        conn.close()
    return {name for name, sql in rows if "WITHOUT ROWID" in sql.upper()}


def test_a_sqlite_file_with_the_earlier_without_rowid_layout_keeps_it_and_works(
    tmp_path: Path,
) -> None:
    path = tmp_path / "earlier.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(EARLIER_ID_TABLES)
    conn.close()

    with SqliteLedger(path) as store:
        store.set_capacity("pool-a", "model_slots", 2)
        first = prepared(
            prepare(store, "adm-1", "sha256:a", [("pool-a", "model_slots", 1)], 30, NOW)
        )
        assert store.record_decision("adm-1", "sha256:a", "admitted", NOW, "{}")
        assert not store.record_decision("adm-1", "sha256:other", "admitted", NOW, "{}")
        batch = store.batch(
            lambda: [
                prepare(store, "adm-2", "sha256:b", [("pool-a", "model_slots", 1)], 30, NOW),
                prepare(store, "adm-3", "sha256:c", [("pool-a", "model_slots", 1)], 30, NOW),
            ]
        )
        assert isinstance(batch[0], Prepared) and isinstance(batch[1], Refused)  # one slot left
        reservation(store.release("adm-1", first.fence, NOW + 1))
        assert used(store, "pool-a", "model_slots") == 1
        row = store.decision("adm-1")
        assert row is not None and row.digest == "sha256:a"
    assert {"ledger_reservation", "ledger_decision"} <= _without_rowid(path)


def test_a_new_sqlite_file_keeps_reservations_and_decisions_in_rowid_tables(
    tmp_path: Path,
) -> None:
    SqliteLedger(tmp_path / "new.sqlite3").close()
    without_rowid = _without_rowid(tmp_path / "new.sqlite3")
    assert "ledger_reservation" not in without_rowid and "ledger_decision" not in without_rowid
    assert "ledger_capacity" in without_rowid  # the small tables keyed by text stay as they were
