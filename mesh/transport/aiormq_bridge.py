"""The one module that reaches below aio-pika's and aiormq's public API.

aiormq publishes one message per call and builds its frames from pamqp objects; the
transport writes ready-made frames (:mod:`mesh.transport.amqp091.publish`), one or a batch,
onto aiormq's channel with aiormq's own confirm bookkeeping, and it needs a few things
neither library exposes. Each is used here and nowhere else:

* ``aiormq.Connection.FRAME_BUFFER_SIZE``: a class attribute, read when a connection opens,
  bounding the queue of frames for its writer task (raised once, at import);
* on an ``aiormq.Channel``: ``lock``, ``delivery_tag``, ``confirmations``,
  ``message_id_delivery_tag``, ``create_future()``, ``number``, ``max_content_size`` and
  ``write_queue`` (the connection's, of ``aiormq.abc.ChannelFrame``): the bookkeeping
  ``Channel.basic_publish`` does for a confirmed publish, done here for frames written here;
* ``aiormq.Connection._Connection__connection_unblocked``: the event aiormq clears on
  ``connection.blocked`` and sets on ``connection.unblocked`` (read defensively);
* on aio-pika's robust connection: ``url`` (read again at every reconnect attempt, so
  setting it moves reconnection to another broker address), ``reconnect_interval``, and
  ``transport.connection`` (the aiormq connection under it, closed to drop it at once).

Tested on aiormq 7.2.4, pamqp 4.0.1 and aio-pika 10.2.1; pyproject.toml pins all three to
the ranges tested. ``tests/integration/test_aiormq_internals.py`` fails by name
when one of these moves or changes shape.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import aiormq
import yarl
from aio_pika.abc import AbstractRobustConnection
from aiormq.abc import ChannelFrame

from mesh.transport.amqp091 import publish_frames

WRITE_QUEUE_FRAMES = 1024
"""How many frames an aiormq connection queues for its writer task (aiormq's default: 10).

A publish puts its frames on that queue *while holding its channel's lock*, and the writer
task empties it once per event-loop turn. With ten, a burst of more than ten publishes on one
channel — a batch's replies, a producer's next requests after a batch of answers — queues on
the lock and goes out one loop turn per publish: with 64 admissions in flight, ~55 publishes
waited there at any moment, and admissions ran at ~0.6x the raw aiormq echo; with 1,024, at
~0.77x (``bench/admission.py``). The writer never waits for the socket (asyncio's transport
buffers), so the small queue held nothing back but the loop; publishers still wait for their
confirms, so the bound on work in flight is theirs. Process-wide: aiormq reads it as a class
attribute when it opens a connection, so every aiormq connection in the process gets it —
the benchmark's raw aiormq echo included, which keeps that comparison fair."""
aiormq.Connection.FRAME_BUFFER_SIZE = max(aiormq.Connection.FRAME_BUFFER_SIZE, WRITE_QUEUE_FRAMES)

Framed = tuple[str, bytes, bytes, str]
"""A confirmed publish as its frames are written: routing key, body, marshalled properties,
message ID."""


async def put_confirmed(
    underlay: aiormq.abc.AbstractChannel,
    exchange: str,
    messages: Sequence[Framed],
    mandatory: bool = True,
) -> list[asyncio.Future[Any]]:
    """Under the channel's lock: a delivery tag and a confirm future per message, then
    every message's frames in one write (``Channel.basic_publish``'s bookkeeping).
    ``RuntimeError`` if the channel is closed: frames on it would close the connection."""
    channel = cast(aiormq.Channel, underlay)
    if channel.is_closed:
        raise RuntimeError("the channel is closed")
    frames: list[bytes] = []
    confirms: list[asyncio.Future[Any]] = []
    async with channel.lock:
        first = channel.delivery_tag + 1
        try:
            await _write_confirmed(channel, exchange, messages, mandatory, frames, confirms)
        except BaseException:
            # The broker has seen none of them: give their tags back, as aiormq does (the
            # broker numbers what it receives; a tag skipped here would shift every later
            # confirm onto the wrong publish).
            for tag in range(first, channel.delivery_tag + 1):
                channel.confirmations.pop(tag, None)
            channel.delivery_tag = first - 1
            for confirm in confirms:
                confirm.cancel()
            raise
    return confirms


async def _write_confirmed(
    channel: aiormq.Channel,
    exchange: str,
    messages: Sequence[Framed],
    mandatory: bool,
    frames: list[bytes],
    confirms: list[asyncio.Future[Any]],
) -> None:
    for routing_key, body, properties, message_id in messages:
        channel.delivery_tag += 1
        tag = channel.delivery_tag
        confirm = channel.create_future()
        channel.confirmations[tag] = confirm
        channel.message_id_delivery_tag[message_id] = tag
        confirm.add_done_callback(partial(_forget_message_id, channel, message_id, tag))
        confirms.append(confirm)
        frames.append(
            publish_frames(
                channel.number,
                exchange,
                routing_key,
                body,
                properties,
                mandatory=mandatory,
                max_body=channel.max_content_size,
            )
        )
    await channel.write_queue.put(ChannelFrame(b"".join(frames), should_close=False))


def _forget_message_id(
    channel: aiormq.Channel, message_id: str, tag: int, _: asyncio.Future[Any]
) -> None:
    """A settled publish's message ID no longer maps to its tag (as aiormq does)."""
    if channel.message_id_delivery_tag.get(message_id) == tag:
        channel.message_id_delivery_tag.pop(message_id)


async def put_unconfirmed(
    underlay: aiormq.abc.AbstractChannel,
    exchange: str,
    messages: Sequence[tuple[str, bytes]],
    properties: bytes,
) -> None:
    """The frames of several ``(routing key, body)`` messages with the marshalled
    ``properties``, handed to the connection's writer as one write, on a channel without
    confirms (no delivery tag or confirm is tracked). ``RuntimeError`` if the channel is
    closed: frames on it would close the connection."""
    channel = cast(aiormq.Channel, underlay)
    if channel.is_closed:
        raise RuntimeError("the channel is closed")
    number, size = channel.number, channel.max_content_size
    payload = ChannelFrame(
        b"".join(
            publish_frames(number, exchange, key, body, properties, mandatory=False, max_body=size)
            for key, body in messages
        ),
        should_close=False,
    )
    async with channel.lock:  # after any publish already under way on the channel
        await channel.write_queue.put(payload)


def is_blocked(connection: AbstractRobustConnection) -> bool:
    """RabbitMQ sent ``connection.blocked`` (a memory or disk alarm) and no ``unblocked``
    since. aiormq tracks it in an event it does not expose; read it defensively."""
    underlying = getattr(connection, "transport", None)
    amqp = getattr(underlying, "connection", None)
    unblocked = getattr(amqp, "_Connection__connection_unblocked", None)
    return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()


async def drop(connection: AbstractRobustConnection, reason: Exception, wait_s: float) -> None:
    """Close the robust connection's current aiormq connection with ``reason``, waiting at
    most ``wait_s`` (a broker that does not answer never sends Close-Ok): its close
    callbacks run either way, and the robust connection reconnects."""
    underlay = connection.transport
    if underlay is None:
        return
    with contextlib.suppress(Exception):  # TimeoutError included
        async with asyncio.timeout(wait_s):
            await underlay.connection.close(reason)


def reconnect_to(connection: AbstractRobustConnection, url: str) -> None:
    """Make the robust connection's next reconnect attempts go to ``url``."""
    connection.url = yarl.URL(url)  # type: ignore[attr-defined]


def reconnect_interval(connection: AbstractRobustConnection) -> float:
    """Seconds between the robust connection's reconnect attempts (aio-pika's default: 5)."""
    return float(getattr(connection, "reconnect_interval", 5.0))
