"""Heartbeat ingestion: the manager's hottest path.

Heartbeats are superseded by the next one, so they are consumed without acks
and handed straight to a synchronous :class:`HeartbeatSink`: decode, feed the
core, done. A bad heartbeat is counted and dropped (dead-lettering every
garbage heartbeat would let one broken agent flood the dead-letter queue).

The sink takes bodies one at a time today; ``ingest_many`` is the seam for
batching (one clock read per batch) or for sharding the queue by agent-ID hash
across several consumers later, without changing the core.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from mesh.core.events import Command, HeartbeatReceived
from mesh.core.pool import PoolCore
from mesh.errors import MessageRejected
from mesh.manager.clock import Clock
from mesh.wire.codec import decode_as
from mesh.wire.models import Heartbeat
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)


class HeartbeatSink:
    """Callable with a raw body; passes any commands the core returns to ``on_commands``."""

    def __init__(
        self,
        core: PoolCore,
        clock: Clock,
        on_commands: Callable[[list[Command]], None],
        counters: Counter[str] | None = None,
        on_heartbeat: Callable[[Heartbeat, float], None] | None = None,
        on_rejected: Callable[[str], None] | None = None,
        verify_identity: bool = False,
    ) -> None:
        """``on_heartbeat(heartbeat, now_wall)`` sees every valid heartbeat, ``on_rejected``
        the reason code of every bad one (for metrics). With ``verify_identity`` a heartbeat
        counts only if its ``agent_id`` is the broker user that published it (RabbitMQ
        validated the ``user_id``); any other is ``NOT_AUTHORIZED``, counted and dropped."""
        self._core = core
        self._clock = clock
        self._on_commands = on_commands
        self._on_heartbeat = on_heartbeat
        self._on_rejected = on_rejected
        self._verify_identity = verify_identity
        self.counters: Counter[str] = Counter() if counters is None else counters

    def __call__(self, body: bytes, user_id: str | None = None) -> None:
        try:
            heartbeat = decode_as(body, Heartbeat)
            if self._verify_identity and heartbeat.agent_id != user_id:
                raise MessageRejected(
                    Reason.NOT_AUTHORIZED,
                    f"a heartbeat for {heartbeat.agent_id!r} published by {user_id!r}",
                )
        except MessageRejected as exc:
            self.counters[f"heartbeat_rejected.{exc.reason}"] += 1
            if self._on_rejected is not None:
                self._on_rejected(exc.reason)
            log.debug("bad heartbeat dropped", extra={"reason": exc.reason})
            return
        self.counters["heartbeats"] += 1
        now = self._clock.now()
        if self._on_heartbeat is not None:
            self._on_heartbeat(heartbeat, now.wall)
        commands = self._core.handle(HeartbeatReceived(heartbeat), now)
        if commands:
            self._on_commands(commands)

    def ingest_many(self, bodies: Iterable[tuple[bytes, str | None]]) -> None:
        for body, user_id in bodies:
            self(body, user_id)
