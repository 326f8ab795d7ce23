"""``submit``'s retry policy (mesh.producer.retry): whether to ask again, and when."""

from __future__ import annotations

from mesh.backoff import Backoff
from mesh.producer.retry import submit_delay_s
from mesh.wire import AdmissionReason
from mesh.wire.admission import AdmissionDecision

STEP = Backoff(base_s=0.1, cap_s=1.0)  # full jitter over a step from 0.1 s to 1 s


def half() -> float:
    return 0.5


def deferred(retry_after_ms: int | None, position: int | None = None) -> AdmissionDecision:
    return AdmissionDecision(
        admission_id="adm-1",
        outcome="deferred",
        reason=AdmissionReason.CAPACITY,
        retry_after_ms=retry_after_ms,
        position=position,
    )


def test_no_answer_is_asked_again_after_the_backoff_alone() -> None:
    assert submit_delay_s(None, 0, STEP, half) == 0.05
    assert submit_delay_s(None, 3, STEP, half) == 0.4  # the step doubled three times


def test_a_deferral_waits_its_retry_after_then_the_backoff() -> None:
    assert submit_delay_s(deferred(250), 0, STEP, half) == 0.25 + 0.05
    assert submit_delay_s(deferred(250), 10, STEP, half) == 0.25 + 0.5  # capped step


def test_a_place_in_line_comes_back_after_exactly_its_retry_after() -> None:
    # The manager spread the line's times already; a later return loses the place.
    assert submit_delay_s(deferred(120, position=3), 7, STEP, half) == 0.12


def test_a_rejection_is_not_asked_again() -> None:
    rejected = AdmissionDecision(
        admission_id="adm-1", outcome="rejected", reason=AdmissionReason.NO_ELIGIBLE_POOL
    )
    assert submit_delay_s(rejected, 0, STEP, half) is None
