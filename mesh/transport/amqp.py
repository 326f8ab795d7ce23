"""The transport over RabbitMQ: :class:`AmqpTransport`, the one object the mesh is handed.

It implements the transport ports (:mod:`mesh.transport.ports`) on one named connection with
a confirming publish channel, and hands each job to a room of its own: the connection's life
(:mod:`~mesh.transport.reconnect`), declarations (:mod:`~mesh.transport.declaring`),
publishing (:mod:`~mesh.transport.publishing`) and consuming
(:mod:`~mesh.transport.consuming`). The rest of the mesh never sees aio-pika types.

Publish outcomes are exceptions from :mod:`mesh.errors`:

* :class:`~mesh.errors.PublishUnroutable` - no queue matched (returned);
* :class:`~mesh.errors.PublishNacked` - the broker refused it (a full bounded queue);
* :class:`~mesh.errors.PublishTimeout` - no confirm in time: the outcome is *unknown*
  and the message may still be enqueued later, so retry with the same business ID.

Each publish attempt gets a fresh ``message_id``: aiormq matches returned
messages to publishes by it, so reusing one could hand one publish another's
outcome. Business IDs travel in headers or ``correlation_id``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection

from mesh import constants as c
from mesh.errors import BrokerUnavailable, LocalProtocolError, TransportError
from mesh.topology.specs import BindingSpec, Declarations
from mesh.transport import aiormq_bridge, dead_letters
from mesh.transport.addresses import BrokerAddresses
from mesh.transport.addresses import redact as redact  # re-exported
from mesh.transport.amqp091 import DeliveriesCallback, LeanConsumer
from mesh.transport.amqp091 import RawBatch as RawBatch  # re-exported
from mesh.transport.amqp091 import RawBatchCallback as RawBatchCallback  # re-exported
from mesh.transport.amqp091 import RawCallback as RawCallback  # re-exported
from mesh.transport.consuming import Consumer as Consumer  # re-exported
from mesh.transport.consuming import Consumers
from mesh.transport.declaring import Declarer
from mesh.transport.delivery import DEFAULT_EXCHANGE as DEFAULT_EXCHANGE  # re-exported
from mesh.transport.delivery import Delivery as Delivery  # re-exported
from mesh.transport.delivery import Handler
from mesh.transport.publishing import Publisher
from mesh.transport.reconnect import LivenessProbe, Reconnection, connect_first
from mesh.transport.urls import not_an_amqp_url
from mesh.transport.urls import url_user as url_user  # re-exported
from mesh.transport.urls import with_heartbeat as with_heartbeat  # re-exported
from mesh.wire.models import Message

_CONTROL_TIMEOUT_S = 5.0  # bound on channel operations that are not publishes


class AmqpTransport:
    """A named connection to RabbitMQ with a confirming publish channel."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        publish_channel: AbstractRobustChannel,
        *,
        url: str,
        publish_timeout_s: float,
        name: str = "mesh",
        addresses: BrokerAddresses | None = None,
        address: str | None = None,
    ) -> None:
        self.url = url
        self.name = name  # the connection's name in the management UI
        self._connection = connection
        self._publish_channel = publish_channel
        self._declarer = Declarer(connection, publish_channel, control_timeout_s=_CONTROL_TIMEOUT_S)
        self._publisher = Publisher(
            connection,
            publish_channel,
            publish_timeout_s=publish_timeout_s,
            control_timeout_s=_CONTROL_TIMEOUT_S,
        )
        self._life = Reconnection(
            connection,
            addresses or BrokerAddresses((url,)),
            address or url,
            url=url,
            on_dropped=self._dropped,
            on_restored=self._restored,
        )
        self._consumers = Consumers(
            connection,
            queue_on=self._declarer.queue_on,
            restoring=lambda: self._life.restoring,
            # From the node this connection reached, then in this process's order.
            consume_only_url=lambda: self._life.addresses.starting_at(self._life.address),
            name=name,
            control_timeout_s=_CONTROL_TIMEOUT_S,
        )
        self._liveness = LivenessProbe(
            connection, publish_channel, url=url, closing=lambda: self._life.closing
        )

    @classmethod
    async def connect(
        cls,
        url: str = c.DEFAULT_AMQP_URL,
        *,
        name: str,
        publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
        liveness_probe_s: float | None = None,
        sign: bool = False,
        properties: Mapping[str, str] | None = None,
    ) -> AmqpTransport:
        """Connect, or raise :class:`BrokerUnavailable` with one sentence that says what to do.

        ``sign``: every publish carries ``user_id`` = the URL's user (where the caller gives
        none), which RabbitMQ validates — so a receiver can tell this process's messages from
        anyone else's (agents take control messages only from the managers' user).

        ``liveness_probe_s``: also probe the broker twice every so many seconds and drop the
        connection (so it reconnects) when a probe gets no answer within that many seconds: a
        silent broker (a blackholed path) is noticed within one and a half intervals — two at
        the most — where the AMQP heartbeat alone takes ``(heartbeat + 1) * 3`` s or more
        (aiormq's rule).

        ``properties``: more client properties beside ``connection_name`` (an agent's
        incarnation), shown in the management API's connection list."""
        for part in url.split(","):
            not_amqp = not_an_amqp_url(part.strip())
            if not_amqp is not None:
                raise BrokerUnavailable(not_amqp)
        try:
            addresses = BrokerAddresses.parse(url)
        except LocalProtocolError as exc:
            raise BrokerUnavailable(str(exc)) from None
        connection, address = await connect_first(
            addresses, name=name, properties=properties, timeout_s=connect_timeout_s
        )
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        transport = cls(
            connection,
            channel,
            url=url,
            publish_timeout_s=publish_timeout_s,
            name=name,
            addresses=addresses,
            address=address,
        )
        if sign:
            transport.sign_as(url_user(url) or "guest")
        if liveness_probe_s is not None:
            transport.watch(liveness_probe_s)
        return transport

    # ---- the connection's life ------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return bool(self._connection.is_closed)

    @property
    def address(self) -> str:
        """The broker URL this connection reached, or is reconnecting to (of several given:
        :mod:`mesh.transport.addresses`)."""
        return self._life.address

    @property
    def blocked(self) -> bool:
        """RabbitMQ sent ``connection.blocked`` (a memory or disk alarm) and no ``unblocked``
        since."""
        return aiormq_bridge.is_blocked(self._connection)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the connection drops (before reconnection starts)."""
        self._life.on_disconnect(callback)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every reconnection (consumers are restored before it)."""
        self._life.on_reconnect(callback)

    def _dropped(self) -> None:
        """The connection dropped (the broker, the network, the liveness probe): the
        consume-only connection is dropped too, whether or not it has noticed yet, so the
        two come back together (:meth:`_restored`)."""
        self._consumers.dropped()

    async def _restored(self) -> None:
        # aio-pika has restored what it knew; forget our cache so later declares are real.
        self._declarer.forget()
        # Every channel is back: only now do the consumers take messages again.
        await self._consumers.restore()

    def watch(self, interval_s: float) -> None:
        """Start the liveness probe (see :meth:`connect` and
        :class:`~mesh.transport.reconnect.LivenessProbe`)."""
        self._liveness.start(interval_s)

    @property
    def probes_unanswered(self) -> int:
        """Liveness probes the broker did not answer in time (each dropped the connection)."""
        return self._liveness.probes_unanswered

    async def close(self) -> None:
        self._life.closing = True
        await self._consumers.close()
        await self._liveness.stop()
        if not self._connection.is_closed:
            await self._connection.close()

    # ---- declaration ----------------------------------------------------------------------
    async def declare(self, declarations: Declarations) -> None:
        """Declare exchanges, queues and bindings; specs already declared are skipped
        (:meth:`~mesh.transport.declaring.Declarer.declare`)."""
        await self._declarer.declare(declarations)

    async def try_declare(self, declarations: Declarations) -> bool:
        """Declare on a channel of its own; ``False`` if a queue already exists with other
        arguments (:meth:`~mesh.transport.declaring.Declarer.try_declare`)."""
        return await self._declarer.try_declare(declarations)

    async def check_exchanges(self, names: Sequence[str]) -> None:
        """:class:`~mesh.errors.TopologyMissing` unless every exchange exists."""
        await self._declarer.check_exchanges(names)

    async def empty_old_queue(self, name: str, bindings: Sequence[BindingSpec], into: str) -> int:
        """A queue renamed since an older version: move what ``name`` holds into ``into``
        (declared) and delete it; how many messages moved (0: there was none)."""
        return await self._declarer.empty_old_queue(name, bindings, into)

    async def declare_reply_queue(self, name: str) -> str:
        """An exclusive, auto-deleted queue for replies to this connection."""
        return await self._declarer.declare_reply_queue(name)

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None:
        await self._declarer.delete_queue(name, if_empty=if_empty)

    async def delete_exchange(self, name: str) -> None:
        await self._declarer.delete_exchange(name)

    async def delete_declared(self, made: Declarations) -> None:
        """Delete the queues and exchanges of ``made``: for a tool that ran in a namespace of
        its own (the conformance kit, a benchmark) and leaves nothing behind."""
        await self._declarer.delete_declared(made)

    # ---- publishing -----------------------------------------------------------------------
    @property
    def publish_timeout_s(self) -> float:
        """How long a confirmed publish waits for its confirm unless told otherwise."""
        return self._publisher.publish_timeout_s

    @publish_timeout_s.setter
    def publish_timeout_s(self, seconds: float) -> None:
        self._publisher.publish_timeout_s = seconds

    @property
    def signer(self) -> str | None:
        """The user every publish is signed with (``user_id``), or None (``connect(sign=)``)."""
        return self._publisher.signer

    @signer.setter
    def signer(self, user: str | None) -> None:
        self._publisher.signer = user

    @property
    def reopened_channels(self) -> int:
        """Times the publishing channel was reopened after refusals (RabbitMQ 3.10's stuck
        channel: :meth:`~mesh.transport.publishing.Publisher.publish`)."""
        return self._publisher.reopened_channels

    def sign_as(self, user: str) -> None:
        """Sign every publish from now on with ``user_id`` = ``user`` (the connection's
        user: RabbitMQ refuses any other)."""
        self._publisher.sign_as(user)

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
    ) -> None:
        """Publish and wait for the broker's confirm. See the module doc for the outcomes.

        ``user_id``, when set, must be this connection's user: RabbitMQ validates it, which is
        what lets the manager trust it as the authenticated publisher (the tenant)."""
        await self._publisher.publish(
            exchange,
            routing_key,
            message,
            reply_to=reply_to,
            correlation_id=correlation_id,
            headers=headers,
            persistent=persistent,
            mandatory=mandatory,
            timeout_s=timeout_s,
            user_id=user_id,
        )

    async def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, Message]],
        *,
        timeout_s: float | None = None,
    ) -> list[TransportError | None]:
        """:meth:`publish` of several ``(routing key, message)`` pairs in one write, each
        outcome ``None`` or the error :meth:`publish` would have raised
        (:meth:`~mesh.transport.publishing.Publisher.publish_many`)."""
        return await self._publisher.publish_many(exchange, messages, timeout_s=timeout_s)

    async def publish_fast(
        self, exchange: str, routing_key: str, body: bytes, *, user_id: str | None = None
    ) -> None:
        """Fire-and-forget on a channel without confirms: for superseded messages (heartbeats).
        ``user_id`` as for :meth:`publish` (RabbitMQ validates it: the manager may trust it)."""
        await self._publisher.publish_fast(exchange, routing_key, body, user_id=user_id)

    async def publish_fast_many(self, exchange: str, messages: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`publish_fast` of several ``(routing key, body)`` messages, in order, as one
        write to the connection."""
        await self._publisher.publish_fast_many(exchange, messages)

    async def dead_letter(
        self,
        delivery: Delivery,
        *,
        dead_letter_exchange: str,
        source_queue: str,
        reason: str,
        detail: str,
    ) -> None:
        """Republish a refused message to the dead-letter exchange with its reason, confirmed
        (:func:`mesh.transport.dead_letters.republish`)."""
        await dead_letters.republish(
            self,
            delivery,
            dead_letter_exchange=dead_letter_exchange,
            source_queue=source_queue,
            reason=reason,
            detail=detail,
        )

    # ---- consuming ------------------------------------------------------------------------
    async def consume(
        self, queue: str, handler: Handler, *, prefetch: int = 1, no_ack: bool = False
    ) -> Consumer:
        """Consume ``queue`` on its own channel. With ``no_ack`` nothing needs acking.
        ``TopologyMissing`` if the queue does not exist; ``TransportError`` if it is another
        connection's exclusive queue.

        Each delivery goes from aiormq straight into a :class:`Delivery` (no aio-pika
        ``IncomingMessage``, one task per message instead of two); the consumer subscribes
        again whenever its channel reopens (after a reconnect: before the ``on_reconnect``
        callbacks run)."""
        return await self._consumers.consume(queue, handler, prefetch=prefetch, no_ack=no_ack)

    async def consume_raw(self, queue: str, callback: RawCallback) -> LeanConsumer:
        """The cheapest path, for superseded messages (heartbeats): no acks, and only the body
        (and the validated ``user_id``) handed to a synchronous callback, or in batches (what
        arrived in one read) to its ``ingest_many`` if it is a :class:`RawBatchCallback`.
        On a consume-only connection of its own (:mod:`mesh.transport.amqp091`), opened on
        first use; it reconnects and consumes again by itself, and is dropped and restored
        with this transport's connection (before the ``on_reconnect`` callbacks run)."""
        return await self._consumers.consume_raw(queue, callback)

    async def consume_acked(
        self, queue: str, on_deliveries: DeliveriesCallback, *, prefetch: int
    ) -> LeanConsumer:
        """Consume ``queue`` with acks, at most ``prefetch`` deliveries unsettled, on the
        consume-only connection (:mod:`mesh.transport.amqp091`): the deliveries of each read
        from the socket go to ``on_deliveries`` (synchronous: it hands them on), each
        settled later with ``ack``/``reject``. For a busy queue whose messages are handled in
        batches (announcements while a fleet registers): without aiormq's task, lock and
        frame objects per message, and with every ack of one loop turn in one write.
        Cancelling stops deliveries at once; its channel closes once all are settled."""
        return await self._consumers.consume_acked(queue, on_deliveries, prefetch=prefetch)

    async def consume_replies(self, name: str, on_deliveries: DeliveriesCallback) -> LeanConsumer:
        """A client's reply queue ``name`` (:func:`~mesh.topology.specs.reply_queue`:
        exclusive, auto-deleted), declared on the consume-only connection — an exclusive
        queue is consumed only by the connection that declared it — and consumed there
        without acks: each read's replies to ``on_deliveries`` as :class:`Delivery` objects
        (nothing to settle). Declared and consumed again after a reconnect, before the
        ``on_reconnect`` callbacks run. Requests still go out on this transport's connection,
        with ``reply_to=name``."""
        return await self._consumers.consume_replies(name, on_deliveries)

    async def get_one(self, queue: str, *, timeout_s: float = 5.0) -> Delivery | None:
        """Fetch one message with basic.get (for tools and tests); ``None`` if empty."""
        return await self._consumers.get_one(queue, timeout_s=timeout_s)

    async def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (passive declare)."""
        return (await self._consumers.queue_counts(queue))[0]

    async def queue_consumers(self, queue: str) -> int:
        """Consumers of ``queue`` now (passive declare)."""
        return (await self._consumers.queue_counts(queue))[1]
