"""Several managers: asking the other shard owners what only they know.

With shards (``ManagerSettings.shard_count``) each manager's registry holds the agents of the
shards it owns, so a lease-path request — ``find``, ``acquire``, ``release``, an operator's
``drain`` — that any manager takes from the shared RPC queue may concern agents another
manager holds. The manager that took it answers from its own registry and from the other
owners': it sends the request to one RPC queue of each other owner
(``<ns>.manager.shard-<k>.rpc``, consumed by shard ``k``'s owner, which answers for every
shard it holds), marked as forwarded, and gathers their replies on a reply queue of its own.
A forwarded request is answered from the receiving manager's registry alone, never forwarded
again, so a request costs at most one hop.

This module is the asking side: a reply queue, the requests in flight by correlation ID, and
a deadline for each answer. What to ask and how to merge the answers is the service's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from mesh.topology import names
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery
from mesh.transport.ports import ManagerTransport, Subscription
from mesh.wire.codec import decode
from mesh.wire.models import Message

log = logging.getLogger(__name__)

REPLY_MAX_BYTES = 64 * 1024 * 1024  # a peer's find reply may list many agents


class Peers:
    """Requests to other managers' shard RPC queues, and their answers."""

    def __init__(
        self,
        transport: ManagerTransport,
        namespace: str,
        manager_id: str,
        *,
        user_id: str | None,
        counters: Counter[str],
    ) -> None:
        self.transport = transport
        self.reply_queue = names.reply_queue(namespace, f"peers-{manager_id}", uuid.uuid4().hex[:8])
        self.user_id = user_id
        self.counters = counters
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._consumer: Subscription | None = None

    async def start(self) -> None:
        await self.transport.declare_reply_queue(self.reply_queue)
        self._consumer = await self.transport.consume(self.reply_queue, self._on_reply, no_ack=True)

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.cancel()
            self._consumer = None
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    async def _on_reply(self, delivery: Delivery) -> None:
        future = self._pending.pop(delivery.correlation_id or "", None)
        if future is None or future.done():
            self.counters["peer_replies_late"] += 1
            return
        try:
            future.set_result(decode(delivery.body, max_bytes=REPLY_MAX_BYTES))
        except Exception as exc:  # a bad reply fails that one question, not the consumer
            future.set_exception(exc)

    async def ask(
        self,
        queue: str,
        message: Message,
        *,
        headers: Mapping[str, Any],
        timeout_s: float,
    ) -> Message | None:
        """``message`` to ``queue`` (a shard's RPC queue), its answer — or ``None`` if none
        came within ``timeout_s`` or it could not be sent (counted: ``peer_no_answer``)."""
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        self.counters["peer_requests"] += 1
        try:
            await self.transport.publish(
                DEFAULT_EXCHANGE,
                queue,
                message,
                reply_to=self.reply_queue,
                correlation_id=correlation_id,
                headers=headers,
                timeout_s=timeout_s,
                user_id=self.user_id,
            )
            async with asyncio.timeout(timeout_s):
                return await future
        except Exception as exc:  # a peer away or slow: the others still answer
            self.counters["peer_no_answer"] += 1
            log.info("no answer from a peer manager", extra={"queue": queue, "error": str(exc)})
            return None
        finally:
            self._pending.pop(correlation_id, None)

    async def ask_all(
        self,
        queues: Sequence[str],
        message: Message,
        *,
        headers: Mapping[str, Any],
        timeout_s: float,
    ) -> list[tuple[str, Message]]:
        """:meth:`ask` every queue at once; the answers that came, with their queue."""
        answers = await asyncio.gather(
            *(self.ask(q, message, headers=headers, timeout_s=timeout_s) for q in queues)
        )
        return [(q, a) for q, a in zip(queues, answers, strict=True) if a is not None]
