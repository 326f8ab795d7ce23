"""Liveness under frozen processes and jittery heartbeats: silence caused by the manager's own
stall is not the agents' fault, jitter inside the window is not a loss, a real stop is exactly
one.

The manager runs in its own OS process (``tests/integration/manager_process.py``: a plain
``ManagerService`` with the test heartbeat rule — lost after 3 missed 0.5 s heartbeats — and a
PostgreSQL ledger in the test's schema); it prints every journal entry, which is what these
tests read. The agents are :class:`~integration.harness.RawAgent` s in the test process, beating
on the shared broker.

* **The manager frozen** (``SIGSTOP``) for :data:`FREEZE_S`, more than twice the agents'
  window, while they keep beating: on ``SIGCONT`` it journals ``manager_stalled`` and declares
  no agent lost. Then one agent really stops: exactly that one is lost, once, within its bound.
  The freeze lands right after the agents' registration — usually before the manager's first
  periodic tick, which is how this test found that a stall before the first tick went unseen
  (every agent evicted on waking; now the manager ticks once at start for a baseline).
* **Heartbeat jitter inside the window**: gaps drawn between 0.1 s and :data:`MAX_GAP_S` (the
  window is 1.5 s) for several seconds: no loss, no flapping. Then a real stop: exactly one loss
  event, within the bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

from integration.harness import RawAgent, eventually
from integration.test_admission_competition import (
    ManagerProcess,
    Managers,
)

from mesh.topology import Topology

INTERVAL_S = 0.5
MISSES = 3  # the manager's rule (PoolSettings.missed_heartbeats_before_lost)
WINDOW_S = MISSES * INTERVAL_S
FREEZE_S = 4.0
MAX_GAP_S = 1.0
TICK_S = 0.2  # manager_process.py's tick
MARGIN_S = 1.5  # two shared cores: scheduling, not tolerance
LOSS_BOUND_S = WINDOW_S + INTERVAL_S + TICK_S + MARGIN_S
"""From an agent's last heartbeat to the manager journaling it lost, at most."""


def entries(proc: ManagerProcess, kind: str, agent_id: str | None = None) -> list[dict[str, Any]]:
    return [
        line
        for line in proc.lines
        if line["event"] == "log"
        and line["kind"] == kind
        and (agent_id is None or line.get("agent_id") == agent_id)
    ]


async def beating_agents(
    transport_factory: Any, topology: Topology, proc: ManagerProcess, count: int
) -> list[RawAgent]:
    transport = await transport_factory(suffix="agents")
    agents = [RawAgent(transport, topology, f"hb-{n}", interval_s=INTERVAL_S) for n in range(count)]
    for agent in agents:
        await agent.start()
        await agent.register()
        agent.start_heartbeats()
    await eventually(
        lambda: all(entries(proc, "ready", a.agent_id) for a in agents),
        what="every agent Ready",
    )
    return agents


async def stop_and_time_the_loss(proc: ManagerProcess, agent: RawAgent) -> float:
    """Stop ``agent``'s heartbeats; seconds from its last one to the manager's ``lost``."""
    await agent.stop_heartbeats()
    last_beat = time.monotonic()
    await eventually(
        lambda: bool(entries(proc, "lost", agent.agent_id)),
        timeout_s=LOSS_BOUND_S + 5,
        what=f"{agent.agent_id} declared lost",
    )
    return time.monotonic() - last_beat


async def test_a_frozen_manager_notices_its_stall_and_evicts_no_healthy_agent(
    managers: Managers, transport_factory: Any, topology: Topology
) -> None:
    (proc,) = await managers.start("m-frozen")
    agents = await beating_agents(transport_factory, topology, proc, 3)
    assert proc.proc is not None

    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(FREEZE_S)  # the agents keep beating; nobody reads them
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    await eventually(
        lambda: bool(entries(proc, "manager_stalled")), what="the manager to notice its stall"
    )
    await asyncio.sleep(3 * WINDOW_S)  # long enough for a wrong eviction to show
    stalls = entries(proc, "manager_stalled")
    print(f"journal: {stalls[0]['reason']}")
    assert len(stalls) == 1
    assert not entries(proc, "lost"), "a healthy agent was evicted for the manager's own stall"

    took = await stop_and_time_the_loss(proc, agents[0])
    await asyncio.sleep(2 * WINDOW_S)
    print(f"{agents[0].agent_id} declared lost {took:.2f} s after its last heartbeat")
    assert took <= LOSS_BOUND_S
    assert [e["agent_id"] for e in entries(proc, "lost")] == [agents[0].agent_id]


async def test_heartbeat_jitter_inside_the_window_never_flaps_and_a_real_stop_is_one_loss(
    managers: Managers, transport_factory: Any, topology: Topology
) -> None:
    (proc,) = await managers.start("m-jitter")
    (agent,) = await beating_agents(transport_factory, topology, proc, 1)
    await agent.stop_heartbeats()  # from here on the beats come with jitter

    rng = random.Random(7)
    gaps = []
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline:
        await agent.heartbeat()
        gap = rng.uniform(0.1, MAX_GAP_S)
        gaps.append(gap)
        await asyncio.sleep(gap)
    await agent.heartbeat()
    print(f"{len(gaps)} jittered gaps, longest {max(gaps):.2f} s (window {WINDOW_S} s)")
    assert max(gaps) > 2 * INTERVAL_S * 0.9  # the jitter did exceed the nominal interval
    assert not entries(proc, "lost"), "jitter inside the window was taken for a loss"

    last_beat = time.monotonic()
    await eventually(
        lambda: bool(entries(proc, "lost", agent.agent_id)),
        timeout_s=LOSS_BOUND_S + 5,
        what="the stopped agent declared lost",
    )
    took = time.monotonic() - last_beat
    await asyncio.sleep(2 * WINDOW_S)  # a second loss event (a flap) would show by now
    print(f"declared lost {took:.2f} s after its last heartbeat")
    assert took <= LOSS_BOUND_S
    assert len(entries(proc, "lost", agent.agent_id)) == 1
    assert len(entries(proc, "ready", agent.agent_id)) == 1  # never re-admitted in between
