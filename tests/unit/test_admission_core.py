"""The pure admission core: requests and a view of the ledger in, decisions and ledger
operations out. No store exists in these tests: what the core would write is the list it
returns, and what it read is the view it was given."""

from __future__ import annotations

import dataclasses

import pytest

from mesh.core.admission import AdmissionCore, AdmissionPolicy
from mesh.core.capacity import LiveCapacity, LiveOffer
from mesh.core.eligibility import capacities
from mesh.core.pressure import PressurePolicy
from mesh.ledger.model import (
    TENANT_POOL,
    Activate,
    DecisionRow,
    Item,
    LedgerView,
    RecordDecision,
    Release,
    Reservation,
    ReservationState,
    Reserve,
    SaveEligibility,
    SetCapacity,
)
from mesh.wire import AdmissionReason, AdmissionRequest
from mesh.wire.admission import requirement_digest

from .samples import DESCRIPTOR, REQUIREMENTS, T0

POOL = DESCRIPTOR.pool_id
POLICY = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
BUDGET = (TENANT_POOL, "tenant_tokens:t")


def core(policy: AdmissionPolicy = POLICY) -> AdmissionCore:
    c = AdmissionCore(policy)
    c.activate(DESCRIPTOR)
    return c


def counters(**used: int) -> dict[tuple[str, str], tuple[int, int]]:
    """The descriptor's counters (``used`` by resource name, default 0) and t's budget."""
    out = {(POOL, r): (used.get(r, 0), cap) for r, cap in capacities(DESCRIPTOR).items()}
    out[BUDGET] = (0, 1_000_000)
    return out


def view(
    counters: dict[tuple[str, str], tuple[int, int]],
    *,
    fences: tuple[int, ...] = (101, 102, 103),
    reservations: dict[str, Reservation] | None = None,
    decisions: dict[str, DecisionRow] | None = None,
) -> LedgerView:
    return LedgerView(counters, reservations or {}, decisions or {}, fences)


def request(admission_id: str, **changes: object) -> tuple[AdmissionRequest, str]:
    reqs = REQUIREMENTS.model_copy(update=changes) if changes else REQUIREMENTS
    return AdmissionRequest(admission_id=admission_id, requirements=reqs), "t"


def kinds(ops: list[object]) -> list[str]:
    return [type(op).__name__ for op in ops]


def test_a_grant_is_a_reservation_to_write_and_a_record_nothing_kept_before_commit() -> None:
    c = core()

    batch = c.decide([request("adm-1")], view(counters()), T0)

    (decision,) = batch.final()
    assert decision.outcome == "admitted" and decision.grant is not None
    assert decision.grant.fence == 101  # the first fence the view drew
    assert kinds(batch.ops) == ["SaveEligibility", "Reserve", "RecordDecision"]
    (reserve,) = [op for op in batch.ops if isinstance(op, Reserve)]
    assert reserve.reservation.state is ReservationState.ACTIVE
    assert reserve.reservation.expires_at == T0 + 60
    assert set(reserve.reservation.items) == {
        Item(TENANT_POOL, "tenant_tokens:t", REQUIREMENTS.estimated_tokens),
        Item(POOL, "model_slots", 1),
        Item(POOL, "sandboxes", 1),
        Item(POOL, "tool:web-search", 2),
    }
    (record,) = [op for op in batch.ops if isinstance(op, RecordDecision)]
    assert record.row.outcome == "admitted"
    assert c.decisions == {}  # kept only once the shell says the batch committed
    c.committed(batch)
    assert list(c.decisions) == ["adm-1"] and "adm-1" in c.grants.held


def test_a_batch_decides_against_its_own_takes() -> None:
    c = core()
    full_but_one = counters(model_slots=DESCRIPTOR.model_limits.slots - 1)

    batch = c.decide([request("adm-1"), request("adm-2")], view(full_but_one), T0)

    first, second = batch.final()
    assert first.outcome == "admitted"
    assert (second.outcome, second.reason) == ("deferred", AdmissionReason.CAPACITY)
    assert kinds(batch.ops).count("Reserve") == 1
    assert c.misses == []  # a capacity miss counts once committed
    c.committed(batch)
    assert c.misses == [(POOL, "CAPACITY")]


def test_a_first_seen_tenant_gets_the_default_budget_as_an_operation() -> None:
    c = core()
    without_budget = {k: v for k, v in counters().items() if k != BUDGET}

    batch = c.decide([request("adm-1")], view(without_budget), T0)

    assert batch.final()[0].outcome == "admitted"
    assert SetCapacity(*BUDGET, POLICY.default_tenant_tokens) in batch.ops


def test_the_same_request_recorded_as_admitted_gets_the_same_grant_and_writes_nothing() -> None:
    c = core()
    first = c.decide([request("adm-1")], view(counters()), T0)
    (granted,) = first.final()
    (record,) = [op.row for op in first.ops if isinstance(op, RecordDecision)]

    # A fresh core (another manager, or after a restart) sees only the ledger's record.
    again = core().decide([request("adm-1")], view(counters(), decisions={"adm-1": record}), T0)

    assert again.final() == [granted]
    assert [op for op in again.ops if not isinstance(op, SaveEligibility)] == []


@pytest.mark.parametrize("then", ["held", "released"])
def test_a_deferral_kept_here_gives_way_to_the_grant_another_manager_recorded_since(
    then: str,
) -> None:
    """This manager deferred adm-1 when its pool was full; the pool's shard moved, another
    manager granted it, and the shard came back. A redelivered or retried adm-1 is answered
    with that grant (journaled as a replay), not decided again from the old deferral: the
    ledger's record is newer than what this manager remembers. Before, the remembered
    deferral hid the record: a held grant was journaled as granted a second time, and a
    released one was refused STALE_FENCE — a second, different answer to one request."""
    here = core()
    full = counters(model_slots=DESCRIPTOR.model_limits.slots)
    deferred = here.decide([request("adm-1")], view(full), T0)
    assert deferred.final()[0].outcome == "deferred"
    here.committed(deferred)

    elsewhere = core().decide([request("adm-1")], view(counters(), fences=(201,)), T0 + 1)
    (granted,) = elsewhere.final()
    (record,) = [op.row for op in elsewhere.ops if isinstance(op, RecordDecision)]
    (reserve,) = [op.reservation for op in elsewhere.ops if isinstance(op, Reserve)]
    if then == "released":
        reserve = dataclasses.replace(reserve, state=ReservationState.RELEASED)

    again = here.decide(
        [request("adm-1")],
        view(counters(), reservations={"adm-1": reserve}, decisions={"adm-1": record}),
        T0 + 2,
    )

    assert again.final() == [granted]
    assert again.replayed == {"adm-1"}
    assert [op for op in again.ops if not isinstance(op, SaveEligibility)] == []


def test_a_reservation_keeps_its_epoch_and_a_replay_after_a_new_epoch_reports_it() -> None:
    """A grant replayed from its reservation (the decision record was not written: the
    manager stopped in between) reports the epoch it was granted under, not the pool's
    current one: an agent checks old-epoch grants against the draining allowlist."""
    first = core().decide([request("adm-1")], view(counters()), T0)
    (reserve,) = [op for op in first.ops if isinstance(op, Reserve)]
    assert reserve.reservation.descriptor_epoch == DESCRIPTOR.descriptor_epoch

    later = core()
    later.activate(
        DESCRIPTOR.model_copy(update={"descriptor_epoch": DESCRIPTOR.descriptor_epoch + 1})
    )
    batch = later.decide(
        [request("adm-1")],
        view(counters(), reservations={"adm-1": reserve.reservation}),
        T0 + 1,
    )

    (replayed,) = batch.final()
    assert replayed.grant is not None and replayed.grant.fence == reserve.reservation.fence
    assert replayed.grant.descriptor_epoch == DESCRIPTOR.descriptor_epoch
    # A row from before reservations kept their epoch reports the pool's current one.
    legacy = dataclasses.replace(reserve.reservation, descriptor_epoch=None)
    again = later.decide([request("adm-1")], view(counters(), reservations={"adm-1": legacy}), T0)
    (old_row,) = again.final()
    assert old_row.grant is not None
    assert old_row.grant.descriptor_epoch == DESCRIPTOR.descriptor_epoch + 1


def test_an_admission_id_reused_with_other_requirements_is_a_conflict() -> None:
    pair = request("adm-1")
    other = requirement_digest(REQUIREMENTS.model_copy(update={"priority": 1}), "t")
    held = Reservation(
        "adm-1", other, POOL, ReservationState.ACTIVE, 7, (Item(POOL, "model_slots", 1),),
        T0 + 60, T0,
    )  # fmt: skip

    batch = core().decide([pair], view(counters(), reservations={"adm-1": held}), T0)

    assert batch.final()[0].reason is AdmissionReason.CONFLICT
    assert kinds(batch.ops).count("Reserve") == 0


def test_a_prepared_reservation_a_stopped_manager_left_is_activated() -> None:
    pair = request("adm-1")
    digest = requirement_digest(REQUIREMENTS, "t")
    prepared = Reservation(
        "adm-1", digest, POOL, ReservationState.PREPARING, 7, (Item(POOL, "model_slots", 1),),
        T0 + 5, T0 - 1,
    )  # fmt: skip

    batch = core().decide([pair], view(counters(), reservations={"adm-1": prepared}), T0)

    (decision,) = batch.final()
    assert decision.outcome == "admitted" and decision.grant is not None
    assert decision.grant.fence == 7  # its own fence, not a fresh one
    assert Activate("adm-1", 7, T0 + 60, T0) in batch.ops


def test_live_capacity_is_written_first_and_bounds_the_grants() -> None:
    c = core()
    one_agent = LiveCapacity({(POOL, "rag.search"): (LiveOffer("2.1.0", 1, 1, "A"),)})

    batch = c.decide([request("adm-1"), request("adm-2")], view(counters()), T0, one_agent)

    live_writes = batch.ops[:2]  # one per capability the descriptor offers, before all else
    assert SetCapacity(POOL, "live_slots:rag.search", 1) in live_writes
    assert SetCapacity(POOL, "live_slots:rag.answer", 0) in live_writes
    first, second = batch.final()
    assert first.outcome == "admitted"
    assert (second.outcome, second.reason) == ("deferred", AdmissionReason.CAPACITY)


def test_a_pool_with_no_live_agent_is_refused_for_that_reason() -> None:
    nobody = LiveCapacity({}, retry_s={POOL: 12.0})

    batch = core().decide([request("adm-1")], view(counters()), T0, nobody)

    (decision,) = batch.final()
    assert (decision.outcome, decision.reason) == ("deferred", AdmissionReason.NO_LIVE_AGENT)
    assert decision.retry_after_ms is not None and decision.retry_after_ms >= 12_000
    assert kinds(batch.ops).count("Reserve") == 0


def test_an_eviction_is_a_release_of_the_victims_fence_before_the_new_reservation() -> None:
    c = core(
        AdmissionPolicy(
            active_generation=DESCRIPTOR.policy_generation,
            grant_ttl_s=60,
            pressure=PressurePolicy(thresholds=(1.0, 1.0, 1.0)),  # stages by signals only
        )
    )
    slots = DESCRIPTOR.model_limits.slots
    spec = {"service_class": "speculative", "recoverability": "rebuildable", "priority": 0}
    for i in range(slots):  # one grant a second: the last is the youngest
        filled = c.decide(
            [request(f"spec-{i}", **spec)], view(counters(model_slots=i), fences=(i + 1,)), T0 + i
        )
        assert filled.final()[0].outcome == "admitted"
        c.committed(filled)
    youngest = f"spec-{slots - 1}"
    full = counters(model_slots=slots)

    batch = c.decide(
        [request("urgent", recoverability="side_effects")], view(full, fences=(500,)), T0 + 20
    )

    assert batch.final()[0].outcome == "admitted"
    releases = [op for op in batch.ops if isinstance(op, Release)]
    assert releases == [Release(youngest, slots, T0 + 20)]  # its fence, from the grant
    assert batch.ops.index(releases[0]) < kinds(batch.ops).index("Reserve")
    assert [e.victim.admission_id for e in batch.evicted] == [youngest]

    c.abandoned(batch, T0 + 20)  # the store failed the batch: the board is as before
    assert c.pressure.pools[POOL].used == slots


@pytest.mark.parametrize("outcome", ["granted", "refused"])
def test_external_grants_are_settled_by_the_shell(outcome: str) -> None:
    c = AdmissionCore(POLICY, external_grants=True)
    c.activate(DESCRIPTOR)

    batch = c.decide([request("adm-1")], view(counters()), T0)

    (pending,) = batch.pending
    assert batch.decisions == [None] and kinds(batch.ops) == ["SaveEligibility"]
    if outcome == "granted":
        decision = c.settle_external(batch, pending, T0, grant_ids=["gpu:1"])
        assert decision.grant is not None and decision.grant.grant_ids[-1] == "gpu:1"
        assert kinds(batch.ops) == ["SaveEligibility", "Reserve", "RecordDecision"]
    else:
        decision = c.settle_external(batch, pending, T0, refused_by="gpu")
        assert decision.reason is AdmissionReason.EXTERNAL_GRANT_FAILED
        assert kinds(batch.ops) == ["SaveEligibility", "RecordDecision"]  # nothing reserved
    assert batch.final() == [decision]


def test_a_stored_record_that_no_longer_parses_is_decided_afresh() -> None:
    damaged = DecisionRow("adm-1", requirement_digest(REQUIREMENTS, "t"), "admitted", T0, "{}")

    batch = core().decide([request("adm-1")], view(counters(), decisions={"adm-1": damaged}), T0)

    assert batch.final()[0].outcome == "admitted"
    assert kinds(batch.ops).count("Reserve") == 1
