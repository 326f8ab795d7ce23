"""The pressure core: the shedding order, stage times, fair shares, retry times, deadlines."""

from __future__ import annotations

import itertools
import random

import pytest

from mesh.core.policy.retry_times import refusal_retry_ms
from mesh.core.policy.stages import RANK_STOPS_AT, stage_called_for
from mesh.core.pressure import PressureBoard, PressurePolicy, Shed, Stage, shed_rank

T0 = 1_000.0
CAPACITY = 20


def board(**policy: object) -> PressureBoard:
    b = PressureBoard(PressurePolicy(**policy))  # type: ignore[arg-type]
    b.observe_usage({"p": (0, CAPACITY)}, T0)
    return b


def ask(
    b: PressureBoard,
    service_class: str,
    tenant: str = "t1",
    *,
    now: float = T0,
    deadline: float | None = None,
    duration: float = 1.0,
    priority: int = 5,
) -> Shed | None:
    return b.check("p", tenant, service_class, priority, duration, deadline, now)


def called_for(b: PressureBoard, *, blocked: bool) -> Stage:
    """The stage the stage policy calls for the pool's state now (its queue empty)."""
    p = b.pools["p"]
    stage, _ = stage_called_for(
        used=p.used,
        capacity=p.capacity,
        limits=p.limits(b.policy),
        blocked=blocked,
        queue_depth=0,
        oldest_age_s=0.0,
        policy=b.policy,
    )
    return stage


def fill(b: PressureBoard, n: int, tenant: str = "t1", start: int = 0) -> None:
    for i in range(start, start + n):
        b.granted(f"{tenant}-{i}", "p", tenant, T0)


def test_work_is_shed_in_the_documented_order_as_utilisation_rises() -> None:
    """Fill one slot at a time; note the utilisation at which each class is first refused.
    (No dwell: each stage as the state calls for it; holding still is tested below.)"""
    b = board(min_dwell_s=0.0)
    first_refused: dict[str, int] = {}
    tenants = [f"t{i}" for i in range(CAPACITY)]  # one grant each: fair shares never bind
    for used in range(CAPACITY):
        for service_class in ("speculative", "batch", "interactive"):
            if service_class not in first_refused and ask(b, service_class, "probe"):
                first_refused[service_class] = used
        b.granted(f"a{used}", "p", tenants[used], T0)

    # floor(0.7 * 20) = 14 and floor(0.85 * 20) = 17 slots; interactive until the pool is full.
    assert first_refused == {"speculative": 14, "batch": 17}
    assert b.pools["p"].used == CAPACITY
    stages = [(c.old, c.new, c.cause) for c in b.drain_changes()]
    assert stages == [
        (Stage.NORMAL, Stage.SHED_SPECULATIVE, "utilisation 14/20"),
        (Stage.SHED_SPECULATIVE, Stage.PAUSE_BATCH, "utilisation 17/20"),
        (Stage.PAUSE_BATCH, Stage.TIGHTEN, "utilisation 19/20"),
    ]


def test_a_broker_alarm_moves_the_stage_at_once_and_the_gate_sheds_by_it() -> None:
    """The board takes the stage the stage policy (mesh.core.policy.stages, tested there)
    calls for under a broker alarm, at once, journaled with its cause; the gate sheds
    interactive work exactly when that stage is interactive's stop; the alarm over, the stage
    steps down."""
    b = board(min_dwell_s=0.0)
    fill(b, CAPACITY // 2, "t1")
    assert ask(b, "interactive", "t2") is None  # 10/20: flowing

    b.observe_broker(True, T0 + 1)
    alarmed = called_for(b, blocked=True)
    assert alarmed is not called_for(b, blocked=False)  # the alarm alone moves it
    assert b.pools["p"].stage is alarmed
    change = b.drain_changes()[-1]
    assert (change.new, change.at, change.cause) == (
        alarmed,
        T0 + 1,
        "broker alarm: publishers blocked",
    )
    shed = ask(b, "interactive", "t2", now=T0 + 1)
    assert (shed is not None) == (alarmed >= RANK_STOPS_AT[2])

    b.observe_broker(False, T0 + 2)
    assert ask(b, "interactive", "t2", now=T0 + 2) is None
    assert b.pools["p"].stage is called_for(b, blocked=False)


def test_a_queue_that_does_not_drain_raises_the_stage_by_one() -> None:
    b = board(queue_age_s=5.0, min_dwell_s=0.0)
    fill(b, 10)  # 10/20: NORMAL
    b.observe_queue("p", depth=3, oldest_age_s=2.0, now=T0 + 1)
    assert b.pools["p"].stage is Stage.NORMAL
    b.observe_queue("p", depth=3, oldest_age_s=6.0, now=T0 + 2)
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    assert ask(b, "speculative", now=T0 + 2) is not None
    assert ask(b, "batch", now=T0 + 2) is None
    assert b.drain_changes()[-1].cause == "oldest queued task waited 6.0 s"
    # Full and not draining: the last stage.
    fill(b, 10, start=10)
    b.observe_queue("p", depth=5, oldest_age_s=9.0, now=T0 + 3)
    assert b.pools["p"].stage is Stage.REJECT_INTERACTIVE


def test_low_priority_fan_out_goes_with_speculative_work_when_configured() -> None:
    policy = PressurePolicy(low_priority=2)
    assert shed_rank("batch", 2, policy) == 0
    assert shed_rank("batch", 3, policy) == 1
    assert shed_rank("batch", 0, PressurePolicy()) == 1  # off by default: 0 is the default
    assert shed_rank("speculative", 9, policy) == 0
    assert shed_rank("interactive", 0, policy) == 2


def test_a_busy_pool_holds_each_tenant_to_its_fair_share() -> None:
    b = board()
    fill(b, 18, "burst")  # one tenant filled an idle pool: allowed
    assert ask(b, "interactive", "burst") is None  # 18 -> 19: still below TIGHTEN's limit
    b.granted("burst-18", "p", "burst", T0)

    # Alone, a tenant may use the whole pool, even at TIGHTEN.
    assert b.fair_share("p", "burst", T0) == CAPACITY
    assert ask(b, "interactive", "burst") is None
    # Once another tenant asks, the bursting one is over its share, and the other is not.
    assert ask(b, "interactive", "quiet") is None
    assert b.fair_share("p", "burst", T0) == 10
    shed = ask(b, "interactive", "burst")
    assert shed is not None and shed.reason == "TENANT_FAIR_SHARE"
    assert "holds 19 of its 20 slots (fair share 10; 1 other tenant(s) below theirs)" in (
        shed.detail
    )
    # A tenant that stopped asking no longer dilutes the shares; one holding grants does.
    assert b.fair_share("p", "burst", T0 + 60) == 20
    assert b.fair_share("p", "quiet", T0 + 60) == 10


def test_a_busy_pool_keeps_a_slot_free_for_each_tenant_below_its_share() -> None:
    """Between SHED_SPECULATIVE and TIGHTEN a tenant over its share may still take slots, but
    never the last free one each other tenant below its share may need."""
    b = board()
    fill(b, 12, "burst")  # 12/20: not busy yet
    for tenant in ("q1", "q2"):
        assert ask(b, "interactive", tenant) is None  # they asked: three active tenants
    assert b.fair_share("p", "burst", T0) == 7
    # 12 used, 8 free: the burst may take slots while 2 stay free for q1 and q2.
    taken = 0
    while ask(b, "interactive", "burst") is None:
        b.granted(f"more-{taken}", "p", "burst", T0)
        taken += 1
    assert taken == 6 and b.pools["p"].used == 18
    shed = ask(b, "interactive", "burst")
    assert shed is not None and "2 other tenant(s) below theirs" in shed.detail
    # The two slots kept free go to the tenants below their share.
    for tenant in ("q1", "q2"):
        assert ask(b, "interactive", tenant) is None
        b.granted(f"{tenant}-0", "p", tenant, T0)
    assert b.pools["p"].used == 20


def test_retry_times_follow_the_measured_service_time_not_a_constant() -> None:
    """The board feeds the retry-time policy (mesh.core.policy.retry_times, tested there)
    the measured service time and the tenant's refused requests still waiting: here with
    the policy's own answer for those numbers as the expectation."""
    fixed = lambda: 0.5  # noqa: E731 - the middle of the jitter: the wait itself
    fast, slow = board(), board()
    for b, hold_s in ((fast, 0.2), (slow, 2.0)):
        fill(b, CAPACITY)
        for i in range(CAPACITY):  # every grant released after hold_s: the real distribution
            b.ended(f"t1-{i}", T0 + hold_s, completed=True)
        fill(b, CAPACITY, start=100)
    assert fast.pools["p"].mean_service_s() == pytest.approx(0.2)
    policy = PressurePolicy()

    def policy_says(service_s: float, competitors: int) -> int | None:
        return refusal_retry_ms(1, competitors, CAPACITY, service_s, T0, None, policy, fixed)

    # The producer's estimate (here 1 s) no longer counts once releases were measured.
    assert fast.retry_after_ms("p", "t1", 1, 1.0, None, T0, fixed) == policy_says(0.2, 0)
    assert slow.retry_after_ms("p", "t1", 1, 1.0, None, T0, fixed) == policy_says(2.0, 0)
    assert policy_says(0.2, 0) != policy_says(2.0, 0)
    # Each refusal in the window is one more request ahead of the next.
    later = [slow.retry_after_ms("p", "t1", 1, 1.0, None, T0, fixed) for _ in range(5)]
    assert later == [policy_says(2.0, k) for k in range(1, 6)]
    assert len(set(later)) == 5


def test_a_task_that_would_miss_its_deadline_is_refused_up_front() -> None:
    b = board()
    fill(b, 10)
    for i in range(10):
        b.ended(f"t1-{i}", T0 + 2.0, completed=True)  # service time: 2 s
    shed = ask(b, "interactive", deadline=T0 + 1.0, duration=0.1)
    assert shed is not None and shed.reason == "DEADLINE_UNREACHABLE"
    assert shed.slots_to_free is None
    assert ask(b, "interactive", deadline=T0 + 3.0, duration=0.1) is None
    # A retry that would land after the deadline is no retry at all.
    fill(b, CAPACITY, start=100)
    assert b.retry_after_ms("p", "t1", 1, 0.1, T0 + 2.05, T0, lambda: 0.5) is None
    assert b.retry_after_ms("p", "t1", 1, 0.1, T0 + 60, T0, lambda: 0.5) is not None


def test_a_queue_ahead_counts_toward_the_predicted_finish() -> None:
    b = board()
    fill(b, CAPACITY)
    for i in range(CAPACITY):
        b.ended(f"t1-{i}", T0 + 1.0, completed=True)  # 1 s each
    b.observe_queue("p", depth=40, oldest_age_s=0.1, now=T0)  # 40 queued / 20 slots: 2 s
    assert ask(b, "interactive", deadline=T0 + 2.5) is not None
    assert ask(b, "interactive", deadline=T0 + 3.5) is None


def test_replays_and_unknown_endings_do_not_move_the_counts() -> None:
    b = board()
    b.granted("a", "p", "t1", T0)
    b.granted("a", "p", "t1", T0)  # the same grant replayed
    b.ended("zzz", T0, completed=True)  # never counted here
    assert b.pools["p"].used == 1 and b.pools["p"].holders == {"t1": 1}
    b.ended("a", T0 + 1, completed=False)  # expired: no service-time sample
    assert b.pools["p"].used == 0 and b.pools["p"].holders == {}
    assert b.pools["p"].mean_service_s() is None


def test_switched_off_nothing_is_shed_and_the_retry_time_is_constant() -> None:
    b = board(enabled=False)
    fill(b, CAPACITY)
    b.observe_broker(True, T0)
    assert ask(b, "speculative", deadline=T0 + 0.001) is None
    assert b.pools["p"].stage is Stage.NORMAL
    rng = random.Random(3)
    assert {b.retry_after_ms("p", "t1", 3, 1.0, None, T0, rng.random) for _ in range(20)} == {1000}


def test_an_unknown_capacity_sheds_nothing() -> None:
    b = PressureBoard()
    assert b.check("new", "t1", "speculative", 0, 1.0, None, T0) is None


def test_from_tighten_on_each_run_is_held_to_its_share_of_the_pool() -> None:
    """One tenant (its share is the whole pool), two runs: the fan-out of run ``a`` is capped
    once the pool is tight; the other run, a new run and run-less work still get slots."""
    b = board(min_dwell_s=0.0)

    def take(run: str, n: int, start: int) -> None:
        for i in range(start, start + n):
            b.granted(f"{run}-{i}", "p", "t1", T0, run=f"t1/{run}")

    def ask_run(run: str | None) -> Shed | None:
        return b.check(
            "p", "t1", "interactive", 5, 1.0, None, T0, None if run is None else f"t1/{run}"
        )

    take("a", 10, 0)
    assert ask_run("a") is None  # 10 of 20 used: not tight, runs are not limited
    take("a", 3, 10)
    take("b", 6, 0)  # 19 of 20: TIGHTEN
    assert b.pools["p"].stage is Stage.TIGHTEN

    refused = ask_run("a")  # active runs a and b: a share of 10 each; a holds 13
    assert refused is not None and refused.reason == "RUN_CONCURRENCY"
    assert "holds 13" in refused.detail and refused.slots_to_free == 1
    assert ask_run("b") is None  # 6 < 10
    assert ask_run("c") is None  # a new run: share 7 among a, b, c; it holds none
    assert ask_run(None) is None  # no run: the tenant's share alone, and it has room

    for i in range(13):  # run a finishes: its count goes with it
        b.ended(f"a-{i}", T0 + 1, completed=True)
    assert b.pools["p"].runs == {"t1/b": 6}


# ---- the stage holds still ------------------------------------------------------------------
def steady_jittery_load(b: PressureBoard, seconds: float, *, capacity: int = 12) -> list[float]:
    """A pool of ``capacity`` slots at a steady 8-11 slots in use, observed every 50 ms (as
    grants and releases move it); returns when the stage changed."""
    rng = random.Random(7)
    for step in range(int(seconds / 0.05)):
        b.observe_usage({"p": (rng.randint(8, 11), capacity)}, T0 + step * 0.05)
    return [c.at for c in b.drain_changes()]


def test_a_pool_at_steady_jittery_load_sits_in_one_stage() -> None:
    policy = PressurePolicy()
    changes = steady_jittery_load(PressureBoard(policy), 60.0)

    gaps = [later - earlier for earlier, later in itertools.pairwise(changes)]
    assert all(gap >= policy.min_dwell_s for gap in gaps), gaps  # at most one per dwell
    assert len(changes) <= 3, changes  # up to where the load sits, and there it stays
    assert not [at for at in changes if at > T0 + 10]  # nothing once it has settled


def test_without_hysteresis_and_dwell_the_same_load_flaps() -> None:
    """The test above can fail: the stage as the instant calls for it changes all the time."""
    changes = steady_jittery_load(
        PressureBoard(PressurePolicy(hysteresis=0.0, min_dwell_s=0)), 60.0
    )
    assert len(changes) > 100


def test_a_stage_steps_down_only_after_a_dwell_below_the_lowered_threshold() -> None:
    b = board(hysteresis=0.1, min_dwell_s=2.0)  # 20 slots: SHED at 14, down below 12
    b.observe_usage({"p": (15, CAPACITY)}, T0)
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    b.observe_usage({"p": (13, CAPACITY)}, T0 + 5)  # below 14, not below 12: held
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    b.observe_usage({"p": (11, CAPACITY)}, T0 + 6)  # below 12: the dwell starts
    b.observe_usage({"p": (11, CAPACITY)}, T0 + 7.5)
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    b.observe_usage({"p": (12, CAPACITY)}, T0 + 7.9)  # back up to 12: the dwell starts over
    b.observe_usage({"p": (11, CAPACITY)}, T0 + 8)
    b.observe_usage({"p": (11, CAPACITY)}, T0 + 9.9)
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    b.observe_usage({"p": (11, CAPACITY)}, T0 + 10)
    assert b.pools["p"].stage is Stage.NORMAL
    assert [(c.new, c.at) for c in b.drain_changes()] == [
        (Stage.SHED_SPECULATIVE, T0),
        (Stage.NORMAL, T0 + 10),
    ]


def test_a_stage_held_high_for_utilisation_sheds_only_at_the_exact_limits() -> None:
    """Held high by the dwell, a stage entered for utilisation refuses nothing itself: a slot
    below a class's limit is that class's as soon as it is free (else a jittery load near a
    limit would keep it idle); rising, the exact limits refuse before the stage catches up."""
    b = board(min_dwell_s=2.0)
    b.observe_usage({"p": (14, CAPACITY)}, T0)  # SHED_SPECULATIVE
    b.observe_usage({"p": (13, CAPACITY)}, T0 + 1)  # held (not below 12)
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    assert ask(b, "speculative", now=T0 + 1) is None  # 14/20 with it: within its limit
    b.observe_usage({"p": (14, CAPACITY)}, T0 + 1.2)
    assert ask(b, "speculative", now=T0 + 1.2) is not None  # 15/20 with it: over
    b.observe_usage({"p": (17, CAPACITY)}, T0 + 1.5)  # PAUSE_BATCH called for, within the dwell
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    assert ask(b, "batch", now=T0 + 1.5) is not None  # its exact limit refuses it regardless
    b.observe_usage({"p": (17, CAPACITY)}, T0 + 2)
    assert b.pools["p"].stage is Stage.PAUSE_BATCH


def test_a_stage_held_high_for_a_signal_sheds_its_classes_while_held() -> None:
    b = board(queue_age_s=5.0, min_dwell_s=2.0)
    fill(b, 10)  # 10/20: below every limit
    b.observe_queue("p", depth=3, oldest_age_s=6.0, now=T0 + 3)  # not draining: one stage up
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    b.observe_queue("p", depth=0, oldest_age_s=0.0, now=T0 + 3.5)  # drained, within the dwell
    assert b.pools["p"].stage is Stage.SHED_SPECULATIVE
    assert ask(b, "speculative", now=T0 + 3.5) is not None  # the signal's stage still sheds
    assert ask(b, "batch", now=T0 + 3.5) is None


def test_a_broker_alarm_moves_the_stage_at_once_despite_the_dwell() -> None:
    b = board(min_dwell_s=60.0)
    b.observe_usage({"p": (14, CAPACITY)}, T0)
    before = b.pools["p"].stage
    b.observe_broker(True, T0 + 0.1)
    assert b.pools["p"].stage is called_for(b, blocked=True) is not before
    assert b.pools["p"].since == T0 + 0.1


# ---- the line's retry times -----------------------------------------------------------------
def measured(b: PressureBoard, hold_s: float) -> None:
    """Give the board a measured service time: a grant held ``hold_s`` and released."""
    b.granted("sample", "p", "t1", T0)
    b.ended("sample", T0 + hold_s, completed=True)


def test_a_newcomer_joins_the_line_only_with_slack_to_its_deadline() -> None:
    """20 slots, 1 s a task: one grant ends every 50 ms. Place 20 comes back in ~1 s and
    finishes ~2 s from now; with a 2.3 s deadline a waiter already in line keeps its place,
    a newcomer is refused at once (the time until its finish again to spare: 4 s > 2.3)."""
    b = board()
    measured(b, 1.0)
    for joining, expected in ((False, True), (True, False)):
        retry = b.line_retry_ms("p", 20, 0, 1.0, T0 + 2 + 2.3, T0 + 2, lambda: 0.5, joining=joining)
        assert (retry is not None) is expected
    # With room to spare both are placed.
    assert b.line_retry_ms("p", 20, 0, 1.0, T0 + 2 + 4.5, T0 + 2, random.random, joining=True)


def test_a_place_in_line_comes_back_before_its_turn_never_after() -> None:
    b = board()
    measured(b, 1.0)  # a grant ends every 50 ms
    rng = random.Random(3)
    retries = [b.line_retry_ms("p", 11, 1, 1.0, None, T0 + 2, rng.random) for _ in range(500)]
    turn_ms = 10 * 50.0  # ten grants end before its turn
    assert all(r is not None and turn_ms - 25 <= r <= turn_ms for r in retries), (
        min(r or 0 for r in retries),
        max(r or 0 for r in retries),
    )
    assert len(set(retries)) > 10  # spread over half a drain interval, not all at once
