"""Moving a queue's messages to another queue without losing one: how a namespace an older
version declared with classic queues moves to quorum queues (docs/architecture.md,
"Upgrading a namespace to quorum queues").

A classic queue cannot become a quorum queue: the type is fixed at declaration, and a declare
with another type is refused (``PRECONDITION_FAILED``). So a queue of the same name is moved
through a holding queue, ``<name>.moving``, in steps that are each safe to repeat — a process
that dies half-way leaves a state the next run finishes:

1. declare the holding queue (quorum, the new arguments) and bind it where the old one is
   bound; unbind the old one — new messages now land in the holding queue;
2. move every message of the old queue to the holding queue (a confirmed publish, then the
   ack: a crash in between copies one message twice, never loses one);
3. delete the old queue (only if empty) and declare the new one under its name, bound;
4. unbind the holding queue, move what it holds into the new queue, delete it.

Between the new queue's binding and the holding queue's unbinding (one round trip) a message
can be routed to both: that is a duplicate, which consumers already handle (an agent answers
a task it answered before from its kept result). A moved message keeps its body and
properties, except ``user_id`` (RabbitMQ lets a connection publish only as its own user): the
original goes to the ``x-mesh-moved-user-id`` header; and ``x-delivery-count``, which counted
deliveries from the queue it leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aio_pika
import aiormq
from aio_pika.abc import AbstractQueue, AbstractRobustChannel, AbstractRobustConnection

from mesh.errors import TopologyMismatch
from mesh.topology.specs import BindingSpec, QueueSpec

log = logging.getLogger(__name__)

MOVED_USER_HEADER = "x-mesh-moved-user-id"
HOLDING_SUFFIX = ".moving"


def holding_queue(name: str) -> str:
    return name + HOLDING_SUFFIX


async def is_other_type(connection: AbstractRobustConnection, spec: QueueSpec) -> bool:
    """Whether ``spec``'s queue exists with arguments the broker refuses as inequivalent in
    its type (``x-queue-type``): a classic queue of an older version. Creates nothing: a
    passive declare first, then the declaration itself on a channel of its own (a refusal
    closes its channel)."""
    if not await _exists(connection, spec.name):
        return False
    channel = await connection.channel()
    try:
        await channel.declare_queue(
            spec.name, durable=spec.durable, arguments=spec.arguments.to_amqp(), robust=False
        )
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        return "x-queue-type" in str(exc)
    finally:
        if not channel.is_closed:
            await channel.close()
    return False


async def has_holding_queue(connection: AbstractRobustConnection, spec: QueueSpec) -> bool:
    """Whether a move of ``spec``'s queue was left half-done (its holding queue exists)."""
    return await _exists(connection, holding_queue(spec.name))


async def move_in_place(
    connection: AbstractRobustConnection,
    spec: QueueSpec,
    bindings: Sequence[BindingSpec],
    *,
    old_type: bool,
) -> int:
    """Replace the queue named ``spec.name`` by one declared as ``spec`` (see the module doc
    for the steps), keeping every message; how many were moved into the new queue.
    ``old_type``: the queue of that name is still the old type (else a move left half-done
    is finished)."""
    holding = holding_queue(spec.name)
    counts = await queue_counts(connection, spec.name) if old_type else None
    if counts is not None and counts[1] > 0:
        # Another process (an older one under the same agent ID) still consumes it: the tasks
        # it holds unacked would go with the old queue. Nothing is touched; moved later.
        raise TopologyMismatch(
            f"queue {spec.name!r} is of an older version's type and still has {counts[1]} "
            "consumer(s): it is moved once nothing consumes it (stop the older process, then "
            "start this one again)"
        )
    channel = await connection.channel(publisher_confirms=True)
    try:
        hold = await _declare(channel, holding, spec)
        for binding in bindings:
            await hold.bind(binding.exchange, routing_key=binding.routing_key)
        if old_type:
            old = await channel.declare_queue(spec.name, passive=True, robust=False)
            for binding in bindings:
                await old.unbind(binding.exchange, routing_key=binding.routing_key)
            moved = await move_messages(channel, old, holding)
            await channel.queue_delete(spec.name, if_empty=True)
            log.info("old queue emptied and deleted", extra={"queue": spec.name, "moved": moved})
    finally:
        if not channel.is_closed:
            await channel.close()
    # A channel of its own for the new queue: RabbitMQ 3.10's channel keeps the type of a
    # queue it published to, and fails a publish to the new queue of the same name.
    channel = await connection.channel(publisher_confirms=True)
    try:
        hold = await _declare(channel, holding, spec)
        new = await _declare(channel, spec.name, spec)
        for binding in bindings:
            await new.bind(binding.exchange, routing_key=binding.routing_key)
            await hold.unbind(binding.exchange, routing_key=binding.routing_key)
        moved = await move_messages(channel, hold, spec.name)
        await channel.queue_delete(holding)
        log.warning("queue moved to its new type", extra={"queue": spec.name, "moved": moved})
        return moved
    finally:
        if not channel.is_closed:
            await channel.close()


async def empty_into(
    connection: AbstractRobustConnection, name: str, bindings: Sequence[BindingSpec], target: str
) -> int:
    """A queue renamed: if the old queue ``name`` exists, unbind it from ``bindings``, move its
    messages to the queue ``target`` (declared and bound already) and delete it; how many
    were moved (0 when there is no old queue)."""
    channel = await connection.channel(publisher_confirms=True)
    try:
        if not await _exists(connection, name):
            return 0
        old = await channel.declare_queue(name, passive=True, robust=False)
        for binding in bindings:
            await old.unbind(binding.exchange, routing_key=binding.routing_key)
        moved = await move_messages(channel, old, target)
        await channel.queue_delete(name, if_empty=True)
        log.warning("old queue emptied into its successor", extra={"queue": name, "to": target})
        return moved
    finally:
        if not channel.is_closed:
            await channel.close()


async def move_messages(channel: AbstractRobustChannel, source: AbstractQueue, target: str) -> int:
    """Every message ``source`` holds, republished (confirmed) to the queue ``target`` and then
    acked; how many."""
    moved = 0
    while True:
        message = await source.get(no_ack=False, fail=False)
        if message is None:
            return moved
        headers = dict(message.headers or {})
        # The count a quorum queue adds on delivery is the source queue's, not the message's
        # (and RabbitMQ 3.10 fails the channel on a publish that carries it back).
        headers.pop("x-delivery-count", None)
        if message.user_id:
            headers[MOVED_USER_HEADER] = message.user_id
        copy = aio_pika.Message(
            body=message.body,
            headers=headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            delivery_mode=message.delivery_mode,
            priority=message.priority,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            expiration=message.expiration,
            message_id=message.message_id,
            timestamp=message.timestamp,
            type=message.type,
            app_id=message.app_id,
        )
        await channel.default_exchange.publish(copy, routing_key=target)
        await message.ack()
        moved += 1


async def _declare(channel: AbstractRobustChannel, name: str, spec: QueueSpec) -> AbstractQueue:
    return await channel.declare_queue(
        name, durable=spec.durable, arguments=spec.arguments.to_amqp(), robust=False
    )


async def queue_counts(connection: AbstractRobustConnection, name: str) -> tuple[int, int] | None:
    """``(ready, consumers)`` of the queue ``name``, by a passive declare on a channel of its
    own (a missing queue closes its channel); ``None`` if there is no such queue. (What
    ``AmqpTransport.queue_depth`` and ``queue_consumers`` read, too.)"""
    probe = await connection.channel()
    try:
        queue = await probe.declare_queue(name, passive=True, robust=False)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    finally:
        if not probe.is_closed:
            await probe.close()
    result = queue.declaration_result
    return int(result.message_count or 0), int(result.consumer_count or 0)


async def _exists(connection: AbstractRobustConnection, name: str) -> bool:
    return await queue_counts(connection, name) is not None
