"""The one backoff (mesh.backoff): every retry loop's spacing, and the two ways it is used."""

from __future__ import annotations

import random

from mesh.agent import backoff_delay
from mesh.backoff import Backoff
from mesh.producer import retry_delay_s


def test_the_step_doubles_from_the_base_up_to_the_cap() -> None:
    fixed = Backoff(base_s=0.5, cap_s=4.0, spread=0.0)  # no random share: the step itself
    assert [fixed.delay_s(a, random.random) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert fixed.delay_s(10_000, random.random) == 4.0  # no overflow far out


def test_full_jitter_ranges_from_nothing_to_the_step_and_equal_jitter_from_half() -> None:
    full, equal = Backoff(base_s=1.0, cap_s=1.0), Backoff(base_s=1.0, cap_s=1.0, spread=0.5)
    assert (full.delay_s(0, lambda: 0.0), full.delay_s(0, lambda: 0.999)) == (0.0, 0.999)
    assert (equal.delay_s(0, lambda: 0.0), equal.delay_s(0, lambda: 1.0)) == (0.5, 1.0)


def test_a_floor_comes_first() -> None:
    assert Backoff(base_s=0.1, cap_s=0.1).delay_s(0, lambda: 0.5, at_least_s=2.0) == 2.05


def test_the_producer_and_the_agent_retry_through_it() -> None:
    """``submit``'s and the agent's retry times are this one function's (the same numbers
    their own formulas gave: the producer's full jitter after retry_after_ms, the agent's
    equal jitter)."""
    assert retry_delay_s(250, 2, Backoff(), lambda: 0.5) == 0.25 + 0.2 * 0.5
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert backoff_delay(3, rng=rng_a, base_s=0.5, cap_s=10.0) == 2.0 + 2.0 * rng_b.random()
