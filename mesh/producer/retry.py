"""``submit``'s retry policy: after each answer (or none), whether to ask again and when.

One function, :func:`submit_delay_s`, pure (randomness is a parameter), with its own tests
(``tests/unit/test_policy_submit_retry.py``); :meth:`MeshClient.submit`'s loop
(:mod:`mesh.producer.admission`) keeps the deadline and the counters. To change how producers
come back, change this module and its test.
"""

from __future__ import annotations

from collections.abc import Callable

from mesh.backoff import Backoff
from mesh.wire.admission import AdmissionDecision

__all__ = ["QUEUE_FULL_RETRY_MS", "retry_delay_s", "submit_delay_s"]

QUEUE_FULL_RETRY_MS = 250  # a full pool queue drains as its agents claim tasks


def retry_delay_s(
    retry_after_ms: int | None, attempt: int, backoff: Backoff, rand: Callable[[], float]
) -> float:
    """Seconds to wait before retry number ``attempt`` (from 0) after a deferral: never
    sooner than the manager's ``retry_after_ms``, then ``backoff`` (:mod:`mesh.backoff`; by
    default full jitter over a step from 50 ms to 5 s)."""
    return backoff.delay_s(attempt, rand, at_least_s=(retry_after_ms or 0) / 1000.0)


def submit_delay_s(
    answer: AdmissionDecision | None,
    attempt: int,
    backoff: Backoff,
    rand: Callable[[], float],
) -> float | None:
    """How long ``submit`` waits before asking again after ``answer`` — ``None`` for no
    answer (the manager or the broker away: asked again with the same admission ID, which
    never takes a second grant) — or ``None`` for "do not ask again" (``rejected``).

    A deferral with a place in the pool's line (``position``) comes back after exactly its
    ``retry_after_ms`` (the manager spread the times already; later, the place is lost);
    any other deferral, a full queue or an eviction after ``retry_after_ms`` and the
    jittered ``backoff`` for retry number ``attempt``."""
    if answer is None:
        return retry_delay_s(None, attempt, backoff, rand)
    if answer.outcome == "rejected":
        return None
    if answer.position is not None:
        return (answer.retry_after_ms or 0) / 1000.0
    return retry_delay_s(answer.retry_after_ms, attempt, backoff, rand)
