"""A burst of confirmed publishes on one channel goes to the connection's writer in one
event-loop turn, not one publish per turn (``WRITE_QUEUE_FRAMES`` in mesh.transport.aiormq_bridge):
a manager answering a batch of admissions publishes that many replies at once."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import aiormq

from mesh.topology import Declarations, QueueSpec
from mesh.transport.aiormq_bridge import WRITE_QUEUE_FRAMES
from mesh.transport.amqp import AmqpTransport

BURST = 200  # well past aiormq's default queue of 10 frames, within ours


async def test_a_burst_of_publishes_is_handed_to_the_writer_in_one_loop_turn(
    transport_factory: Any, namespace: str
) -> None:
    assert BURST < WRITE_QUEUE_FRAMES
    transport: AmqpTransport = await transport_factory(suffix="burst")
    queue = f"{namespace}.burst"
    await transport.declare(Declarations(queues=(QueueSpec(queue, durable=False),)))
    channel = cast(aiormq.Channel, await transport._publish_channel.get_underlay_channel())
    tag_before = channel.delivery_tag

    publishes = [
        asyncio.create_task(transport.publish("", queue, f"{n}".encode())) for n in range(BURST)
    ]
    await asyncio.sleep(0)  # one turn: every publish task runs until it waits for its confirm
    # Each publish takes its delivery tag just before it queues its frames. With aiormq's ten
    # frames, the eleventh would wait for the writer holding the channel's lock, and the rest
    # behind it: eleven tags in this turn, not 200.
    assert channel.delivery_tag - tag_before == BURST

    await asyncio.gather(*publishes)  # every one confirmed
    assert await transport.queue_depth(queue) == BURST
