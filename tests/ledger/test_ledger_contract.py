"""The ledger's behavioural contract, one suite run against SQLite and PostgreSQL.

After every step that can touch counters, ``assert_conserved`` checks the ledger's central
invariant: each counter's ``used`` equals the amounts held by PREPARING and ACTIVE
reservations — nothing leaks, nothing is given back twice.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from concurrent.futures import Future, ThreadPoolExecutor

import psycopg
import pytest

from mesh.errors import LocalProtocolError, StoreError
from mesh.ledger import (
    Item,
    LedgerReason,
    LedgerStore,
    Prepared,
    Refused,
    Reservation,
    ReservationState,
)
from mesh.ledger.model import LedgerView, Reserve
from mesh.ledger.sql_rows import Db
from mesh.ledger.store import SqlLedger

from .conftest import LedgerFactory
from .helpers import prepare

T0 = 1_000.0
TTL = 30.0
SLOT = ("pool-a", "model_slots", 1)
SANDBOX = ("pool-a", "sandboxes", 1)
SEARCH = ("pool-a", "tool:search", 1)


def tokens(n: int, tenant: str = "acme") -> tuple[str, str, int]:
    return ("*", f"tenant_tokens:{tenant}", n)


def assert_conserved(ledger: LedgerStore) -> None:
    held: dict[tuple[str, str], int] = {}
    for reservation in ledger.active():
        for pool_id, resource, amount in reservation.items:
            held[(pool_id, resource)] = held.get((pool_id, resource), 0) + amount
    used = {key: used for key, (used, _capacity) in ledger.usage().items() if used}
    assert used == held


def used(ledger: LedgerStore, pool_id: str, resource: str) -> int:
    return ledger.usage()[(pool_id, resource)][0]


def prepared(outcome: Prepared | Refused) -> Reservation:
    assert isinstance(outcome, Prepared), f"expected Prepared, got {outcome}"
    return outcome.reservation


def refused(outcome: object, reason: LedgerReason) -> Refused:
    assert isinstance(outcome, Refused), f"expected Refused({reason}), got {outcome}"
    assert outcome.reason == reason, outcome
    return outcome


def reservation(outcome: Reservation | Refused) -> Reservation:
    assert isinstance(outcome, Reservation), f"expected a Reservation, got {outcome}"
    return outcome


@pytest.fixture
def pool(ledger: LedgerStore) -> LedgerStore:
    """The ledger with pool-a's counters and tenant acme's budget."""
    ledger.set_capacity("pool-a", "model_slots", 2)
    ledger.set_capacity("pool-a", "sandboxes", 2)
    ledger.set_capacity("pool-a", "tool:search", 2)
    ledger.set_capacity("*", "tenant_tokens:acme", 1_000)
    return ledger


# ---- prepare --------------------------------------------------------------------------------
def test_a_prepared_reservation_holds_its_items_until_its_ttl(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, SANDBOX, tokens(100)], TTL, T0))

    assert held.state is ReservationState.PREPARING
    assert held.pool_id == "pool-a"
    assert held.items == (
        Item("*", "tenant_tokens:acme", 100),
        Item("pool-a", "model_slots", 1),
        Item("pool-a", "sandboxes", 1),
    )
    assert (held.created_at, held.expires_at) == (T0, T0 + TTL)
    assert pool.get("adm-1") == held
    assert used(pool, "*", "tenant_tokens:acme") == 100
    assert_conserved(pool)


def test_preparing_again_with_the_same_digest_replays_the_decision(pool: LedgerStore) -> None:
    first = prepared(prepare(pool, "adm-1", "d1", [SLOT, tokens(10)], TTL, T0))
    usage = pool.usage()

    again = prepare(pool, "adm-1", "d1", [SLOT, tokens(10)], TTL, T0 + 1)

    assert again == Prepared(first, replayed=True)
    assert pool.usage() == usage

    reservation(pool.activate("adm-1", first.fence, TTL, T0 + 2))
    reservation(pool.release("adm-1", first.fence, T0 + 3))
    replayed = prepared(prepare(pool, "adm-1", "d1", [SLOT, tokens(10)], TTL, T0 + 4))
    assert (replayed.state, replayed.fence) == (ReservationState.RELEASED, first.fence)
    assert used(pool, "pool-a", "model_slots") == 0
    assert_conserved(pool)


def test_a_reservation_keeps_the_descriptor_epoch_it_was_granted_under(
    pool: LedgerStore,
) -> None:
    first = pool.batch(
        lambda: prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0, descriptor_epoch=7))
    )
    assert first.descriptor_epoch == 7
    assert reservation_of(pool, "adm-1").descriptor_epoch == 7
    untold = prepared(prepare(pool, "adm-2", "d2", [SLOT], TTL, T0))
    assert (
        untold.descriptor_epoch is None and reservation_of(pool, "adm-2").descriptor_epoch is None
    )
    # Written as an operation of a decided batch, as the admission core does.
    fence = max(r.fence for r in pool.active()) + 100
    written = Reservation(
        "adm-3", "d3", "pool-a", ReservationState.ACTIVE, fence,
        (Item("pool-a", "sandboxes", 1),), T0 + TTL, T0, T0, 9,
    )  # fmt: skip
    pool.apply([Reserve(written)])
    assert pool.get("adm-3") == written
    assert [r.descriptor_epoch for r in pool.active()] == [7, None, 9]


def reservation_of(store: LedgerStore, admission_id: str) -> Reservation:
    found = store.get(admission_id)
    assert found is not None, admission_id
    return found


def test_the_same_admission_id_with_another_digest_is_a_conflict(pool: LedgerStore) -> None:
    first = prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0))
    usage = pool.usage()

    conflict = refused(prepare(pool, "adm-1", "d2", [SANDBOX], TTL, T0), LedgerReason.CONFLICT)

    assert "d1" in conflict.detail
    assert pool.usage() == usage
    assert pool.get("adm-1") == first


def test_a_request_takes_all_of_its_items_or_none(pool: LedgerStore) -> None:
    pool.set_capacity("pool-a", "tool:search", 0)
    before = pool.usage()

    short = refused(
        prepare(pool, "adm-1", "d1", [SLOT, SANDBOX, SEARCH], TTL, T0), LedgerReason.CAPACITY
    )

    assert "tool:search" in short.detail
    assert pool.usage() == before
    assert pool.get("adm-1") is None
    assert pool.active() == []

    pool.set_capacity("pool-a", "tool:search", 1)
    prepared(prepare(pool, "adm-1", "d1", [SLOT, SANDBOX, SEARCH], TTL, T0))
    assert_conserved(pool)


def test_a_resource_without_capacity_counts_as_zero(pool: LedgerStore) -> None:
    outcome = prepare(pool, "adm-1", "d1", [SLOT, ("pool-a", "tool:unknown", 1)], TTL, T0)

    assert "no capacity" in refused(outcome, LedgerReason.CAPACITY).detail
    assert_conserved(pool)


def test_a_short_tenant_budget_is_tenant_budget_and_a_short_counter_capacity(
    pool: LedgerStore,
) -> None:
    refused(
        prepare(pool, "adm-1", "d1", [SLOT, tokens(1_001)], TTL, T0), LedgerReason.TENANT_BUDGET
    )
    refused(
        prepare(pool, "adm-2", "d1", [("pool-a", "model_slots", 3), tokens(1)], TTL, T0),
        LedgerReason.CAPACITY,
    )
    refused(prepare(pool, "adm-3", "d1", [tokens(1, "other")], TTL, T0), LedgerReason.TENANT_BUDGET)
    assert pool.active() == []
    assert_conserved(pool)


def test_the_last_unit_goes_to_exactly_one_admission(pool: LedgerStore) -> None:
    prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0))
    prepared(prepare(pool, "adm-2", "d1", [SLOT], TTL, T0))

    refused(prepare(pool, "adm-3", "d1", [SLOT], TTL, T0), LedgerReason.CAPACITY)
    assert pool.usage()[("pool-a", "model_slots")] == (2, 2)
    assert_conserved(pool)


def test_duplicate_items_are_summed(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, SLOT], TTL, T0))

    assert held.items == (Item("pool-a", "model_slots", 2),)
    assert used(pool, "pool-a", "model_slots") == 2


def test_lowering_capacity_below_use_admits_nothing_new_until_releases(
    pool: LedgerStore,
) -> None:
    first = prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0))
    second = prepared(prepare(pool, "adm-2", "d1", [SLOT], TTL, T0))

    pool.set_capacity("pool-a", "model_slots", 1)
    assert pool.usage()[("pool-a", "model_slots")] == (2, 1)
    refused(prepare(pool, "adm-3", "d1", [SLOT], TTL, T0), LedgerReason.CAPACITY)

    reservation(pool.release("adm-1", first.fence, T0))
    refused(prepare(pool, "adm-3", "d1", [SLOT], TTL, T0), LedgerReason.CAPACITY)
    reservation(pool.release("adm-2", second.fence, T0))
    prepared(prepare(pool, "adm-3", "d1", [SLOT], TTL, T0))
    assert_conserved(pool)


def test_misuse_raises_instead_of_refusing(pool: LedgerStore) -> None:
    with pytest.raises(LocalProtocolError):
        prepare(pool, "adm-1", "d1", [("pool-a", "model_slots", 0)], TTL, T0)
    with pytest.raises(LocalProtocolError):
        prepare(pool, "adm-1", "d1", [SLOT], 0, T0)
    with pytest.raises(LocalProtocolError):
        pool.set_capacity("pool-a", "model_slots", -1)
    assert pool.get("adm-1") is None


# ---- activate ---------------------------------------------------------------------------------
def test_activate_is_a_compare_and_set_on_the_fence(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, tokens(5)], TTL, T0))

    refused(pool.activate("adm-1", held.fence + 1000, TTL, T0 + 1), LedgerReason.STALE_FENCE)
    refused(pool.activate("nobody", held.fence, TTL, T0 + 1), LedgerReason.NOT_FOUND)
    assert pool.get("adm-1") == held

    active = reservation(pool.activate("adm-1", held.fence, 60.0, T0 + 1))
    assert (active.state, active.fence, active.expires_at) == (
        ReservationState.ACTIVE,
        held.fence,
        T0 + 1 + 60.0,
    )
    again = refused(pool.activate("adm-1", held.fence, TTL, T0 + 2), LedgerReason.STALE_FENCE)
    assert "ACTIVE" in again.detail
    assert pool.get("adm-1") == active
    assert_conserved(pool)


def test_a_preparing_reservation_past_its_ttl_cannot_be_activated(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0))

    late = refused(pool.activate("adm-1", held.fence, TTL, T0 + TTL), LedgerReason.STALE_FENCE)

    assert "expired" in late.detail
    assert pool.get("adm-1") == held  # the sweep, not activate, takes it back
    assert_conserved(pool)


# ---- release, cancellation, expiry ------------------------------------------------------------
def test_release_gives_the_counters_back_exactly_once(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, SANDBOX, tokens(50)], TTL, T0))
    assert_conserved(pool)
    reservation(pool.activate("adm-1", held.fence, TTL, T0 + 1))
    assert_conserved(pool)

    refused(pool.release("adm-1", held.fence - 1, T0 + 2), LedgerReason.STALE_FENCE)
    refused(pool.release("nobody", held.fence, T0 + 2), LedgerReason.NOT_FOUND)
    assert used(pool, "*", "tenant_tokens:acme") == 50
    assert_conserved(pool)

    released = reservation(pool.release("adm-1", held.fence, T0 + 2))
    assert released.state is ReservationState.RELEASED
    assert_conserved(pool)

    twice = refused(pool.release("adm-1", held.fence, T0 + 3), LedgerReason.STALE_FENCE)
    assert "RELEASED" in twice.detail
    assert used(pool, "*", "tenant_tokens:acme") == 0
    assert used(pool, "pool-a", "model_slots") == 0
    assert_conserved(pool)


def test_releases_together_answer_as_each_release_would_and_give_back_exactly_once(
    pool: LedgerStore,
) -> None:
    one = prepared(prepare(pool, "adm-1", "d1", [SLOT, tokens(10)], TTL, T0))
    two = prepared(prepare(pool, "adm-2", "d1", [SANDBOX, tokens(20)], TTL, T0))
    three = prepared(prepare(pool, "adm-3", "d1", [SLOT, tokens(30)], TTL, T0))
    reservation(pool.activate("adm-2", two.fence, TTL, T0 + 1))

    outcomes = pool.release_many(
        [
            ("adm-1", one.fence),
            ("adm-2", two.fence),
            ("adm-3", three.fence - 1),  # a stale holder
            ("nobody", one.fence),
            ("adm-1", one.fence),  # the same release twice in one batch
        ],
        T0 + 2,
    )

    assert reservation(outcomes[0]).state is ReservationState.RELEASED
    assert reservation(outcomes[1]).state is ReservationState.RELEASED
    refused(outcomes[2], LedgerReason.STALE_FENCE)
    refused(outcomes[3], LedgerReason.NOT_FOUND)
    assert "RELEASED" in refused(outcomes[4], LedgerReason.STALE_FENCE).detail
    assert used(pool, "*", "tenant_tokens:acme") == 30  # only adm-3 still holds
    assert used(pool, "pool-a", "model_slots") == 1
    assert used(pool, "pool-a", "sandboxes") == 0
    assert_conserved(pool)
    assert pool.release_many([], T0 + 3) == []


def test_cancellation_before_active_releases_everything(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, SANDBOX, SEARCH, tokens(7)], TTL, T0))

    cancelled = reservation(pool.release("adm-1", held.fence, T0 + 1))

    assert cancelled.state is ReservationState.RELEASED
    assert all(used == 0 for used, _ in pool.usage().values())
    refused(pool.activate("adm-1", held.fence, TTL, T0 + 2), LedgerReason.STALE_FENCE)
    assert pool.active() == []
    assert_conserved(pool)


def test_ttl_cleanup_racing_a_stale_holder_gives_back_only_once(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT, tokens(20)], TTL, T0))
    active = reservation(pool.activate("adm-1", held.fence, TTL, T0 + 1))

    assert pool.expire_due(active.expires_at - 0.001) == []
    (expired,) = pool.expire_due(active.expires_at)

    assert expired.state is ReservationState.EXPIRED
    assert expired.fence > held.fence
    assert used(pool, "*", "tenant_tokens:acme") == 0
    # The holder wakes up late with its old fence: nothing it does counts.
    refused(pool.release("adm-1", held.fence, active.expires_at + 1), LedgerReason.STALE_FENCE)
    refused(
        pool.activate("adm-1", held.fence, TTL, active.expires_at + 1), LedgerReason.STALE_FENCE
    )
    # Not even with the sweep's fence: EXPIRED is final.
    refused(pool.release("adm-1", expired.fence, active.expires_at + 1), LedgerReason.STALE_FENCE)
    assert pool.expire_due(active.expires_at + 100) == []
    assert used(pool, "*", "tenant_tokens:acme") == 0
    assert used(pool, "pool-a", "model_slots") == 0
    assert pool.get("adm-1") == expired
    assert_conserved(pool)


def test_a_release_before_the_sweep_leaves_the_sweep_nothing(pool: LedgerStore) -> None:
    held = prepared(prepare(pool, "adm-1", "d1", [SLOT], TTL, T0))
    # Past its TTL but not yet swept: the holder may still give it back.
    reservation(pool.release("adm-1", held.fence, T0 + TTL + 5))

    assert pool.expire_due(T0 + TTL + 10) == []
    assert used(pool, "pool-a", "model_slots") == 0
    assert_conserved(pool)


def test_the_sweep_expires_exactly_the_due_reservations(pool: LedgerStore) -> None:
    early = prepared(prepare(pool, "adm-early", "d", [SLOT], 10, T0))
    late = prepared(prepare(pool, "adm-late", "d", [SLOT], 100, T0))
    active = reservation(pool.activate("adm-late", late.fence, 5, T0 + 1))

    swept = pool.expire_due(T0 + 10)

    assert [r.admission_id for r in swept] == ["adm-early", "adm-late"]
    assert all(r.state is ReservationState.EXPIRED for r in swept)
    assert swept[0].fence > max(early.fence, active.fence)
    assert swept[1].fence > swept[0].fence
    assert pool.active() == []
    assert_conserved(pool)


# ---- fences, recovery, the log ---------------------------------------------------------------
def test_fences_strictly_increase(pool: LedgerStore) -> None:
    seen: list[int] = []
    for i in range(5):
        seen.append(prepared(prepare(pool, f"adm-{i}", "d", [tokens(1)], 1, T0 + i)).fence)
        for expired in pool.expire_due(T0 + i):
            seen.append(expired.fence)
        refused(prepare(pool, f"big-{i}", "d", [tokens(10_000)], 1, T0), LedgerReason.TENANT_BUDGET)

    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen) == 9


def test_a_reopened_ledger_recovers_every_holding_reservation(
    ledger_factory: LedgerFactory, pool: LedgerStore
) -> None:
    a = prepared(prepare(pool, "adm-a", "d", [SLOT, tokens(3)], TTL, T0))
    b = prepared(prepare(pool, "adm-b", "d", [SANDBOX, SEARCH], TTL, T0))
    c = prepared(prepare(pool, "adm-c", "d", [SANDBOX], TTL, T0))
    d = prepared(prepare(pool, "adm-d", "d", [SLOT], 1, T0))
    a_active = reservation(pool.activate("adm-a", a.fence, 300, T0 + 1))
    reservation(pool.release("adm-c", c.fence, T0 + 1))
    pool.expire_due(T0 + 1)  # adm-d
    holding, usage = pool.active(), pool.usage()
    pool.close()

    reopened = ledger_factory.open()

    assert reopened.active() == holding == [a_active, b]
    assert reopened.usage() == usage
    swept = reopened.get("adm-d")
    assert swept is not None
    assert (swept.state, swept.fence > d.fence) == (ReservationState.EXPIRED, True)
    newest = max(r.fence for r in (a, b, c, swept))
    assert prepared(prepare(reopened, "adm-e", "d", [SLOT], TTL, T0 + 2)).fence > newest
    reservation(reopened.release("adm-a", a.fence, T0 + 3))
    assert_conserved(reopened)


def test_the_log_replays_to_the_live_state(pool: LedgerStore) -> None:
    a = prepared(prepare(pool, "adm-a", "d", [SLOT], TTL, T0))
    b = prepared(prepare(pool, "adm-b", "d", [SLOT], TTL, T0))
    reservation(pool.activate("adm-a", a.fence, TTL, T0))
    reservation(pool.release("adm-b", b.fence, T0))
    prepared(prepare(pool, "adm-c", "d", [SANDBOX], 1, T0))
    pool.expire_due(T0 + 5)

    live = {
        r.admission_id: (r.state, r.fence)
        for r in (pool.get(i) for i in ("adm-a", "adm-b", "adm-c"))
        if r is not None
    }
    assert pool.replay_log() == live
    assert [e.event for e in pool.log()] == [
        "prepared",
        "prepared",
        "activated",
        "released",
        "prepared",
        "expired",
    ]


def test_the_log_is_append_only(ledger_factory: LedgerFactory, pool: LedgerStore) -> None:
    prepared(prepare(pool, "adm-1", "d", [SLOT], TTL, T0))

    if ledger_factory.kind == "sqlite":
        with contextlib.closing(sqlite3.connect(ledger_factory.main)) as db:
            for statement in ("UPDATE ledger_log SET fence = 0", "DELETE FROM ledger_log"):
                with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                    db.execute(statement)
    else:
        assert ledger_factory.dsn is not None
        table = f'"{ledger_factory.main}".ledger_log'
        with psycopg.connect(ledger_factory.dsn, autocommit=True) as conn:
            for statement in (f"UPDATE {table} SET fence = 0", f"TRUNCATE {table}"):
                with pytest.raises(psycopg.DatabaseError, match="append-only"):
                    conn.execute(statement)
    assert len(pool.log()) == 1


def test_admission_ids_are_opaque_strings_through_reads_and_releases(pool: LedgerStore) -> None:
    # Any 1 to 128 characters (the wire contract's Identifier): quotes, backslashes, commas and
    # braces travel as they are (PostgreSQL's statements take them as array literals).
    ids = ['a"b', "c\\d", "e,f", "{g}", " h ", "NULL", "ü"]
    held = {i: prepared(prepare(pool, i, "d", [tokens(1)], TTL, T0)) for i in ids}

    def view() -> LedgerView:
        return pool.read_for_decision([*ids, "absent"], fences=0)

    assert set(pool.batch(view).reservations) == set(ids)
    outcomes = pool.release_many([(i, held[i].fence) for i in ids], T0 + 1)

    assert [reservation(o).admission_id for o in outcomes] == ids
    assert used(pool, "*", "tenant_tokens:acme") == 0
    assert_conserved(pool)


def test_giving_back_more_than_a_counter_holds_fails_and_keeps_nothing(
    ledger_factory: LedgerFactory, pool: LedgerStore
) -> None:
    # Counters and reservations disagree only if someone wrote the tables by hand: a
    # release or an expiry that would take a counter below zero fails whole.
    held = prepared(prepare(pool, "adm-1", "d", [SLOT, SANDBOX], TTL, T0))
    if ledger_factory.kind == "sqlite":
        with contextlib.closing(sqlite3.connect(ledger_factory.main)) as db, db:
            db.execute("UPDATE ledger_capacity SET used = 0 WHERE resource = 'sandboxes'")
    else:
        assert ledger_factory.dsn is not None
        table = f'"{ledger_factory.main}".ledger_capacity'
        with psycopg.connect(ledger_factory.dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {table} SET used = 0 WHERE resource = 'sandboxes'")

    with pytest.raises(StoreError, match="holds less"):
        pool.release("adm-1", held.fence, T0 + 1)
    with pytest.raises(StoreError, match="holds less"):
        pool.expire_due(T0 + TTL + 1)

    assert pool.get("adm-1") == held  # neither ended it
    assert (used(pool, "pool-a", "model_slots"), used(pool, "pool-a", "sandboxes")) == (1, 0)


def test_threads_sharing_one_store_never_overbook(pool: LedgerStore) -> None:
    # The manager calls the store through asyncio.to_thread: calls may overlap.
    pool.set_capacity("pool-a", "model_slots", 25)

    def admit(n: int) -> bool:
        outcome = prepare(pool, f"adm-{n}", "d", [SLOT], TTL, T0)
        if isinstance(outcome, Refused):
            return False
        return isinstance(
            pool.activate(f"adm-{n}", outcome.reservation.fence, TTL, T0), Reservation
        )

    with ThreadPoolExecutor(max_workers=8) as threads:
        admitted = sum(threads.map(admit, range(100)))

    assert admitted == 25
    assert pool.usage()[("pool-a", "model_slots")] == (25, 25)
    assert_conserved(pool)


# ---- prepare-and-activate, group commit, decision records -------------------------------------
def test_prepare_with_activate_ttl_goes_straight_to_active_and_logs_both_steps(
    pool: LedgerStore,
) -> None:
    held = prepared(prepare(pool, "adm-1", "d", [SLOT, tokens(5)], TTL, T0, activate_ttl_s=90))

    assert (held.state, held.expires_at) == (ReservationState.ACTIVE, T0 + 90)
    assert pool.get("adm-1") == held
    assert [(e.event, e.state) for e in pool.log()] == [
        ("prepared", ReservationState.PREPARING),
        ("activated", ReservationState.ACTIVE),
    ]
    assert pool.replay_log() == {"adm-1": (ReservationState.ACTIVE, held.fence)}
    replayed = prepare(pool, "adm-1", "d", [SLOT, tokens(5)], TTL, T0 + 1, activate_ttl_s=90)
    assert isinstance(replayed, Prepared) and replayed.replayed and replayed.reservation == held
    assert used(pool, "pool-a", "model_slots") == 1
    assert_conserved(pool)


def test_a_batch_commits_every_call_in_it_at_once(pool: LedgerStore) -> None:
    def work() -> list[Reservation]:
        first = prepared(prepare(pool, "adm-1", "d", [SLOT], TTL, T0, activate_ttl_s=TTL))
        second = prepared(prepare(pool, "adm-2", "d", [SLOT], TTL, T0))
        assert pool.get("adm-1") == first  # the batch reads its own writes
        return [first, reservation(pool.activate("adm-2", second.fence, TTL, T0))]

    first, second = pool.batch(work)

    assert {r.state for r in (first, second)} == {ReservationState.ACTIVE}
    assert [r.admission_id for r in pool.active()] == ["adm-1", "adm-2"]
    assert used(pool, "pool-a", "model_slots") == 2
    assert_conserved(pool)


def test_a_batch_replays_known_ids_and_reads_its_own_writes(pool: LedgerStore) -> None:
    before = prepared(prepare(pool, "adm-1", "d", [SLOT], TTL, T0, activate_ttl_s=TTL))
    assert pool.record_decision("adm-1", "d", "admitted", T0, '{"n": 1}')

    def work() -> list[object]:
        return [
            prepare(pool, "adm-1", "d", [SLOT], TTL, T0 + 1, activate_ttl_s=TTL),  # replayed
            prepare(pool, "adm-1", "other", [SLOT], TTL, T0 + 1),  # conflict
            prepare(pool, "adm-2", "d", [SLOT, tokens(10)], TTL, T0 + 1, activate_ttl_s=TTL),
            prepare(pool, "adm-2", "d", [SLOT, tokens(10)], TTL, T0 + 1),  # its own, replayed
            prepare(pool, "adm-9", "d", [SLOT], TTL, T0 + 1),  # no slot left
            pool.record_decision("adm-1", "other", "rejected", T0 + 1, "{}"),  # not kept
            pool.record_decision("adm-2", "d", "admitted", T0 + 1, '{"n": 2}'),
            pool.decision("adm-2"),  # recorded in this batch, read back inside it
            pool.usage()[("pool-a", "model_slots")],
            pool.decision("adm-2"),  # still the batch's own
            pool.record_decision("adm-2", "other", "rejected", T0 + 2, "{}"),  # not kept
        ]

    again, conflict, fresh, own, none_left, kept1, kept2, row, slots, row2, kept3 = pool.batch(work)

    assert isinstance(again, Prepared) and again.replayed and again.reservation == before
    refused(conflict, LedgerReason.CONFLICT)
    adm2 = prepared(fresh)
    assert adm2.state is ReservationState.ACTIVE and adm2.fence > before.fence
    assert isinstance(own, Prepared) and own.replayed and own.reservation == adm2
    refused(none_left, LedgerReason.CAPACITY)
    assert (kept1, kept2) == (False, True)
    assert row is not None and (row.digest, row.record) == ("d", '{"n": 2}')
    assert row2 == row and kept3 is False
    assert slots == (2, 2)
    assert pool.get("adm-2") == adm2 and pool.get("adm-9") is None
    stored = pool.decision("adm-1")
    assert stored is not None and stored.record == '{"n": 1}'
    assert pool.replay_log() == {
        "adm-1": (ReservationState.ACTIVE, before.fence),
        "adm-2": (ReservationState.ACTIVE, adm2.fence),
    }
    assert used(pool, "*", "tenant_tokens:acme") == 10
    assert_conserved(pool)


def test_a_refusal_inside_a_batch_rolls_back_only_its_own_call(pool: LedgerStore) -> None:
    def work() -> list[Prepared | Refused]:
        return [
            prepare(pool, "adm-1", "d", [SLOT], TTL, T0),
            # takes the second slot, then misses on budget: only this call is undone
            prepare(pool, "adm-2", "d", [SLOT, tokens(5_000)], TTL, T0),
            prepare(pool, "adm-3", "d", [SLOT, tokens(10)], TTL, T0),
        ]

    one, two, three = pool.batch(work)

    prepared(one)
    refused(two, LedgerReason.TENANT_BUDGET)
    prepared(three)
    assert pool.get("adm-2") is None
    assert used(pool, "pool-a", "model_slots") == 2
    assert used(pool, "*", "tenant_tokens:acme") == 10
    assert_conserved(pool)


def test_a_batch_that_fails_keeps_nothing(pool: LedgerStore) -> None:
    class Boom(Exception):
        pass

    def work() -> None:
        prepared(prepare(pool, "adm-1", "d", [SLOT, tokens(10)], TTL, T0, activate_ttl_s=TTL))
        assert pool.record_decision("adm-1", "d", "admitted", T0, "{}")
        raise Boom

    with pytest.raises(Boom):
        pool.batch(work)

    assert pool.get("adm-1") is None and pool.decision("adm-1") is None
    assert pool.log() == []
    assert used(pool, "pool-a", "model_slots") == 0
    assert_conserved(pool)
    prepared(prepare(pool, "adm-1", "d", [SLOT], TTL, T0))  # the store is usable afterwards


def test_other_threads_wait_for_a_batch_and_then_see_all_of_it(pool: LedgerStore) -> None:
    with ThreadPoolExecutor(max_workers=1) as reader:

        def work() -> Future[list[Reservation]]:
            prepared(prepare(pool, "adm-1", "d", [SLOT], TTL, T0))
            waiting = reader.submit(pool.active)
            time.sleep(0.2)
            assert not waiting.done(), "another thread read the ledger in the middle of a batch"
            prepared(prepare(pool, "adm-2", "d", [SLOT], TTL, T0))
            return waiting

        waiting = pool.batch(work)
        assert [r.admission_id for r in waiting.result(timeout=10)] == ["adm-1", "adm-2"]


def test_decisions_are_kept_per_admission_and_never_overwritten_by_another_digest(
    pool: LedgerStore,
) -> None:
    assert pool.decision("adm-1") is None
    assert pool.record_decision("adm-1", "d1", "deferred", T0, '{"n": 1}')
    assert pool.record_decision("adm-1", "d1", "admitted", T0 + 1, '{"n": 2}')
    assert not pool.record_decision("adm-1", "d2", "rejected", T0 + 2, '{"n": 3}')

    row = pool.decision("adm-1")
    assert row is not None
    assert (row.digest, row.outcome, row.decided_at, row.record) == (
        "d1",
        "admitted",
        T0 + 1,
        '{"n": 2}',
    )


def test_decisions_are_read_many_at_once_as_one_by_one(pool: LedgerStore) -> None:
    assert pool.record_decision("adm-1", "d1", "admitted", T0, '{"n": 1}')
    assert pool.record_decision("adm-2", "d2", "deferred", T0, '{"n": 2}')

    rows = pool.decisions(["adm-1", "adm-2", "adm-none"])

    assert rows == {"adm-1": pool.decision("adm-1"), "adm-2": pool.decision("adm-2")}
    assert pool.decisions([]) == {}


def test_a_batchs_counters_are_taken_together_or_not_at_all(pool: LedgerStore) -> None:
    # What a decided batch's writes do first (SQLite's way; PostgreSQL's ledger_move does the
    # same in one call): take the batch's totals, every one or (a counter would pass its
    # capacity) none — the batch then fails and rolls back.
    assert isinstance(pool, SqlLedger)
    keys = [("*", "tenant_tokens:acme"), ("pool-a", "model_slots")]
    writer = pool._writer

    fits = [(keys[0], 400), (keys[1], 2)]
    assert pool._transaction(lambda db: writer.increment_all(db, fits), write=True)
    assert (used(pool, "*", "tenant_tokens:acme"), used(pool, "pool-a", "model_slots")) == (400, 2)

    def take_or_fail(db: Db) -> None:  # as a batch's flush: a miss fails the whole transaction
        if not writer.increment_all(db, [(keys[0], 100), (keys[1], 1)]):  # the slots are taken
            raise StoreError("a counter would pass its capacity")

    with pytest.raises(StoreError):
        pool._transaction(take_or_fail, write=True)
    assert (used(pool, "*", "tenant_tokens:acme"), used(pool, "pool-a", "model_slots")) == (400, 2)


def test_an_eligibility_snapshot_is_kept_once_under_its_ref(pool: LedgerStore) -> None:
    assert pool.eligibility("sha256:a") is None
    pool.save_eligibility("sha256:a", '{"pools": []}')
    pool.save_eligibility("sha256:a", '{"pools": []}')  # again: nothing changes, no error

    assert pool.eligibility("sha256:a") == '{"pools": []}'
    assert pool.eligibility("sha256:b") is None


def test_a_batch_keeps_its_snapshots_with_its_decisions_or_neither(pool: LedgerStore) -> None:
    def work(fail: bool) -> None:
        pool.save_eligibility("sha256:s", "{}")
        assert pool.eligibility("sha256:s") == "{}"  # the batch reads its own write
        assert pool.record_decision("adm-1", "d", "admitted", T0, '{"ref": "sha256:s"}')
        if fail:
            raise RuntimeError("the batch fails")

    with pytest.raises(RuntimeError):
        pool.batch(lambda: work(fail=True))
    assert pool.eligibility("sha256:s") is None and pool.decision("adm-1") is None

    pool.batch(lambda: work(fail=False))
    assert pool.eligibility("sha256:s") == "{}" and pool.decision("adm-1") is not None


def test_maintain_can_run_while_decisions_go_on(pool: LedgerStore) -> None:
    for n in range(50):
        prepared(prepare(pool, f"adm-{n}", "d", [tokens(1)], TTL, T0, activate_ttl_s=TTL))
    with ThreadPoolExecutor(max_workers=1) as other:
        checkpoint = other.submit(pool.maintain)
        prepared(prepare(pool, "adm-last", "d", [tokens(1)], TTL, T0))
        checkpoint.result()
    assert used(pool, "*", "tenant_tokens:acme") == 51
    assert_conserved(pool)


# ---- descriptors ------------------------------------------------------------------------------
def test_a_descriptor_is_kept_only_for_a_newer_epoch(ledger: LedgerStore) -> None:
    assert ledger.save_descriptor("pool-a", 2, '{"epoch": 2}')
    assert not ledger.save_descriptor("pool-a", 1, '{"epoch": 1}')  # older: the stored stays
    assert ledger.save_descriptor("pool-b", 1, '{"b": 1}')

    assert ledger.descriptors() == [("pool-a", 2, '{"epoch": 2}'), ("pool-b", 1, '{"b": 1}')]


def test_descriptors_newer_than_the_callers_are_all_it_reads_back(ledger: LedgerStore) -> None:
    for pool_id, epoch in (("pool-a", 2), ("pool-b", 1), ("pool-c", 3)):
        ledger.save_descriptor(pool_id, epoch, f'{{"{pool_id}": {epoch}}}')

    # pool-a is held at its epoch, pool-b at an older one, pool-c not at all.
    assert ledger.descriptors(known={"pool-a": 2, "pool-b": 0}) == [
        ("pool-b", 1, '{"pool-b": 1}'),
        ("pool-c", 3, '{"pool-c": 3}'),
    ]
    assert ledger.descriptors(known={"pool-a": 2, "pool-b": 1, "pool-c": 3}) == []


def test_the_recent_deferrals_are_read_back_oldest_first(pool: LedgerStore) -> None:
    """What a restarted manager rebuilds its admission lines from: the decisions still
    recorded as deferrals, made at ``since`` or later — not one since admitted."""
    pool.record_decision("adm-old", "d", "deferred", T0, '{"n": 0}')
    pool.record_decision("adm-2", "d", "deferred", T0 + 20, '{"n": 2}')
    pool.record_decision("adm-1", "d", "deferred", T0 + 10, '{"n": 1}')
    pool.record_decision("adm-3", "d", "deferred", T0 + 11, "{}")
    pool.record_decision("adm-3", "d", "admitted", T0 + 12, "{}")  # no longer waiting
    pool.record_decision("adm-4", "d", "rejected", T0 + 13, "{}")

    rows = pool.deferred_since(T0 + 5)

    assert [(r.admission_id, r.decided_at, r.record) for r in rows] == [
        ("adm-1", T0 + 10, '{"n": 1}'),
        ("adm-2", T0 + 20, '{"n": 2}'),
    ]
