"""Managers with ``shard_count`` set share the registry's shards through the real PostgreSQL
lease table, on the real broker: an even split, every transfer in the orchestration log, a
clean stop handing its shards over, agents registered with their shard's owner only (and
moving with their shard), and a clear error without a PostgreSQL ledger."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mesh.agent import AgentRuntime, AgentSettings
from mesh.agent.errors import RegistrationRefusedError
from mesh.core.events import ScaleTo
from mesh.core.pool import PoolSettings
from mesh.core.scaling import ScalingPolicy
from mesh.core.shards import shard_of
from mesh.errors import LocalProtocolError
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.render import render_status
from mesh.samples.echo import EchoAgent
from mesh.top import shard_line
from mesh.topology import names
from mesh.topology.specs import BindingSpec, Declarations, QueueSpec
from mesh.transport import AmqpTransport
from mesh.transport.delivery import Delivery
from mesh.wire import AdmissionReason
from mesh.wire.codec import encode
from mesh.wire.models import (
    AgentRegistration,
    FindReply,
    FindRequest,
    Lease,
    Refusal,
    Released,
)
from mesh.wire.reasons import Reason
from mesh.wire.status import StatusReply, StatusRequest

from . import test_admission_competition as competition
from .harness import eventually
from .test_admission_competition import PgSchema
from .test_backpressure import echo_descriptor, echo_requirements

pg_schema = competition.pg_schema  # the competition tests' fixture: a schema of the test's own

pytestmark = pytest.mark.integration

SHARDS = 4
LEASE_S = 1.0

MakeManager = Callable[[str], ManagerSettings]


@pytest.fixture
async def started(
    amqp_url: str, namespace: str, pg_schema: PgSchema, tmp_path: Path
) -> AsyncIterator[Callable[[str], asyncio.Future[ManagerService]]]:
    dsn, schema = pg_schema.dsn, pg_schema.schema
    services: list[ManagerService] = []

    async def start(
        manager_id: str, scaler: Any = None, capacity: str = "descriptor", **overrides: Any
    ) -> ManagerService:
        scaling = tuple(ScalingPolicy(p, min_replicas=0) for p in POOLS) if scaler else ()
        settings = ManagerSettings(
            amqp_url=amqp_url,
            namespace=namespace,
            journal_path=tmp_path / f"{manager_id}.sqlite3",
            manager_id=manager_id,
            ledger_url=dsn,
            ledger_schema=schema,
            admission_capacity=capacity,  # type: ignore[arg-type]
            shard_count=SHARDS,
            shard_lease_s=LEASE_S,
            pool=PoolSettings(reregister_backoff_s=0.5, scaling=scaling),
            operator_user="guest",  # the test publishes descriptors
            peer_timeout_s=10.0,  # these tests check merged answers, not a slow peer left out
        )
        settings = dataclasses.replace(settings, **overrides)
        service = ManagerService(settings, scaler=scaler)
        services.append(service)
        await service.start()
        return service

    yield start  # type: ignore[misc]
    for service in reversed(services):
        await service.stop()


def owned(service: ManagerService) -> set[int]:
    assert service.shards is not None
    return set(service.shards.owned())


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> float:
    """Seconds until ``check`` holds (``harness.eventually``, polled every 50 ms)."""
    started = time.monotonic()
    await eventually(check, what=what, timeout_s=timeout_s, poll_s=0.05)
    return time.monotonic() - started


def shard_log(service: ManagerService) -> list[tuple[str, int]]:
    assert service.journal is not None
    return [
        (e.reason, int(e.detail["shard"]))
        for e in service.journal.query(limit=None)
        if e.kind == "shard"
    ]


async def stop_answering(service: ManagerService) -> None:
    """``service`` stops answering while it still holds its shards (frozen or dying, its lease
    not yet run out): every consumer of its cancelled."""
    shard_consumers = (c for cs in service.sharding.consumers.values() for c in cs)
    for consumer in [*service._consumers, *shard_consumers]:
        await consumer.cancel()


async def split_evenly(
    started: Callable[..., asyncio.Future[ManagerService]], *extra: Any, **settings: Any
) -> tuple[ManagerService, ManagerService]:
    """Managers a and b (each started with ``extra`` and ``settings``), once they hold half
    the shards each."""
    a = await started("manager-a", *extra, **settings)
    b = await started("manager-b", *extra, **settings)
    await until(lambda: len(owned(a)) == len(owned(b)) == SHARDS // 2, "an even split")
    return a, b


async def test_two_managers_split_the_shards_and_a_clean_stop_hands_them_over(
    started: Callable[[str], asyncio.Future[ManagerService]],
) -> None:
    a = await started("manager-a")
    assert owned(a) == set(range(SHARDS))  # alone, it holds everything from its start
    b = await started("manager-b")
    await until(lambda: len(owned(a)) == len(owned(b)) == SHARDS // 2, "an even split")
    assert owned(a) | owned(b) == set(range(SHARDS))
    assert sorted(s for change, s in shard_log(a) if change == "given_back") == sorted(owned(b))
    assert sorted(s for change, s in shard_log(b) if change == "taken") == sorted(owned(b))

    assert a.shards is not None
    await a.shards.step()  # a fresh read of the table for the status below
    reply = a.status(StatusRequest(agents_limit=10))
    assert reply.shard_count == SHARDS
    assert {(row.shard, row.owner) for row in reply.shards or []} == {
        *((s, "manager-a") for s in owned(a)),
        *((s, "manager-b") for s in owned(b)),
    }
    metrics = a.observer.metrics.render().decode()
    assert f'mesh_shards_held{{manager="manager-a"}} {len(owned(a))}.0' in metrics
    for shard, fence in a.shards.owned().items():
        assert f'mesh_shard_fence{{manager="manager-a",shard="{shard}"}} {fence}.0' in metrics
    assert 'mesh_shard_transfers_total{change="given_back",manager="manager-a"}' in metrics
    shown = render_status(reply)
    assert f"shards: {SHARDS} of {SHARDS} held" in shown
    assert "manager-b" in shown
    # The status page's document (and so `mesh top`) names the holders too.
    page = a.observer.document(0, 0)["shards"]
    assert page["count"] == SHARDS
    assert {(r["shard"], r["owner"]) for r in page["owners"]} == {
        (row.shard, row.owner) for row in reply.shards or []
    }
    line = shard_line(page, "manager-a")
    assert line.startswith(f"shards {SHARDS}: manager-a (this one) ") and "manager-b " in line

    handed = owned(b)
    await b.stop()
    # No lease to wait out: a's next step (a third of a lease) takes them.
    took = await until(lambda: owned(a) == set(range(SHARDS)), "a takes b's shards back")
    assert took < LEASE_S
    # Their agents are registering again with a: a status says so, to a client that knows
    # the field (settling_shards), for a default heartbeat interval after the move.
    client = await MeshClient.connect(a.settings.amqp_url, namespace=a.settings.namespace)
    try:
        settling = await client.status(agents_limit=10)
    finally:
        await client.close()
    # Every shard moved within the interval: a took all at its start, b's just now.
    assert settling.settling_shards == SHARDS, settling
    assert f"settling: {SHARDS} shard(s) changed hands just now" in render_status(settling)
    assert a.shards.settling_shards(window_s=0.0) == 0  # every shard leased, none moving now
    reopened = SqliteJournal(b.settings.journal_path)  # b's own journal, closed with b
    try:
        given = [e.detail["shard"] for e in reopened.query(limit=None) if e.reason == "given_back"]
    finally:
        reopened.close()
    assert set(given) >= handed


POOLS = ("iota", "gamma", "echo", "calc")  # shards 0, 1, 2, 3 of 4
HEARTBEAT_S = 5.0  # the agents' minimum


def pool_agent(amqp_url: str, namespace: str, pool: str, **settings: object) -> AgentRuntime:
    """An echo agent of pool ``pool`` (the sample, in another deployment)."""
    agent_class = type(f"Echo_{pool}", (EchoAgent,), {"deployment": pool})
    return AgentRuntime(
        agent_class(f"{pool}-1", heartbeat_interval_s=HEARTBEAT_S),
        AgentSettings(amqp_url=amqp_url, namespace=namespace, **settings),  # type: ignore[arg-type]
    )


def registered(service: ManagerService) -> set[str]:
    return set(service.core.agents)


def lost_agents(service: ManagerService) -> list[str]:
    assert service.journal is not None
    return [e.agent_id for e in service.journal.query(limit=None) if e.kind == "lost"]


@contextlib.asynccontextmanager
async def an_agent_on_b(
    started: Callable[..., asyncio.Future[ManagerService]],
    amqp_url: str,
    namespace: str,
    client_name: str,
) -> AsyncIterator[tuple[ManagerService, ManagerService, str, MeshClient]]:
    """Managers a and b (half the shards each, peers answering within 0.3 s), an echo agent
    registered with b (its pool's shard is b's), and a client: ``(a, b, pool, client)``."""
    a, b = await split_evenly(started, peer_timeout_s=0.3)
    pool = next(p for p in POOLS if shard_of(p, SHARDS) in owned(b))
    agent = pool_agent(amqp_url, namespace, pool)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name=client_name)
    try:
        await agent.start()
        yield a, b, pool, client
    finally:
        await client.close()
        await agent.stop()


async def test_agents_register_with_their_shards_owner_and_move_with_their_shard(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    assert [shard_of(pool, SHARDS) for pool in POOLS] == [0, 1, 2, 3]
    a, b = await split_evenly(started)
    agents = [pool_agent(amqp_url, namespace, pool) for pool in POOLS]
    try:
        for agent in agents:  # each registers through the shared queue, whoever takes it
            await agent.start()

        # Each agent is in exactly its shard's owner's registry, and was told its shard.
        expected = {m: {f"{p}-1" for p in POOLS if shard_of(p, SHARDS) in owned(m)} for m in (a, b)}
        assert registered(a) == expected[a] and registered(b) == expected[b]
        assert [agent.shard for agent in agents] == [0, 1, 2, 3]
        forwarded = a.counters["registrations_forwarded"] + b.counters["registrations_forwarded"]
        assert forwarded >= 1, "no registration went through the other manager"
        # Heartbeats reach the owner only (under its own key, through the shard's queue).
        seqs = {m: {i: m.core.agents[i].last_heartbeat_seq for i in expected[m]} for m in (a, b)}
        await until(
            lambda: all(
                m.core.agents[i].last_heartbeat_seq > seqs[m][i]
                for m in (a, b)
                for i in expected[m]
            ),
            "a heartbeat of every agent at its owner",
            timeout_s=2 * HEARTBEAT_S,
        )
        assert a.counters["heartbeat_unknown_agent"] == b.counters["heartbeat_unknown_agent"] == 0

        # b stops (a clean stop hands its shards back): a takes them, asks their agents to
        # register again, and holds the whole fleet; nobody is declared lost on the way.
        await b.stop()
        moved = await until(
            lambda: registered(a) == {f"{p}-1" for p in POOLS},
            "every agent with a",
            timeout_s=3 * HEARTBEAT_S,
        )
        print(f"\nb's agents registered with a {moved:.2f} s after b stopped")
        assert moved < LEASE_S + HEARTBEAT_S + 1.5  # the bound: a lease and a heartbeat
        assert lost_agents(a) == [] and a.core.counters["lost"] == 0
        for agent in agents:  # b's agents registered twice, a's once
            again = agent.agent.agent_id in expected[b]
            assert agent.counters["registration_attempts"] == (2 if again else 1), agent.counters
    finally:
        for agent in agents:
            await agent.stop()


async def test_a_clean_stop_hands_its_agents_over_at_once_and_their_leases_stay_valid(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    # The only agent offering a capability is on b; b stops cleanly. Asked at once (not at
    # its next heartbeat), the agent registers with a before an acquire right after the stop
    # gives up, and a task under the lease b granted just before still runs.
    a, b = await split_evenly(started)
    pool = next(p for p in POOLS if shard_of(p, SHARDS) in owned(b))
    agent = pool_agent(amqp_url, namespace, pool)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        await agent.start()
        assert registered(b) == {f"{pool}-1"} and registered(a) == set()
        held = await client.acquire("test.echo")
        assert isinstance(held, Lease), held
        await until(
            lambda: held.lease_id in agent.credentials.issued, "the agent told of the lease"
        )

        await b.stop()
        stopped = time.monotonic()
        lease = await client.acquire("test.echo")
        took = time.monotonic() - stopped
        print(f"\nacquired on the new owner {took:.2f} s after the old one stopped")
        assert isinstance(lease, Lease) and lease.agent_id == f"{pool}-1", lease
        assert took < HEARTBEAT_S / 2  # asked at once: a heartbeat (5 s) is not waited for
        assert b.counters["handed_over_asked"] == 1 and agent.counters["handed_over"] == 1
        assert agent.counters["leases_forgotten"] == 0
        for granted in (held, lease):  # b's lease (a does not know it) and a's
            result = await client._send_and_wait(
                granted, {"message": "hi", "sleep_ms": 0}, time.time() + 10
            )
            assert result.status == "ok", result
        assert lost_agents(a) == [] and a.core.counters["lost"] == 0
    finally:
        await client.close()
        await agent.stop()


async def test_an_owner_that_does_not_answer_makes_an_acquire_retryable_not_unknown(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    # The only agent offering a capability is on b, and b stops answering while it still
    # holds its shards (frozen or dying, its lease not yet run out: here its consumers are
    # cancelled). An acquire that only a can take must not say nobody offers the capability:
    # it is refused NO_AGENT_AVAILABLE with a hint of when to ask again.
    async with an_agent_on_b(started, amqp_url, namespace, "producer") as (a, b, pool, client):
        assert registered(b) == {f"{pool}-1"}
        await stop_answering(b)

        refused = await client.acquire("test.echo")
        assert isinstance(refused, Refusal), refused
        assert refused.reason is Reason.NO_AGENT_AVAILABLE, refused
        assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
        assert "did not answer" in refused.detail
        assert a.counters["acquires_refused_for_now.UNKNOWN_CAPABILITY"] == 1
        # b may hold any capability while it is silent: even one nobody else offers.
        other = await client.acquire("test.nothing")
        assert isinstance(other, Refusal) and other.reason is Reason.NO_AGENT_AVAILABLE, other


async def test_a_status_over_an_owner_that_does_not_answer_says_it_is_partial(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    # b holds an agent and stops answering (its consumers cancelled, its lease not run out):
    # a's status leaves b's agents out, and says so to a client that knows the field.
    async with an_agent_on_b(started, amqp_url, namespace, "operator") as (a, b, _, client):
        whole = await client.status(agents_limit=10)
        assert whole.unanswered_shards == 0 and whole.agents_total == 1, whole
        assert "partial" not in render_status(whole)

        await stop_answering(b)
        partial = await client.status(agents_limit=10)
        assert partial.manager_id == a.settings.manager_id
        # Every shard a does not hold is b's, or was a moment ago: none of them answered.
        missing = SHARDS - len(owned(a))
        assert partial.unanswered_shards == missing and partial.agents_total == 0, partial
        shown = render_status(partial)
        assert f"partial: the owners of {missing} shard(s) did not answer in time" in shown
        assert a.counters["status_shards_unanswered"] >= missing
        # A client that does not list the feature (one that predates the field, which
        # refuses unknown fields) is not sent it.
        older = await client.request(StatusRequest(agents_limit=10))
        assert isinstance(older, StatusReply) and older.unanswered_shards is None, older
        assert "unanswered_shards" not in json.loads(encode(older))


async def test_a_find_over_an_owner_that_does_not_answer_says_it_is_partial(
    started: Callable[[str], asyncio.Future[ManagerService]],
    amqp_url: str,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The only agent offering test.echo is on b, and b stops answering while it still holds
    # its shards: a's find leaves the agent out, and says so to a client that knows the field.
    async with an_agent_on_b(started, amqp_url, namespace, "producer") as (a, b, pool, client):
        whole = await client.find_reply("test.echo")
        assert [s.agent_id for s in whole.agents] == [f"{pool}-1"], whole
        assert whole.unanswered_shards == 0, whole

        await stop_answering(b)
        partial = await client.find_reply("test.echo")
        missing = SHARDS - len(owned(a))
        assert partial.agents == [] and partial.unanswered_shards == missing, partial
        assert a.counters["find_shards_unanswered"] >= missing
        with caplog.at_level("WARNING", logger="mesh.producer.client"):
            assert await client.find("test.echo") == []
        assert f"the owners of {missing} shard(s) did not answer in time" in caplog.text
        # A client that does not list the feature is not sent the field.
        older = await client.request(FindRequest(capability="test.echo"))
        assert isinstance(older, FindReply) and older.unanswered_shards is None, older
        assert "unanswered_shards" not in json.loads(encode(older))


async def test_any_manager_finds_acquires_and_releases_on_every_shard(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    a, b = await split_evenly(started)
    agents = [pool_agent(amqp_url, namespace, pool) for pool in POOLS]
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    everyone = {f"{pool}-1" for pool in POOLS}
    try:
        for agent in agents:
            await agent.start()
        assert registered(a) | registered(b) == everyone and not registered(a) & registered(b)

        # Each request goes to whichever manager takes it from the shared RPC queue; every
        # answer covers the agents of both managers.
        for _ in range(6):
            assert {x.agent_id for x in await client.find("test.echo")} == everyone
        assert len(await client.find("test.echo", limit=3)) == 3
        # Status: the summary added up over both registries, the rows paged in ID order, the
        # described pool's live figures from its owner whichever manager answers.
        described = echo_descriptor(8).model_copy(update={"policy_generation": 1})
        assert (await client.publish_descriptor(described)).type.endswith("accepted.v1")
        await until(lambda: all(m.admission.descriptors for m in (a, b)), "both know the pool")
        for _ in range(4):
            first = await client.status(agents_limit=3)
            rest = await client.status(agents_offset=3, agents_limit=3)
            assert first.agents_total == rest.agents_total == len(POOLS)
            assert [r.agent_id for r in first.agents + rest.agents] == sorted(everyone)
            assert {p.pool_id for p in first.pool_states or []} == set(POOLS)
            (echo,) = first.capability_loads or []
            assert (echo.name, echo.agents) == ("test.echo", len(POOLS))
            (pool,) = first.pools
            assert (pool.pool_id, pool.live_agents, pool.live_slots) == ("echo", 1, 8), pool
        # Acquire by capability takes the least loaded agent of all: 8 leases, 2 on each.
        leases = [await client.acquire("test.echo") for _ in range(2 * len(POOLS))]
        assert all(isinstance(lease, Lease) for lease in leases), leases
        held = Counter(lease.agent_id for lease in leases if isinstance(lease, Lease))
        assert held == dict.fromkeys(everyone, 2)
        # By name, on either manager's agent; released through whichever manager.
        for agent_id in sorted(everyone):
            named = await client.acquire("test.echo", agent_id=agent_id)
            assert isinstance(named, Lease) and named.agent_id == agent_id, named
            leases.append(named)
        for lease in leases:
            assert isinstance(lease, Lease)
            assert isinstance(await client.release(lease.lease_id), Released)
        assert all(not m.core.leases for m in (a, b))
        again = await client.release(leases[0].lease_id)  # asked of every owner: none holds it
        assert isinstance(again, Refusal) and again.reason is Reason.UNKNOWN_LEASE, again
        unknown = await client.acquire("test.echo", agent_id="nobody-1")
        assert isinstance(unknown, Refusal) and unknown.reason is Reason.UNKNOWN_AGENT
        # The whole lease path: find, acquire, run on the agent, release.
        outcome = await client.run_task("test.echo", {"message": "hi", "sleep_ms": 0})
        assert outcome.output["message"] == "hi", outcome
        assert a.counters["peer_requests"] + b.counters["peer_requests"] > 0
        assert a.counters["peer_no_answer"] == b.counters["peer_no_answer"] == 0
    finally:
        await client.close()
        for agent in agents:
            await agent.stop()


async def test_an_agent_that_cannot_route_by_shard_is_refused_with_the_reason(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    await started("manager-a")

    class Unsharded(EchoAgent):  # an SDK from before shards: it would beat to the shared queue
        def registration(self, incarnation: str) -> AgentRegistration:
            listed = super().registration(incarnation)
            return listed.model_copy(update={"features": ["descriptor-epochs"]})

    agent = AgentRuntime(
        Unsharded("echo-old", heartbeat_interval_s=HEARTBEAT_S),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )
    try:
        with pytest.raises(RegistrationRefusedError, match="SHARDS_UNSUPPORTED"):
            await agent.start()
    finally:
        await agent.stop()


async def test_shards_without_a_postgresql_ledger_are_a_clear_error(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    settings = ManagerSettings(
        amqp_url=amqp_url,
        namespace=namespace,
        journal_path=tmp_path / "journal.sqlite3",
        ledger_url=f"sqlite:{tmp_path / 'ledger.sqlite3'}",
        shard_count=4,
    )
    with pytest.raises(LocalProtocolError, match="shards need a PostgreSQL ledger"):
        await ManagerService(settings).start()


class RecordingScaler:
    """Records what a manager asks of its scaler (a Deployment named after each pool)."""

    def __init__(self) -> None:
        self.scaled: list[tuple[str, int]] = []
        self.read: list[str] = []

    async def current_replicas(self, deployment: str) -> int | None:
        self.read.append(deployment)
        return 1

    async def scale_to(
        self, deployment: str, replicas: int, *, remove_first: str | None = None
    ) -> None:
        self.scaled.append((deployment, replicas))

    async def delete_pod(self, deployment: str, pod: str) -> None:
        self.scaled.append((deployment, -1))

    async def close(self) -> None:
        return None


async def test_only_the_owner_of_a_pools_shard_scales_its_deployment(
    started: Callable[[str], asyncio.Future[ManagerService]],
) -> None:
    scalers = {m: RecordingScaler() for m in ("manager-a", "manager-b")}
    a = await started("manager-a", scalers["manager-a"])
    b = await started("manager-b", scalers["manager-b"])
    await until(lambda: len(owned(a)) == len(owned(b)) == SHARDS // 2, "an even split")
    for manager in (a, b):
        for pool in POOLS:
            await manager.scaling.scale(ScaleTo(pool, 3, "a capacity miss"))
    for manager in (a, b):
        mine = {p for p in POOLS if shard_of(p, SHARDS) in owned(manager)}
        assert scalers[manager.settings.manager_id].scaled == [(p, 3) for p in POOLS if p in mine]
        assert manager.counters["scaling_left_to_the_owner"] == len(POOLS) - len(mine)
    # Taking b's shards, a reads their deployments' replicas afresh (b may have scaled them).
    scalers["manager-a"].read.clear()
    moving = {p for p in POOLS if shard_of(p, SHARDS) in owned(b)}
    await b.stop()
    await until(lambda: owned(a) == set(range(SHARDS)), "a holds every shard")
    await until(lambda: set(scalers["manager-a"].read) >= moving, "a reads their replicas")


async def test_admission_is_bounded_by_live_agents_whichever_manager_decides(
    started: Callable[..., asyncio.Future[ManagerService]],
    amqp_url: str,
    namespace: str,
    pg_schema: PgSchema,
) -> None:
    """Live capacity across managers (mesh.manager.live_share): the echo pool's owner writes
    its agents' free concurrency, fenced by its shard lease, and both managers admit against
    it — at most the live agents' 8 slots though the descriptor allows 100; with no live
    agent left, either manager refuses NO_LIVE_AGENT. With ``descriptor`` capacity all 12
    would be granted."""
    a, b = await split_evenly(started, capacity="live")
    owner = a if shard_of("echo", SHARDS) in owned(a) else b
    agent = pool_agent(amqp_url, namespace, "echo")
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        described = echo_descriptor(100).model_copy(update={"policy_generation": 1})
        assert (await client.publish_descriptor(described)).type.endswith("accepted.v1")
        await until(lambda: all(m.admission.descriptors for m in (a, b)), "both know the pool")
        await agent.start()
        assert registered(owner) == {"echo-1"}
        await until(
            lambda: all(m.admission._live(m.clock.now()).free("echo", "test.echo") == 8
                        for m in (a, b)),
            "both managers see the owner's 8 free slots",
        )  # fmt: skip
        with psycopg.connect(pg_schema.dsn) as conn:
            row = conn.execute(
                f'SELECT shard, fence, offers FROM "{pg_schema.schema}".live_offer '
                "WHERE pool_id = 'echo'"
            ).fetchone()
            capacity = conn.execute(
                f'SELECT capacity FROM "{pg_schema.schema}".ledger_capacity '
                "WHERE pool_id = 'echo' AND resource = 'live_slots:test.echo'"
            ).fetchone()
        assert owner.shards is not None
        shard, fence = shard_of("echo", SHARDS), owner.shards.owned()[shard_of("echo", SHARDS)]
        assert row == (shard, fence, [["test.echo", "1.0.0", "C", 1, 8]]), row
        assert capacity == (8,)
        metrics = owner.observer.metrics.render().decode()
        me = owner.settings.manager_id
        assert f'mesh_live_writes_total{{manager="{me}",outcome="written"}}' in metrics

        batches = {m: m.counters["admission_batches"] for m in (a, b)}
        decisions = [await client.admit(echo_requirements()) for _ in range(12)]
        granted = [d for d in decisions if d.outcome == "admitted"]
        assert len(granted) == 8, [(d.outcome, d.reason) for d in decisions]
        assert all(m.counters["admission_batches"] > batches[m] for m in (a, b)), "one decided all"
        assert a.counters["live_writes_fenced"] == b.counters["live_writes_fenced"] == 0

        await agent.stop()  # deregisters: its owner writes that the pool has no live agent
        await until(
            lambda: all(m.admission._live(m.clock.now()).agents("echo", "test.echo") == 0
                        for m in (a, b)),
            "both managers see no live agent",
        )  # fmt: skip
        refusals = [await client.admit(echo_requirements()) for _ in range(6)]
        assert {d.reason for d in refusals} == {AdmissionReason.NO_LIVE_AGENT}, refusals
    finally:
        await client.close()
        await agent.stop()


async def test_a_redelivered_acquire_or_release_is_answered_the_same_again(
    started: Callable[[str], asyncio.Future[ManagerService]], amqp_url: str, namespace: str
) -> None:
    """A manager answered an acquire with a lease and stopped before its ack: the broker gives
    the request, marked redelivered, to another manager. That one holds no agent of the
    capability here (they are all b's, and full now), and deciding anew would say "no agent
    available" — one request answered twice, differently. It asks the owners for the lease the
    request's ID already holds and answers with it. Likewise a release answered ``released``
    and redelivered is answered ``released`` again, not ``UNKNOWN_LEASE``. The redeliveries are
    handed to manager a as the broker hands them (the request as it went out, marked
    redelivered)."""
    async with an_agent_on_b(started, amqp_url, namespace, "producer") as (a, b, _pool, client):
        tap = await AmqpTransport.connect(amqp_url, name="tap")
        seen: asyncio.Queue[Delivery] = asyncio.Queue()
        queue = f"{namespace}.test.tap"
        await tap.declare(
            Declarations(
                queues=(QueueSpec(queue, durable=False),),
                bindings=tuple(
                    BindingSpec(queue, client.topology.control_exchange, names.rpc_key(method))
                    for method in ("acquire", "release")
                ),
            )
        )
        await tap.consume(queue, seen.put, no_ack=True)
        try:
            first = await client.acquire("test.echo")
            assert isinstance(first, Lease), first
            request = await asyncio.wait_for(seen.get(), 5)
            while isinstance(await client.acquire("test.echo"), Lease):  # the agent is full
                pass
            held = set(b.core.leases)

            await a.intake.handle_request(dataclasses.replace(request, redelivered=True))

            await eventually(lambda: client.counters["duplicate_replies"] == 1, what="again")
            assert client.counters["duplicate_replies_differing"] == 0, list(
                client.answered_differently
            )
            assert a.counters["acquires_redelivered_answered_again"] == 1
            assert set(b.core.leases) == held and first.lease_id in held  # no lease more

            assert isinstance(await client.release(first.lease_id), Released)
            while (release := await asyncio.wait_for(seen.get(), 5)).routing_key != (
                names.rpc_key("release")
            ):
                pass  # the acquires that filled the agent
            await a.intake.handle_request(dataclasses.replace(release, redelivered=True))
            await eventually(lambda: client.counters["duplicate_replies"] == 2, what="again")
            assert client.counters["duplicate_replies_differing"] == 0, list(
                client.answered_differently
            )
            assert a.counters["releases_redelivered_answered_again"] == 1
        finally:
            await tap.close()
