"""Staged shedding as a function of a pool's numbers (mesh.core.policy.stages)."""

from __future__ import annotations

import pytest

from mesh.core.policy.settings import PressurePolicy, Stage
from mesh.core.policy.stages import RANK_STOPS_AT, shed_rank, stage_called_for, stage_limits

POLICY = PressurePolicy()  # thresholds 0.7, 0.85, 0.95; hysteresis 0.1; queue age 5 s


def called_for(
    used: int,
    capacity: int = 20,
    *,
    blocked: bool = False,
    queue_depth: int = 0,
    oldest_age_s: float = 0.0,
) -> tuple[Stage, str]:
    limits, _ = stage_limits(capacity, POLICY)
    return stage_called_for(
        used=used,
        capacity=capacity,
        limits=limits,
        blocked=blocked,
        queue_depth=queue_depth,
        oldest_age_s=oldest_age_s,
        policy=POLICY,
    )


def test_the_limits_are_the_thresholds_floor_of_capacity_at_least_one() -> None:
    assert stage_limits(20, POLICY) == ((14, 17, 19), (12, 15, 17))
    assert stage_limits(1, POLICY) == ((1, 1, 1), (1, 1, 1))  # an idle small pool admits


@pytest.mark.parametrize(
    ("used", "stage"),
    [
        (13, Stage.NORMAL),
        (14, Stage.SHED_SPECULATIVE),
        (17, Stage.PAUSE_BATCH),
        (19, Stage.TIGHTEN),
        (20, Stage.TIGHTEN),  # full: utilisation alone never rejects interactive work
    ],
)
def test_utilisation_calls_for_the_highest_stage_whose_limit_is_reached(
    used: int, stage: Stage
) -> None:
    assert called_for(used) == (stage, "utilisation")


def test_an_old_queue_raises_one_stage_and_a_broker_alarm_rejects_interactive_work() -> None:
    assert called_for(3, queue_depth=4, oldest_age_s=6.0) == (Stage.SHED_SPECULATIVE, "queue age")
    assert called_for(19, queue_depth=4, oldest_age_s=6.0) == (Stage.TIGHTEN, "utilisation")
    assert called_for(20, queue_depth=4, oldest_age_s=6.0) == (
        Stage.REJECT_INTERACTIVE,
        "queue age",
    )
    assert called_for(3, queue_depth=4, oldest_age_s=4.0) == (Stage.NORMAL, "utilisation")
    assert called_for(0, blocked=True) == (Stage.REJECT_INTERACTIVE, "blocked")


def test_off_calls_for_nothing() -> None:
    off = PressurePolicy(enabled=False)
    assert stage_called_for(
        used=20,
        capacity=20,
        limits=(1, 1, 1),
        blocked=True,
        queue_depth=9,
        oldest_age_s=60.0,
        policy=off,
    ) == (Stage.NORMAL, "off")


def test_work_is_shed_cheapest_first() -> None:
    assert [shed_rank(c, 0, POLICY) for c in ("speculative", "batch", "interactive")] == [0, 1, 2]
    assert shed_rank("batch", 1, PressurePolicy(low_priority=2)) == 0  # low-priority fan-out
    assert RANK_STOPS_AT == {
        0: Stage.SHED_SPECULATIVE,
        1: Stage.PAUSE_BATCH,
        2: Stage.REJECT_INTERACTIVE,
    }
