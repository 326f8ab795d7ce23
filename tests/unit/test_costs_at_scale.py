"""Costs that grow with what changes, not with the fleet: the work one call does at 100k grants
or agents is measured in Python lines executed (``sys.settrace``), not in seconds, so the test
means the same on a busy machine. A walk over every grant or agent would run each loop line
100k times; these calls must run about as many lines at 100k as at 100."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

from mesh.core.pressure import EVICTION_ORDER, PressureBoard, PressurePolicy, evict_order

from .samples import T0

NO_STAGES = PressurePolicy(thresholds=(1.0, 1.0, 1.0))


def lines_run(call: Callable[[], Any]) -> tuple[int, Any]:
    """How many Python lines ``call()`` executes (in every function it calls), and its result."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        result = call()
    finally:
        sys.settrace(None)
    return count, result


def board_with(grants: int, tenants: int = 10) -> PressureBoard:
    """One full pool ``p`` holding ``grants`` batch and speculative grants, every third one not
    evictable, the rest rebuildable or retryable, spread over ``tenants`` tenants."""
    b = PressureBoard(NO_STAGES)
    b.observe_usage({"p": (0, grants + 1)}, T0)
    recoverabilities = (*EVICTION_ORDER, "side_effects")
    for i in range(grants):
        b.granted(
            f"g{i}",
            "p",
            f"t{i % tenants}",
            T0 + i * 1e-3,
            rank=i % 2,
            evict_order=evict_order(recoverabilities[i % 3]),
        )
    return b


def test_choosing_a_victim_runs_as_many_lines_at_100k_grants_as_at_100() -> None:
    small, large = board_with(100), board_with(100_000)
    for tenant in ("t0", "newcomer"):  # at its share (own grants only) and below it (any)
        lines_small, _ = lines_run(partial(small.victim, "p", tenant, 2, T0 + 200))
        lines_large, chosen = lines_run(partial(large.victim, "p", tenant, 2, T0 + 200))
        assert chosen is not None
        assert lines_large <= lines_small + 20, (tenant, lines_small, lines_large)


def end_all(b: PressureBoard, admission_ids: list[str]) -> None:
    for admission_id in admission_ids:
        b.ended(admission_id, T0 + 500, completed=True)


def test_ending_grants_costs_the_same_per_grant_at_100k_as_at_100() -> None:
    """Dropping a grant from the eviction index is amortised O(1): end a tenth of the grants
    and compare lines per grant (the heaps compact now and then, which the average includes)."""
    per_grant = []
    for size in (1_000, 100_000):
        b = board_with(size)
        ending = [f"g{i}" for i in range(0, size, 10)]
        lines, _ = lines_run(partial(end_all, b, ending))
        per_grant.append(lines / len(ending))
    assert per_grant[1] <= per_grant[0] * 1.5 + 5, per_grant


def brute_force_victim(b: PressureBoard, pool_id: str, tenant: str, rank: int, now: float):
    """The definition, walked over every grant (what the board did before it kept an index)."""
    p = b.pool(pool_id)
    below_share = p.holders.get(tenant, 0) < b.fair_share(pool_id, tenant, now)
    best, chosen = None, None
    for admission_id, held in b._holdings.items():
        if held.pool_id != pool_id or held.evict_order is None or held.rank >= rank:
            continue
        if not below_share and held.tenant != tenant:
            continue
        key = (held.evict_order, held.rank, -held.since)
        if best is None or key < best:
            best, chosen = key, admission_id
    return chosen


def test_the_indexed_victim_is_the_one_the_definition_picks_through_grants_ending_and_restored():
    rng = random.Random(20)
    b = PressureBoard(NO_STAGES)
    b.observe_usage({"p": (0, 400)}, T0)
    live: dict[str, Any] = {}
    now = T0
    recoverabilities = (*EVICTION_ORDER, "side_effects", None)
    for step in range(4_000):
        now += rng.choice((0.0, 0.001, 0.5))  # equal grant times happen too
        roll = rng.random()
        if roll < 0.55 or not live:
            admission_id = f"a{step}"
            b.granted(
                admission_id,
                "p",
                rng.choice(("t1", "t2", "t3")),
                now,
                rank=rng.randrange(3),
                evict_order=evict_order(rng.choice(recoverabilities)),
            )
            live[admission_id] = None
        elif roll < 0.9:
            admission_id = rng.choice(sorted(live))
            held = b.ended(admission_id, now, completed=rng.random() < 0.5)
            if rng.random() < 0.2:  # the evicting transaction rolled back
                assert held is not None
                b.restore(admission_id, held, now)
            else:
                del live[admission_id]
        tenant = rng.choice(("t1", "t2", "t3", "t4"))
        assert b.victim("p", tenant, 2, now) == brute_force_victim(b, "p", tenant, 2, now)
