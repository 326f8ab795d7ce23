"""The manager's hold on its shards: renew, notice a loss, rebalance — every third of a lease.

How it works. :class:`ShardOwnership` drives a :class:`~mesh.core.shards.ShardKeeper` against
the PostgreSQL lease table (:class:`~mesh.ledger.shard_leases.ShardLeases`), whose calls are
blocking and run where the caller says (the manager's ledger thread). One step:

1. renew every lease held (and the manager's presence); a lease the table did not keep is
   **lost**: forgotten at once, logged, counted — the manager must not act on that shard;
2. read the table (live managers, live leases) and plan toward the balanced target;
3. give back the shards targeted to another manager, then take the free ones targeted here.

A step runs every ``lease_s / 3``, so a lease is renewed twice before it could lapse even when
one step is late. A manager paused for longer than its lease (SIGSTOP, a cut network) wakes
up, runs a step, and its first renewal tells it what it lost before it does anything else.
Every change of ownership goes to the orchestration log (kind ``shard``) through
``on_change``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

from mesh.core.capacity import PoolLive
from mesh.core.events import LogEntry
from mesh.core.shards import ShardKeeper
from mesh.errors import StoreError
from mesh.ledger.shard_leases import ShardLeases, ShardView
from mesh.wire.status import ShardOwner

log = logging.getLogger(__name__)

T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]
Change = Literal["taken", "given_back", "lost"]


class ShardOwnership:
    """Holds and balances one manager's shard leases; see the module doc."""

    def __init__(
        self,
        leases: ShardLeases,
        manager_id: str,
        *,
        lease_s: float,
        run_blocking: RunBlocking,
        wall_clock: Callable[[], float],
        on_change: Callable[[list[LogEntry]], Awaitable[None]],
        counters: Counter[str] | None = None,
    ) -> None:
        self.leases = leases
        self.keeper = ShardKeeper.new(manager_id, leases.shard_count)
        self.lease_s = lease_s
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.last_view: ShardView | None = None
        self._run = run_blocking
        self._wall = wall_clock
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        # Per held shard, the monotonic time its lease surely still runs until here: measured
        # from *before* the call that took or renewed it, so never later than the table's.
        self._valid_until: dict[int, float] = {}
        self._stepping = asyncio.Lock()  # the periodic step and one run on demand
        self.taken_at: dict[int, float] = {}  # held shard -> monotonic time this tenure began
        # The monotonic time a step last saw shards change hands (see ``moving``).
        self.moved_at = float("-inf")
        # Per shard, the monotonic time a step last saw its holder change (``settling_shards``).
        self.changed_at: dict[int, float] = {}

    def lapsed(self) -> list[int]:
        """The shards this manager still counts as held though their leases may have run
        out by its own clock (it was paused or starved): it must step before acting."""
        now = time.monotonic()
        return [s for s in self.keeper.held if now >= self._valid_until.get(s, 0.0)]

    def holds(self, shard: int) -> bool:
        """Whether this manager may act on ``shard`` now: it held it at its last step and
        the lease cannot have lapsed since. A manager that was paused past its lease answers
        False at once on waking, before its next step has told it of the loss."""
        return shard in self.keeper.held and time.monotonic() < self._valid_until.get(shard, 0.0)

    @property
    def manager_id(self) -> str:
        return self.keeper.manager_id

    def owned(self) -> dict[int, int]:
        """The shards this manager holds now, with their fences."""
        return dict(self.keeper.held)

    def owners(self) -> list[ShardOwner]:
        """Every held shard's holder as last read, this manager's own holdings as it knows
        them now (``mesh status``, the status page)."""
        seen = {} if self.last_view is None else dict(self.last_view.leases)
        for shard in [s for s, lease in seen.items() if lease.owner == self.manager_id]:
            del seen[shard]  # its own: as held now, not as read a step ago
        rows = [
            ShardOwner(shard=s, owner=lease.owner, fence=lease.fence) for s, lease in seen.items()
        ]
        rows += [
            ShardOwner(shard=s, owner=self.manager_id, fence=f) for s, f in self.keeper.held.items()
        ]
        return sorted(rows, key=lambda row: row.shard)

    async def step(self) -> None:
        """Renew, then rebalance (module doc). A database error is logged and counted; the
        next step tries again, and leases not renewed in time are simply lost."""
        async with self._stepping:
            await self._step()

    async def _step(self) -> None:
        try:
            await self._renew()
            await self._rebalance()
        except StoreError as exc:
            self.counters["shard_store_errors"] += 1
            log.warning("shard lease step failed", extra={"error": str(exc)})

    async def _renew(self) -> None:
        asked_at = time.monotonic()
        kept = await self._run(
            self.leases.renew, self.manager_id, dict(self.keeper.held), self.lease_s
        )
        lost = self.keeper.renewed(kept)
        for shard in self.keeper.held:
            self._valid_until[shard] = asked_at + self.lease_s
        for shard in lost:
            self._valid_until.pop(shard, None)
            self.taken_at.pop(shard, None)
        if lost:
            self.counters["shards_lost"] += len(lost)
            log.warning("shard leases lost", extra={"shards": list(lost)})
            await self._log([("lost", shard, None) for shard in lost])

    def moving(self) -> bool:
        """Whether shards may be changing hands: a shard without a live lease (its owner
        gone, nobody has taken it yet), or owners that changed within the last lease period
        (a new owner's agents are still registering again with it)."""
        return self.settling(self.lease_s)

    def settling(self, window_s: float) -> bool:
        """Whether shards may have changed hands within the last ``window_s``: agents of a
        shard taken that recently may still be registering again with its new owner."""
        view = self.last_view
        if view is None or len(view.leases) < self.leases.shard_count:
            return True
        return time.monotonic() - self.moved_at < window_s

    def settling_shards(
        self,
        window_s: float,
        held_elsewhere: Iterable[ShardOwner] = (),
        handing_over: Iterable[int] = (),
    ) -> int:
        """How many shards have no live lease, or changed holders within the last
        ``window_s`` as this manager saw the lease table: their agents may still be
        registering again with the new owner (every shard, before the first step).
        ``held_elsewhere``: other managers' own holdings as they just said (their status
        replies); one this manager's last read does not show was taken since it read.
        ``handing_over``: shards known to be mid-handover (:meth:`handing_over`)."""
        view = self.last_view
        if view is None:
            return self.leases.shard_count
        since = time.monotonic() - window_s
        leased = set(view.leases) | set(self.keeper.held)  # its own takes are newer than view
        unseen = {
            row.shard
            for row in held_elsewhere
            if (lease := view.leases.get(row.shard)) is None
            or (lease.owner, lease.fence) != (row.owner, row.fence)
        }
        unseen.update(handing_over)
        return sum(
            1
            for shard in range(self.leases.shard_count)
            if shard not in leased
            or shard in unseen
            or self.changed_at.get(shard, float("-inf")) > since
        )

    def handing_over(self, rows: Iterable[PoolLive], capability: str | None = None) -> set[int]:
        """The shards whose agents are registering again with a new owner, as the shared live
        rows say (:mod:`mesh.manager.live_share`): a row counting live agents (of
        ``capability``, if named) written under an older fence than the shard's lease now.
        Its new owner writes its own rows only once every agent the last row counted is back
        with it, or its handover time has passed — a fact, where ``settling`` is a window."""
        current = {} if self.last_view is None else self.last_view.fences()
        current.update(self.keeper.held)  # its own takes are newer than the view
        return {
            row.shard
            for row in rows
            if row.fence < current.get(row.shard, row.fence)
            and any(offer.agents > 0 and capability in (None, name) for name, offer in row.offers)
        }

    async def look(self) -> None:
        """Read the lease table now (one statement), so ``moving`` and ``settling_shards``
        know of moves made since the last step: asked before an answer that would be
        definite ("nobody offers it") or a status. A failed read counts as a move."""
        try:
            self._saw(await self._run(self.leases.view))
        except StoreError as exc:
            self.moved_at = time.monotonic()
            log.warning("could not read the shard leases", extra={"error": str(exc)})

    def _saw(self, view: ShardView) -> None:
        """Take ``view`` as the last read of the table, noting which shards changed hands."""
        before = {} if self.last_view is None else self.last_view.owners()
        if self.last_view is None or view.owners() != before:
            self.moved_at = time.monotonic()
            owners = view.owners()
            for shard in set(before) | set(owners):
                if before.get(shard) != owners.get(shard) and self.last_view is not None:
                    self.changed_at[shard] = self.moved_at
        self.last_view = view

    async def _rebalance(self) -> None:
        view: ShardView = await self._run(self.leases.view)
        self._saw(view)
        moves = self.keeper.plan(view.managers, view.owners())
        changes: list[tuple[Change, int, int | None]] = []
        for shard in moves.give_back:
            fence = self.keeper.held[shard]
            if await self._run(self.leases.give_back, self.manager_id, shard, fence):
                changes.append(("given_back", shard, fence))
            self.keeper.gave_back(shard)  # given back, or already not ours: either way
            self.taken_at.pop(shard, None)
        for shard in moves.take:
            asked_at = time.monotonic()
            fence = await self._run(self.leases.take, self.manager_id, shard, self.lease_s)
            if fence is not None:
                self.keeper.took(shard, fence)
                self._valid_until[shard] = asked_at + self.lease_s
                self.taken_at[shard] = time.monotonic()
                changes.append(("taken", shard, fence))
        if changes:
            self.moved_at = time.monotonic()
            for _, shard, _ in changes:
                self.changed_at[shard] = self.moved_at
            self.counters["shards_taken"] += sum(1 for c in changes if c[0] == "taken")
            self.counters["shards_given_back"] += sum(1 for c in changes if c[0] == "given_back")
            await self._log(changes)

    async def _log(self, changes: list[tuple[Change, int, int | None]]) -> None:
        at = self._wall()
        await self._on_change(
            [
                LogEntry(
                    at=at,
                    kind="shard",
                    reason=change,
                    detail={"shard": shard, "fence": fence, "manager_id": self.manager_id},
                )
                for change, shard, fence in changes
            ]
        )

    def start(self) -> None:
        """Step every third of a lease, in the background, until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._forever(), name="shard-leases")

    async def _forever(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.lease_s / 3)

    @property
    def running(self) -> bool:
        return self._task is not None

    async def stop(self, *, give_back: bool = True) -> None:
        """Stop stepping; with ``give_back`` hand every shard over at once (a clean stop)
        instead of letting the leases lapse."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if give_back and self.keeper.held:
            held = dict(self.keeper.held)
            try:
                await self._run(self.leases.leave, self.manager_id)
            except StoreError as exc:
                log.warning("could not give shards back", extra={"error": str(exc)})
                return
            for shard in held:
                self.keeper.gave_back(shard)
                self.taken_at.pop(shard, None)
            self.counters["shards_given_back"] += len(held)
            await self._log([("given_back", shard, fence) for shard, fence in held.items()])
