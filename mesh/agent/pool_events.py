"""What an agent does with its pool's events (``grant.<deployment>.#`` on the events exchange,
heard on its control queue): a ``descriptor_active`` event with a newer epoch consumes the
pool queue again (a new epoch may come with a new queue); a ``grant_revoked`` event is
remembered by the core (the highest revoked fence per admission) and stops the handler of an
evicted or security-revoked grant. What each event means is :meth:`AgentCore.on_event`'s to
decide; this room carries it out.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from mesh.agent.core import AgentCore
from mesh.agent.pool_queue import PoolQueue
from mesh.agent.settings import Identity
from mesh.wire.events import OrchestrationEvent

log = logging.getLogger(__name__)


class PoolEvents:
    """Carries out what the core makes of each event of our pool."""

    def __init__(
        self,
        identity: Identity,
        *,
        core: AgentCore,
        pool: PoolQueue,
        counters: Counter[str],
        stop_running: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
    ) -> None:
        self._identity = identity
        self._core = core
        self._pool = pool
        self._counters = counters
        self._stop_running = stop_running
        self._spawn = spawn

    def on_event(self, event: OrchestrationEvent) -> None:
        extra = self._identity.extra
        seen = self._core.on_event(event, pool_consumed=self._pool.consumed)
        if seen.kind == "ignored":
            self._counters["events_ignored"] += 1
            log.debug("event ignored", extra=extra(kind=event.kind))
            return
        if seen.kind == "epoch":
            if seen.newer:
                log.info("descriptor epoch", extra=extra(descriptor_epoch=seen.epoch))
            if seen.resubscribe:  # a new epoch may come with a new queue
                self._spawn(self._pool.consume(seen.epoch), "pool consumer")
            return
        self._counters["grants_revoked_seen"] += 1
        log.info(
            "grant revoked",
            extra=extra(admission_id=seen.admission_id, fence=seen.fence, evicted=seen.evicted),
        )
        if seen.stop_running and seen.admission_id is not None:
            self._stop_running(seen.admission_id)
