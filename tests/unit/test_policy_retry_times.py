"""Retry times from the pool's drain rate (mesh.core.policy.retry_times)."""

from __future__ import annotations

import math
import random
import statistics

from mesh.core.policy.retry_times import line_retry_ms, no_agent_retry_ms, refusal_retry_ms
from mesh.core.policy.settings import PressurePolicy

POLICY = PressurePolicy(jitter=0.0, line_jitter=0.0)
NOW = 1_000.0


def middle() -> float:
    return 0.5


def test_a_refusal_waits_for_its_slots_and_its_tenants_waiting_requests_to_drain() -> None:
    # 10 slots, 2 s each: a grant ends every 0.2 s.
    assert refusal_retry_ms(1, 0, 10, 2.0, NOW, None, POLICY, middle) == 200
    assert refusal_retry_ms(3, 2, 10, 2.0, NOW, None, POLICY, middle) == 1_000
    # Clamped, and the default before any service time is known.
    assert refusal_retry_ms(1, 10_000, 10, 2.0, NOW, None, POLICY, middle) == POLICY.retry_max_ms
    assert refusal_retry_ms(1, 0, 10, 0.0, NOW, None, POLICY, middle) == POLICY.retry_default_ms


def test_a_refusal_whose_deadline_passes_first_is_told_so() -> None:
    assert refusal_retry_ms(1, 0, 10, 2.0, NOW, NOW + 2.1, POLICY, middle) is None
    assert refusal_retry_ms(1, 0, 10, 2.0, NOW, NOW + 2.3, POLICY, middle) == 200


def test_jitter_spreads_refused_producers_around_the_wait() -> None:
    spread = PressurePolicy(jitter=0.5)
    low = refusal_retry_ms(1, 4, 10, 2.0, NOW, None, spread, lambda: 0.0)
    high = refusal_retry_ms(1, 4, 10, 2.0, NOW, None, spread, lambda: 1.0)
    assert (low, high) == (500, 1_500)


def test_off_is_a_constant() -> None:
    off = PressurePolicy(enabled=False)
    assert refusal_retry_ms(9, 9, 10, 2.0, NOW, NOW, off, middle) == off.retry_default_ms


def test_a_place_in_line_comes_back_when_the_grants_before_it_have_ended() -> None:
    # 10 slots, 2 s each: one ends every 200 ms. Fifth in line with one slot free: 4 to end.
    assert line_retry_ms(5, 1, 10, 2.0, 0.0, NOW, None, POLICY, middle) == 800
    assert line_retry_ms(1, 1, 10, 2.0, 0.0, NOW, None, POLICY, middle) == 200
    early = PressurePolicy(line_jitter=0.5)  # up to half an interval early, never late
    assert line_retry_ms(5, 1, 10, 2.0, 0.0, NOW, None, early, lambda: 1.0) == 700


def test_joining_the_line_needs_slack_before_the_deadline_a_placed_request_does_not() -> None:
    # Back in 0.8 s, then 1 s queued and 2 s of service: finishes 3.8 s from now.
    args = (5, 1, 10, 2.0, 1.0, NOW, NOW + 5.0, POLICY, middle)
    assert line_retry_ms(*args) == 800
    assert line_retry_ms(*args, joining=True) is None  # 3.8 + 0.05 + 3.8 > 5


def test_retry_times_are_spread_uniformly_around_the_wait() -> None:
    """Statistical: the same wait, many refused producers — the retry times follow
    U(wait * 0.5, wait * 1.5) (Kolmogorov-Smirnov at 1 %), not one instant."""
    rng = random.Random(20261130)
    n = 2000
    samples = []
    for _ in range(n):  # no competitors: the same wait every time
        retry_ms = refusal_retry_ms(4, 0, 20, 1.0, NOW, None, PressurePolicy(), rng.random)
        assert retry_ms is not None
        samples.append(retry_ms)
    wait = 1000 * 4 / (20 / 1.0)  # 4 slots at 20 per second: 200 ms
    lo, hi = wait * 0.5, wait * 1.5
    assert lo <= min(samples) and max(samples) <= hi
    ordered = sorted(samples)
    d = max(
        max((i + 1) / n - (x - lo) / (hi - lo), (x - lo) / (hi - lo) - i / n)
        for i, x in enumerate(ordered)
    )
    assert d < 1.63 / math.sqrt(n), d  # KS critical value at alpha = 0.01
    assert statistics.pstdev(samples) / statistics.mean(samples) > 0.25
    assert max(samples.count(v) for v in set(samples)) < n * 0.02  # no synchronised instant


def test_without_jitter_the_retry_times_would_coincide() -> None:
    """The guard for the test above: the same inputs with jitter off do synchronise."""
    rng = random.Random(1)
    samples = set()
    for _ in range(50):
        off = PressurePolicy(jitter=0.0)
        samples.add(refusal_retry_ms(4, 0, 20, 1.0, NOW, None, off, rng.random))
    assert samples == {200}


def test_without_a_live_agent_a_request_comes_back_when_the_scale_up_is_expected() -> None:
    # The scale planner expects an agent in 4 s; the spread is up to a fifth later.
    assert no_agent_retry_ms(4.0, NOW, None, POLICY, lambda: 0.0) == 4_000
    assert no_agent_retry_ms(4.0, NOW, None, POLICY, lambda: 1.0) == 4_800
    # No scaling policy: the default retry time; and never zero.
    assert no_agent_retry_ms(None, NOW, None, POLICY, lambda: 0.0) == POLICY.retry_default_ms
    assert no_agent_retry_ms(0.0, NOW, None, POLICY, middle) == 1


def test_without_a_live_agent_a_request_whose_deadline_passes_first_is_told_so() -> None:
    assert no_agent_retry_ms(4.0, NOW, NOW + 4.0, POLICY, lambda: 0.0) is None
    assert no_agent_retry_ms(4.0, NOW, NOW + 4.1, POLICY, lambda: 0.0) == 4_000
