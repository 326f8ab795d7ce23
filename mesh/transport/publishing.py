"""Publishing: confirmed (one or a batch, each outcome an exception of
:mod:`mesh.errors`) on the transport's confirming channel, and fire-and-forget on a channel
without confirms.

Every publish's frames are written by :mod:`mesh.transport.amqp091.publish` and handed to
aiormq's channel through :mod:`mesh.transport.aiormq_bridge`, with aiormq's own confirm
bookkeeping. Each attempt gets a fresh ``message_id`` (returns are matched by it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import aiormq
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection

from mesh import constants as c
from mesh.errors import PublishNacked, PublishTimeout, PublishUnroutable, TransportError
from mesh.ids import IdSequence
from mesh.transport import aiormq_bridge
from mesh.transport.amqp091 import message_properties
from mesh.wire.codec import encode
from mesh.wire.models import Message

log = logging.getLogger(__name__)

_FAST_PROPERTIES = aiormq.spec.Basic.Properties(content_type=c.CONTENT_TYPE)
_FAST_MARSHALLED = _FAST_PROPERTIES.marshal()
_REOPEN_EVERY_S = 5.0  # a refusing publishing channel is reopened at most this often


def _where(exchange: str, routing_key: str) -> str:
    return f"{exchange or '<default>'}/{routing_key}"


class Publisher:
    """Publishes of one transport: confirmed on ``channel`` (reopened when RabbitMQ 3.10
    keeps refusing on it), confirm-less on a channel of its own opened on first use."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        channel: AbstractRobustChannel,
        *,
        publish_timeout_s: float,
        control_timeout_s: float,
    ) -> None:
        self.publish_timeout_s = publish_timeout_s
        self._connection = connection
        self._publish_channel = channel
        self._control_timeout_s = control_timeout_s
        self._fast_channel: AbstractRobustChannel | None = None
        self._message_ids = IdSequence()  # fresh per publish attempt
        # The user every publish is signed with (``user_id``), or None (``connect(sign=)``).
        self.signer: str | None = None
        self._fast_properties = _FAST_PROPERTIES  # signed by sign_as
        self._fast_marshalled = _FAST_MARSHALLED
        self._reopened_at = -math.inf  # monotonic: the publishing channel last reopened
        self.reopened_channels = 0  # reopened after refusals (RabbitMQ 3.10's stuck channel)

    def sign_as(self, user: str) -> None:
        """Sign every publish from now on with ``user_id`` = ``user`` (the connection's
        user: RabbitMQ refuses any other)."""
        self.signer = user
        self._fast_properties = aiormq.spec.Basic.Properties(
            content_type=c.CONTENT_TYPE, user_id=user
        )
        self._fast_marshalled = self._fast_properties.marshal()

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
        body = message if isinstance(message, bytes) else encode(message)
        signer = self.signer if user_id is None else user_id
        # Whole seconds (AMQP's resolution): the management API reports the head message's
        # timestamp per (classic) queue, which is how the manager shows the oldest one's age.
        timestamp = int(time.time()) if persistent else None
        kind = None if isinstance(message, bytes) else message.type
        timeout = self.publish_timeout_s if timeout_s is None else timeout_s
        for attempt in (1, 2):
            message_id = self._message_ids.next()  # fresh per attempt (returns match by it)
            properties = message_properties(
                kind,
                message_id,
                reply_to=reply_to,
                correlation_id=correlation_id,
                user_id=signer,
                headers=headers or None,
                persistent=persistent,
                timestamp=timestamp,
            )
            try:
                await self._publish_once(
                    exchange, routing_key, body, properties, message_id, mandatory, timeout
                )
                return
            except PublishNacked:
                # RabbitMQ 3.10 can keep refusing every publish on a channel whose publish
                # met a quorum queue leader's death, while a fresh channel is accepted: the
                # channel is reopened (at most every _REOPEN_EVERY_S) and the publish tried
                # once more there. A queue that is really full refuses that one too.
                if attempt == 2 or not await self._reopen_refusing_channel():
                    raise

    async def _publish_once(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        message_id: str,
        mandatory: bool,
        wait_s: float,
    ) -> None:
        timeout = wait_s
        try:
            # On aiormq's confirming channel, with its bookkeeping (a delivery tag and a
            # confirm future, the message ID mapped to the tag so a return finds it), but the
            # frames written by mesh.transport.amqp091.publish, not through pamqp's objects.
            # The confirm is the wait: nothing waits for the writer to flush the frames, so
            # concurrent publishes do not go out one loop turn at a time.
            async with asyncio.timeout(timeout):  # the reconnect wait counts, too
                channel = await self._publish_channel.get_underlay_channel()
                (confirm,) = await aiormq_bridge.put_confirmed(
                    channel, exchange, [(routing_key, body, properties, message_id)], mandatory
                )
                await confirm
        # Where it went is named (_where) on an error only: not built on every publish.
        except aiormq.exceptions.PublishError as exc:
            raise PublishUnroutable(
                f"no queue bound for {_where(exchange, routing_key)} ({exc})"
            ) from None
        except aiormq.exceptions.DeliveryError as exc:
            raise PublishNacked(
                f"broker refused publish to {_where(exchange, routing_key)} ({exc})"
            ) from None
        except TimeoutError:
            raise PublishTimeout(
                f"no confirm within {timeout:g} s for {_where(exchange, routing_key)}; the"
                " message may still be enqueued"
            ) from None
        except (aiormq.exceptions.AMQPError, RuntimeError) as exc:
            raise TransportError(
                f"publish to {_where(exchange, routing_key)} failed: {exc}"
            ) from exc
        except asyncio.CancelledError:
            # aiormq fails a closing connection's pending futures with CancelledError (its
            # default close reason; a missed-heartbeats close too): the connection died, this
            # task was not cancelled. A real cancellation of the caller still propagates.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise TransportError(
                f"publish to {exchange}/{routing_key} failed: the connection closed"
            ) from None

    async def _reopen_refusing_channel(self) -> bool:
        """Reopen the publishing channel after a refusal, unless it was reopened less than
        ``_REOPEN_EVERY_S`` ago (a queue really full refuses again and again: one more try
        each so often, not each time); whether it was reopened now. Publishes in flight on
        the old channel fail ``TransportError`` (outcome unknown: they are retried)."""
        now = time.monotonic()
        if now - self._reopened_at < _REOPEN_EVERY_S:
            return False
        self._reopened_at = now
        self.reopened_channels += 1
        log.warning("publishes refused: reopening the publishing channel")
        try:
            async with asyncio.timeout(self._control_timeout_s):
                await self._publish_channel.close()
                await self._publish_channel.reopen()
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            log.warning("publishing channel not reopened", extra={"error": str(exc)})
            return False
        return True

    async def publish_many(
        self,
        exchange: str,
        messages: Sequence[tuple[str, Message]],
        *,
        timeout_s: float | None = None,
    ) -> list[TransportError | None]:
        """:meth:`publish` (mandatory, not persistent) of several ``(routing key, message)``
        pairs in one write to the confirming channel, waiting for all their confirms
        together: each outcome is ``None`` (confirmed) or the error :meth:`publish` would
        have raised for it (:class:`PublishUnroutable`, :class:`PublishNacked`,
        :class:`PublishTimeout`, :class:`TransportError`). A batch of registrations answers
        its agents with this.

        aiormq publishes one message per call; this does what ``Channel.basic_publish``
        does for each (a delivery tag and a confirm future per message, its message ID mapped
        to the tag so a return finds it) under the channel's lock once, and hands all the
        frames to the connection's writer as one write."""
        if not messages:
            return []
        timeout = self.publish_timeout_s if timeout_s is None else timeout_s
        outcomes: list[TransportError | None] = [None] * len(messages)
        try:
            async with asyncio.timeout(timeout):
                channel = await self._publish_channel.get_underlay_channel()
                confirms = await aiormq_bridge.put_confirmed(
                    channel, exchange, [self._framed(key, message) for key, message in messages]
                )
                answers = await asyncio.gather(*confirms, return_exceptions=True)
        except TimeoutError:
            return [
                PublishTimeout(
                    f"no confirm within {timeout:g} s for {exchange or '<default>'}/{key}; "
                    "the message may still be enqueued"
                )
                for key, _ in messages
            ]
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError, ValueError) as exc:
            failed = TransportError(f"publish of {len(messages)} to {exchange} failed: {exc}")
            return [failed] * len(messages)
        for index, ((key, _), answer) in enumerate(zip(messages, answers, strict=True)):
            where = _where(exchange, key)
            if isinstance(answer, aiormq.exceptions.PublishError):
                outcomes[index] = PublishUnroutable(f"no queue bound for {where} ({answer})")
            elif isinstance(answer, aiormq.exceptions.DeliveryError):
                outcomes[index] = PublishNacked(f"broker refused publish to {where} ({answer})")
            elif isinstance(answer, BaseException):
                outcomes[index] = TransportError(f"publish to {where} failed: {answer!r}")
        return outcomes

    def _framed(self, routing_key: str, message: Message) -> aiormq_bridge.Framed:
        """A message of :meth:`publish_many` as
        :func:`~mesh.transport.aiormq_bridge.put_confirmed` takes it."""
        message_id = self._message_ids.next()
        properties = message_properties(message.type, message_id, user_id=self.signer)
        return routing_key, encode(message), properties, message_id

    async def _fast_underlay(self) -> aiormq.Channel:
        """The confirm-less channel's current underlying aiormq channel (opened on first use).
        Straight to aiormq: without confirms, aio-pika's Exchange and Message objects only add
        per-message work."""
        if self._fast_channel is None:
            self._fast_channel = await self._connection.channel(publisher_confirms=False)
        return cast(aiormq.Channel, await self._fast_channel.get_underlay_channel())

    async def publish_fast(
        self, exchange: str, routing_key: str, body: bytes, *, user_id: str | None = None
    ) -> None:
        """Fire-and-forget on a channel without confirms: for superseded messages (heartbeats).
        ``user_id`` as for :meth:`publish` (RabbitMQ validates it: the manager may trust it)."""
        try:
            channel = await self._fast_underlay()
            properties = (
                self._fast_properties
                if user_id is None
                else aiormq.spec.Basic.Properties(content_type=c.CONTENT_TYPE, user_id=user_id)
            )
            # ``wait=False``: handed to the connection's writer, not waited for until it is
            # flushed (aiormq would hold the channel's lock meanwhile, so a burst of these went
            # out one loop turn each); there is no confirm to wait for anyway.
            await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                wait=False,
            )
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError) as exc:
            raise TransportError(
                f"publish to {_where(exchange, routing_key)} failed: {exc}"
            ) from exc

    async def publish_fast_many(self, exchange: str, messages: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`publish_fast` of several ``(routing key, body)`` messages, in order, as one
        write to the connection: their frames are encoded together and handed to aiormq's
        writer once (one lock, one queue hand-off, one socket send) instead of once each — a
        batch of registrations publishes hundreds of feed events at a time.

        aiormq has no batch publish, so this builds what ``Channel.basic_publish`` builds for
        each message (a ``basic.publish`` method frame, a content header, the body in frames
        of at most the negotiated size) on a channel without confirms, where no delivery tag
        or confirm is tracked."""
        if not messages:
            return
        try:
            channel = await self._fast_underlay()
            await aiormq_bridge.put_unconfirmed(channel, exchange, messages, self._fast_marshalled)
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError, ValueError) as exc:
            raise TransportError(
                f"publish of {len(messages)} messages to {exchange} failed: {exc}"
            ) from exc
