"""Live capacity across several managers: each pool's owner writes it, every manager reads it.

How it works. With shards (:mod:`mesh.manager.shards`) a manager's registry holds only the
agents of the shards it owns, but any manager admits a task for any pool. So each manager,
every ``interval_s``:

1. **reads** every pool's row, and admits with one :class:`~mesh.core.capacity.LiveCapacity`
   merged from its own registry (the pools it owns) and the rows (every other pool) — only
   when a write was signalled since the last read (every write does ``pg_notify``; each
   manager listens on a thread of its own), a shard was taken, or ``refresh_s`` passed;
2. **writes** the live figures of the pools of every shard it holds, if they changed since it
   last wrote them: a row per pool in the shared ``live_offer`` table (versions, cost classes,
   live agents, free concurrency, the scale planner's retry hint) and the ledger's
   ``live_slots:<capability>`` capacities — both in one transaction fenced by the shard's lease
   (:meth:`~mesh.ledger.shard_leases.ShardLeases.publish_live`), so a manager whose lease has
   lapsed is refused by the store (counted as ``live_writes_fenced``).

The ledger's live-slot counters are the bound: every manager's admission batch takes them
in its transaction, and a capacity the owner lowered meanwhile makes the batch retry. The
rows only say *why* a pool cannot take a task (``NO_LIVE_AGENT``) and how pools rank (cost
class); a row a moment old may let a request past that gate, never past the counter.

Handover. A manager that has just taken a shard knows none of its agents yet: they register
again at their next heartbeat. Until they have (every pool of the shard has as many live agents
as its last row says) or ``handover_s`` has passed, the new owner neither writes the shard's
rows nor trusts its own figures for them, and admission keeps using the previous owner's last
row; a shard nobody wrote rows for is its owner's at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mesh.core.capacity import LiveCapacity, PoolLive, described_free, merged_live, pool_lives
from mesh.core.shards import shard_of
from mesh.errors import StoreError
from mesh.manager.shards import ShardOwnership
from mesh.wire.admission import CapabilityDescriptor

log = logging.getLogger(__name__)

RunBlocking = Callable[..., Awaitable[Any]]


class SharedLive:
    """One manager's side of the shared live capacity; see the module doc."""

    def __init__(
        self,
        shards: ShardOwnership,
        *,
        run_blocking: RunBlocking,
        own: Callable[[], LiveCapacity],
        descriptors: Callable[[], Mapping[str, CapabilityDescriptor]],
        interval_s: float,
        handover_s: float,
        counters: Counter[str],
    ) -> None:
        self.shards = shards
        self.shard_count = shards.leases.shard_count
        self.interval_s = interval_s
        self.handover_s = handover_s
        self.counters = counters
        self._run = run_blocking
        self._own = own
        self._descriptors = descriptors
        self.shared: dict[str, PoolLive] = {}  # pool -> its row, as last read
        self._shared_version = 0  # bumped whenever a read differs from the one before
        self._read_since = float("-inf")  # monotonic time the last completed read began
        # shard -> (fence, rows, capacities) last written, so an unchanged shard costs nothing
        self._written: dict[int, tuple[int, dict[str, PoolLive], dict[tuple[str, str], int]]] = {}
        self._settled: dict[int, int] = {}  # shard -> the fence whose handover is over
        self._merged: tuple[LiveCapacity, int, frozenset[int], LiveCapacity] | None = None
        self._versions = 0
        self._task: asyncio.Task[None] | None = None
        # Started (start()): the rows are read again only when a write was signalled
        # (PostgreSQL's LISTEN/NOTIFY, on a thread of its own), a shard was taken since the
        # last read, or ``refresh_s`` passed — an idle namespace costs no reads. Stepped by
        # hand (tests), every step reads.
        self.refresh_s = 10.0
        self._changed = True  # set from the listening thread: a plain store, no wake-up
        self._listening: threading.Thread | None = None
        self._stop_listening = threading.Event()

    # ---- what admission decides with -------------------------------------------------------
    def view(self) -> LiveCapacity:
        """The merged snapshot (module doc): rebuilt only when this manager's registry, the
        rows read, or the shards it answers for changed."""
        own = self._own()
        mine = frozenset(s for s in self.shards.owned() if self._answers_for(s))
        cached = self._merged
        if cached is not None and cached[0] is own and cached[1:3] == (self._shared_version, mine):
            return cached[3]  # the registry hands out the same snapshot while nothing changed
        self._versions += 1

        def from_own(pool_id: str) -> bool:
            return shard_of(pool_id, self.shard_count) in mine

        merged = merged_live(own, self.shared, from_own, self._versions)
        self._merged = (own, self._shared_version, mine, merged)
        return merged

    def _answers_for(self, shard: int) -> bool:
        """Whether this manager's own registry speaks for ``shard``'s pools: it holds the
        shard and the handover is over (module doc)."""
        fence = self.shards.owned().get(shard)
        if fence is None or not self.shards.holds(shard):
            return False
        if self._settled.get(shard) == fence:
            return True
        taken = self.shards.taken_at.get(shard, float("-inf"))
        if self._read_since < taken:
            return False  # the previous owner's rows are not known yet: not caught up
        earlier = [
            (pool_id, row.agents())
            for pool_id, row in self.shared.items()
            if row.shard == shard and row.fence < fence
        ]
        own = _agents_by_pool(self._own()) if earlier else {}
        caught_up = all(own.get(pool_id, 0) >= agents for pool_id, agents in earlier)
        if caught_up or time.monotonic() - taken >= self.handover_s:
            self._settled = {s: f for s, f in self._settled.items() if s in self.shards.owned()}
            self._settled[shard] = fence
            return True
        return False

    # ---- the periodic step -------------------------------------------------------------------
    async def step(self) -> None:
        """Read every row, then write what changed of the shards this manager answers for
        (read first: a shard just taken is judged against its previous owner's rows). A
        database error is logged and counted; the next step tries again."""
        try:
            if self._read_due():
                await self._read()
            await self._write()
        except StoreError as exc:
            self.counters["live_share_errors"] += 1
            log.warning("sharing live capacity failed", extra={"error": str(exc)})

    async def _write(self) -> None:
        own, descriptors = self._own(), self._descriptors()
        held = self.shards.owned()
        pools_of: dict[int, set[str]] = {shard: set() for shard in held}
        for pool_id in {p for p, _ in own.offers} | set(own.retry_s) | set(descriptors):
            shard = shard_of(pool_id, self.shard_count)
            if shard in pools_of:
                pools_of[shard].add(pool_id)
        for shard, fence in held.items():
            if not self._answers_for(shard):
                continue
            pools = pools_of[shard]
            rows = pool_lives(own, pools, shard, fence)
            capacities = described_free(descriptors, own, pools)
            if self._written.get(shard) == (fence, rows, capacities):
                continue
            written = await self._run(
                self.shards.leases.publish_live,
                shard,
                self.shards.manager_id,
                fence,
                rows,
                capacities,
            )
            if written:
                self._written[shard] = (fence, rows, capacities)
                self.counters["live_writes"] += 1
            else:
                self._written.pop(shard, None)
                self.counters["live_writes_fenced"] += 1
                log.warning(
                    "live capacity not written: the shard's lease is no longer this manager's",
                    extra={"shard": shard, "fence": fence},
                )
        for shard in [s for s in self._written if s not in held]:
            del self._written[shard]

    def _read_due(self) -> bool:
        if self._listening is None or self._changed:
            return True
        taken = max(self.shards.taken_at.values(), default=float("-inf"))
        return taken > self._read_since or time.monotonic() - self._read_since >= self.refresh_s

    def _signalled(self) -> None:
        self._changed = True

    async def _read(self) -> None:
        asked_at = time.monotonic()
        self._changed = False  # a write signalled from now on is read at the next step
        try:
            rows = await self._run(self.shards.leases.read_live)
        except BaseException:
            self._changed = True
            raise
        self.counters["live_reads"] += 1
        self._read_since = asked_at
        if rows != self.shared:
            self.shared = rows
            self._shared_version += 1

    def start(self) -> None:
        """Step every ``interval_s`` in the background until :meth:`stop`."""
        if self._task is None:
            self._stop_listening.clear()
            self._listening = threading.Thread(
                target=self.shards.leases.listen_live,
                args=(self._stop_listening, self._signalled),
                name="live-share-listen",
                daemon=True,
            )
            self._listening.start()
            self._task = asyncio.create_task(self._forever(), name="live-share")

    async def _forever(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._listening is not None:
            self._stop_listening.set()
            await asyncio.to_thread(self._listening.join, 5.0)
            self._listening = None


def _agents_by_pool(live: LiveCapacity) -> Counter[str]:
    agents: Counter[str] = Counter()
    for (pool_id, _), offers in live.offers.items():
        agents[pool_id] += sum(offer.agents for offer in offers)
    return agents
