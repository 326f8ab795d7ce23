"""The in-memory broker's records: messages, queues, consumers and connections.

Plain state with the few questions each record answers about itself (whose turn it is,
whether a consumer has room); the broker (:mod:`mesh.testing.broker`) moves messages
between them. ``QueuedMessage`` and ``QueueInfo`` are what a test sees of that state.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mesh.testing.amqp_rules import Spec
from mesh.testing.broker_errors import DeliverySettleError
from mesh.topology.specs import QueueSpec
from mesh.transport.delivery import Delivery, Handler, Settlement

__all__ = [
    "NO_ACK",
    "Connection",
    "ConnectionState",
    "Consumer",
    "Queue",
    "QueueInfo",
    "QueuedMessage",
    "RawCallback",
    "StoredMessage",
]

RawCallback = Callable[[bytes, str | None], None]  # body, user_id
ConnectionState = Literal["open", "disconnected", "closed"]


# ---- what a test can inspect --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class QueuedMessage:
    """A ready message, as :meth:`InMemoryBroker.messages` shows it."""

    body: bytes
    exchange: str
    routing_key: str
    headers: Mapping[str, Any]
    reply_to: str | None
    correlation_id: str | None
    message_id: str | None
    redelivered: bool


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's counts, as the management UI shows them."""

    name: str
    spec: QueueSpec
    ready: int
    unacked: int
    consumers: int


# ---- the broker's state -------------------------------------------------------------------
@dataclass(slots=True)
class StoredMessage:
    """A message as a queue holds it: one copy per queue it was routed to."""

    body: bytes
    exchange: str
    routing_key: str
    headers: dict[str, Any] = field(default_factory=dict)
    reply_to: str | None = None
    correlation_id: str | None = None
    message_id: str | None = None
    redelivered: bool = False
    expires_at: float | None = None
    returns: int = 0  # times handed back to its queue (for x-delivery-limit)
    user_id: str | None = None  # as the publisher claimed it (no users to validate against)

    def copy(self) -> StoredMessage:
        return StoredMessage(
            self.body,
            self.exchange,
            self.routing_key,
            copy.deepcopy(self.headers),
            self.reply_to,
            self.correlation_id,
            self.message_id,
            user_id=self.user_id,
        )

    def delivery(self, settlement: Settlement) -> Delivery:
        """What a consumer (or ``get_one``) receives for this message."""
        return Delivery(
            body=self.body,
            routing_key=self.routing_key,
            exchange=self.exchange,
            headers=copy.deepcopy(self.headers),
            reply_to=self.reply_to,
            correlation_id=self.correlation_id,
            message_id=self.message_id,
            user_id=self.user_id,
            redelivered=self.redelivered,
            _raw=settlement,
        )

    def snapshot(self) -> QueuedMessage:
        return QueuedMessage(
            self.body,
            self.exchange,
            self.routing_key,
            copy.deepcopy(self.headers),
            self.reply_to,
            self.correlation_id,
            self.message_id,
            self.redelivered,
        )


@dataclass(eq=False, slots=True)
class Connection:
    """The broker's side of one transport: its state, its consumers, what it declared (to
    declare again after a reconnect) and the callbacks a disconnect and a reconnect call."""

    name: str
    state: ConnectionState = "open"
    consumers: list[Consumer] = field(default_factory=list)
    declared: dict[Spec, None] = field(default_factory=dict)  # the declare cache
    topology: dict[Spec, None] = field(default_factory=dict)  # what a reconnect declares
    reconnect_callbacks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    disconnect_callbacks: list[Callable[[], None]] = field(default_factory=list)


class Queue:
    def __init__(self, spec: QueueSpec, owner: Connection, now: float) -> None:
        self.spec = spec
        self.owner = owner  # matters only for exclusive queues
        self.ready: deque[StoredMessage] = deque()
        self.consumers: list[Consumer] = []
        self.last_used = now
        self.deleted = False
        self._turn = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def ready_bytes(self) -> int:
        """The bodies' bytes of the ready messages: what ``x-max-length-bytes`` counts."""
        return sum(len(m.body) for m in self.ready)

    def next_consumer(self) -> Consumer | None:
        """Round-robin over the consumers that have room under their prefetch."""
        count = len(self.consumers)
        for step in range(count):
            consumer = self.consumers[(self._turn + step) % count]
            if consumer.has_room():
                self._turn = (self._turn + step + 1) % count
                return consumer
        return None

    def locked_for(self, connection: Connection) -> bool:
        return self.spec.exclusive and self.owner is not connection


class Consumer:
    def __init__(
        self,
        connection: Connection,
        queue: Queue,
        *,
        handler: Handler | None,
        raw: RawCallback | None,
        prefetch: int,
        no_ack: bool,
    ) -> None:
        self.connection = connection
        self.queue = queue
        self.handler = handler
        self.raw = raw
        self.no_ack = no_ack or raw is not None
        self.limit = None if self.no_ack or prefetch <= 0 else prefetch
        self.unacked: dict[int, StoredMessage] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.epoch = 0  # bumped when the connection drops: older deliveries cannot settle
        self.cancelled = False
        self.on_broker_cancel: Callable[[], None] | None = None  # its queue was deleted

    def has_room(self) -> bool:
        return self.limit is None or len(self.unacked) < self.limit

    @property
    def idle(self) -> bool:
        return self.cancelled and not self.unacked and not self.tasks


class _NoAck:
    """The settlement of a delivery consumed with ``no_ack`` (or fetched with ``get_one``)."""

    async def ack(self) -> None:
        raise DeliverySettleError("this delivery was consumed with no_ack: nothing to ack")

    async def reject(self, requeue: bool = False) -> None:
        raise DeliverySettleError("this delivery was consumed with no_ack: nothing to reject")

    def held(self) -> bool:
        return True


NO_ACK = _NoAck()
