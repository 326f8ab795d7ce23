"""Ports: the transport as the SDKs see it, as ``typing.Protocol`` classes any transport can meet.

:class:`Transport` is what an agent needs; :class:`ManagerTransport` and
:class:`ClientTransport` add what the manager and :class:`~mesh.producer.MeshClient` use on
top. :class:`~mesh.transport.AmqpTransport` meets all three, and so does
:class:`mesh.testing.InMemoryTransport`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from mesh.errors import TransportError
from mesh.topology.specs import BindingSpec, Declarations
from mesh.transport.delivery import Delivery, Handler
from mesh.wire.models import Message


class Subscription(Protocol):
    """A running consumer."""

    async def cancel(self) -> None: ...


@runtime_checkable
class ReportsBrokerCancel(Protocol):
    """A subscription that says when the broker cancelled it (its queue was deleted):
    ``on_broker_cancel``, if set, is called once, and nothing is delivered after. Both
    :class:`~mesh.transport.AmqpTransport`'s and the in-memory transport's consumers do."""

    on_broker_cancel: Callable[[], None] | None


class Transport(Protocol):
    """What the SDKs need from a transport. :class:`~mesh.transport.AmqpTransport` is the real
    one; tests and users can pass their own (an in-memory one, a recording fake)."""

    async def declare(self, declarations: Declarations) -> None: ...

    async def check_exchanges(self, names: Sequence[str]) -> None:
        """Raise :class:`mesh.errors.TopologyMissing` unless every exchange exists."""
        ...

    async def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, no_ack: bool = False
    ) -> Subscription: ...

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        message: Message | bytes,
        *,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        persistent: bool = False,
        mandatory: bool = True,
        timeout_s: float | None = None,
        user_id: str | None = None,
    ) -> None: ...

    async def publish_fast(
        self, exchange: str, routing_key: str, body: bytes, *, user_id: str | None = None
    ) -> None: ...

    async def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, Message]],
        *,
        timeout_s: float | None = None,
    ) -> list[TransportError | None]: ...

    async def publish_fast_many(
        self, exchange: str, messages: Sequence[tuple[str, bytes]]
    ) -> None: ...

    async def dead_letter(
        self,
        delivery: Delivery,
        *,
        dead_letter_exchange: str,
        source_queue: str,
        reason: str,
        detail: str,
    ) -> None: ...

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None: ...

    async def queue_depth(self, queue: str) -> int: ...

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None: ...

    async def close(self) -> None: ...


class ManagerTransport(Transport, Protocol):
    """What :class:`~mesh.manager.service.ManagerService` needs: heartbeats are consumed raw
    (no acks, the body and the validated user to a synchronous callback), and a dropped
    connection is reported."""

    async def consume_raw(
        self, queue: str, callback: Callable[[bytes, str | None], None]
    ) -> Subscription:
        """``callback(body, user_id)``: ``user_id`` as the broker validated it (or None)."""
        ...

    async def consume_acked(
        self, queue: str, on_deliveries: Callable[[list[Delivery]], None], *, prefetch: int
    ) -> Subscription:
        """``on_deliveries(deliveries)``: those that arrived together, in order, to be settled
        later (at most ``prefetch`` unsettled); it must not block."""
        ...

    def on_disconnect(self, callback: Callable[[], None]) -> None: ...

    async def declare_reply_queue(self, name: str) -> str:
        """An exclusive queue for answers to this connection (several managers ask each
        other: :mod:`mesh.manager.peers`)."""
        ...

    async def try_declare(self, declarations: Declarations) -> bool:
        """Declare on a channel of its own; ``False`` if a queue already exists with other
        arguments (RabbitMQ's PRECONDITION_FAILED), leaving it as it is."""
        ...

    async def empty_old_queue(self, name: str, bindings: Sequence[BindingSpec], into: str) -> int:
        """A queue renamed since an older version: move what ``name`` holds into ``into``
        and delete it; how many messages moved (0: there was no such queue)."""
        ...

    @property
    def blocked(self) -> bool:
        """The broker has blocked this connection's publishers (a memory or disk alarm)."""
        ...


class ClientTransport(Transport, Protocol):
    """What :class:`~mesh.producer.MeshClient` needs: an exclusive queue for its replies."""

    async def declare_reply_queue(self, name: str) -> str: ...

    async def consume_replies(
        self, name: str, on_deliveries: Callable[[list[Delivery]], None]
    ) -> Subscription:
        """Declare the exclusive reply queue ``name`` where it is consumed, and consume it
        without acks: ``on_deliveries(deliveries)`` gets those that arrived together, in
        order; it must not block."""
        ...
