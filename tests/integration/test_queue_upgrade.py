"""A namespace an older version declared with classic queues moves to quorum queues without
losing a message (issue 47; docs/architecture.md, "Upgrading a namespace to quorum queues").

A classic queue lives on one broker node: while that node is down it cannot even be declared,
so a process that declares it again on reconnect cannot reconnect. The agents' task queues
and the dead-letter queue are quorum queues now. An agent's task queue keeps its name and is
moved in place when the agent starts (through a holding queue, in steps a crash can resume);
the dead-letter queue has a new name, ``<ns>.dead-letters``, and a manager empties the old
``<ns>.dead-letter`` into it at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mesh.errors import TopologyMismatch
from mesh.topology import Declarations, QueueArguments, QueueSpec, Topology
from mesh.topology.specs import BindingSpec
from mesh.transport import DEFAULT_EXCHANGE, Delivery
from mesh.transport.amqp import AmqpTransport
from mesh.transport.moves import holding_queue

from .harness import eventually, manager_settings, start_manager

AGENT_ID = "upgraded-1"


def classic_task_queue(topology: Topology, bound: int) -> Declarations:
    """An agent's task queue as versions before quorum queues declared it."""
    name = topology.agent_task_queue(AGENT_ID)
    spec = QueueSpec(
        name,
        arguments=QueueArguments(
            max_length=bound,
            overflow="reject-publish",
            dead_letter_exchange=topology.dead_letter_exchange,
            expires_ms=topology.agent_queue_expires_ms,
        ),
    )
    binding = BindingSpec(name, topology.tasks_exchange, AGENT_ID)
    return topology.shared() + Declarations(queues=(spec,), bindings=(binding,))


async def drain(transport: AmqpTransport, queue: str) -> list[bytes]:
    bodies = []
    while (delivery := await transport.get_one(queue, timeout_s=1)) is not None:
        bodies.append(delivery.body)
    return bodies


async def test_an_agent_task_queue_declared_classic_moves_to_quorum_keeping_its_tasks(
    transport_factory: Any, topology: Topology, management_api: Any
) -> None:
    old = await transport_factory(suffix="old-version")
    await old.declare(classic_task_queue(topology, 16))
    queued = [f"task-{n}".encode() for n in range(5)]
    for body in queued:
        await old.publish(topology.tasks_exchange, AGENT_ID, body, persistent=True)
    await old.close()

    new = await transport_factory(suffix="new-version")
    await new.declare(topology.agent(AGENT_ID, 16))  # what the agent declares at start

    name = topology.agent_task_queue(AGENT_ID)
    info = management_api.get_queue(name)
    assert info["type"] == "quorum", info
    assert management_api.list_names("queues", holding_queue(name)) == []
    await new.publish(topology.tasks_exchange, AGENT_ID, b"after", persistent=True)
    assert await drain(new, name) == [*queued, b"after"]  # all kept, in order, routed


async def test_a_move_left_half_done_is_finished_by_the_next_start(
    transport_factory: Any, topology: Topology, management_api: Any
) -> None:
    """The process died after deleting the old queue and before the new one took over: the
    holding queue has the tasks and the binding. The next start finishes the move."""
    name = topology.agent_task_queue(AGENT_ID)
    [spec] = [q for q in topology.agent(AGENT_ID, 16).queues if q.name == name]
    crashed = await transport_factory(suffix="crashed")
    holding = QueueSpec(holding_queue(name), arguments=spec.arguments)
    await crashed.declare(
        topology.shared()
        + Declarations(
            queues=(holding,),
            bindings=(BindingSpec(holding.name, topology.tasks_exchange, AGENT_ID),),
        )
    )
    for n in range(2):
        await crashed.publish(DEFAULT_EXCHANGE, holding.name, f"held-{n}".encode())
    await crashed.close()

    new = await transport_factory(suffix="restarted")
    await new.declare(topology.agent(AGENT_ID, 16))

    assert management_api.list_names("queues", holding.name) == []
    await new.publish(topology.tasks_exchange, AGENT_ID, b"after")
    assert await drain(new, name) == [b"held-0", b"held-1", b"after"]  # none twice


async def test_a_manager_empties_the_old_classic_dead_letter_queue_into_the_quorum_one(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    transport_factory: Any,
    topology: Topology,
    management_api: Any,
) -> None:
    old_name = topology.classic_dead_letter_queue
    old = await transport_factory(suffix="old-version")
    await old.declare(
        topology.shared()
        + Declarations(
            queues=(QueueSpec(old_name, arguments=QueueArguments(overflow="drop-head")),),
            bindings=(BindingSpec(old_name, topology.dead_letter_exchange, "#"),),
        )
    )
    for n in range(3):
        await old.publish(topology.dead_letter_exchange, "some.queue", f"dead-{n}".encode())
    await old.close()

    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    try:
        assert management_api.list_names("queues", old_name + "") == [
            topology.dead_letter_queue
        ]  # the old one is gone; the new one (same prefix) stays
        assert management_api.get_queue(topology.dead_letter_queue)["type"] == "quorum"
        reader = await transport_factory(suffix="reader")
        assert await drain(reader, topology.dead_letter_queue) == [
            b"dead-0",
            b"dead-1",
            b"dead-2",
        ]
    finally:
        await manager.stop()


async def test_a_classic_task_queue_another_process_still_consumes_is_not_moved(
    transport_factory: Any, topology: Topology, management_api: Any
) -> None:
    """An older process under the same agent ID still consumes the classic queue (the tasks
    it holds unacked would go with the old queue): nothing is touched, and the start says
    why; the move happens on a start once nothing consumes it."""
    old = await transport_factory(suffix="old-version")
    await old.declare(classic_task_queue(topology, 16))
    for n in range(3):
        await old.publish(topology.tasks_exchange, AGENT_ID, f"task-{n}".encode())
    held: list[Delivery] = []

    async def hold(delivery: Delivery) -> None:
        held.append(delivery)  # never acked: the old process is working on it

    consumer = await old.consume(topology.agent_task_queue(AGENT_ID), hold, prefetch=1)
    await eventually(lambda: len(held) == 1, what="the old process holding a task")

    new = await transport_factory(suffix="new-version")
    with pytest.raises(TopologyMismatch, match="still has 1 consumer"):
        await new.declare(topology.agent(AGENT_ID, 16))

    name = topology.agent_task_queue(AGENT_ID)
    assert management_api.get_queue(name)["type"] == "classic"
    assert management_api.list_names("queues", holding_queue(name)) == []
    await consumer.cancel()
    await old.close()  # its unacked task goes back to the queue

    await new.declare(topology.agent(AGENT_ID, 16))
    assert management_api.get_queue(name)["type"] == "quorum"
    assert sorted(await drain(new, name)) == [b"task-0", b"task-1", b"task-2"]
