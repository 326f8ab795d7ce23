"""Costs that grow with what changes, not with the fleet: the work one call does at 100k grants
or agents is measured in Python lines executed (``sys.settrace``), not in seconds, so the test
means the same on a busy machine. A walk over every grant or agent would run each loop line
100k times; these calls must run about as many lines at 100k as at 100."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from mesh.core import HeartbeatReceived, RegistrationReceived
from mesh.core.pressure import EVICTION_ORDER, PressureBoard, PressurePolicy, evict_order
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.wire import Heartbeat, StatusRequest

from .builders import capability, registration
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


# ---- the manager's views at 100k agents ------------------------------------------------------

POOLS = ("rag-eu", "rag-us", "calc", "echo")


def manager_with(agents: int, tmp_path: Path) -> ManagerService:
    """A manager (not started: no broker) whose pool core holds ``agents`` registered agents
    over four pools, two capabilities each, every tenth one busy."""
    service = ManagerService(
        ManagerSettings(
            namespace="scale",
            journal_path=tmp_path / f"journal-{agents}.sqlite3",
            ledger_url=f"sqlite:{tmp_path / f'ledger-{agents}.sqlite3'}",
        )
    )
    core, now = service.core, service.clock.now()
    caps = [capability("rag.search", "2.1.0", max_concurrency=4), capability("calc.add")]
    for n in range(agents):
        agent_id = f"agent-{n:06d}"
        reg = registration(agent_id, *caps, deployment=POOLS[n % len(POOLS)])
        core.handle(RegistrationReceived(reg, True), now)
        if n % 10 == 0:
            hb = Heartbeat(
                agent_id=agent_id,
                incarnation="inc-1",
                seq=1,
                sent_at=now.wall,
                pool_in_flight={"rag.search": 2},
            )
            core.handle(HeartbeatReceived(hb), now)
    return service


def test_metrics_status_summary_and_a_status_page_cost_the_same_at_100k_agents_as_at_100(
    tmp_path: Path,
) -> None:
    small, large = manager_with(100, tmp_path), manager_with(100_000, tmp_path)
    views: list[tuple[str, Callable[[ManagerService], Callable[[], Any]]]] = [
        ("/metrics", lambda s: s.observer.metrics.render),
        ("/api/status", lambda s: partial(s.observer.document, 0, 50)),  # a page of 50 rows
        ("status summary", lambda s: partial(s.status, StatusRequest(agents_limit=0))),
        ("status page", lambda s: partial(s.status, StatusRequest(agents_limit=50))),
    ]
    for what, view in views:
        lines_small, _ = lines_run(view(small))
        lines_large, _ = lines_run(view(large))
        assert lines_large <= lines_small * 1.1 + 200, (what, lines_small, lines_large)

    summary = large.status(StatusRequest(agents_limit=0))
    assert summary.agents_total == 100_000 and summary.agents == []
    by_pool = {p.pool_id: p.states for p in summary.pool_states or []}
    assert by_pool["rag-eu"] == {"Ready": 20_000, "Busy": 5_000}  # n % 20 == 0 is busy
    assert by_pool["rag-us"] == {"Ready": 25_000}
    (_, rag) = summary.capability_loads or []
    assert (rag.name, rag.agents, rag.in_flight, rag.capacity) == (
        "rag.search",
        100_000,
        20_000,
        400_000,
    )
    page = large.status(StatusRequest(agents_offset=99_990, agents_limit=50))
    assert [a.agent_id for a in page.agents] == [f"agent-{n:06d}" for n in range(99_990, 100_000)]
    text = large.observer.metrics.render().decode()
    assert 'mesh_agents{capability="rag.search",state="Busy"} 10000.0' in text
    assert 'mesh_in_flight{capability="rag.search"} 20000.0' in text
