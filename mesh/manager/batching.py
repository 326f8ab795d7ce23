"""Group commit for the event loop: many concurrent callers, one batch at a time.

Each caller ``await``s :meth:`GroupCommit.submit` with one item. If no batch is running, a
batch starts at once with whatever is queued (a lone request is never held back waiting for
company: there is no timer). While a batch runs, new items queue; when it finishes, the next
batch takes all of them, up to ``max_batch``. So under light load every item is its own batch,
and under heavy load the batch size grows to the number of callers in flight — the cost of a
batch (a thread hand-off, a transaction, an fsync) is shared by everyone who waited for it.
Under load a batch may also linger for company (``linger_s``); with ``quiet_s`` set, only
while company keeps coming: it stops at the first ``quiet_s`` in which nothing new arrived.

Results go back to each caller in submission order. If ``run`` raises, every caller of that
batch gets the exception; the next batch is unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from mesh.errors import LocalProtocolError

I = TypeVar("I")  # noqa: E741 - the item type
O = TypeVar("O")  # noqa: E741 - the result type


class GroupCommit(Generic[I, O]):
    """Coalesce concurrent ``submit`` calls into calls of ``run(items) -> results``."""

    def __init__(
        self,
        run: Callable[[list[I]], Awaitable[list[O]]],
        *,
        max_batch: int = 64,
        max_yields: int = 4,
        linger_s: float = 0.0,
        quiet_s: float | None = None,
        busy_gap_s: float = 0.005,
    ):
        if max_batch < 1:
            raise LocalProtocolError(f"max_batch must be at least 1, got {max_batch}")
        if linger_s < 0 or busy_gap_s < 0:
            raise LocalProtocolError("linger_s and busy_gap_s must not be negative")
        self._run = run
        self._max_batch = max_batch
        self._max_yields = max_yields
        self._linger_s = linger_s
        self.quiet_s = quiet_s  # may be set later, before the first batch
        self._busy_gap_s = busy_gap_s
        self._last_batch_end = float("-inf")  # loop time
        self._queue: list[tuple[I, asyncio.Future[O]]] = []
        self._drainer: asyncio.Task[None] | None = None
        self.batches = 0  # batches run so far
        self.items = 0  # items decided so far
        self.largest = 0  # the largest batch so far

    async def submit(self, item: I) -> O:
        future: asyncio.Future[O] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="group-commit")
        return await future

    async def _gather(self) -> None:
        """Let callers already scheduled on the loop join this batch: yield one loop iteration
        at a time while the queue keeps growing (at most ``max_yields``). Under load — the
        previous batch ended less than ``busy_gap_s`` ago — first linger up to ``linger_s``
        for company (PostgreSQL's ``commit_delay`` idea: when the process is busy anyway, a
        short wait shares one commit among more requests). With ``quiet_s``, in steps of
        it, stopping at the first step in which nothing arrived: for a batch that runs on
        the loop itself, where a closed loop of callers (each waits for its answer before
        it asks again) has sent everything it will send once its burst is in, and waiting
        the whole ``linger_s`` is a pause in which nothing happens. An idle manager never
        lingers."""
        loop = asyncio.get_running_loop()
        busy = loop.time() - self._last_batch_end < self._busy_gap_s
        if self._linger_s and busy:
            deadline = loop.time() + self._linger_s
            step = self.quiet_s or self._linger_s
            while len(self._queue) < self._max_batch:
                left = deadline - loop.time()
                if left <= 0:
                    break
                before = len(self._queue)
                await asyncio.sleep(min(step, left))
                if len(self._queue) == before:
                    break  # a quiet step: company has stopped coming
        for _ in range(self._max_yields):
            before = len(self._queue)
            if before >= self._max_batch:
                return
            await asyncio.sleep(0)
            if len(self._queue) == before:
                return

    async def close(self) -> None:
        """Wait for the batches already queued to finish."""
        if self._drainer is not None:
            with contextlib.suppress(Exception):
                await self._drainer

    async def _drain(self) -> None:
        while self._queue:
            await self._gather()
            batch = self._queue[: self._max_batch]
            del self._queue[: self._max_batch]
            self.batches += 1
            self.items += len(batch)
            self.largest = max(self.largest, len(batch))
            try:
                results = await self._run([item for item, _ in batch])
                if len(results) != len(batch):
                    raise LocalProtocolError(
                        f"a batch of {len(batch)} items returned {len(results)} results"
                    )
            except BaseException as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            finally:
                self._last_batch_end = asyncio.get_running_loop().time()
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # its caller may have been cancelled meanwhile
                    future.set_result(result)
