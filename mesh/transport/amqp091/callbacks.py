"""The callbacks a consumer of the consume-only connection gives, and what they are handed.

Shared by the protocol that calls them, the connection that registers them and the
transport that takes them from its callers (:meth:`mesh.transport.AmqpTransport.consume_raw`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from mesh.transport.delivery import Delivery

RawCallback = Callable[[bytes, str | None], None]
"""A raw consumer's callback: the body, and the ``user_id`` RabbitMQ validated (if any)."""

RawBatch = list[tuple[bytes, str | None]]
"""Raw deliveries in arrival order: (body, validated ``user_id``) pairs."""


DeliveriesCallback = Callable[[list[Delivery]], None]
"""An acked consumer's callback: the deliveries that arrived in one read, in order. It must
not block: it hands them on (a queue, a task) and each is settled later."""


@runtime_checkable
class RawBatchCallback(Protocol):
    """A raw callback that can also take a batch: :meth:`ingest_many` gets, in one call and
    in order, every delivery that arrived in one read from the socket."""

    def __call__(self, body: bytes, user_id: str | None, /) -> None: ...

    def ingest_many(self, bodies: RawBatch, /) -> None: ...
