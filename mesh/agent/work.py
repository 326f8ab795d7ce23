"""The work under way in one agent runtime, counted in one place: the tasks being handled, the
tasks in flight per capability, and the pool tasks started (reported to the manager in each
heartbeat, ``pool_in_flight``). The task runner changes it; heartbeats, the pool queue and the
shutdown read it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


class Work:
    """What runs here now, and a pulse for "a slot may have freed (or we began draining)"."""

    def __init__(self, capabilities: Iterable[str]) -> None:
        names = list(capabilities)
        self.in_flight: dict[str, int] = dict.fromkeys(names, 0)
        """Tasks being worked per capability (received and not yet acked)."""
        self.pool_started: dict[str, int] = dict.fromkeys(names, 0)
        """Pool tasks (admission path) started and not finished, per capability."""
        self.active: set[asyncio.Task[Any]] = set()
        """The asyncio tasks handling a delivery now."""
        self.idle = asyncio.Event()
        """Set while no delivery is being handled."""
        self.idle.set()
        self._changed = asyncio.Event()

    def began(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self.active.add(task)
        self.idle.clear()

    def ended(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self.active.discard(task)
        if not self.active:
            self.idle.set()
        self.pulse()

    def pulse(self) -> None:
        """Wake whoever waits for a slot (one of its tasks ended, or the drain began)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def changed(self) -> None:
        """Until the next :meth:`pulse`."""
        await self._changed.wait()
