"""Pool signals (mesh.core.signals): rates over a sliding window, decisions counted for the
pools they concern, and each figure of a pool's signals from the figures the shell gathers —
with the clock a parameter."""

from __future__ import annotations

import pytest

from mesh.core.capacity import LiveCapacity, LiveOffer
from mesh.core.signals import (
    WINDOW_S,
    PoolActivity,
    PoolFigures,
    decision_pools,
    pool_signals,
)
from mesh.manager.pool_signals import live_free_by_pool
from mesh.render import render_status
from mesh.wire import AdmissionDecision, AdmissionReason, StatusReply
from mesh.wire.admission import CapabilityRange

from .samples import DESCRIPTOR, GRANT

T0 = 1_700_000_000.0


def deferral(reason: AdmissionReason = AdmissionReason.CAPACITY) -> AdmissionDecision:
    return AdmissionDecision(
        admission_id="a1", outcome="deferred", reason=reason, retry_after_ms=100
    )


# ---- the window --------------------------------------------------------------------------------


def test_rates_count_the_decisions_of_the_last_window_per_second() -> None:
    activity = PoolActivity()
    for i in range(30):  # one decision every second for 30 s: 20 grants, 10 deferrals
        outcome = "admitted" if i % 3 else "deferred"
        activity.record("echo", outcome, None if outcome == "admitted" else "CAPACITY", T0 + i)
    (signals,) = pool_signals({}, activity, T0 + 30).values()
    assert signals.add_rate == pytest.approx(30 / WINDOW_S)
    assert signals.dispatch_rate == pytest.approx(20 / WINDOW_S)
    assert signals.refusals == {"CAPACITY": 10}
    assert signals.window_s == WINDOW_S


def test_decisions_older_than_the_window_leave_the_rates_but_stay_in_the_totals() -> None:
    activity = PoolActivity(window_s=10)
    activity.record("echo", "rejected", "NO_LIVE_AGENT", T0)
    activity.record("echo", "admitted", None, T0 + 5)
    assert activity.window("echo", T0 + 9.5).requests == 2
    later = activity.window("echo", T0 + 11.5)  # the first bucket [T0, T0+1) is out
    assert (later.requests, later.grants, dict(later.refusals)) == (1, 1, {})
    assert activity.refusals_total("echo") == {"NO_LIVE_AGENT": 1}
    signals = pool_signals({"echo": PoolFigures()}, activity, T0 + 100)["echo"]
    assert signals.add_rate == 0 and signals.refusals == {}
    assert signals.refusals_total == {"NO_LIVE_AGENT": 1}


def test_old_buckets_are_dropped_as_new_decisions_come() -> None:
    activity = PoolActivity(window_s=5)
    for i in range(1_000):
        activity.record("echo", "admitted", None, T0 + i)
    assert len(activity._pools["echo"].buckets) <= 5
    assert activity.window("echo", T0 + 999).grants == 5


def test_a_clock_that_steps_back_counts_in_the_newest_bucket() -> None:
    activity = PoolActivity()
    activity.record("echo", "admitted", None, T0 + 10)
    activity.record("echo", "admitted", None, T0 + 3)
    assert activity.window("echo", T0 + 10).grants == 2


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PoolActivity(window_s=0)


# ---- which pools a decision counts for -----------------------------------------------------------


def test_a_grant_counts_for_its_pool_a_refusal_for_every_eligible_pool() -> None:
    admitted = AdmissionDecision(admission_id=GRANT.admission_id, outcome="admitted", grant=GRANT)
    eligible = {"eligible": ["echo-eu", "echo-us", "echo-eu"], "pools": []}
    assert decision_pools(admitted, eligible) == (GRANT.pool_id,)
    assert decision_pools(deferral(), eligible) == ("echo-eu", "echo-us")
    assert decision_pools(deferral(), {"eligible": [], "pools": []}) == ()
    assert decision_pools(deferral(), None) == ()


# ---- each figure ---------------------------------------------------------------------------------


def test_backlog_is_queued_plus_deferred_and_overdue_places_count_for_nothing() -> None:
    figures = PoolFigures(
        queued=4,
        queued_oldest_s=2.5,
        waiting=[(T0 - 7, T0 + 5), (T0 - 3, T0 + 5), (T0 - 30, T0 - 1)],  # the last is overdue
        in_flight=6,
        model_slots=8,
        live_capacity=2,
        agents={"Ready": 1, "Busy": 2, "Draining": 1},
        desired_replicas=5,
    )
    s = pool_signals({"echo": figures}, PoolActivity(), T0)["echo"]
    assert (s.queued, s.deferred, s.backlog) == (4, 2, 6)
    assert s.oldest_deferred_s == pytest.approx(7.0)
    assert s.oldest_queued_s == 2.5
    assert s.oldest_wait_s == pytest.approx(7.0)
    assert (s.in_flight, s.demand) == (6, 8)
    assert (s.live_capacity, s.model_slots) == (2, 8)
    assert (s.agents, s.agents_ready, s.desired_replicas) == (4, 3, 5)


def test_the_queue_head_is_the_oldest_wait_when_it_waited_longer() -> None:
    figures = PoolFigures(queued=1, queued_oldest_s=40.0, waiting=[(T0 - 7, T0 + 5)])
    assert pool_signals({"p": figures}, PoolActivity(), T0)["p"].oldest_wait_s == 40.0


def test_an_empty_pool_waits_for_nothing() -> None:
    s = pool_signals({"p": PoolFigures(queued_oldest_s=12.0)}, PoolActivity(), T0)["p"]
    assert (s.backlog, s.oldest_wait_s, s.demand) == (0, 0.0, 0)
    assert s.oldest_deferred_s is None and s.oldest_queued_s is None
    assert s.desired_replicas is None and s.model_slots is None


def test_a_pool_known_only_from_recent_decisions_is_listed() -> None:
    activity = PoolActivity()
    activity.record("ghost", "rejected", "NO_LIVE_AGENT", T0)
    assert list(pool_signals({"echo": PoolFigures()}, activity, T0 + 1)) == ["echo", "ghost"]
    assert list(pool_signals({}, activity, T0 + 3600)) == []  # quiet since: gone


# ---- how `mesh status` shows them ----------------------------------------------------------------


def test_mesh_status_prints_a_row_per_pool_with_its_refusals() -> None:
    activity = PoolActivity()
    activity.record("echo", "deferred", "CAPACITY", T0)
    activity.record("echo", "admitted", None, T0)
    figures = PoolFigures(queued=3, waiting=[(T0 - 4, T0 + 60)], in_flight=2, live_capacity=4)
    reply = StatusReply(
        manager_id="m1",
        uptime_s=1.0,
        agents=[],
        counters={},
        pool_signals=pool_signals({"echo": figures}, activity, T0 + 1),
    )
    text = render_status(reply)
    assert "pool signals (rates per second over 60 s):" in text
    (row,) = [line for line in text.splitlines() if line.startswith("echo ")]
    assert row.split() == ["echo", "3", "1", "5.0s", "0.03", "0.02", "2", "4", "0", "-"]
    assert "refused in the window: CAPACITY 1" in text
    assert "pool signals" not in render_status(reply.model_copy(update={"pool_signals": None}))


# ---- live capacity as the manager gathers it ---------------------------------------------------


def test_a_described_pool_offers_only_what_its_descriptor_covers_any_other_pool_all() -> None:
    offers = (LiveOffer("1.4.0", 2, 6, "C"), LiveOffer("2.0.0", 1, 4, "C"))
    live = LiveCapacity(
        {("echo", "test.echo"): offers, ("free", "test.echo"): offers, ("echo", "other"): offers}
    )
    described = DESCRIPTOR.model_copy(
        update={
            "pool_id": "echo",
            "capabilities": [CapabilityRange(name="test.echo", version_spec=">=1,<2")],
        }
    )
    assert live_free_by_pool(live, {"echo": described}) == {"echo": 6, "free": 10}
