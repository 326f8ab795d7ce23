"""The pool's shared task queue (``<ns>.pool.<deployment>.tasks``): admitted tasks, taken by
every agent of the pool.

The manager declares the queue when the pool's descriptor is published; until then there is
nothing to take, and each announcement of a newer epoch tries again — subscribing afresh,
which also recovers from an operator deleting and the manager declaring the queue again. A
queue deleted under the consumer (the broker cancels it) is looked for again, at growing
intervals, until it is back. Draining: the consumer is cancelled at once, pool tasks
prefetched but not started go back to the queue for the other agents (they wait for a slot in
:meth:`PoolQueue.wait_to_start`, which says no once the drain began), started ones finish;
then a heartbeat says ``draining`` with what still runs, which is the manager's cue that no
pool task will start here any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from functools import partial
from typing import Any

from mesh.agent.base import BoundCapability
from mesh.agent.core import AgentCore
from mesh.agent.liveness import Liveness
from mesh.agent.settings import Identity
from mesh.agent.settling import cancel_quietly
from mesh.agent.work import Work
from mesh.topology import Topology
from mesh.transport import Delivery
from mesh.transport.ports import ReportsBrokerCancel, Subscription
from mesh.transport.ports import Transport as AgentTransport

log = logging.getLogger(__name__)

# A deleted pool queue is looked for again after 0.5 s, then at doubling intervals up to 5 s.
_POOL_BACK_FIRST_S = 0.5
_POOL_BACK_MAX_S = 5.0


class PoolQueue:
    """This agent's consumer of its pool's task queue."""

    def __init__(
        self,
        identity: Identity,
        *,
        capabilities: Mapping[str, BoundCapability],
        prefetch: int,
        core: AgentCore,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        work: Work,
        liveness: Liveness,
        on_task: Callable[[Delivery], Awaitable[None]],
        accepted: Callable[[], bool],
        draining: Callable[[], bool],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ) -> None:
        self._identity = identity
        self._capabilities = capabilities
        self._prefetch = prefetch
        self._core = core
        self._queue = topology.pool_task_queue(identity.deployment)
        self._transport = transport
        self._counters = counters
        self._work = work
        self._liveness = liveness
        self._on_task = on_task
        self._accepted = accepted
        self._draining = draining
        self._spawn = spawn
        self._consumer: Subscription | None = None
        self._return: asyncio.Task[None] | None = None  # waiting for it after a delete
        self._epoch: int | None = None  # the newest descriptor epoch known when it began
        self._lock = asyncio.Lock()
        self.closed = False
        """Draining, and the consumer is cancelled: no pool task starts here any more."""

    @property
    def consumed(self) -> bool:
        return self._consumer is not None

    async def consume(self, epoch: int | None = None) -> None:
        """Take admitted tasks from our pool's queue, alongside the other agents of the pool.
        Called at the start and on each announcement of a newer ``epoch``. Not when the
        consumer there began at that epoch or later, or before any epoch was known (the
        start's subscription and the first announcement race): a subscription replaced hands
        its prefetched tasks back to the queue, where they come again marked redelivered."""
        extra = self._identity.extra
        async with self._lock:
            if self._draining() or self._core.phase not in ("starting", "running"):
                return
            if not self._accepted():
                # A descriptor_active event can come while our registration is deferred (a
                # live incarnation holds our ID): nothing is ours to take before the manager
                # accepted this incarnation; the start subscribes once it has.
                return
            if self._consumer is not None and (
                epoch is None or self._epoch is None or epoch <= self._epoch
            ):
                if self._epoch is None:
                    self._epoch = epoch  # the first epoch learned: the queue consumed
                return
            old, self._consumer = self._consumer, None
            await cancel_quietly(old)
            try:
                self._consumer = await self._transport().consume(
                    self._queue, self._on_task, prefetch=self._prefetch
                )
            except Exception as exc:  # 404 on the passive declare: not declared yet
                log.debug("no pool queue to consume yet", extra=extra(error=str(exc)))
                return
            if self._draining():  # began draining meanwhile
                await self.stop_consumer()
                return
            self._epoch = self._core.active_epoch
            if isinstance(self._consumer, ReportsBrokerCancel):
                self._consumer.on_broker_cancel = partial(self._gone, self._consumer)
        self._counters["pool_subscriptions"] += 1
        log.info("taking tasks from the pool queue", extra=extra(queue=self._queue))

    def _gone(self, consumer: Subscription) -> None:
        """The broker cancelled our pool consumer: the pool queue was deleted (an operator in
        the management UI, say). We are not subscribed any more, and try again until the
        queue is back — the manager declares a described pool's queue again when it finds
        it gone — rather than wait for a newer epoch that may never come."""
        if self._consumer is not consumer:
            return
        self._consumer = None
        self._counters["pool_queue_lost"] += 1
        log.warning(
            "our pool queue was deleted; subscribing again once it is back",
            extra=self._identity.extra(),
        )
        if self._return is None or self._return.done():
            self._return = self._spawn(self._back(), "pool queue back")

    async def _back(self) -> None:
        delay = _POOL_BACK_FIRST_S
        while self._consumer is None and not self._draining() and self._core.phase == "running":
            await asyncio.sleep(delay)
            await self.consume()
            delay = min(2 * delay, _POOL_BACK_MAX_S)

    async def stop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        await cancel_quietly(consumer)

    async def close(self) -> None:
        """Draining: take no more pool tasks, hand back the prefetched ones not started, and
        tell the manager (a heartbeat saying ``draining``) what still runs here."""
        await self.stop_consumer()
        async with self._lock:  # a (re)subscription under way has finished or seen us
            self.closed = True
        self._work.pulse()  # pool tasks waiting for a slot go back to the queue
        if self._liveness.running:
            await self._liveness.send()

    async def wait_to_start(self, capability: str) -> bool:
        """Wait for a free slot of ``capability`` for a pool task; ``False`` if we began
        draining first (the task goes back to the pool queue, not started)."""
        bound = self._capabilities.get(capability)
        while not self._draining() and bound is not None and bound.semaphore.locked():
            await self._work.changed()
        return not self._draining()
