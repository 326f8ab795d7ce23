"""A minimal AMQP 0-9-1 client for the transport's hot paths, written at the frame level.

What it carries: every message the manager takes in — agents' heartbeats (no ack),
announcements and requests (acked) — and a producer's replies, on a consume-only connection
of its own (:class:`LeanConnection`); and the frames of every confirmed publish, the
manager's replies and a producer's requests among them, which :mod:`mesh.transport.amqp`
writes onto aiormq's channel (:func:`publish_frames`).

Why it exists: aiormq handles every frame as an object (three ``readexactly`` calls and an
``asyncio.Lock`` per frame, a pamqp object for each of a message's three frames, two queue
hand-offs and a task per delivery): ~60 µs of CPU per message before the manager looks at
it, most of a manager's time at 50,000 agents; marshalling a publish through pamqp's objects
costs ~25 µs where writing its frames with ``struct`` costs ~4 µs. Here a delivery costs a
few slices and a ``struct`` unpack (~5 µs). Control frames are still marshalled and parsed
by pamqp, as aiormq does; nothing here imports aiormq or aio-pika.

The rooms: :mod:`~.reading` (a delivery's fields and properties from raw bytes),
:mod:`~.protocol` (one connection's handshake and frame reader), :mod:`~.connection` (the
connection kept up, its consumers consuming), :mod:`~.publish` (a publish's frames),
:mod:`~.callbacks` (what consumers are handed).
"""

from __future__ import annotations

from mesh.transport.amqp091.callbacks import (
    DeliveriesCallback,
    RawBatch,
    RawBatchCallback,
    RawCallback,
)
from mesh.transport.amqp091.connection import LeanConnection, LeanConsumer
from mesh.transport.amqp091.publish import message_properties, publish_frames

__all__ = [
    "DeliveriesCallback",
    "LeanConnection",
    "LeanConsumer",
    "RawBatch",
    "RawBatchCallback",
    "RawCallback",
    "message_properties",
    "publish_frames",
]
