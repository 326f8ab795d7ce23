"""A manager killed under load: three ``mesh manager --shards`` processes, a fleet of agents
spread over every shard, and producers running tasks on both paths the whole time.

kill -9 the manager holding the most shards while ``run_task`` (the lease path: find and
acquire across managers) and ``submit`` (admission against the shared PostgreSQL ledger) run
in a loop, then:

* every request is answered — no producer call fails;
* the ledger holds each admission once, under its own fence, and every one is settled
  (nothing granted twice, nothing left held);
* no agent is declared lost by any manager (the dead one's agents register with the new
  owners, which never saw them silent);
* the dead manager's shards are owned again within the lease and a step, and every agent is
  registered again within a heartbeat interval after that — both times are printed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import pytest
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.events import LogEntry
from mesh.core.shards import shard_of
from mesh.ledger import PostgresLedger, ReservationState
from mesh.manager.journal import SqliteJournal
from mesh.producer import MeshClient
from mesh.samples.echo import EchoAgent

from .tcp_proxy import TcpProxy
from .test_shard_failover import LEASE_S, SHARDS, STEP_S, Fleet, balanced, until
from .test_shard_failover import fleet as fleet  # the fixture, used by name

POOLS = ("lambda", "beta", "echo", "calc", "alpha", "gamma")  # shards 0..5 of 6
HEARTBEAT_S = 5.0  # the agents' minimum
AMQP_HEARTBEAT_S = max(1, int(LEASE_S / 2))  # what a sharded manager asks the broker for
LOAD_S = 3.0  # of load before the kill
AFTER_S = LEASE_S + HEARTBEAT_S + 4.0  # of load after it: takeover and re-registration


def agent_of(
    amqp_url: str, namespace: str, pool: str, n: int, heartbeat_s: float = HEARTBEAT_S
) -> AgentRuntime:
    agent_class = type(f"Echo_{pool}", (EchoAgent,), {"deployment": pool})
    return AgentRuntime(
        agent_class(f"{pool}-{n}", heartbeat_interval_s=heartbeat_s),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )


@pytest.fixture
async def agents(fleet: Fleet, amqp_url: str, namespace: str) -> AsyncIterator[list[str]]:
    runtimes = [agent_of(amqp_url, namespace, pool, 1) for pool in POOLS]
    runtimes.append(agent_of(amqp_url, namespace, "echo", 2))  # the admission path's pool
    async for ids in running(runtimes):
        yield ids


async def running(runtimes: list[AgentRuntime]) -> AsyncIterator[list[str]]:
    """The agents started, their IDs yielded, stopped afterwards (a fixture's body)."""
    try:
        for runtime in runtimes:
            await runtime.start()
        yield [r.agent.agent_id for r in runtimes]
    finally:
        for runtime in runtimes:
            await runtime.stop()


class Load:
    """Producers on both paths in a loop until stopped: two ``run_task`` (the lease path)
    and two ``submit`` (admission); every call's outcome is counted or its failure kept."""

    def __init__(self, producer: MeshClient) -> None:
        self.producer = producer
        self.done: Counter[str] = Counter()
        self.failures: list[str] = []
        self.admitted: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._lease_path()) for _ in range(2)]
        self._tasks += [asyncio.create_task(self._admission_path()) for _ in range(2)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _lease_path(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = await self.producer.run_task(
                    "test.echo", {"message": "lease", "sleep_ms": 20}, timeout_s=30
                )
                assert outcome.output["message"] == "lease"
                self.done["run_task"] += 1
            except Exception as exc:
                self.failures.append(f"run_task: {exc!r}")

    async def _admission_path(self) -> None:
        while not self._stop.is_set():
            try:
                submitted = await self.producer.submit(
                    echo_requirements(), {"message": "admitted", "sleep_ms": 20}, timeout_s=30
                )
                self.admitted.append(submitted.decision.admission_id)
                self.done["submit"] += 1
            except Exception as exc:
                self.failures.append(f"submit: {exc!r}")


@pytest.fixture
async def producer(amqp_url: str, namespace: str) -> AsyncIterator[MeshClient]:
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        yield client
    finally:
        await client.close()


def pool_of(agent_id: str) -> str:
    return agent_id.rsplit("-", 1)[0]


def journal_of(fleet: Fleet, manager_id: str) -> list[LogEntry]:
    journal = SqliteJournal(fleet.journal_path(manager_id))
    try:
        return list(journal.query(limit=None))
    finally:
        journal.close()


def assert_it_acted_on_nothing_it_lost(
    fleet: Fleet, manager_id: str, held: set[int], woke_at: float
) -> None:
    """Woken, it acted on none of the shards it lost: its journal has each loss, and from its
    waking on nothing about an agent of a lost shard (until it takes that shard again)."""
    log = journal_of(fleet, manager_id)
    lost = {int(e.detail["shard"]) for e in log if e.kind == "shard" and e.reason == "lost"}
    assert lost == held
    # From its waking on, a lost shard is not its own until it takes it again (a new tenure,
    # under a larger fence, once it rejoins the balance).
    theirs = set(lost)
    acted = []
    for e in (e for e in log if e.at >= woke_at):
        if e.kind == "shard" and e.reason == "taken":
            theirs.discard(int(e.detail["shard"]))
        elif e.agent_id and shard_of(pool_of(e.agent_id), SHARDS) in theirs:
            acted.append(e)
    assert acted == [], [
        (round(e.at - woke_at, 3), e.kind, e.agent_id, e.reason, e.detail)
        for e in log
        if e.at >= woke_at - 0.5
    ][:30]


def lost_in_journals(fleet: Fleet) -> list[tuple[str, str]]:
    lost = []
    for manager_id in fleet.procs:
        journal = SqliteJournal(fleet.journal_path(manager_id))
        try:
            lost += [(manager_id, e.agent_id) for e in journal.query(kinds=["lost"], limit=None)]
        finally:
            journal.close()
    return lost


async def ready_for_load(
    fleet: Fleet, producer: MeshClient, agents: int
) -> Callable[[], Awaitable[bool]]:
    """Wait for an even split and every agent registered with its shard's owner, describe the
    echo pool; returns the check that every agent is registered."""

    async def everyone_registered() -> bool:
        return (await producer.status(agents_limit=0)).agents_total == agents

    # The agents registered while the managers were still sharing out the shards: those that
    # moved register again with the new owner on their next heartbeat.
    await until(lambda: balanced(fleet, set(fleet.procs)), "an even split over three")
    await until(everyone_registered, "every agent registered with its shard's owner")
    # `mesh manager` runs policy generation 1 (the sample descriptor says 7).
    descriptor = echo_descriptor(8).model_copy(update={"policy_generation": 1})
    accepted = await producer.publish_descriptor(descriptor)
    assert accepted.type == "mesh.descriptor-accepted.v1", accepted
    return everyone_registered


async def assert_nothing_lost(
    load: Load, before: dict[str, int], ledger: PostgresLedger, fleet: Fleet
) -> None:
    """Every request answered on both paths, before and after the change, and none answered
    twice differently; the ledger holds each admission once, under a fence of its own, every
    one settled; no agent declared lost by any manager."""
    assert load.failures == []
    # Answered twice only the same (the first manager died before its ack), never differently.
    differing = load.producer.counters["duplicate_replies_differing"]
    assert differing == 0, list(load.producer.answered_differently)
    assert load.done["run_task"] > before.get("run_task", 0) > 0
    assert load.done["submit"] > before.get("submit", 0) > 0
    await until(lambda: all_released(ledger), "every grant released (releases asked again)")
    reservations = {r: state for r, (state, _) in ledger.replay_log().items()}
    assert set(load.admitted) <= set(reservations)
    assert Counter(reservations.values()) == {ReservationState.RELEASED: len(reservations)}
    fences = [fence for _, fence in ledger.replay_log().values()]
    assert len(fences) == len(set(fences))
    assert lost_in_journals(fleet) == []
    # A grant given again from the ledger (a redelivered request) is journaled as a replay.
    assert grants_journaled_twice(fleet) == {}
    await until(lambda: live_capacity_from_the_owners(fleet), "live figures from the owners")


def replays(fleet: Fleet) -> int:
    return sum(
        1
        for manager_id in fleet.procs
        for e in journal_of(fleet, manager_id)
        if e.kind == "admission" and e.reason == "replayed"
    )


def all_released(ledger: PostgresLedger) -> bool:
    """A release that met a failover is asked again in the background (producer)."""
    states = {state for state, _ in ledger.replay_log().values()}
    return states <= {ReservationState.RELEASED}


def grants_journaled_twice(fleet: Fleet) -> dict[str, int]:
    """Admission IDs journaled as granted more than once over every manager's journal. A
    request decided and answered by one manager whose ack never left (killed or frozen) is
    decided again from the ledger — the same grant — by the manager the broker gives it to,
    which journals it ``replayed``."""
    granted: Counter[str] = Counter()
    for manager_id in fleet.procs:
        for e in journal_of(fleet, manager_id):
            if e.kind == "admission" and e.reason == "admitted":
                granted[str(e.detail["admission_id"])] += 1
    return {a: n for a, n in granted.items() if n > 1}


def live_capacity_from_the_owners(fleet: Fleet) -> bool:
    """Admission is bounded by live agents (``submit`` takes a live slot per grant): every
    pool's live figures in the ledger are written by its shard's owner now, under its fence,
    and count the pool's agents (echo has two, every other pool one). A shard taken a moment
    ago may still show its previous owner's row until its agents are back."""
    leases = fleet.view().leases
    rows = fleet.leases.read_live()
    return (
        set(rows) == set(POOLS)
        and all(
            (row.shard, row.fence) == (shard_of(pool, SHARDS), leases[row.shard].fence)
            and row.agents() == (2 if pool == "echo" else 1)
            for pool, row in rows.items()
            if row.shard in leases
        )
        and set(leases) == set(range(SHARDS))
    )


def spread(fleet: Fleet, managers: set[str]) -> bool:
    """Every shard held, by exactly ``managers``, as evenly as the count allows."""
    held = {m: len(s) for m, s in fleet.held_by().items()}
    return (
        set(held) == managers
        and sum(held.values()) == SHARDS
        and max(held.values()) - min(held.values()) <= 1
    )


async def test_managers_joining_and_leaving_under_load_rebalance_without_losing_an_agent(
    fleet: Fleet, agents: list[str], producer: MeshClient, ledger: PostgresLedger, amqp_url: str
) -> None:
    everyone_registered = await ready_for_load(fleet, producer, len(agents))
    load = Load(producer)
    load.start()
    await asyncio.sleep(LOAD_S)
    before = dict(load.done)

    fleet.start("m3")  # a fourth joins: it takes its share from the others
    joined = await until(lambda: spread(fleet, {"m0", "m1", "m2", "m3"}), "a share for m3")
    await until(everyone_registered, "every agent registered after the join")
    fleet.procs["m0"].terminate()  # one leaves cleanly: it gives its shards back
    assert fleet.procs["m0"].wait(timeout=30) == 0
    left = await until(lambda: spread(fleet, {"m1", "m2", "m3"}), "m0's shards taken")
    await until(everyone_registered, "every agent registered after the leave")
    await asyncio.sleep(2.0)
    await load.stop()
    print(
        f"\njoin rebalanced in {joined:.2f} s, leave in {left:.2f} s; requests before "
        f"{before}, in all {dict(load.done)}"
    )
    await assert_nothing_lost(load, before, ledger, fleet)


async def test_a_manager_cut_off_from_the_broker_gives_its_shards_up_and_comes_back(
    fleet: Fleet, agents: list[str], producer: MeshClient, ledger: PostgresLedger, amqp_url: str
) -> None:
    async with TcpProxy() as proxy:
        # m2 again, but reaching the broker through the proxy (PostgreSQL directly).
        fleet.procs["m2"].terminate()
        assert fleet.procs["m2"].wait(timeout=30) == 0
        del fleet.procs["m2"]
        url = urlsplit(amqp_url)
        fleet.start(
            "m2",
            urlunsplit(url._replace(netloc=f"{url.netloc.split('@')[0]}@127.0.0.1:{proxy.port}")),
        )
        everyone_registered = await ready_for_load(fleet, producer, len(agents))
        load = Load(producer)
        load.start()
        await asyncio.sleep(LOAD_S)
        before = dict(load.done)
        held = fleet.held_by()["m2"]

        proxy.reset()  # cut: every connection reset, new ones refused
        cut = time.monotonic()
        took = await until(lambda: spread(fleet, {"m0", "m1"}), "m2's shards taken")
        await until(everyone_registered, "every agent registered with m0 or m1")
        back = time.monotonic() - cut
        proxy.pass_through()
        rejoined = await until(lambda: spread(fleet, {"m0", "m1", "m2"}), "m2 back")
        await until(everyone_registered, "every agent registered after m2 is back")
        await asyncio.sleep(2.0)
        await load.stop()
        print(
            f"\ncut of m2 ({len(held)} shards): given up and taken in {took:.2f} s, every "
            f"agent registered again in {back:.2f} s, m2 holding shards again "
            f"{rejoined:.2f} s after the link came back; in all {dict(load.done)}"
        )
        # Cut off, it gave its shards back rather than hold what it could not serve.
        assert took <= LEASE_S / 2 + LEASE_S + 2 * STEP_S
        given = [s for change, s, _ in fleet.shard_log("m2") if change == "given_back"]
        assert set(given) >= held
        await assert_nothing_lost(load, before, ledger, fleet)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_a_manager_killed_or_frozen_under_load_loses_no_request_no_grant_and_no_agent(
    fault: str, fleet: Fleet, agents: list[str], producer: MeshClient, ledger: PostgresLedger
) -> None:
    assert sorted(shard_of(pool, SHARDS) for pool in POOLS) == list(range(SHARDS))
    everyone_registered = await ready_for_load(fleet, producer, len(agents))
    load = Load(producer)
    load.start()
    await asyncio.sleep(LOAD_S)
    before_kill = dict(load.done)

    held = fleet.held_by()
    victim = max(held, key=lambda m: (len(held[m]), m))
    survivors = set(fleet.procs) - {victim}
    faulted = time.monotonic()
    if fault == "kill":
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait()
    else:
        fleet.procs[victim].send_signal(signal.SIGSTOP)

    def taken_over() -> bool:
        owners = fleet.held_by()
        return set(owners) <= survivors and sum(map(len, owners.values())) == SHARDS

    took = await until(taken_over, "the survivors hold every shard")
    # Its agents are back with the new owners while it is still frozen: the broker closes
    # the frozen connection after about two of its AMQP heartbeats (half a lease, at least
    # 1 s), so its shard queues' single-active-consumer moves on as the leases did.
    await until(everyone_registered, "every agent registered again")
    back = time.monotonic() - faulted
    if fault == "freeze":
        # Woken: the first thing it does with any message is to learn what it lost.
        woke_at = time.time()
        fleet.procs[victim].send_signal(signal.SIGCONT)
    await asyncio.sleep(max(0.0, AFTER_S - back))
    await load.stop()
    done = load.done
    print(
        f"\n{fault} of {victim} ({len(held[victim])} shards): shards owned again after "
        f"{took:.2f} s, every agent registered again after {back:.2f} s; "
        f"requests done before the fault {before_kill}, in all {dict(done)}; answered twice "
        f"{producer.counters['duplicate_replies']}, grants replayed "
        f"{replays(fleet)}"
    )
    if fault == "freeze":
        assert_it_acted_on_nothing_it_lost(fleet, victim, held[victim], woke_at)

    assert took <= LEASE_S + 2 * STEP_S + 0.5
    # The lease, a step to notice, an agent's heartbeat interval to be asked to register
    # again; frozen, the broker's two missed AMQP heartbeats (1 s each here) may come later.
    closed_s = 0.0 if fault == "kill" else 2 * AMQP_HEARTBEAT_S
    assert back <= max(LEASE_S + 2 * STEP_S, closed_s) + HEARTBEAT_S + 2.0
    await assert_nothing_lost(load, before_kill, ledger, fleet)
