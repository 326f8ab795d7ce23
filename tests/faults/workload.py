"""A producer and a consumer of numbered messages, counted by a :class:`Tally`.

The producer publishes each business ID with confirms (persistent) and retries an ``unknown``
outcome under the same ID, as a mesh producer does; a ``nacked`` one is final. The consumer
applies each ID's effect once (it remembers what it applied: the idempotent consumer every
at-least-once system needs) and acks after applying. Both run on :class:`AmqpTransport`, the
mesh's own transport, so its reconnects and consumer restores are what is under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from mesh.topology import BindingSpec, Declarations, ExchangeSpec, QueueSpec
from mesh.topology.specs import QueueArguments, QueueType
from mesh.transport import Delivery
from mesh.transport.amqp import AmqpTransport

from .accounting import Tally

RETRY_PAUSE_S = 0.2
POLL_S = 0.02
"""How often the fault tests look at a condition: a stream moves on quickly."""


def ids(prefix: str, count: int) -> list[str]:
    """``count`` business IDs, ``<prefix>-0000`` on."""
    return [f"{prefix}-{n:04d}" for n in range(count)]


def work_queue(
    namespace: str, queue_type: QueueType = "classic", **arguments: object
) -> Declarations:
    """A durable topic exchange ``<ns>.work`` and a durable queue ``<ns>.work.q`` bound to it."""
    exchange = f"{namespace}.work"
    queue = f"{exchange}.q"
    args = QueueArguments(queue_type=queue_type, **arguments)  # type: ignore[arg-type]
    return Declarations(
        exchanges=(ExchangeSpec(exchange),),
        queues=(QueueSpec(queue, durable=True, arguments=args),),
        bindings=(BindingSpec(queue, exchange, "work.#"),),
    )


@dataclass
class Workload:
    producer: AmqpTransport
    consumer: AmqpTransport
    exchange: str
    queue: str
    tally: Tally = field(default_factory=Tally)
    handle_s: float = 0.0  # time a consumer spends on each message (some are in flight)
    poison: Callable[[str], bool] = lambda _: False  # IDs the consumer always rejects
    publish_timeout_s: float = 2.0
    applied: set[str] = field(default_factory=set)

    @classmethod
    async def over(
        cls,
        producer: AmqpTransport,
        consumer: AmqpTransport,
        declarations: Declarations,
        publish_timeout_s: float,
    ) -> Workload:
        """Declare :func:`work_queue`'s ``declarations`` and work on them."""
        await producer.declare(declarations)
        return cls(
            producer,
            consumer,
            exchange=declarations.exchanges[0].name,
            queue=declarations.queues[0].name,
            publish_timeout_s=publish_timeout_s,
        )

    async def consume(self, prefetch: int = 20) -> None:
        await self.consumer.consume(self.queue, self._on_message, prefetch=prefetch)

    async def _on_message(self, delivery: Delivery) -> None:
        business_id = delivery.body.decode()
        self.tally.delivered(business_id)
        if self.poison(business_id):
            await delivery.reject(requeue=True)  # a handler that crashes on it, every time
            return
        if self.handle_s:
            await asyncio.sleep(self.handle_s)
        if business_id not in self.applied:
            self.applied.add(business_id)
            self.tally.applied(business_id)
        await delivery.ack()

    async def publish_one(self, business_id: str) -> str:
        return await self.tally.publish(
            business_id,
            lambda: self.producer.publish(
                self.exchange,
                f"work.{business_id}",
                business_id.encode(),
                persistent=True,
                timeout_s=self.publish_timeout_s,
            ),
        )

    async def produce(self, ids: list[str], *, give_up_after_s: float = 90.0) -> None:
        """Publish every ID until confirmed or nacked (``unknown`` is retried)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + give_up_after_s
        for business_id in ids:
            while await self.publish_one(business_id) == "unknown":
                if loop.time() > deadline:
                    raise AssertionError(f"still unknown after {give_up_after_s} s: {business_id}")
                await asyncio.sleep(RETRY_PAUSE_S)

    async def settled(self, timeout_s: float = 60.0) -> None:
        """Wait until every confirmed ID was consumed (applied) or dead-lettered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.tally.lost:
            if loop.time() > deadline:
                raise AssertionError(
                    f"{len(self.tally.lost)} confirmed IDs never consumed: {self.tally.report()}"
                )
            await asyncio.sleep(0.1)
