"""Registrations that arrive together are handled as a batch, on the real broker: each still
gets its answer, is journaled, and is checked on its own (bad input dead-lettered with its
reason, an agent speaking for another refused), and the batch shares one journal commit.

Each test publishes its burst onto the announce queue before the manager consumes it, so
the manager finds a backlog and takes it in batches (as after a restart or a failover, when
a whole fleet registers at once)."""

from __future__ import annotations

import asyncio
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from mesh import constants as c
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.topology import BindingSpec, Declarations, QueueSpec, Topology, names
from mesh.transport import AmqpTransport, Delivery
from mesh.wire import AgentRegistration, Reason, RegistrationAccepted, decode, encode

from .harness import echo_capability, eventually, manager_settings, start_manager


class Inbox:
    """One queue bound to every agent's control key: what the manager tells the agents."""

    def __init__(self) -> None:
        self.accepted: list[RegistrationAccepted] = []
        self.other: list[Any] = []

    async def open(self, transport: AmqpTransport, topology: Topology) -> None:
        name = f"{topology.namespace}.test-inbox.{uuid.uuid4().hex[:6]}"
        queue = QueueSpec(name, durable=False, auto_delete=True)
        await transport.declare(
            topology.shared()
            + Declarations(
                queues=(queue,), bindings=(BindingSpec(name, topology.agents_exchange, "#"),)
            )
        )
        await transport.consume(name, self._on_message, no_ack=True)

    async def _on_message(self, delivery: Delivery) -> None:
        message = decode(delivery.body)
        if isinstance(message, RegistrationAccepted):
            self.accepted.append(message)
        else:
            self.other.append(message)


def registration(agent_id: str) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        incarnation=uuid.uuid4().hex,
        deployment="batch",
        capabilities=[echo_capability()],
        heartbeat_interval_s=5.0,
        features=[c.FEATURE_DESCRIPTOR_EPOCHS],
    )


async def publish_all(
    transport: AmqpTransport,
    topology: Topology,
    bodies: list[tuple[str, bytes]],
    user_id: str | None = None,
) -> None:
    """Every body on the announce exchange at once, as agents registering together do;
    ``user_id`` as the broker validates it (this transport's user)."""
    await asyncio.gather(
        *(
            transport.publish(
                topology.announce_exchange,
                names.agent_announce_key(agent_id, "register"),
                body,
                user_id=user_id,
            )
            for agent_id, body in bodies
        )
    )


async def backlog_then_manager(
    transport: AmqpTransport,
    topology: Topology,
    bodies: list[tuple[str, bytes]],
    amqp_url: str,
    tmp_path: Path,
    user_id: str | None = None,
    **overrides: Any,
) -> ManagerService:
    """The manager's queues declared, ``bodies`` waiting in the announce queue, then the
    manager started on them."""
    await transport.declare(topology.manager())
    await publish_all(transport, topology, bodies, user_id)
    settings = manager_settings(
        topology.namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url, **overrides
    )
    return await start_manager(settings)


async def test_a_burst_of_registrations_is_accepted_and_journaled_in_batches(
    transport_factory: Any, topology: Topology, amqp_url: str, tmp_path: Path
) -> None:
    transport = await transport_factory()
    inbox = Inbox()
    await inbox.open(transport, topology)
    regs = [registration(f"burst-{n:03d}") for n in range(300)]
    manager = await backlog_then_manager(
        transport, topology, [(r.agent_id, encode(r)) for r in regs], amqp_url, tmp_path
    )
    try:
        await eventually(lambda: len(inbox.accepted) >= 300, what="300 acceptances")
        await asyncio.sleep(0.3)  # nothing answered twice
        assert sorted((a.agent_id, a.incarnation) for a in inbox.accepted) == sorted(
            (r.agent_id, r.incarnation) for r in regs
        )
        assert set(manager.core.agents) == {r.agent_id for r in regs}
        # Batches for real: far fewer than one per registration.
        batches = manager.counters["announce_batches"]
        assert 1 <= batches <= 300 // 4, batches
        assert manager.counters["received.mesh.agent-registration.v1"] == 300
    finally:
        await manager.stop()
    journal = SqliteJournal(tmp_path / "journal.sqlite3")
    try:
        kinds = [(e.agent_id, e.kind) for e in journal.query(limit=None)]
    finally:
        journal.close()
    for reg in regs:
        assert (reg.agent_id, "registered") in kinds
        assert (reg.agent_id, "ready") in kinds


async def test_a_bad_registration_in_a_batch_is_dead_lettered_and_the_others_accepted(
    transport_factory: Any, topology: Topology, amqp_url: str, tmp_path: Path
) -> None:
    transport = await transport_factory()
    inbox = Inbox()
    await inbox.open(transport, topology)
    good = [registration(f"good-{n:02d}") for n in range(40)]
    unknown_field = encode(registration("sneaky"))[:-1] + b',"admin":true}'
    bodies = [(r.agent_id, encode(r)) for r in good[:20]]
    bodies += [("garbled", b"{not json"), ("sneaky", unknown_field)]
    bodies += [(r.agent_id, encode(r)) for r in good[20:]]
    manager = await backlog_then_manager(transport, topology, bodies, amqp_url, tmp_path)
    try:
        await eventually(lambda: len(inbox.accepted) >= 40, what="40 acceptances")
        await eventually(lambda: manager.counters["dead_lettered"] == 2, what="2 dead letters")
        assert {a.agent_id for a in inbox.accepted} == {r.agent_id for r in good}
        assert set(manager.core.agents) == {r.agent_id for r in good}
        assert manager.counters[f"dead_lettered.{Reason.MALFORMED_JSON}"] == 1
        assert manager.counters[f"dead_lettered.{Reason.UNKNOWN_FIELD}"] == 1
        assert manager.counters["announce_batches"] < len(bodies)
        reasons = set()
        for _ in range(2):
            dead = await transport.get_one(topology.dead_letter_queue)
            assert dead is not None
            assert dead.headers[c.H_SOURCE_QUEUE] == topology.announce_queue
            reasons.add(dead.headers[c.H_REASON])
        assert reasons == {Reason.MALFORMED_JSON.value, Reason.UNKNOWN_FIELD.value}
    finally:
        await manager.stop()


async def test_in_a_batch_each_registration_speaks_only_for_its_own_broker_user(
    transport_factory: Any, topology: Topology, amqp_url: str, tmp_path: Path
) -> None:
    # With agent identities on, a registration counts only for the agent named as its
    # publishing broker user: of one burst published as this test's broker user (validated
    # by RabbitMQ), the agent named as that user is accepted and the ten for other agents
    # are dead-lettered NOT_AUTHORIZED, wherever they sit in the batch.
    user = urllib.parse.urlsplit(amqp_url).username or "guest"
    transport = await transport_factory()
    inbox = Inbox()
    await inbox.open(transport, topology)
    own = registration(user)
    forged = [registration(f"someone-{n}") for n in range(10)]
    bodies = [(r.agent_id, encode(r)) for r in forged[:5]]
    bodies += [(own.agent_id, encode(own))]
    bodies += [(r.agent_id, encode(r)) for r in forged[5:]]
    manager = await backlog_then_manager(
        transport, topology, bodies, amqp_url, tmp_path, user_id=user, agent_identity=True
    )
    try:
        await eventually(lambda: manager.counters["dead_lettered"] == 10, what="10 dead letters")
        await eventually(lambda: len(inbox.accepted) == 1, what="the acceptance")
        assert inbox.accepted[0].agent_id == user
        assert set(manager.core.agents) == {user}
        assert manager.counters[f"dead_lettered.{Reason.NOT_AUTHORIZED}"] == 10
        assert not inbox.other  # nobody was answered on another agent's control key
    finally:
        await manager.stop()
