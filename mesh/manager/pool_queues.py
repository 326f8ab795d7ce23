"""The pools' task queues (``<ns>.pool.<pool>.tasks``): declared by the manager once a pool
has a descriptor, bounded at the pool's model slots by a broker policy, polled for depth, and
declared again when an operator deleted one.

Each queue is declared once with arguments that never change (quorum, ``reject-publish``, a
fixed ceiling, the dead-letter exchange); its bound at the pool's slots is a policy set through
the management API whenever the slots change (:meth:`Topology.pool_bound_policy`), so a bound
that moves never needs a queue deleted or replaced.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from mesh.errors import TopologyMissing
from mesh.manager.observe import Observer
from mesh.topology.specs import Topology
from mesh.transport.ports import ManagerTransport
from mesh.wire.admission import CapabilityDescriptor

log = logging.getLogger(__name__)

REDECLARE_AFTER_S = 1.0
"""A deleted pool queue is declared again only once it has been missing this long. RabbitMQ
answers a consumed queue's deletion by consuming again, under the same tag, from the queue of
that name (meant for a mirrored queue's failover): declared again within those first tens of
milliseconds, the agents' consumers move to the new queue silently — no ``basic.cancel``, and
no deliveries either. Missing a moment longer, they are cancelled, and the agents subscribe
again themselves."""


class PoolQueues:
    """The described pools' task queues, as this manager declared and bounded them."""

    def __init__(
        self,
        *,
        topology: Topology,
        transport: Callable[[], ManagerTransport],
        observer: Observer,
        counters: Counter[str],
    ) -> None:
        self._topology = topology
        self._transport = transport
        self._observer = observer
        self._counters = counters
        self._declared: set[str] = set()  # pools whose task queue this manager declared
        self._slots: dict[str, int] = {}  # the model slots each pool's policy bounds at
        self._missing_since: dict[str, float] = {}  # pool -> when a poll first found it gone

    async def depths(
        self, descriptors: Mapping[str, CapabilityDescriptor]
    ) -> dict[str, tuple[int, float | None]]:
        """``pool -> (ready tasks, head age)`` of every described pool's queue that answers."""
        ages = {q.name: q.oldest_age_s for q in self._observer.view.queues}
        found = {}
        for pool_id in list(descriptors):
            queue = self._topology.pool_task_queue(pool_id)
            try:
                depth = await self._transport().queue_depth(queue)
            except TopologyMissing:
                await self._gone(descriptors, pool_id)
                continue
            except Exception as exc:  # the broker is away: next poll
                log.debug("pool queue depth unavailable", extra={"queue": queue, "error": str(exc)})
                continue
            self._missing_since.pop(pool_id, None)
            found[pool_id] = (depth, ages.get(queue))
        return found

    async def _gone(self, descriptors: Mapping[str, CapabilityDescriptor], pool_id: str) -> None:
        """A described pool's queue is gone (deleted in the management UI, say): declared
        again, with its bound, by the first poll ``REDECLARE_AFTER_S`` or more after the first
        that found it gone, so producers' tasks are routed again and the pool's agents — which
        look for it again after the broker cancelled their consumers — take them. Counted
        (``pool_queue_redeclared``)."""
        descriptor = descriptors.get(pool_id)
        if descriptor is None:
            return
        now = time.monotonic()
        if now - self._missing_since.setdefault(pool_id, now) < REDECLARE_AFTER_S:
            return  # the agents' consumers are told first (basic.cancel)
        del self._missing_since[pool_id]
        self._declared.discard(pool_id)
        self._slots.pop(pool_id, None)
        self._counters["pool_queue_redeclared"] += 1
        log.warning(
            "pool queue missing: declared again",
            extra={"pool_id": pool_id, "queue": self._topology.pool_task_queue(pool_id)},
        )
        await self.ensure([descriptor])

    async def ensure(self, descriptors: Sequence[CapabilityDescriptor]) -> None:
        """Each pool's task queue, declared once with arguments that never change, and its
        bound at the pool's model slots, a broker policy set through the management API
        whenever the slots change (:meth:`Topology.pool_bound_policy`). Nothing here deletes
        or replaces a queue, and a broker error on one pool is logged, counted and retried on
        the next announcement: it costs neither the other pools nor the connection."""
        for descriptor in descriptors:
            pool_id, slots = descriptor.pool_id, descriptor.model_limits.slots
            if self._slots.get(pool_id) == slots:
                continue
            if pool_id not in self._declared:
                try:
                    current = await self._transport().try_declare(self._topology.pool(pool_id))
                except Exception as exc:
                    self._counters["pool_queue_declare_failed"] += 1
                    log.warning(
                        "pool queue not declared", extra={"pool_id": pool_id, "error": str(exc)}
                    )
                    continue
                self._declared.add(pool_id)
                if not current:  # declared by an older mesh, bound in its arguments
                    self._counters["pool_queue_legacy_arguments"] += 1
                    log.warning(
                        "pool queue was declared with other arguments (by an older mesh, "
                        "whose x-max-length followed the slots): it is used as it is, and the "
                        "broker applies the lower of its own bound and the policy's; delete "
                        "it once it is empty to take the current layout",
                        extra={
                            "pool_id": pool_id,
                            "queue": self._topology.pool_task_queue(pool_id),
                        },
                    )
            policy = self._topology.pool_bound_policy(pool_id, slots)
            if await self._observer.apply_policy(policy):
                self._slots[pool_id] = slots
            elif not self._observer.has_management_api:
                self._slots[pool_id] = slots  # nothing more to try until the slots change
                self._counters["pool_queue_unbounded_by_slots"] += 1
                log.warning(
                    "no management API (--management-url): the pool queue is bounded at its "
                    "declared ceiling, not at the pool's slots; the ledger still holds "
                    "capacity exactly",
                    extra={
                        "pool_id": pool_id,
                        "model_slots": slots,
                        "ceiling": self._topology.pool_queue_max_length,
                    },
                )
