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
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from integration.test_admission_competition import PgSchema
from integration.test_backpressure import echo_descriptor, echo_requirements

from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.shards import shard_of
from mesh.ledger import PostgresLedger, ReservationState
from mesh.manager.journal import SqliteJournal
from mesh.producer import MeshClient
from mesh.samples.echo import EchoAgent

from .test_shard_failover import LEASE_S, SHARDS, STEP_S, Fleet, balanced, until
from .test_shard_failover import fleet as fleet  # the fixture, used by name

POOLS = ("lambda", "beta", "echo", "calc", "alpha", "gamma")  # shards 0..5 of 6
HEARTBEAT_S = 5.0  # the agents' minimum
LOAD_S = 3.0  # of load before the kill
AFTER_S = LEASE_S + HEARTBEAT_S + 4.0  # of load after it: takeover and re-registration


def agent_of(amqp_url: str, namespace: str, pool: str, n: int) -> AgentRuntime:
    agent_class = type(f"Echo_{pool}", (EchoAgent,), {"deployment": pool})
    return AgentRuntime(
        agent_class(f"{pool}-{n}", heartbeat_interval_s=HEARTBEAT_S),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )


@pytest.fixture
async def agents(fleet: Fleet, amqp_url: str, namespace: str) -> AsyncIterator[list[str]]:
    runtimes = [agent_of(amqp_url, namespace, pool, 1) for pool in POOLS]
    runtimes.append(agent_of(amqp_url, namespace, "echo", 2))  # the admission path's pool
    try:
        for runtime in runtimes:
            await runtime.start()
        yield [r.agent.agent_id for r in runtimes]
    finally:
        for runtime in runtimes:
            await runtime.stop()


def lost_in_journals(fleet: Fleet) -> list[tuple[str, str]]:
    lost = []
    for manager_id in fleet.procs:
        journal = SqliteJournal(fleet.journal_path(manager_id))
        try:
            lost += [(manager_id, e.agent_id) for e in journal.query(kinds=["lost"], limit=None)]
        finally:
            journal.close()
    return lost


async def test_a_manager_killed_under_load_loses_no_request_no_grant_and_no_agent(
    fleet: Fleet, agents: list[str], amqp_url: str, namespace: str, pg_schema: PgSchema
) -> None:
    assert sorted(shard_of(pool, SHARDS) for pool in POOLS) == list(range(SHARDS))
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    ledger = PostgresLedger(pg_schema.dsn, schema=pg_schema.schema, application_name="test")
    try:

        async def everyone_registered() -> bool:
            return (await producer.status(agents_limit=0)).agents_total == len(agents)

        # The agents registered while the managers were still sharing out the shards: those
        # that moved register again with the new owner on their next heartbeat.
        await until(lambda: balanced(fleet, set(fleet.procs)), "an even split over three")
        await until(everyone_registered, "every agent registered with its shard's owner")
        # `mesh manager` runs policy generation 1 (the sample descriptor says 7).
        descriptor = echo_descriptor(8).model_copy(update={"policy_generation": 1})
        accepted = await producer.publish_descriptor(descriptor)
        assert accepted.type == "mesh.descriptor-accepted.v1", accepted

        stop = asyncio.Event()
        done: Counter[str] = Counter()
        failures: list[str] = []
        admitted: list[str] = []

        async def lease_path() -> None:
            while not stop.is_set():
                try:
                    outcome = await producer.run_task(
                        "test.echo", {"message": "lease", "sleep_ms": 20}, timeout_s=30
                    )
                    assert outcome.output["message"] == "lease"
                    done["run_task"] += 1
                except Exception as exc:
                    failures.append(f"run_task: {exc!r}")

        async def admission_path() -> None:
            while not stop.is_set():
                try:
                    submitted = await producer.submit(
                        echo_requirements(), {"message": "admitted", "sleep_ms": 20}, timeout_s=30
                    )
                    admitted.append(submitted.decision.admission_id)
                    done["submit"] += 1
                except Exception as exc:
                    failures.append(f"submit: {exc!r}")

        load = [asyncio.create_task(lease_path()) for _ in range(2)]
        load += [asyncio.create_task(admission_path()) for _ in range(2)]
        await asyncio.sleep(LOAD_S)
        before_kill = dict(done)

        held = fleet.held_by()
        victim = max(held, key=lambda m: (len(held[m]), m))
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait()
        survivors = set(fleet.procs) - {victim}

        def taken_over() -> bool:
            owners = fleet.held_by()
            return set(owners) <= survivors and sum(map(len, owners.values())) == SHARDS

        took = await until(taken_over, "the survivors hold every shard")
        back = took + await until(everyone_registered, "every agent registered again")
        await asyncio.sleep(max(0.0, AFTER_S - back))
        stop.set()
        await asyncio.gather(*load)
        print(
            f"\nkill -9 of {victim} ({len(held[victim])} shards): shards owned again after "
            f"{took:.2f} s, every agent registered again after {back:.2f} s; "
            f"requests done before the kill {before_kill}, in all {dict(done)}"
        )

        # Every request answered, on both paths, before and after the kill.
        assert failures == []
        assert done["run_task"] > before_kill.get("run_task", 0) > 0
        assert done["submit"] > before_kill.get("submit", 0) > 0
        assert took <= LEASE_S + 2 * STEP_S + 0.5
        assert back <= LEASE_S + 2 * STEP_S + HEARTBEAT_S + 2.0
        # The ledger: each admission once, under a fence of its own, every one settled.
        reservations = {r: state for r, (state, _) in ledger.replay_log().items()}
        assert set(admitted) <= set(reservations)
        assert Counter(reservations.values()) == {ReservationState.RELEASED: len(reservations)}
        fences = [fence for _, fence in ledger.replay_log().values()]
        assert len(fences) == len(set(fences))
        # No agent declared lost, by any manager.
        assert lost_in_journals(fleet) == []
    finally:
        ledger.close()
        await producer.close()
