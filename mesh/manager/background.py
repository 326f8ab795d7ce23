"""Tasks a manager runs beside its handlers (a request's handling, a fence that retries, the
commands of a heartbeat), kept so that stopping waits for them rather than cutting them off."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    """A set of running tasks: each removes itself when done; :meth:`wait` lets all finish."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None], name: str | None = None) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until every task running now has ended."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
