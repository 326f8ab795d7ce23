"""Several managers: this manager's share of the registry's shards, and the queues it consumes
for them.

Theory of operation
-------------------
With ``settings.shard_count``, the registry is split into shards by pool (``shard_of``), each
held by one manager under a lease in PostgreSQL (:class:`~mesh.manager.shards.ShardOwnership`).
A manager consumes exactly the announce, heartbeat and RPC queues of the shards it holds: a
shard taken is joined (its consumers started), one given back or lost is left (its consumers
cancelled, its agents forgotten — they register with the new owner when it asks, keeping their
leases). Cut off from the broker for half a lease, a manager gives every shard back and takes a
share again once reconnected. A manager that may have been paused past its leases steps before
it acts on its registry (:meth:`Sharding.checked`), so it never answers with shards it lost.

Without shards every method here is a no-op and :meth:`Sharding.holds_pool` says yes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from mesh.core.events import AppendLog, LogEntry
from mesh.core.pool import PoolCore
from mesh.core.registry import AgentRecord
from mesh.core.shards import shard_of
from mesh.errors import LocalProtocolError, TransportError
from mesh.manager.clock import Clock
from mesh.manager.commands import CommandExecutor
from mesh.manager.heartbeats import HeartbeatSink
from mesh.manager.peers import Peers
from mesh.manager.settings import ManagerSettings
from mesh.topology.specs import Topology
from mesh.transport.delivery import Delivery
from mesh.transport.ports import ManagerTransport, Subscription
from mesh.wire.admission import CapabilityDescriptor
from mesh.wire.models import Message, ReRegisterRequest

if TYPE_CHECKING:
    from mesh.manager.live_share import SharedLive
    from mesh.manager.shards import ShardOwnership

log = logging.getLogger(__name__)

Take = Callable[[list[Delivery]], None]


class Sharding:
    """The shards this manager holds, their consumers, its peers and shared live capacity."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        topology: Topology,
        core: PoolCore,
        clock: Clock,
        counters: Counter[str],
        transport: Callable[[], ManagerTransport],
        commands: CommandExecutor,
        heartbeats: HeartbeatSink,
        announced: Callable[[str], Take],
        requested: Callable[[str], Take],
        observe: Callable[[str], Awaitable[None]],
        descriptors: Callable[[], Mapping[str, CapabilityDescriptor]],
        share_live: Callable[[], None],
        manager_user: str | None,
        stopping: Callable[[], bool],
    ) -> None:
        self._settings = settings
        self._topology = topology
        self._core = core
        self._clock = clock
        self._counters = counters
        self._transport = transport
        self._commands = commands
        self._heartbeats = heartbeats
        self._announced = announced
        self._requested = requested
        self._observe = observe
        self._descriptors = descriptors
        self._share_live = share_live
        self._manager_user = manager_user
        self._stopping = stopping
        self.shards: ShardOwnership | None = None
        self.peers: Peers | None = None  # the other owners, asked on lease-path requests
        self.shared_live: SharedLive | None = None  # with live admission capacity
        self._thread: ThreadPoolExecutor | None = None
        # The consumers of each held shard's announce, heartbeat and RPC queues.
        self.consumers: dict[int, list[Subscription]] = {}
        self._step: asyncio.Task[None] | None = None  # a step run from heartbeats
        self._suspension: asyncio.Task[None] | None = None  # the broker is away

    # ---- questions ----------------------------------------------------------------------------
    def holds_pool(self, pool_id: str) -> bool:
        """Whether this manager holds ``pool_id``'s shard (always, without shards)."""
        count = self._settings.shard_count
        if self.shards is None or count is None:
            return True
        return self.shards.holds(shard_of(pool_id, count))

    def owned(self) -> dict[int, int]:
        """The shards held, each with its fence (none without shards)."""
        return {} if self.shards is None else self.shards.owned()

    def owners(self) -> tuple[int, list[tuple[int, str, int]]] | None:
        """The shard count and every shard's owner and fence as last read."""
        if self.shards is None:
            return None
        rows = [(r.shard, r.owner, r.fence) for r in self.shards.owners()]
        return self.shards.leases.shard_count, rows

    async def checked(self) -> None:
        """Before acting on its registry, a manager whose leases may have run out by its own
        clock (it was paused: SIGSTOP, a VM freeze, a starved loop) steps first, so it learns
        what it lost — and forgets those shards' agents — before it answers anything with
        them (``shard_checks_before_acting``)."""
        if self.shards is not None and self.shards.lapsed():
            self._counters["shard_checks_before_acting"] += 1
            await self.shards.step()

    def step_soon(self) -> None:
        """A shard step in the background (from a synchronous path), one at a time."""
        if self._step is None or self._step.done():
            self._step = asyncio.create_task(self.checked())

    def heartbeat_sink(self) -> ShardHeartbeats:
        return ShardHeartbeats(self, self._heartbeats, self._counters)

    # ---- start and stop -----------------------------------------------------------------------
    async def start(self) -> None:
        """Hold this manager's share of the registry's shards (``settings.shard_count``)."""
        s = self._settings
        if s.shard_count is None:
            return
        if not s.ledger_url.startswith(("postgresql://", "postgres://")):
            raise LocalProtocolError(
                "shards need a PostgreSQL ledger (--ledger postgresql://…): with SQLite one "
                "manager owns the whole registry"
            )
        from mesh.ledger.shard_leases import ShardLeases  # psycopg: only where it is used
        from mesh.manager.shards import ShardOwnership

        loop = asyncio.get_running_loop()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shard-leases")

        def run_blocking(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return loop.run_in_executor(self._thread, fn, *args)

        leases = await run_blocking(
            partial(ShardLeases, schema=s.ledger_schema), s.ledger_url, s.shard_count
        )
        self.shards = ShardOwnership(
            leases,
            s.manager_id,
            lease_s=s.shard_lease_s,
            run_blocking=run_blocking,
            wall_clock=lambda: self._clock.now().wall,
            on_change=self._changed,
            counters=self._counters,
        )
        self.peers = Peers(
            self._transport(),
            s.namespace,
            s.manager_id,
            user_id=self._manager_user,
            counters=self._counters,
        )
        await self.peers.start()
        await self.shards.step()  # its first share before it consumes anything
        self.shards.start()
        if s.admission_capacity == "live":
            from mesh.manager.live_share import SharedLive

            self.shared_live = SharedLive(
                self.shards,
                run_blocking=run_blocking,
                own=lambda: self._core.live_capacity(self._clock.now()),
                descriptors=self._descriptors,
                interval_s=s.live_share_interval_s,
                handover_s=s.live_handover_s,
                counters=self._counters,
            )
            self._share_live()
            await self.shared_live.step()
            self.shared_live.start()

    async def stop(self) -> None:
        """Give every shard back (their agents asked to register with the new owners) and
        stop consuming their queues."""
        broker_away = self._suspension is not None
        if self._suspension is not None:
            self._suspension.cancel()
            await asyncio.gather(self._suspension, return_exceptions=True)
            self._suspension = None
        if self._step is not None:
            await asyncio.gather(self._step, return_exceptions=True)
            self._step = None
        left = await self._leave(set(self.consumers))
        if self.shared_live is not None:
            await self.shared_live.stop()
            self.shared_live = None
        if self.peers is not None:
            await self.peers.close()
            self.peers = None
        if self.shards is not None:
            held = set(self.shards.keeper.held)
            await self.shards.stop(give_back=True)
            if not broker_away:  # the shards given back are journaled by now
                await self._ask_to_register_again(left, held - set(self.shards.keeper.held))
            self.shards.leases.close()
            self.shards = None
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    # ---- the broker going and coming back -----------------------------------------------------
    def lost_broker(self) -> None:
        """The broker is away: if it stays away for half a lease, every shard is given back."""
        if self.shards is not None and self._suspension is None:
            self._suspension = asyncio.create_task(self._suspend())

    async def _suspend(self) -> None:
        """Cut off from the broker (not from PostgreSQL), a manager still renews leases of
        shards it cannot serve: their agents' heartbeats and registrations would wait in
        their queues until it is back. If the broker is not back within half a lease, it
        gives every shard back (the others take them at their next step, and the agents
        register with them) and rejoins the balance once reconnected."""
        assert self.shards is not None
        await asyncio.sleep(self._settings.shard_lease_s / 2)
        self._counters["shards_suspended"] += 1
        log.warning("the broker is still away: giving every shard back")
        await self.shards.stop(give_back=True)

    async def resume(self) -> None:
        """The broker is back: if the shards were given back meanwhile, take a share again."""
        suspension, self._suspension = self._suspension, None
        if suspension is None or self.shards is None or self._stopping():
            return
        suspension.cancel()
        await asyncio.gather(suspension, return_exceptions=True)
        if not self.shards.running:  # it gave its shards back: take a share again
            assert self._settings.shard_count is not None
            count = self._settings.shard_count
            await self._transport().declare(self._topology.manager_shards(count))
            await self.shards.step()
            self.shards.start()

    # ---- shards taken and left ------------------------------------------------------------------
    async def _changed(self, entries: list[LogEntry]) -> None:
        """Shards taken, given back or lost (``ShardOwnership``): journaled, and this
        manager consumes exactly the queues of the shards it holds. A shard it no longer
        holds is left first (its consumers cancelled, its agents forgotten: they register
        with the new owner when it asks), then the new ones are joined."""
        left = await self._leave({int(e.detail["shard"]) for e in entries if e.reason != "taken"})
        await self._commands.execute([AppendLog(e) for e in entries])
        given_back = {int(e.detail["shard"]) for e in entries if e.reason == "given_back"}
        await self._ask_to_register_again(left, given_back)
        taken = {int(e.detail["shard"]) for e in entries if e.reason == "taken"}
        for shard in sorted(taken):
            if not self._stopping():
                await self._join(shard)
        if taken and self._settings.shard_count is not None:
            # The deployments it now scales: their replicas as they are now (another
            # manager may have scaled them since this one last looked).
            count = self._settings.shard_count
            for deployment in self._core.scaling.deployments:
                if shard_of(deployment, count) in taken:
                    await self._observe(deployment)

    async def _join(self, shard: int) -> None:
        if shard in self.consumers:
            return
        t, s, transport = self._topology, self._settings, self._transport()
        announce = t.shard_announce_queue(shard)
        rpc = t.shard_rpc_queue(shard)
        self.consumers[shard] = [
            await transport.consume_acked(
                announce, self._announced(announce), prefetch=2 * s.announce_batch
            ),
            await transport.consume_raw(t.shard_heartbeat_queue(shard), self.heartbeat_sink()),
            await transport.consume_acked(rpc, self._requested(rpc), prefetch=s.prefetch),
        ]
        log.info("consuming shard", extra={"shard": shard})

    async def _leave(self, shards: set[int]) -> list[AgentRecord]:
        """Stop consuming ``shards``' queues and forget their agents (returned)."""
        if not shards:
            return []
        # Their agents first, in one pass and before any await: a handler running meanwhile
        # (the consumers' cancels yield) must not find them here any more.
        forgotten: list[AgentRecord] = []
        if self._settings.shard_count is not None:
            count = self._settings.shard_count
            forgotten = self._core.hand_over(lambda pool: shard_of(pool, count) in shards)
            log.info(
                "left shards",
                extra={"shards": sorted(shards), "agents_forgotten": len(forgotten)},
            )
        for shard in shards:
            for consumer in self.consumers.pop(shard, []):
                with contextlib.suppress(Exception):  # the channel may be gone already
                    await consumer.cancel()
        return forgotten

    async def _ask_to_register_again(self, agents: list[AgentRecord], given_back: set[int]) -> None:
        """Agents of shards this manager gave back (journaled by now) are asked to register
        with the new owner at once, keeping their leases: otherwise they would be nobody's
        until their next heartbeat, and an acquire meanwhile would find no agent offering
        what they offer. Only agents that keep their leases when asked (``hand-over``): an
        older agent would forget them and refuse tasks granted just before; it registers
        again at its next heartbeat, as before. Not for a shard whose lease was lost (its
        new owner may already hold the agent) nor while the broker is away (nothing can be
        sent; the new owner asks at the next heartbeat)."""
        why = "shard handed over to another manager"
        count = self._settings.shard_count
        if count is None or self._suspension is not None:
            return
        asked: list[tuple[str, Message]] = [
            (a.agent_id, ReRegisterRequest(agent_id=a.agent_id, reason=why, leases_kept=True))
            for a in agents
            if a.keeps_leases and shard_of(a.deployment, count) in given_back
        ]
        if not asked:
            return
        try:
            await self._commands.send_to_agents(asked)
        except TransportError as exc:
            log.info("hand-over requests not sent", extra={"error": str(exc)})
            return
        self._counters["handed_over_asked"] += len(asked)


class ShardHeartbeats:
    """A shard's heartbeats into the manager's sink — unless its leases may have run out by
    its own clock (it was paused): then they are dropped (``heartbeats_held_back``; the next
    ones count) and a step runs first, so a woken manager books nothing for shards it lost.
    Heartbeats are synchronous, so they cannot wait for that step."""

    def __init__(self, sharding: Sharding, sink: HeartbeatSink, counters: Counter[str]) -> None:
        self._sharding = sharding
        self._sink = sink
        self._counters = counters

    def __call__(self, body: bytes, user_id: str | None = None) -> None:
        self.ingest_many(((body, user_id),))

    def ingest_many(self, bodies: Iterable[tuple[bytes, str | None]]) -> None:
        shards = self._sharding.shards
        if shards is not None and shards.lapsed():
            batch = list(bodies)
            self._counters["heartbeats_held_back"] += len(batch)
            self._sharding.step_soon()
            return
        self._sink.ingest_many(bodies)
