"""The manager against the real broker, driven by raw wire messages."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mesh import constants as c
from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.pool import PoolSettings
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Declarations, QueueArguments, QueueSpec, Topology
from mesh.wire import (
    AcquireRequest,
    DrainComplete,
    DrainNotice,
    DrainRequest,
    Message,
    Reason,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    StatusRequest,
    encode,
)

from .harness import RawAgent, echo_capability, eventually, manager_settings, start_manager


@pytest.fixture
async def raw_agent(transport_factory: Any, topology: Topology) -> Callable[..., Any]:
    async def make(agent_id: str, **kwargs: Any) -> RawAgent:
        agent = RawAgent(await transport_factory(suffix=agent_id), topology, agent_id, **kwargs)
        await agent.start()
        return agent

    return make


def states(status: Any) -> dict[str, str]:
    return {a.agent_id: a.state for a in status.agents}


async def test_a_registered_agent_becomes_ready_and_is_told_so(
    manager: ManagerService, client: MeshClient, raw_agent: Any, tmp_path: Path
) -> None:
    agent = await raw_agent("raw-1")
    await agent.register()

    await eventually(lambda: bool(agent.received(RegistrationAccepted)), what="acceptance")
    status = await client.status()
    assert states(status) == {"raw-1": "Ready"}
    found = await client.find("test.echo")
    assert [a.agent_id for a in found] == ["raw-1"]

    kinds = [(e.kind, e.to_state) for e in SqliteJournal(tmp_path / "journal.sqlite3").tail()]
    assert ("registered", "Registering") in kinds
    assert ("ready", "Ready") in kinds


async def test_a_heartbeat_interval_below_five_seconds_is_refused_with_its_reason(
    amqp_url: str, namespace: str, tmp_path: Path, raw_agent: Any
) -> None:
    # The production rule (5 s minimum), not the shortened test one.
    settings = manager_settings(namespace, tmp_path / "j.sqlite3", amqp_url=amqp_url)
    service = await start_manager(replace(settings, pool=PoolSettings()))
    try:
        agent = await raw_agent("too-eager", interval_s=1.0)
        await agent.register()
        await eventually(lambda: bool(agent.received(RegistrationRefused)), what="refusal")
        refusal = agent.received(RegistrationRefused)[0]
        assert isinstance(refusal, RegistrationRefused)
        assert refusal.reason is Reason.HEARTBEAT_INTERVAL_TOO_SHORT
        assert "GC pauses" in refusal.detail
        assert service.status().agents == []
    finally:
        await service.stop()


async def test_an_agent_whose_heartbeats_stop_is_terminated_and_never_returned_again(
    manager: ManagerService, client: MeshClient, raw_agent: Any, tmp_path: Path
) -> None:
    steady = await raw_agent("steady", interval_s=0.5)
    fading = await raw_agent("fading", interval_s=0.5)
    for agent in (steady, fading):
        await agent.register()
        agent.start_heartbeats()
    await eventually(lambda: len(manager.core.agents) == 2, what="two agents")

    await fading.stop_heartbeats()
    await eventually(lambda: "fading" not in manager.core.agents, timeout_s=10, what="loss")

    # The steady one (heartbeats with jitter inside the window) was never evicted.
    assert "steady" in manager.core.agents
    assert [a.agent_id for a in await client.find("test.echo")] == ["steady"]
    refusal = await client.acquire("test.echo", agent_id="fading")
    assert isinstance(refusal, Refusal) and refusal.reason is Reason.AGENT_TERMINATED
    lost = [e for e in SqliteJournal(tmp_path / "journal.sqlite3").tail() if e.kind == "lost"]
    assert [(e.agent_id, e.to_state) for e in lost] == [("fading", "Terminated")]
    await steady.stop_heartbeats()


async def test_malformed_and_unknown_field_messages_are_dead_lettered_with_a_reason(
    manager: ManagerService,
    client: MeshClient,
    raw_agent: Any,
    topology: Topology,
    management_api: Any,
) -> None:
    agent = await raw_agent("sloppy")
    bad_bodies = {
        Reason.MALFORMED_JSON: b"{not json",
        Reason.MISSING_TYPE: b'{"agent_id": "sloppy"}',
        Reason.UNKNOWN_MESSAGE_TYPE: b'{"type": "mesh.nonsense.v9"}',
        Reason.UNKNOWN_FIELD: encode(DrainRequest(agent_id="sloppy"))[:-1] + b',"admin":true}',
        Reason.MESSAGE_TOO_LARGE: b'{"type":"x","pad":"' + b"x" * c.MAX_MESSAGE_BYTES + b'"}',
    }
    for body in bad_bodies.values():
        await agent.publish_announce("register", body)

    await eventually(
        lambda: manager.counters["dead_lettered"] == len(bad_bodies), what="dead letters"
    )
    reasons = set()
    for _ in bad_bodies:
        delivery = await agent.transport.get_one(topology.dead_letter_queue)
        assert delivery is not None
        assert delivery.headers[c.H_SOURCE_QUEUE] == topology.announce_queue
        reason = Reason(delivery.headers[c.H_REASON])
        reasons.add(reason.value)
        # Every dead letter says how big the original was; an oversized one keeps a prefix.
        original = bad_bodies[reason]
        assert delivery.headers[c.H_ORIGINAL_SIZE] == len(original)
        if len(original) > c.DEAD_LETTER_KEEP_BYTES:
            assert delivery.headers[c.H_TRUNCATED] is True
            assert delivery.body == original[: c.DEAD_LETTER_KEEP_BYTES]
        else:
            assert delivery.headers[c.H_TRUNCATED] is False and delivery.body == original
    assert reasons == {r.value for r in bad_bodies}
    for reason in bad_bodies:
        assert manager.counters[f"dead_lettered.{reason}"] == 1

    # Still serving: a good registration right after the garbage is accepted.
    await agent.register()
    await eventually(lambda: bool(agent.received(RegistrationAccepted)), what="acceptance")
    status = await client.status()
    assert states(status) == {"sloppy": "Ready"}
    assert status.counters["dead_lettered"] == len(bad_bodies)


async def test_a_forged_registration_never_displaces_a_live_agent(
    manager: ManagerService,
    client: MeshClient,
    raw_agent: Any,
    transport_factory: Any,
    topology: Topology,
    tmp_path: Path,
) -> None:
    """Identities off (the default): anyone may publish a registration for any agent ID. A
    second incarnation of a live agent advertising 1,000 slots is refused AGENT_ID_IN_USE,
    journaled and counted; the registry keeps the live one, which stays Ready, and nothing
    can be leased beyond its own two slots."""
    victim = await raw_agent("victim", capabilities=[echo_capability(max_concurrency=2)])
    await victim.register()
    await eventually(lambda: bool(victim.received(RegistrationAccepted)), what="acceptance")
    victim.start_heartbeats()
    forger = RawAgent(
        await transport_factory(suffix="forger"),
        topology,
        "victim",
        capabilities=[echo_capability(max_concurrency=1000)],
    )
    await forger.start()

    await forger.register()

    await eventually(
        lambda: manager.core.counters["registration_incarnation_live"] == 1,
        what="the refusal",
    )

    # The refusal went to the ID's control queue, which both consume: one of them has it.
    def refusals() -> list[Message]:
        return victim.received(RegistrationRefused) + forger.received(RegistrationRefused)

    await eventually(lambda: bool(refusals()), what="the refusal delivered")
    [refused] = refusals()
    assert isinstance(refused, RegistrationRefused)
    assert refused.reason is Reason.AGENT_ID_IN_USE and refused.incarnation == forger.incarnation
    assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
    [found] = await client.find("test.echo")
    assert found.agent_id == "victim"
    assert manager.core.agents["victim"].incarnation == victim.incarnation
    leases = [await client.acquire("test.echo") for _ in range(3)]
    assert [isinstance(lease, Refusal) for lease in leases] == [False, False, True]
    refusals = [e for e in SqliteJournal(tmp_path / "journal.sqlite3").tail() if e.kind != "lease"]
    assert [(e.kind, e.reason) for e in refusals if e.kind == "registration_refused"] == [
        ("registration_refused", "AGENT_ID_IN_USE")
    ]
    assert states(await client.status()) == {"victim": "Busy"}
    await victim.stop_heartbeats()


async def test_an_agent_whose_acceptance_cannot_be_delivered_never_becomes_leasable(
    manager: ManagerService, client: MeshClient, transport_factory: Any, topology: Topology
) -> None:
    """A registration from something with no control queue (a fuzzer, a forger, an agent
    whose queue is gone): the acceptance comes back unroutable, and the registration is taken
    back — no phantom agent stays Ready to be leased (they took 386 leases under a fuzz)."""
    phantom = RawAgent(await transport_factory(suffix="phantom"), topology, "phantom")
    await phantom.register()  # no queues declared: nobody will hear the acceptance

    await eventually(
        lambda: manager.core.counters["acceptance_undelivered"] == 1, what="taken back"
    )
    assert "phantom" not in manager.core.agents
    assert states(await client.status()) == {}
    refused = await client.acquire("test.echo")
    assert isinstance(refused, Refusal), refused


async def test_a_drain_request_on_the_announce_exchange_must_name_the_live_incarnation(
    manager: ManagerService, client: MeshClient, raw_agent: Any
) -> None:
    """Identities off: anyone may publish on ``agent.<id>.drain``. A drain request there that
    names no incarnation, or another one, is dead-lettered ``NOT_AUTHORIZED`` and the agent
    stays Ready; the agent's own (its incarnation named) drains it."""
    agent = await raw_agent("drained-by-name")
    await agent.register()
    await eventually(lambda: bool(agent.received(RegistrationAccepted)), what="acceptance")
    agent.start_heartbeats()
    try:
        for forged in (None, uuid.uuid4().hex):
            request = DrainRequest(agent_id=agent.agent_id, reason="forged", incarnation=forged)
            await agent.publish_announce("drain", encode(request))
        await eventually(
            lambda: manager.counters["drain_incarnation_mismatch"] == 2, what="both refused"
        )
        await eventually(lambda: manager.counters["dead_lettered"] == 2, what="dead-lettered")
        assert states(await client.status()) == {"drained-by-name": "Ready"}
        assert not agent.received(DrainNotice)

        own = DrainRequest(agent_id=agent.agent_id, reason="SIGTERM", incarnation=agent.incarnation)
        await agent.publish_announce("drain", encode(own))
        await eventually(lambda: bool(agent.received(DrainNotice)), what="the drain")
    finally:
        await agent.stop_heartbeats()


async def test_a_restarted_agent_registers_once_its_old_incarnation_is_gone(
    manager: ManagerService,
    client: MeshClient,
    raw_agent: Any,
    amqp_url: str,
    namespace: str,
    topology: Topology,
    management_api: Any,
) -> None:
    """kill -9 and a restart with the same ID, identities off: the new process's registration
    is deferred while the old incarnation is live, and accepted once it is declared lost; the
    SDK waits out the refusal's retry time instead of giving up."""
    old = await raw_agent("phoenix")
    await old.register()
    await eventually(lambda: bool(old.received(RegistrationAccepted)), what="acceptance")
    old.start_heartbeats()
    await asyncio.sleep(0.3)
    await old.stop_heartbeats()  # "killed": silent, never deregistered
    await old.transport.close()
    # The raw agent's task queue is bounded for 4 slots, the echo sample's for 8.
    management_api.delete_queue(topology.agent_task_queue("phoenix"))
    runtime = AgentRuntime(
        SAMPLES["echo"]("phoenix", heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )
    try:
        await asyncio.wait_for(runtime.start(), timeout=20)

        assert runtime.counters["registration_deferred"] >= 1
        assert manager.core.agents["phoenix"].incarnation != old.incarnation
        assert manager.core.counters["lost"] == 1
        assert states(await client.status()) == {"phoenix": "Ready"}
    finally:
        await runtime.stop()


async def test_a_flood_of_oversized_messages_keeps_the_dead_letter_queue_small(
    manager: ManagerService, raw_agent: Any, topology: Topology, management_api: Any
) -> None:
    """Oversized bodies are refused and dead-lettered as prefixes: 200 bodies of 300 KB
    (60 MB) leave at most 200 times the kept prefix in the dead-letter queue, and the queue's
    declaration bounds it by bytes as well as by count."""
    agent = await raw_agent("flooder")
    body = b'{"type":"x","pad":"' + b"x" * (300 * 1024) + b'"}'
    for _ in range(200):
        await agent.publish_announce("register", body)

    await eventually(lambda: manager.counters["dead_lettered"] == 200, what="200 dead letters")
    info: dict[str, Any] = {}

    def counted() -> bool:  # the management API's statistics lag a few seconds
        nonlocal info
        info = management_api.get_queue(topology.dead_letter_queue)
        return info["messages"] == 200 and "message_bytes" in info

    await eventually(counted, timeout_s=20, what="the dead-letter queue's statistics")
    assert info["message_bytes"] <= 200 * c.DEAD_LETTER_KEEP_BYTES
    args = info["arguments"]
    assert args["x-max-length-bytes"] == topology.dead_letter_max_bytes
    assert args["x-max-length"] == topology.dead_letter_max_length
    assert args["x-overflow"] == "drop-head"


async def test_a_malformed_request_gets_a_refusal_reply_and_a_dead_letter(
    manager: ManagerService, client: MeshClient, topology: Topology
) -> None:
    fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    correlation = uuid.uuid4().hex
    client._pending[correlation] = fut  # type: ignore[assignment]
    await client.transport.publish(
        topology.control_exchange,
        "rpc.acquire",
        b'{"type": "mesh.acquire-request.v1", "capability": "NOT A NAME"}',
        reply_to=client.reply_queue,
        correlation_id=correlation,
    )
    reply = await asyncio.wait_for(fut, 10)
    assert isinstance(reply, Refusal)
    assert reply.reason is Reason.SCHEMA_VIOLATION
    assert "capability" in reply.detail
    await eventually(lambda: manager.counters["dead_lettered"] == 1, what="dead letter")


async def test_draining_an_idle_agent_terminates_it_and_tells_it_to_exit(
    manager: ManagerService, client: MeshClient, raw_agent: Any
) -> None:
    agent = await raw_agent("idle-one")
    await agent.register()
    await eventually(lambda: "idle-one" in manager.core.agents, what="registration")

    reply = await client.drain("idle-one", "test")
    assert not isinstance(reply, Refusal)
    await eventually(lambda: bool(agent.received(DrainComplete)), what="drain complete")
    assert agent.received(DrainNotice)
    assert "idle-one" not in manager.core.agents
    assert await client.find("test.echo") == []


async def test_leases_gate_on_in_flight_and_release_makes_room_again(
    manager: ManagerService, client: MeshClient, raw_agent: Any
) -> None:
    agent = await raw_agent("pair", capabilities=[echo_capability(max_concurrency=2)])
    await agent.register()
    await eventually(lambda: "pair" in manager.core.agents, what="registration")

    first = await client.acquire("test.echo")
    second = await client.acquire("test.echo")
    third = await client.acquire("test.echo")
    assert not isinstance(first, Refusal) and not isinstance(second, Refusal)
    assert isinstance(third, Refusal) and third.reason is Reason.NO_AGENT_AVAILABLE
    assert states(await client.status()) == {"pair": "Busy"}

    assert not isinstance(await client.release(first.lease_id), Refusal)
    again = await client.release(first.lease_id)
    assert isinstance(again, Refusal) and again.reason is Reason.UNKNOWN_LEASE
    assert [a.agent_id for a in await client.find("test.echo")] == ["pair"]


async def test_a_restarted_manager_asks_unknown_agents_to_register_again(
    amqp_url: str, namespace: str, tmp_path: Path, raw_agent: Any
) -> None:
    journal = tmp_path / "journal.sqlite3"
    first = await start_manager(manager_settings(namespace, journal, amqp_url=amqp_url))
    agent = await raw_agent("survivor")
    await agent.register()
    agent.start_heartbeats()
    await eventually(lambda: "survivor" in first.core.agents, what="registration")
    await first.stop()

    second = await start_manager(manager_settings(namespace, journal, amqp_url=amqp_url))
    try:
        await eventually(lambda: bool(agent.received(ReRegisterRequest)), what="re-register ask")
        assert "survivor" not in second.core.agents
        await agent.register()
        await eventually(lambda: "survivor" in second.core.agents, what="re-registration")
        # The journal spans both lives of the manager.
        starts = [e for e in SqliteJournal(journal).tail(100) if e.kind == "manager_started"]
        assert len(starts) == 2
    finally:
        await agent.stop_heartbeats()
        await second.stop()


async def test_a_manager_whose_connection_is_cut_keeps_ingesting_heartbeats_and_requests(
    manager: ManagerService, client: MeshClient, raw_agent: Any, management_api: Any
) -> None:
    agent = await raw_agent("steady-through-cut", interval_s=0.5)
    await agent.register()
    agent.start_heartbeats()
    await eventually(lambda: manager.counters["heartbeats"] >= 2, what="heartbeats")

    # In a thread: the management API call blocks, and this manager shares the test's loop.
    prefix = f"manager:{manager.settings.manager_id}"
    assert await asyncio.to_thread(management_api.close_connections, prefix) >= 1
    await eventually(lambda: manager.counters["reconnects"] >= 1, timeout_s=20, what="reconnect")
    seen = manager.counters["heartbeats"]

    await eventually(lambda: manager.counters["heartbeats"] >= seen + 3, what="heartbeats again")
    # Nobody was evicted for the silence the manager itself caused.
    assert states(await client.status()) == {"steady-through-cut": "Ready"}
    assert manager.core.counters["lost"] == 0
    await agent.stop_heartbeats()


async def test_replies_that_cannot_be_delivered_never_stall_the_manager(
    manager: ManagerService, client: MeshClient, topology: Topology
) -> None:
    # A requester whose reply queue refuses everything (bounded at 0, reject-publish).
    full = f"{topology.namespace}.reply.full"
    await client.transport.declare(
        Declarations(
            queues=(
                QueueSpec(full, arguments=QueueArguments(max_length=0, overflow="reject-publish")),
            )
        )
    )
    for _ in range(manager.settings.prefetch + 10):  # more than the consumer's prefetch
        await client.transport.publish(
            topology.control_exchange,
            "rpc.status",
            StatusRequest(),
            reply_to=full,
            correlation_id=uuid.uuid4().hex,
        )

    await eventually(
        lambda: manager.counters["reply_failed"] == manager.settings.prefetch + 10,
        what="every failed reply counted",
    )
    status = await client.status(timeout_s=5)  # the consumer still serves
    assert status.counters["reply_failed"] == manager.settings.prefetch + 10


async def test_a_grant_that_cannot_reach_its_requester_is_released_at_once(
    manager: ManagerService, client: MeshClient, raw_agent: Any, topology: Topology
) -> None:
    agent = await raw_agent("only-one", capabilities=[echo_capability(max_concurrency=1)])
    await agent.register()
    await eventually(lambda: "only-one" in manager.core.agents, what="registration")

    await client.transport.publish(
        topology.control_exchange,
        "rpc.acquire",
        AcquireRequest(capability="test.echo"),
        reply_to=f"{topology.namespace}.reply.nobody-home",  # no such queue
        correlation_id=uuid.uuid4().hex,
    )

    await eventually(
        lambda: manager.counters["leases_released_unclaimed"] == 1, what="the unclaimed release"
    )
    assert manager.core.agents["only-one"].in_flight == 0
    lease = await client.acquire("test.echo")  # the single slot is free again
    assert not isinstance(lease, Refusal)
