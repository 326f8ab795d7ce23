"""Eviction by recoverability: which admitted work an interactive request may take a slot back
from (the pressure core), and what the admitter does about it in the ledger (SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.agent.grants import RevokedGrants
from mesh.core.pressure import Holding, PressureBoard, PressurePolicy, evict_order
from mesh.errors import StoreError
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.wire import AdmissionReason, AdmissionRequest
from mesh.wire.models import TaskGrant

from .samples import DESCRIPTOR, REQUIREMENTS, T0

SLOTS = DESCRIPTOR.model_limits.slots  # 16
# Stages by signals only: the pool can be filled with any class, which is what eviction needs.
NO_STAGES = PressurePolicy(thresholds=(1.0, 1.0, 1.0))

# ---- the pressure core ----------------------------------------------------------------------


def full_board(*holders: tuple[str, str, int, str | None], policy: PressurePolicy = NO_STAGES):
    """A board whose pool ``p`` is full with ``(admission, tenant, rank, recoverability)``."""
    b = PressureBoard(policy)
    b.observe_usage({"p": (0, len(holders))}, T0)
    for i, (admission_id, tenant, rank, recoverability) in enumerate(holders):
        b.granted(
            admission_id, "p", tenant, T0 + i, rank=rank, evict_order=evict_order(recoverability)
        )
    return b


def test_only_recoverable_lower_ranked_work_is_a_victim_and_only_for_interactive_requests() -> None:
    b = full_board(
        ("effects", "t", 0, "side_effects"),
        ("approval", "t", 0, "awaiting_approval"),
        ("commit", "t", 1, "near_commit"),
        ("unknown", "t", 0, None),
        ("peer", "t", 2, "rebuildable"),  # interactive: never evicted for interactive
    )
    assert b.victim("p", "t", rank=2, now=T0) is None

    b = full_board(("spec", "t", 0, "retryable"))
    assert b.victim("p", "t", rank=1, now=T0) is None  # batch does not evict
    assert b.victim("p", "t", rank=0, now=T0) is None
    assert b.victim("p", "t", rank=2, now=T0) == "spec"


def test_the_board_gives_up_grants_in_the_victim_policys_order_youngest_first() -> None:
    """The order itself (rebuildable before retryable, lower rank first) is the victim
    policy's (mesh.core.policy.victims, tested there); the board must walk its grants in that
    order, the youngest of each kind first, and forget each one that ended."""
    holders = (
        ("batch-retry", "t", 1, "retryable"),
        ("spec-retry", "t", 0, "retryable"),
        ("batch-rebuild", "t", 1, "rebuildable"),
        ("spec-rebuild-old", "t", 0, "rebuildable"),
        ("spec-rebuild-new", "t", 0, "rebuildable"),
    )
    b = full_board(*holders)
    order = []
    while (victim := b.victim("p", "t", rank=2, now=T0 + 10)) is not None:
        order.append(victim)
        b.ended(victim, T0 + 10, completed=False)
    # (evict order, rank) as the policy ranks them, then the youngest (granted last) first.
    ranked = sorted(enumerate(holders), key=lambda h: (evict_order(h[1][3]), h[1][2], -h[0]))
    assert order == [admission_id for _, (admission_id, *_) in ranked]
    assert order.index("spec-rebuild-new") < order.index("spec-rebuild-old")  # youngest first


def test_a_tenant_at_its_fair_share_may_evict_only_its_own_work() -> None:
    b = full_board(
        ("a-1", "a", 0, "retryable"),
        ("a-2", "a", 0, "retryable"),
        ("b-1", "b", 0, "retryable"),
        ("b-2", "b", 0, "retryable"),
    )  # fair share of 4 slots between a and b: 2 each
    assert b.victim("p", "a", rank=2, now=T0) == "a-2"  # a holds its share: its own work only
    b.ended("a-1", T0, completed=False)
    b.ended("a-2", T0, completed=False)
    retryable = evict_order("retryable")
    b.granted("b-3", "p", "b", T0 + 5, rank=0, evict_order=retryable)
    b.granted("b-4", "p", "b", T0 + 6, rank=0, evict_order=retryable)
    assert b.victim("p", "a", rank=2, now=T0 + 7) == "b-4"  # a holds none: below its share


def test_no_eviction_when_it_is_switched_off_or_the_broker_blocks_publishers() -> None:
    holder = ("spec", "t", 0, "rebuildable")
    off = full_board(holder, policy=PressurePolicy(thresholds=(1.0, 1.0, 1.0), evict=False))
    assert off.victim("p", "t", rank=2, now=T0) is None
    disabled = full_board(holder, policy=PressurePolicy(enabled=False))
    assert disabled.victim("p", "t", rank=2, now=T0) is None
    blocked = full_board(holder)
    blocked.observe_broker(True, T0)
    assert blocked.victim("p", "t", rank=2, now=T0) is None


def test_restore_undoes_an_eviction_on_the_board() -> None:
    b = full_board(("spec", "t", 0, "rebuildable"), ("other", "u", 1, None))
    before = (b.pools["p"].used, dict(b.pools["p"].holders))
    holding = b.ended("spec", T0, completed=False)
    assert holding == Holding("p", "t", T0, 0, evict_order("rebuildable"))
    b.restore("spec", holding, T0)
    assert (b.pools["p"].used, b.pools["p"].holders) == before
    assert b.pools["p"].service_s == type(b.pools["p"].service_s)()  # no service sample


# ---- the admitter and the ledger ------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def slot_request(admission_id: str, service_class: str, recoverability: str) -> AdmissionRequest:
    """Model slots are its only pool resource (no tools, no sandbox), so they run out first."""
    reqs = REQUIREMENTS.model_copy(
        update={
            "service_class": service_class,
            "recoverability": recoverability,
            "required_tools": [],
            "needs_sandbox": False,
            "estimated_tokens": 10,
            "deadline": None,
            "allowed_fallbacks": [],
        }
    )
    return AdmissionRequest(admission_id=admission_id, requirements=reqs)


def admitter_full_of(ledger: SqliteLedger, recoverability: str) -> Admitter:
    a = Admitter(
        ledger,
        AdmissionPolicy(
            active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60, pressure=NO_STAGES
        ),
    )
    assert a.publish_descriptor(DESCRIPTOR, T0) is None
    for i in range(SLOTS):
        d = a.admit(slot_request(f"spec-{i}", "speculative", recoverability), "t", T0 + i)
        assert d.outcome == "admitted", d
    return a


def slots_used(ledger: SqliteLedger) -> tuple[int, int]:
    return ledger.usage()[(DESCRIPTOR.pool_id, "model_slots")]


def test_an_interactive_request_evicts_the_youngest_rebuildable_grant_in_the_same_transaction(
    ledger: SqliteLedger,
) -> None:
    a = admitter_full_of(ledger, "rebuildable")
    assert slots_used(ledger) == (SLOTS, SLOTS)

    decision = a.admit(slot_request("urgent", "interactive", "side_effects"), "t", T0 + 50)

    assert decision.outcome == "admitted"
    (eviction,) = a.drain_evictions()
    assert eviction.victim.admission_id == f"spec-{SLOTS - 1}"  # the youngest
    assert eviction.for_admission == "urgent"
    victim = ledger.get(f"spec-{SLOTS - 1}")
    assert victim is not None and victim.state == "RELEASED"
    assert slots_used(ledger) == (SLOTS, SLOTS)  # one out, one in: never over capacity
    holding = [r for r in ledger.active() if r.pool_id == DESCRIPTOR.pool_id]
    assert len(holding) == SLOTS
    assert a.pressure.pools[DESCRIPTOR.pool_id].used == SLOTS
    # The victim's holder cannot release it again (its reservation is final), and is told why.
    refused = a.release(victim.admission_id, victim.fence, T0 + 51)
    assert (refused.released, refused.reason) == (False, AdmissionReason.STALE_FENCE)
    assert "evicted" in refused.detail


def test_work_with_side_effects_is_never_evicted(ledger: SqliteLedger) -> None:
    a = admitter_full_of(ledger, "side_effects")

    decision = a.admit(slot_request("urgent", "interactive", "side_effects"), "t", T0 + 50)

    assert decision.outcome == "deferred"
    assert decision.reason is AdmissionReason.CAPACITY
    assert decision.retry_after_ms is not None
    assert a.drain_evictions() == []
    assert all(r.state == "ACTIVE" for r in ledger.active())
    assert slots_used(ledger) == (SLOTS, SLOTS)


def test_batch_work_does_not_evict(ledger: SqliteLedger) -> None:
    a = admitter_full_of(ledger, "rebuildable")
    decision = a.admit(slot_request("later", "batch", "retryable"), "t", T0 + 50)
    assert decision.outcome == "deferred"
    assert a.drain_evictions() == []


def test_eviction_survives_a_restart_the_board_knows_who_is_evictable(
    ledger: SqliteLedger,
) -> None:
    a = admitter_full_of(ledger, "retryable")
    restarted = Admitter(ledger, a.policy)
    restarted.load_descriptors()
    assert restarted.recover_pressure(T0 + 40) == SLOTS

    decision = restarted.admit(slot_request("urgent", "interactive", "side_effects"), "t", T0 + 50)

    assert decision.outcome == "admitted"
    assert [e.victim.admission_id for e in restarted.drain_evictions()] == [f"spec-{SLOTS - 1}"]


def test_an_eviction_in_a_batch_that_rolls_back_is_undone_everywhere(
    ledger: SqliteLedger,
) -> None:
    """The batch's transaction fails after the eviction: the victim is ACTIVE again, the board
    counts it again, nothing is reported; deciding again one by one evicts exactly once."""
    a = admitter_full_of(ledger, "rebuildable")
    real_batch = ledger.batch
    calls: list[int] = []

    def failing_once(work):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            return real_batch(work)

        def then_fail():  # type: ignore[no-untyped-def]
            work()
            assert ledger.get(f"spec-{SLOTS - 1}").state == "RELEASED"  # type: ignore[union-attr]
            raise StoreError("deadlock detected")

        return real_batch(then_fail)

    ledger.batch = failing_once  # type: ignore[method-assign]
    urgent = slot_request("urgent", "interactive", "side_effects")
    other = slot_request("other", "interactive", "side_effects")
    decisions = a.admit_many([(urgent, "t"), (other, "t")], T0 + 50)

    assert [d.outcome for d in decisions] == ["admitted", "admitted"]
    assert len(calls) == 3  # the failed batch, then one transaction each
    evicted = [e.victim.admission_id for e in a.drain_evictions()]
    assert evicted == [f"spec-{SLOTS - 1}", f"spec-{SLOTS - 2}"]  # once each, youngest first
    assert slots_used(ledger) == (SLOTS, SLOTS)
    assert a.pressure.pools[DESCRIPTOR.pool_id].used == SLOTS
    assert len(ledger.active()) == SLOTS


# ---- the agent's memory of evictions --------------------------------------------------------


def grant(admission_id: str, fence: int) -> TaskGrant:
    return TaskGrant(
        admission_id=admission_id,
        pool_id="p",
        descriptor_epoch=1,
        policy_generation=1,
        fence=fence,
        expires_at=T0 + 60,
    )


def test_revoked_grants_remember_whether_a_revocation_was_an_eviction() -> None:
    revoked = RevokedGrants()
    revoked.revoke("a", 5, evicted=True)
    revoked.revoke("b", 5)
    assert revoked.evicted(grant("a", 5)) and revoked.evicted(grant("a", 4))
    assert not revoked.evicted(grant("a", 6))  # a newer grant than the one evicted
    assert not revoked.evicted(grant("b", 5))  # released or expired, not evicted
    revoked.revoke("a", 3)  # an older revocation changes nothing
    assert revoked.fence("a") == 5 and revoked.evicted(grant("a", 5))
    revoked.revoke("a", 7)  # a later expiry supersedes the eviction
    assert revoked.fence("a") == 7 and not revoked.evicted(grant("a", 5))
