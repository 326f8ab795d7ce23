"""Three managers at the documented defaults, through every way a manager leaves and comes
back (issue 47, fault test 5): only true answers while shards move.

Three ``mesh manager --shards`` processes on one PostgreSQL ledger at the documented 10 s shard
lease, agents beating every 10 s (the default), ``submit`` and ``run_task`` looping the whole
time — ``run_task`` also for ``math.evaluate``, which one agent in one pool offers, so its
shard's owner leaving makes the capability unknown to every other registry for a while. Then,
in turn: the manager holding ``calc``'s shard killed -9 and started again (a join), the next
holder frozen (SIGSTOP) past its lease and woken, and one stopped cleanly (SIGTERM). A poller
asks ``mesh status`` every half second throughout.

It ends on: no definite refusal (``UNKNOWN_CAPABILITY`` / ``CAPABILITY_NOT_OFFERED``) of a
capability whose agent was alive (``NO_AGENT_AVAILABLE`` with a retry time is true while its
shard moves: asked again after it); every call answered; no request answered twice
differently (both answers printed if one is); no grant granted twice or journaled twice; no
status that misses agents without saying so (``unanswered_shards`` or ``settling_shards``);
no agent declared lost. The counts (sent, completed, answered twice, definite refusals,
partial statuses flagged and unflagged, recovery seconds) are printed. A request answered
twice *the same* is printed, not refused: a manager killed or frozen between publishing an
answer and acking its request has the request redelivered and answered again from the
ledger — the same grant, the same lease, the same deferral (the producer takes the first
answer and counts the second, ``duplicate_replies``); AMQP cannot make an answer and an ack
one step.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from integration.test_admission_competition import PgSchema

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.shards import shard_of
from mesh.errors import TaskRefused
from mesh.ledger import PostgresLedger
from mesh.producer import MeshClient
from mesh.samples.calc import CalcAgent
from mesh.wire.reasons import Reason

from .test_shard_failover import SHARDS, Fleet, managers_of, until
from .test_shard_failover_load import (
    Load,
    agent_of,
    assert_nothing_lost,
    ready_for_load,
    replays,
    running,
)
from .test_shard_failover_load import producer as producer  # the fixture, used by name

LEASE_S = 10.0  # the documented default
HEARTBEAT_S = c.DEFAULT_HEARTBEAT_INTERVAL_S  # 10 s
POOLS = ("lambda", "beta", "echo", "alpha", "gamma")
DEFINITE = (Reason.UNKNOWN_CAPABILITY.value, Reason.CAPABILITY_NOT_OFFERED.value)


@pytest.fixture
def fleet(amqp_url: str, namespace: str, pg_schema: PgSchema, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(amqp_url, namespace, pg_schema.dsn, pg_schema.schema, tmp_path, lease_s=LEASE_S)
    yield from managers_of(fleet, 3)


@pytest.fixture
async def agents(fleet: Fleet, amqp_url: str, namespace: str) -> AsyncIterator[list[str]]:
    runtimes = [agent_of(amqp_url, namespace, pool, 1, HEARTBEAT_S) for pool in POOLS]
    runtimes.append(agent_of(amqp_url, namespace, "echo", 2, HEARTBEAT_S))
    runtimes.append(
        AgentRuntime(
            CalcAgent("calc-1", heartbeat_interval_s=HEARTBEAT_S),
            AgentSettings(amqp_url=amqp_url, namespace=namespace),
        )
    )
    async for ids in running(runtimes):
        yield ids


class TruthLoad(Load):
    """:class:`Load` plus ``run_task`` of ``math.evaluate`` (one agent, one shard) and a
    status poller; definite refusals and unflagged partial statuses are kept."""

    def __init__(self, producer: MeshClient, agents: int) -> None:
        super().__init__(producer)
        self.agents = agents
        self.definite: list[str] = []
        self.retryable: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()

    def start(self) -> None:
        super().start()
        self._tasks.append(asyncio.create_task(self._calc_path()))
        self._tasks.append(asyncio.create_task(self._status_path()))

    async def _calc_path(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = await self.producer.run_task(
                    "math.evaluate", {"expression": "6 * 7"}, timeout_s=30
                )
                assert outcome.output["value"] == 42
                self.done["calc"] += 1
            except TaskRefused as exc:
                if exc.code == Reason.NO_AGENT_AVAILABLE.value and exc.retry_after_ms:
                    # True while its shard moves: asked again after the hint, as a producer
                    # would (run_task leaves that to its caller).
                    self.retryable[exc.code] += 1
                    await asyncio.sleep(exc.retry_after_ms / 1000)
                    continue
                if exc.code in DEFINITE:
                    self.definite.append(f"{exc.code}: {exc}")
                self.failures.append(f"calc: {exc!r}")
            except Exception as exc:
                self.failures.append(f"calc: {exc!r}")

    async def _status_path(self) -> None:
        while not self._stop.is_set():
            try:
                reply = await self.producer.status(agents_limit=0, timeout_s=5)
            except Exception as exc:
                self.statuses[f"failed: {type(exc).__name__}"] += 1
            else:
                flagged = bool(reply.unanswered_shards or reply.settling_shards)
                if reply.agents_total == self.agents:
                    self.statuses["whole"] += 1
                elif flagged:
                    self.statuses["partial, flagged"] += 1
                else:
                    self.statuses["partial, unflagged"] += 1
            await asyncio.sleep(0.5)


def holder(fleet: Fleet, pool: str) -> str:
    return next(m for m, shards in fleet.held_by().items() if shard_of(pool, SHARDS) in shards)


def spread_over(fleet: Fleet, managers: set[str]) -> bool:
    held = fleet.held_by()
    return set(held) == managers and sum(map(len, held.values())) == SHARDS


async def test_three_managers_at_the_defaults_answer_only_what_is_true_while_shards_move(
    fleet: Fleet, agents: list[str], producer: MeshClient, ledger: PostgresLedger
) -> None:
    everyone_registered = await ready_for_load(fleet, producer, len(agents))
    load = TruthLoad(producer, len(agents))
    load.start()
    await asyncio.sleep(3.0)
    before = dict(load.done)
    times: dict[str, float] = {}

    # 1. kill -9 of calc's holder, then the same manager started again (it joins).
    victim = holder(fleet, "calc")
    fleet.procs[victim].send_signal(signal.SIGKILL)
    fleet.procs[victim].wait()
    t0 = time.monotonic()
    await until(lambda: spread_over(fleet, set(fleet.procs) - {victim}), "kill: taken", 60)
    await until(everyone_registered, "kill: every agent registered again", 60)
    times["kill"] = time.monotonic() - t0
    fleet.start(victim)
    t0 = time.monotonic()
    await until(lambda: spread_over(fleet, set(fleet.procs)), "join: a share again", 60)
    await until(everyone_registered, "join: every agent registered", 60)
    times["join"] = time.monotonic() - t0

    # 2. SIGSTOP of calc's holder past its lease, then SIGCONT.
    frozen = holder(fleet, "calc")
    fleet.procs[frozen].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    await until(lambda: spread_over(fleet, set(fleet.procs) - {frozen}), "freeze: taken", 60)
    await until(everyone_registered, "freeze: every agent registered again", 60)
    times["freeze"] = time.monotonic() - t0
    fleet.procs[frozen].send_signal(signal.SIGCONT)
    t0 = time.monotonic()
    await until(lambda: spread_over(fleet, set(fleet.procs)), "woken: a share again", 60)
    await until(everyone_registered, "woken: every agent registered", 60)
    times["woken"] = time.monotonic() - t0

    # 3. SIGTERM of calc's holder: it gives its shards back and leaves.
    leaver = holder(fleet, "calc")
    fleet.procs[leaver].terminate()
    assert fleet.procs[leaver].wait(timeout=30) == 0
    t0 = time.monotonic()
    await until(lambda: spread_over(fleet, set(fleet.procs) - {leaver}), "leave: taken", 60)
    await until(everyone_registered, "leave: every agent registered again", 60)
    times["leave"] = time.monotonic() - t0
    await asyncio.sleep(2.0)
    await load.stop()

    sent = sum(load.done.values()) + len(load.failures)
    print(
        f"\nthree managers at a {LEASE_S:.0f} s lease, {HEARTBEAT_S:.0f} s heartbeats: sent "
        f"{sent}, completed {dict(load.done)}, failed {len(load.failures)}, definite refusals "
        f"{len(load.definite)}, retryable refusals {dict(load.retryable)}, answered twice "
        f"{producer.counters['duplicate_replies']} (differently "
        f"{producer.counters['duplicate_replies_differing']}), "
        f"grants replayed {replays(fleet)}, statuses {dict(load.statuses)}; every agent "
        f"registered again after (s) " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    )
    for correlation_id, first, second in producer.answered_differently:
        print(f"answered twice, differently: {correlation_id}: first {first}; then {second}")
    assert load.definite == []
    assert load.statuses["partial, unflagged"] == 0, dict(load.statuses)
    assert load.done["calc"] > 0
    await assert_nothing_lost(load, before, ledger, fleet)
