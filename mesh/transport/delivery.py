"""What the rest of the mesh sees of a received message, independent of the AMQP client.

Kept apart from :mod:`mesh.transport.amqp` so that code which only handles deliveries — the
in-memory broker of :mod:`mesh.testing`, the transport ports — never loads aio-pika.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_EXCHANGE = ""


class Settlement(Protocol):
    """What a :class:`Delivery` settles through: aio-pika's incoming message in
    :mod:`mesh.transport.amqp`, an in-memory stand-in in :mod:`mesh.testing`."""

    async def ack(self) -> None: ...

    async def reject(self, requeue: bool = False) -> None: ...

    def held(self) -> bool:
        """Whether the channel the message came on is still open: once it is gone the broker
        has given the message back to its queue, and another consumer may hold it now."""
        ...


class NoSettle:
    """A delivery consumed without acks: there is nothing to settle."""

    __slots__ = ()

    async def ack(self) -> None:
        return None

    async def reject(self, requeue: bool = False) -> None:
        return None

    def held(self) -> bool:
        return True  # consumed without acks: never given to anyone else


NO_SETTLE = NoSettle()


@dataclass(slots=True)
class Delivery:
    """One received message, independent of the AMQP client library."""

    body: bytes
    routing_key: str
    exchange: str
    headers: Mapping[str, Any]
    reply_to: str | None
    correlation_id: str | None
    message_id: str | None
    user_id: str | None
    redelivered: bool
    _raw: Settlement = field(repr=False)

    async def ack(self) -> None:
        await self._raw.ack()

    async def reject(self, requeue: bool = False) -> None:
        await self._raw.reject(requeue=requeue)

    def held(self) -> bool:
        """Whether this consumer still holds the message: False once the channel it came on
        is gone, when the broker has requeued it and may have given it to another consumer
        (a manager that answered it now would answer a request someone else answers too)."""
        return self._raw.held()


Handler = Callable[[Delivery], Awaitable[None]]
