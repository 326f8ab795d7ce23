"""The manager service: the asyncio shell around :class:`~mesh.core.PoolCore`, wired from
rooms with one job each.

Theory of operation
-------------------
Everything runs on one event loop, so the core never needs a lock (its ``handle`` is
synchronous and never interleaves). The service starts, wires and stops these rooms:

* :class:`~mesh.manager.intake.Intake` takes ``<ns>.manager.announce`` (registrations and
  other announcements, in batches) and ``<ns>.manager.rpc`` (the client API), feeds the core
  or the admission service, answers, dead-letters bad input, and acks.
* :class:`~mesh.manager.heartbeats.HeartbeatSink` takes ``<ns>.manager.heartbeats`` (no-ack).
* :class:`~mesh.manager.commands.CommandExecutor` carries out what the cores decide: the
  journal, the live feed, messages to agents, replies.
* :class:`~mesh.manager.admission_service.AdmissionService`: admission (the ledger), with
  :class:`~mesh.manager.rollout.RolloutService` for the operator's descriptors and revocations.
* :class:`~mesh.manager.scaling.Scaling`: the scaler and fencing of lost agents.
* :class:`~mesh.manager.sharding.Sharding` and :class:`~mesh.manager.forwarding.Forwarding`:
  several managers (shard leases, and the lease path across every owner's registry).
* :class:`~mesh.manager.observe.Observer`: the status page and metrics.

A ticker feeds ``Tick`` once per ``tick_interval_s`` for heartbeat loss and lease expiry, and
ticks the admission service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mesh.core.events import (
    AppendLog,
    ConnectionLost,
    ConnectionRestored,
    LogEntry,
    Tick,
)
from mesh.core.pool import PoolCore
from mesh.errors import LocalProtocolError, TransportError
from mesh.ledger.store import LedgerStore
from mesh.manager.admission import Admitter, ExternalGrantor
from mesh.manager.admission_service import AdmissionService
from mesh.manager.background import Background
from mesh.manager.clock import Clock, SystemClock
from mesh.manager.commands import CommandExecutor
from mesh.manager.forwarding import Forwarding
from mesh.manager.heartbeats import HeartbeatSink
from mesh.manager.intake import Intake
from mesh.manager.journal import Journal, SqliteJournal
from mesh.manager.observe import Observer, vhost_of
from mesh.manager.peers import Peers
from mesh.manager.scaling import Scaling
from mesh.manager.settings import ManagerSettings
from mesh.manager.sharding import Sharding
from mesh.scaler.base import Scaler
from mesh.topology.specs import BindingSpec, Topology
from mesh.transport.amqp import AmqpTransport, url_user, with_heartbeat
from mesh.transport.ports import ManagerTransport, Subscription
from mesh.wire.events import OrchestrationEvent
from mesh.wire.status import (
    CapabilityLoadStatus,
    PoolStates,
    StatusReply,
    StatusRequest,
)

if TYPE_CHECKING:
    from mesh.manager.live_share import SharedLive
    from mesh.manager.shards import ShardOwnership

log = logging.getLogger(__name__)


class ManagerService:
    """Runs the pool manager against a broker until stopped."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        transport: ManagerTransport | None = None,
        journal: Journal | None = None,
        clock: Clock | None = None,
        on_log: Callable[[OrchestrationEvent], None] | None = None,
        scaler: Scaler | None = None,
        ledger: LedgerStore | None = None,
        grantors: Sequence[ExternalGrantor] = (),
    ) -> None:
        self.settings = settings
        self.topology = topology = Topology(namespace=settings.namespace)
        self.core = core = PoolCore(settings.pool)
        self.counters: Counter[str] = Counter()
        self.clock: Clock = clock or SystemClock()
        self._transport = transport
        self._owns_transport = transport is None
        self._journal = journal
        self.scaler = scaler
        self._stopping = False
        self._stopped = False
        self._consumers: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None
        self._background = Background()
        self._started_at = self.clock.now().mono
        manager_user = url_user(settings.amqp_url)  # the broker user managers publish as
        self.observer = Observer(
            manager_id=settings.manager_id,
            namespace=settings.namespace,
            vhost=vhost_of(settings.amqp_url),
            tally=lambda: core.tally,
            agent_rows=lambda offset, limit: core.status(self.clock.now(), offset, limit),
            offers=lambda capability: capability in core.index,
            descriptors=lambda: self.admission.descriptors,
            active_epochs=lambda: self.admitter.active_epochs if self.admitter else {},
            pressure=lambda: self.admitter.pools_seen if self.admitter else {},
            active_generation=settings.admission.active_generation,
            counters=self.counters,
            started_at=self._started_at,
            management_url=settings.management_url,
            queue_poll_interval_s=settings.queue_poll_interval_s,
            shards=lambda: self.sharding.owned(),
            shard_owners=lambda: self.sharding.owners(),
            live=lambda: core.live_capacity(self.clock.now()),
            lines=lambda: self.admitter.core.places.lines if self.admitter else {},
            desired_replicas=core.scaling.desired,
        )
        self.scaling = Scaling(
            core=core,
            clock=self.clock,
            counters=self.counters,
            scaler=scaler,
            holds_pool=lambda pool_id: self.sharding.holds_pool(pool_id),
            close_agent_connections=self.observer.close_agent_connections,
        )
        self.commands = CommandExecutor(
            core=core,
            clock=self.clock,
            counters=self.counters,
            topology=topology,
            transport=lambda: self.transport,
            journal=lambda: self._journal,
            background=self._background,
            shard_count=settings.shard_count,
            pool_epoch=lambda pool_id: self.admission.pool_epoch(pool_id),
            scale=self.scaling.scale,
            fence=self.scaling.fence,
            before_acting=lambda: self.sharding.checked(),
            on_log=on_log,
        )
        self.admission = AdmissionService(
            settings,
            clock=self.clock,
            counters=self.counters,
            topology=topology,
            core=core,
            observer=self.observer,
            commands=self.commands,
            transport=lambda: self.transport,
            journal=lambda: self._journal,
            shared_live=lambda: self.sharding.shared_live,
            ledger=ledger,
            grantors=grantors,
        )
        self.heartbeats = HeartbeatSink(
            core,
            self.clock,
            self.commands.spawn,
            self.counters,
            on_heartbeats=self.observer.heartbeats,
            on_rejected=self.observer.heartbeat_rejected,
            verify_identity=settings.agent_identity,
        )
        self.sharding = Sharding(
            settings,
            topology=topology,
            core=core,
            clock=self.clock,
            counters=self.counters,
            transport=lambda: self.transport,
            commands=self.commands,
            heartbeats=self.heartbeats,
            announced=lambda queue: self.intake.announced(queue),
            requested=lambda queue: self.intake.requested(queue),
            observe=self.scaling.observe,
            descriptors=lambda: self.admission.descriptors,
            share_live=self.admission.share_live,
            manager_user=manager_user,
            stopping=lambda: self._stopping,
        )
        forwarding = Forwarding(
            settings,
            topology=topology,
            core=core,
            counters=self.counters,
            commands=self.commands,
            sharding=self.sharding,
            status=self.status,
        )
        self.intake = Intake(
            settings,
            topology=topology,
            core=core,
            clock=self.clock,
            counters=self.counters,
            transport=lambda: self.transport,
            commands=self.commands,
            admission=self.admission,
            sharding=self.sharding,
            forwarding=forwarding,
            status=self.status,
            dead_lettered=self.observer.dead_lettered,
            background=self._background,
            manager_user=manager_user,
        )

    @property
    def admitter(self) -> Admitter | None:
        """The admission path's admitter, once started (see :class:`AdmissionService`)."""
        return self.admission.admitter

    @property
    def journal(self) -> Journal | None:
        return self._journal

    @property
    def transport(self) -> ManagerTransport:
        if self._transport is None:
            raise LocalProtocolError("the manager is not started")
        return self._transport

    @property
    def shards(self) -> ShardOwnership | None:
        """The shards this manager holds (several managers), once started."""
        return self.sharding.shards

    @property
    def peers(self) -> Peers | None:
        return self.sharding.peers

    @property
    def shared_live(self) -> SharedLive | None:
        return self.sharding.shared_live

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, recover, serve, consume. If any step fails, what was started is stopped
        again before the error propagates (so the error is the last thing said, and nothing
        is left consuming)."""
        try:
            await self._start()
        except BaseException:
            self._stopping = True
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def _start(self) -> None:
        s = self.settings
        if self._transport is None:
            self._transport = await AmqpTransport.connect(
                _connection_url(s),
                name=f"manager:{s.manager_id}",
                publish_timeout_s=s.publish_timeout_s,
                liveness_probe_s=s.liveness_probe_s,
                sign=True,  # agents take control messages only from the managers' user
            )
        if self._journal is None:
            self._journal = SqliteJournal(s.journal_path)
        await self.admission.start()
        if s.http_port is not None:  # first: a port in use fails the start before any work
            url = await self.observer.serve(s.http_host, s.http_port)
            log.info("status page", extra={"url": url, "metrics": f"{url}metrics"})
        await self.transport.declare(self.topology.manager())
        await self._empty_classic_dead_letters()
        if s.shard_count is not None:
            await self.transport.declare(self.topology.manager_shards(s.shard_count))
        await self.sharding.start()  # after the events exchange exists: transfers are logged
        await self.admission.bind_pool_queues()
        await self.commands.execute(
            [
                AppendLog(
                    LogEntry(at=self.clock.now().wall, kind="manager_started", reason=s.manager_id)
                )
            ]
        )
        await self.scaling.observe_all()
        # The first tick is the baseline the stall check measures from: without it, a manager
        # stopped (SIGSTOP, a VM pause) before its first periodic tick would judge every
        # agent's silence meanwhile as theirs and evict them all on waking.
        await self.commands.feed(Tick())
        t = self.topology
        self._consumers = [
            await self.transport.consume_acked(
                t.announce_queue,
                self.intake.announced(t.announce_queue),
                prefetch=2 * s.announce_batch,
            ),
            await self.transport.consume_acked(
                t.rpc_queue, self.intake.requested(t.rpc_queue), prefetch=s.prefetch
            ),
            await self.transport.consume_raw(t.heartbeat_queue, self.heartbeats),
        ]
        self.transport.on_disconnect(self._lost_broker)
        self.transport.on_reconnect(self._after_reconnect)
        self._ticker = asyncio.create_task(self._tick_forever(), name="manager-ticker")
        log.info("manager started", extra={"namespace": s.namespace, "manager_id": s.manager_id})

    async def stop(self) -> None:
        """Stop everything started (also after a failed start); a second call does nothing."""
        if self._stopped:
            return
        self._stopping = True  # the connection closing from here on is ours, not a loss
        if self.scaler is not None:
            # First: agents the scaler runs drain through this manager while it still listens.
            await self.scaler.close()
        for consumer in self._consumers:
            await consumer.cancel()
        self._consumers = []
        await self.intake.finish_announcements()  # what was taken is handled, kept and acked
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        await self._background.wait()
        await self.admission.close_intake()
        await self.sharding.stop()
        await self.observer.close()
        if self._owns_transport and self._transport is not None:
            await self._transport.close()
        # The journal's checkpoints run on the ledger thread too: wait for it before closing.
        await self.admission.barrier()
        if self._journal is not None:
            self._journal.close()
        await self.admission.close()
        self._stopped = True
        log.info("manager stopped", extra={"manager_id": self.settings.manager_id})

    async def run_until_stopped(
        self, stop: asyncio.Event, on_started: Callable[[], None] | None = None
    ) -> None:
        await self.start()
        if on_started is not None:
            on_started()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def _lost_broker(self) -> None:
        if self._stopping:
            return
        log.warning("lost the broker; no agent is evicted for silence until it is back")
        self.core.handle(ConnectionLost(), self.clock.now())
        self.sharding.lost_broker()

    async def _empty_classic_dead_letters(self) -> None:
        """An older version kept dead letters in a classic queue, ``<ns>.dead-letter``: its
        messages move into the quorum one and it is deleted. (An older process still running
        declares it again, bound: a manager's next start empties it again.) A failure is
        logged, never fatal: the old queue and its dead letters stay where they are."""
        t = self.topology
        old = t.classic_dead_letter_queue
        try:
            moved = await self.transport.empty_old_queue(
                old, [BindingSpec(old, t.dead_letter_exchange, "#")], t.dead_letter_queue
            )
        except TransportError as exc:
            log.warning("the old dead-letter queue stays", extra={"queue": old, "error": str(exc)})
            return
        if moved:
            log.warning(
                "dead letters moved from the old classic queue",
                extra={"from": old, "to": t.dead_letter_queue, "moved": moved},
            )

    async def _after_reconnect(self) -> None:
        self.counters["reconnects"] += 1
        try:
            await self.commands.feed(ConnectionRestored())
        finally:
            await self.transport.declare(self.topology.manager())
            await self.sharding.resume()

    async def _tick_forever(self) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(self.settings.tick_interval_s)
            try:
                await self.commands.feed(Tick())
                await self.admission.tick()
            except TransportError as exc:
                log.warning("tick commands not delivered", extra={"error": str(exc)})
            except Exception:  # the ticker must outlive any bug in one tick
                self.counters["handler_errors"] += 1
                log.exception("bug while ticking")
            # ``stop`` cancels the ticker and waits for it. A cancellation that arrived mid-tick
            # can be lost on the way (seen: 1 stop in ~12 under load hung, the ticker back in
            # its sleep, "cancelling"), so the request itself is checked too.
            if task is not None and task.cancelling():
                return

    # ---- status ------------------------------------------------------------------------------
    def status(self, request: StatusRequest | None = None) -> StatusReply:
        """The status reply to ``request`` (none: every agent's row, no summary, as an older
        client's request gets). The summary comes from the pool core's running tally."""
        now = self.clock.now()
        counters = Counter(self.core.counters)
        counters.update(self.counters)
        common: dict[str, Any] = {
            "manager_id": self.settings.manager_id,
            "uptime_s": now.mono - self._started_at,
            "counters": dict(sorted(counters.items())),
            "pools": self.admission.pool_capacities(now),
            "pool_signals": self.observer.pool_signals.signals(),
        }
        shards = self.sharding.shards
        if shards is not None:
            common["shard_count"] = shards.leases.shard_count
            common["shards"] = shards.owners()
        if request is None or request.agents_limit is None:
            return StatusReply(agents=self.core.status(now), **common)
        tally = self.core.tally
        offset = request.agents_offset or 0
        return StatusReply(
            agents=self.core.status(now, offset, request.agents_limit),
            agents_total=tally.agents,
            agents_offset=offset,
            pool_states=[
                PoolStates(pool_id=pool_id, states=states)
                for pool_id, states in tally.pools().items()
            ],
            capability_loads=[
                CapabilityLoadStatus(
                    name=name,
                    agents=load.agents,
                    taking_work=load.taking_work,
                    in_flight=load.in_flight,
                    capacity=load.capacity,
                )
                for name, load in sorted(tally.loads.items())
            ],
            **common,
        )


def _connection_url(settings: ManagerSettings) -> str:
    """With shards, an AMQP heartbeat of half the lease unless the URL names one
    (``ManagerSettings.shard_lease_s``): a frozen owner's shard queues move with its lease."""
    if settings.shard_count is None:
        return settings.amqp_url
    return with_heartbeat(settings.amqp_url, max(1, int(settings.shard_lease_s / 2)))
