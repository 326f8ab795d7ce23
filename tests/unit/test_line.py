"""The line of deferred requests (mesh.core.line) and the admission core's use of it: a
request refused for want of capacity keeps its place, newcomers do not jump it, tenants
take turns, and a place not claimed in time is lost."""

from __future__ import annotations

import pytest

from mesh.core.admission import AdmissionCore, AdmissionPolicy
from mesh.core.capacity import LiveCapacity
from mesh.core.eligibility import capacities
from mesh.core.line import PoolLine
from mesh.core.pressure import PressurePolicy
from mesh.core.records import DecisionRecord
from mesh.ledger.model import TENANT_POOL, DecisionRow, LedgerView, Reserve
from mesh.wire import AdmissionDecision, AdmissionReason, AdmissionRequest

from .samples import DESCRIPTOR, REQUIREMENTS, T0

POOL = DESCRIPTOR.pool_id
ROOM = min(capacities(DESCRIPTOR)[r] for r in ("model_slots", "sandboxes"))  # per request


# ---- the line itself -----------------------------------------------------------------------
def test_within_a_tenant_the_line_is_in_arrival_order() -> None:
    line = PoolLine()
    for i in range(3):
        line.join(f"a{i}", "acme", "interactive", T0 + i, T0 + 100)

    assert [line.ahead(f"a{i}", "acme", "interactive", T0 + 5) for i in range(3)] == [0, 1, 2]
    assert line.ahead("newcomer", "acme", "interactive", T0 + 5) == 3
    line.join("a0", "acme", "interactive", T0 + 6, T0 + 200)  # a retry keeps its place
    assert line.ahead("a0", "acme", "interactive", T0 + 6) == 0


def test_tenants_take_turns_so_a_crowd_does_not_push_back_a_quiet_tenant() -> None:
    line = PoolLine()
    for i in range(100):
        line.join(f"crowd-{i}", "crowd", "interactive", T0 + i * 0.01, T0 + 100)

    # The quiet tenant's first request waits behind the crowd's first only.
    assert line.ahead("quiet-0", "quiet", "interactive", T0 + 2) == 1
    line.join("quiet-0", "quiet", "interactive", T0 + 2, T0 + 100)
    assert line.ahead("crowd-1", "crowd", "interactive", T0 + 3) == 2  # crowd-0, quiet-0
    assert line.ahead("crowd-99", "crowd", "interactive", T0 + 3) == 100


def test_a_higher_class_waits_ahead_of_a_lower_one_and_not_behind_it() -> None:
    line = PoolLine()
    line.join("b0", "acme", "batch", T0, T0 + 100)
    line.join("b1", "acme", "batch", T0, T0 + 100)
    line.join("i0", "acme", "interactive", T0 + 1, T0 + 100)

    assert line.ahead("i-new", "other", "interactive", T0 + 2) == 1  # i0 only
    assert line.ahead("b-new", "other", "batch", T0 + 2) == 2  # i0 and b0 (round robin)
    assert line.ahead("b1", "acme", "batch", T0 + 2) == 2  # i0 and b0


def test_a_place_not_claimed_in_time_is_lost() -> None:
    line = PoolLine()
    line.join("late", "acme", "interactive", T0, due_by=T0 + 1)
    line.join("on-time", "acme", "interactive", T0 + 0.5, due_by=T0 + 10)

    assert line.ahead("on-time", "acme", "interactive", T0 + 0.9) == 1
    assert line.ahead("on-time", "acme", "interactive", T0 + 1.1) == 0
    assert "late" not in line and len(line) == 1


def test_a_full_line_places_nobody_more() -> None:
    line = PoolLine(max_waiting=2)
    assert line.join("a", "t", "interactive", T0, T0 + 9)
    assert line.join("b", "t", "interactive", T0, T0 + 9)
    assert not line.join("c", "t", "interactive", T0, T0 + 9)
    assert line.join("a", "t", "interactive", T0 + 1, T0 + 19)  # one inside keeps its place


def test_undo_puts_the_line_back_as_it_was() -> None:
    line = PoolLine()
    line.join("a", "t", "interactive", T0, T0 + 9)
    line.join("b", "t", "interactive", T0 + 1, T0 + 9)
    line.forget_undo()
    mark = line.mark()

    line.leave("a")
    line.join("c", "u", "interactive", T0 + 2, T0 + 9)
    line.undo(mark)

    assert "c" not in line and "a" in line
    assert line.ahead("a", "t", "interactive", T0 + 3) == 0
    assert line.ahead("b", "t", "interactive", T0 + 3) == 1


# ---- the admission core keeps the line ------------------------------------------------------
class Pool:
    """An admission core and a ledger view it writes through (the store, played by a dict):
    what each decision reserves or releases is applied before the next batch."""

    def __init__(self, *, line: bool = True) -> None:
        pressure = PressurePolicy(line=line, jitter=0.0, line_jitter=0.0, evict=False)
        self.core = AdmissionCore(
            AdmissionPolicy(
                active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60, pressure=pressure
            ),
            rand=lambda: 0.5,
        )
        self.core.activate(DESCRIPTOR)
        self.counters = {(POOL, r): (0, cap) for r, cap in capacities(DESCRIPTOR).items()}
        self.counters[(TENANT_POOL, "tenant_tokens:t")] = (0, 10**9)
        self.counters[(TENANT_POOL, "tenant_tokens:u")] = (0, 10**9)
        self.fence = 100
        self.granted: dict[str, int] = {}  # admission ID -> fence, oldest first

    def ask(self, admission_id: str, now: float, tenant: str = "t") -> AdmissionDecision:
        request = AdmissionRequest(admission_id=admission_id, requirements=REQUIREMENTS)
        fences = tuple(range(self.fence + 1, self.fence + 4))
        self.fence += 3
        batch = self.core.decide(
            [(request, tenant)], LedgerView(dict(self.counters), {}, {}, fences), now, LIVE
        )
        self.counters = batch.counters
        for op in batch.ops:
            if isinstance(op, Reserve):
                self.granted[op.reservation.admission_id] = op.reservation.fence
        self.core.committed(batch)
        (decision,) = batch.final()
        return decision

    def free_one(self, now: float) -> None:
        """A grant ends: its slot (and the rest of its items) back."""
        admission_id, fence = next(iter(self.granted.items()))
        del self.granted[admission_id]
        del fence
        held = self.core.grants.held[admission_id]
        for pool_id, resource, amount in held.items:
            used, cap = self.counters[(pool_id, resource)]
            self.counters[(pool_id, resource)] = (used - amount, cap)
        self.core.ended(admission_id, now, completed=True)


LIVE: LiveCapacity | None = None  # the descriptor's counters alone decide (no registry)


def fill(pool: Pool, now: float) -> None:
    for i in range(ROOM):
        assert pool.ask(f"held-{i}", now).outcome == "admitted"


def test_a_deferred_request_is_told_its_place_and_keeps_it_against_newcomers() -> None:
    pool = Pool()
    fill(pool, T0)

    first = pool.ask("first", T0 + 1)
    second = pool.ask("second", T0 + 1.1)
    assert (first.outcome, first.reason, first.position) == (
        "deferred",
        AdmissionReason.CAPACITY,
        1,
    )
    assert second.position == 2 and first.retry_after_ms is not None
    assert second.retry_after_ms is not None and second.retry_after_ms > first.retry_after_ms

    pool.free_one(T0 + 2)
    newcomer = pool.ask("newcomer", T0 + 2.01)  # asks first once the slot is free
    assert (newcomer.outcome, newcomer.position) == ("deferred", 3)
    assert "ahead" in newcomer.detail

    assert pool.ask("first", T0 + 2.1).outcome == "admitted"  # the slot was held for it
    assert pool.ask("second", T0 + 2.2).outcome == "deferred"
    assert pool.core.places.lines[POOL].ahead("newcomer", "t", "interactive", T0 + 2.3) == 1


def test_without_the_line_the_newcomer_takes_the_freed_slot() -> None:
    """The same sequence with lines off: the target of the test above can fail."""
    pool = Pool(line=False)
    fill(pool, T0)
    assert pool.ask("first", T0 + 1).position is None
    pool.free_one(T0 + 2)

    assert pool.ask("newcomer", T0 + 2.01).outcome == "admitted"
    assert pool.ask("first", T0 + 2.1).outcome == "deferred"


def test_a_place_not_claimed_goes_to_the_next_in_line() -> None:
    pool = Pool()
    fill(pool, T0)
    first = pool.ask("first", T0 + 1)
    pool.ask("second", T0 + 1.1)
    assert first.retry_after_ms is not None
    pool.free_one(T0 + 2)

    gone = T0 + 1 + first.retry_after_ms / 1000 + pool.core.policy.pressure.line_grace_s + 0.1
    assert pool.ask("second", max(gone, T0 + 2.1)).outcome == "admitted"
    comeback = pool.ask("first", max(gone, T0 + 2.1) + 0.1)
    assert comeback.outcome == "deferred" and comeback.position == 1  # at the back: alone


def test_an_abandoned_batch_leaves_the_line_as_it_was() -> None:
    pool = Pool()
    fill(pool, T0)
    pool.ask("first", T0 + 1)
    request = AdmissionRequest(admission_id="second", requirements=REQUIREMENTS)
    batch = pool.core.decide(
        [(request, "t")], LedgerView(dict(pool.counters), {}, {}, (900, 901)), T0 + 1.5
    )
    assert batch.final()[0].position == 2

    pool.core.abandoned(batch, T0 + 1.5)

    assert "second" not in pool.core.places.lines[POOL] and "first" in pool.core.places.lines[POOL]


@pytest.mark.parametrize("deadline_in_s", [0.5])
def test_a_turn_that_would_come_after_the_deadline_is_refused_at_once(
    deadline_in_s: float,
) -> None:
    pool = Pool()
    fill(pool, T0)
    request = AdmissionRequest(
        admission_id="urgent",
        requirements=REQUIREMENTS.model_copy(
            update={"deadline": T0 + 1 + deadline_in_s, "estimated_duration_s": 5.0}
        ),
    )
    batch = pool.core.decide(
        [(request, "t")], LedgerView(dict(pool.counters), {}, {}, (900, 901)), T0 + 1
    )

    (decision,) = batch.final()
    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.DEADLINE_UNREACHABLE)
    assert "urgent" not in pool.core.places.lines.get(POOL, PoolLine())


def test_a_new_core_rebuilds_the_line_from_the_recorded_deferrals_in_arrival_order() -> None:
    """What a restarted manager does: the records of the deferred requests (as the ledger
    keeps them) give a fresh core the same line — the same order, the same times."""
    pool = Pool()
    fill(pool, T0)
    for n, name in enumerate(("first", "second", "third")):
        assert pool.ask(name, T0 + 1 + n / 10).outcome == "deferred"
    records = recorded_deferrals(pool)
    before = pool.core.places.lines[POOL]

    restarted = Pool()
    restarted.counters = pool.counters
    # Fed newest first: the order comes from the records, not from the reading.
    assert restarted.core.rejoin_lines(reversed(list(records.items())), T0 + 1.5) == 3
    line = restarted.core.places.lines[POOL]
    ahead = [line.ahead(a, "t", "interactive", T0 + 1.5) for a in ("first", "second", "third")]
    assert ahead == [0, 1, 2]
    assert line.get("first") == before.get("first")

    newcomer = restarted.ask("newcomer", T0 + 1.6)
    assert (newcomer.outcome, newcomer.position) == ("deferred", 4)


def test_a_place_that_fell_due_while_no_manager_ran_is_kept_a_grace_after_the_restart() -> None:
    """Its holder's retry waits in the queue while the manager is away: the place is not
    lost for that. A place whose request's deadline has passed is not taken again."""
    pool = Pool()
    fill(pool, T0)
    assert pool.ask("first", T0 + 1).outcome == "deferred"
    assert pool.ask("second", T0 + 1.1).outcome == "deferred"
    records = recorded_deferrals(pool)
    second = records["second"]
    assert second.line is not None
    second.line[0][4] = T0 + 5  # second's request gives up at T0 + 5
    line = pool.core.places.lines[POOL]
    due = max(w.due_by for w in (line.get("first"), line.get("second")) if w is not None)
    back = max(due, T0 + 5) + 1  # the manager is back after both fell due

    restarted = Pool()
    assert restarted.core.rejoin_lines(records.items(), back) == 1
    kept = restarted.core.places.lines[POOL].get("first")
    assert kept is not None and "second" not in restarted.core.places.lines[POOL]
    assert kept.due_by == back + restarted.core.policy.pressure.line_grace_s
    assert kept.joined_at == T0 + 1


def recorded_deferrals(pool: Pool) -> dict[str, DecisionRecord]:
    """The decision records of the requests in ``pool``'s line, as the ledger gives them back."""
    return {
        admission_id: DecisionRecord.from_row(
            DecisionRow(admission_id, "d", "deferred", 0, decided.to_json())
        )
        for admission_id, decided in pool.core.decisions.items()
        if admission_id in pool.core.places.lines[POOL]
    }
