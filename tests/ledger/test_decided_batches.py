"""A decided batch — read the view, decide, apply — as the admitter runs it, on both stores.

PostgreSQL reads the view with one statement outside a transaction and sends the batch's
writes as one ``ledger_apply`` call when the batch ends (its commit); a call after the
``apply`` begins a transaction instead. These tests hold both stores to the same outcome:
what is kept, what is refused, and that a batch that fails keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mesh.errors import LocalProtocolError, StaleView, StoreError
from mesh.ledger import Item, LedgerStore, Reservation, ReservationState
from mesh.ledger.model import DecisionRow, RecordDecision, Reserve, SaveEligibility, SetCapacity
from mesh.ledger.postgres import PostgresLedger

from .conftest import LedgerFactory
from .helpers import prepare
from .test_ledger_contract import T0, TTL, assert_conserved, used

SLOT = Item("pool-a", "model_slots", 1)


@pytest.fixture
def pool(ledger: LedgerStore) -> LedgerStore:
    ledger.set_capacity("pool-a", "model_slots", 2)
    return ledger


def grant(admission_id: str, fence: int) -> Reservation:
    return Reservation(
        admission_id, f"d-{admission_id}", "pool-a", ReservationState.ACTIVE, fence,
        (SLOT,), T0 + TTL, T0, T0, 3,
    )  # fmt: skip


def decided(admission_id: str, digest: str | None = None) -> RecordDecision:
    return RecordDecision(
        DecisionRow(admission_id, digest or f"d-{admission_id}", "admitted", T0, '{"r": 1}')
    )


def test_the_view_carries_every_stored_descriptors_epoch(pool: LedgerStore) -> None:
    # A batch that finds no pool for a request learns from its view alone whether another
    # manager stored a descriptor it has not loaded (the admitter reads bodies only then).
    assert pool.read_for_decision(["adm-1"], fences=1).epochs == {}
    assert pool.save_descriptor("pool-a", 3, '{"d": 3}')
    assert pool.save_descriptor("pool-b", 1, '{"d": 1}')
    assert pool.save_descriptor("pool-a", 4, '{"d": 4}')

    view = pool.batch(lambda: pool.read_for_decision(["adm-1"], fences=1))

    assert view.epochs == {"pool-a": 4, "pool-b": 1}


def test_a_decided_batch_keeps_what_it_decided_against_the_view_it_read(
    pool: LedgerStore,
) -> None:
    def work() -> tuple[Reservation, Reservation]:
        view = pool.read_for_decision(["adm-1", "adm-2"], fences=2)
        assert view.counters[("pool-a", "model_slots")] == (0, 2)
        assert (view.reservations, view.decisions, len(view.fences)) == ({}, {}, 2)
        first, second = grant("adm-1", view.fences[0]), grant("adm-2", view.fences[1])
        pool.apply(
            [
                SetCapacity("pool-a", "sandboxes", 5),
                Reserve(first),
                decided("adm-1"),
                SaveEligibility("ref-1", '{"pools": []}'),
                Reserve(second),
                decided("adm-2"),
            ]
        )
        return first, second

    first, second = pool.batch(work)

    assert (pool.get("adm-1"), pool.get("adm-2")) == (first, second)
    assert used(pool, "pool-a", "model_slots") == 2
    assert pool.usage()[("pool-a", "sandboxes")] == (0, 5)
    decision = pool.decision("adm-1")
    assert decision is not None and decision.record == '{"r": 1}'
    assert pool.eligibility("ref-1") == '{"pools": []}'
    assert [(e.admission_id, e.event.value, e.fence) for e in pool.log()] == [
        ("adm-1", "prepared", first.fence),
        ("adm-1", "activated", first.fence),
        ("adm-2", "prepared", second.fence),
        ("adm-2", "activated", second.fence),
    ]
    # Read again, the view shows the batch's rows.
    view = pool.read_for_decision(["adm-1", "adm-3"], fences=0)
    assert view.reservations == {"adm-1": first}
    assert set(view.decisions) == {"adm-1"} and view.fences == ()
    assert_conserved(pool)


def test_calls_after_the_apply_see_its_rows_and_commit_with_them(pool: LedgerStore) -> None:
    def work() -> Reservation | None:
        (fence,) = pool.read_for_decision(["adm-1"], fences=1).fences
        pool.apply([Reserve(grant("adm-1", fence)), decided("adm-1")])
        held = pool.get("adm-1")
        assert held is not None
        pool.release("adm-1", held.fence, T0 + 1)
        return pool.get("adm-1")

    released = pool.batch(work)

    assert released is not None and released.state is ReservationState.RELEASED
    assert pool.get("adm-1") == released
    assert used(pool, "pool-a", "model_slots") == 0
    assert_conserved(pool)


def test_a_batch_that_fails_after_its_apply_keeps_nothing(pool: LedgerStore) -> None:
    def work() -> None:
        (fence,) = pool.read_for_decision(["adm-1"], fences=1).fences
        pool.apply([Reserve(grant("adm-1", fence)), decided("adm-1")])
        raise RuntimeError("the manager fails before the batch commits")

    with pytest.raises(RuntimeError):
        pool.batch(work)

    assert pool.get("adm-1") is None and pool.decision("adm-1") is None
    assert used(pool, "pool-a", "model_slots") == 0 and pool.log() == []


def test_a_counter_taken_inside_the_batch_before_its_apply_fails_the_apply(
    pool: LedgerStore,
) -> None:
    def work() -> None:
        view = pool.read_for_decision(["adm-1", "adm-2"], fences=2)
        # The same transaction takes both slots before the decided rows are written.
        prepare(pool, "adm-0", "d0", [("pool-a", "model_slots", 2)], TTL, T0)
        pool.apply([Reserve(grant("adm-1", view.fences[0])), decided("adm-1")])

    with pytest.raises(StaleView):
        pool.batch(work)

    assert pool.get("adm-0") is None and pool.get("adm-1") is None
    assert used(pool, "pool-a", "model_slots") == 0


def another_writer(ledger_factory: LedgerFactory) -> LedgerStore:
    if ledger_factory.kind == "sqlite":
        pytest.skip("an SQLite batch holds the write lock from its start: nobody writes under it")
    return ledger_factory.open()


def test_a_counter_another_manager_took_under_the_batch_fails_it_whole(
    pool: LedgerStore, ledger_factory: LedgerFactory
) -> None:
    other = another_writer(ledger_factory)

    def work() -> None:
        view = pool.read_for_decision(["adm-1", "adm-2"], fences=2)
        assert view.counters[("pool-a", "model_slots")] == (0, 2)
        prepare(other, "adm-9", "d9", [("pool-a", "model_slots", 1)], TTL, T0)
        pool.apply(
            [
                Reserve(grant("adm-1", view.fences[0])),
                Reserve(grant("adm-2", view.fences[1])),
                decided("adm-1"),
                decided("adm-2"),
            ]
        )

    with pytest.raises(StaleView):
        pool.batch(work)

    assert pool.get("adm-1") is None and pool.get("adm-2") is None
    assert pool.decision("adm-1") is None
    assert used(pool, "pool-a", "model_slots") == 1  # the other manager's, only
    assert_conserved(pool)


def test_a_decision_another_manager_recorded_for_another_digest_fails_the_batch(
    pool: LedgerStore, ledger_factory: LedgerFactory
) -> None:
    other = another_writer(ledger_factory)

    def work() -> None:
        view = pool.read_for_decision(["adm-1"], fences=1)
        assert other.record_decision("adm-1", "other-digest", "deferred", T0, "{}")
        pool.apply([Reserve(grant("adm-1", view.fences[0])), decided("adm-1")])

    with pytest.raises(StaleView):
        pool.batch(work)

    assert pool.get("adm-1") is None
    kept = pool.decision("adm-1")
    assert kept is not None and kept.digest == "other-digest"
    assert used(pool, "pool-a", "model_slots") == 0


def test_a_batch_the_database_refuses_fails_with_a_store_error_and_keeps_nothing(
    pool: LedgerStore,
) -> None:
    taken = grant("adm-1", 1)
    pool.apply([Reserve(taken)])

    def work() -> None:
        (fence,) = pool.read_for_decision(["adm-2"], fences=1).fences
        # adm-1 exists: its row cannot be inserted again (a bug in the caller's view).
        pool.apply([Reserve(grant("adm-2", fence)), Reserve(grant("adm-1", fence + 1))])

    with pytest.raises(StoreError):
        pool.batch(work)

    assert pool.get("adm-2") is None and pool.get("adm-1") == taken
    assert used(pool, "pool-a", "model_slots") == 1
    assert_conserved(pool)


# ---- releases as the batch's last call (the admitter's releases that came with a batch) ----


def held_grant(pool: LedgerStore, admission_id: str) -> Reservation:
    """A grant committed earlier (one slot), to be released inside a later batch."""
    (fence,) = pool.read_for_decision([admission_id], fences=1).fences
    taken = grant(admission_id, fence)
    pool.apply([Reserve(taken), decided(admission_id)])
    return taken


def test_releases_as_the_batch_s_last_call_commit_with_its_writes(
    pool: LedgerStore, ledger_factory: LedgerFactory
) -> None:
    old = held_grant(pool, "adm-0")
    statements = count_statements(pool)

    def work() -> tuple[Reservation, list[object]]:
        (fence,) = pool.read_for_decision(["adm-1"], fences=1).fences
        fresh = grant("adm-1", fence)
        pool.apply([Reserve(fresh), decided("adm-1")])
        # adm-0 released; a stale fence and an unknown ID refused, each as release() would.
        answers = pool.release_many(
            [("adm-0", old.fence), ("adm-0", old.fence + 100), ("adm-x", 1)], T0 + 1
        )
        return fresh, list(answers)

    fresh, answers = pool.batch(work)

    released = pool.get("adm-0")
    assert released is not None and released.state is ReservationState.RELEASED
    assert answers[0] == released
    assert [getattr(a, "reason", None) is not None for a in answers] == [False, True, True]
    assert pool.get("adm-1") == fresh
    assert used(pool, "pool-a", "model_slots") == 1  # adm-1's; adm-0's given back
    events = [(e.admission_id, e.event.value) for e in pool.log()][-3:]
    assert events == [("adm-1", "prepared"), ("adm-1", "activated"), ("adm-0", "released")]
    if ledger_factory.kind == "postgres":  # the view, then the writes and releases together
        assert statements() == 2
    assert_conserved(pool)


def test_a_batch_whose_writes_are_stale_keeps_none_of_its_releases(
    pool: LedgerStore, ledger_factory: LedgerFactory
) -> None:
    other = another_writer(ledger_factory)
    old = held_grant(pool, "adm-0")

    def work() -> None:
        view = pool.read_for_decision(["adm-1", "adm-2"], fences=2)
        prepare(other, "adm-9", "d9", [("pool-a", "model_slots", 1)], TTL, T0)  # the last slot
        pool.apply(
            [
                Reserve(grant("adm-1", view.fences[0])),
                Reserve(grant("adm-2", view.fences[1])),
                decided("adm-1"),
                decided("adm-2"),
            ]
        )
        pool.release_many([("adm-0", old.fence)], T0 + 1)

    with pytest.raises(StaleView):
        pool.batch(work)

    held = pool.get("adm-0")
    assert held is not None and held.state is ReservationState.ACTIVE  # not released
    assert pool.get("adm-1") is None and pool.get("adm-2") is None
    assert used(pool, "pool-a", "model_slots") == 2  # adm-0's and the other manager's
    assert_conserved(pool)


def test_a_postgresql_batch_takes_no_call_after_its_releases(
    pool: LedgerStore, ledger_factory: LedgerFactory
) -> None:
    if ledger_factory.kind != "postgres":
        pytest.skip("SQLite runs every call of a batch in its one transaction")
    old = held_grant(pool, "adm-0")

    def work() -> None:
        pool.read_for_decision(["adm-1"], fences=0)
        pool.release_many([("adm-0", old.fence)], T0 + 1)
        pool.apply([decided("adm-1")])

    with pytest.raises(LocalProtocolError, match="last call"):
        pool.batch(work)


def count_statements(pool: LedgerStore) -> Callable[[], int]:
    """How many statements a PostgreSQL ledger sends from now on (one round trip each)."""
    if not isinstance(pool, PostgresLedger):
        return lambda: 0
    sent = 0
    one_statement = pool._one_statement

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        return one_statement(*args, **kwargs)

    pool._one_statement = counted  # type: ignore[method-assign]
    return lambda: sent
