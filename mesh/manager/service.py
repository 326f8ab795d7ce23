"""The manager service: the asyncio shell around :class:`~mesh.core.PoolCore`.

Theory of operation
-------------------
Three consumers feed the core, all on one event loop, so the core never needs
a lock (its ``handle`` is synchronous and never interleaves):

* ``<ns>.manager.announce`` (quorum): registrations, deregistrations, drain
  requests from agents, taken in batches (those that arrived together): each is
  fed to the core in order, then the batch's commands are carried out together
  (one journal commit) and only then is each acked.
* ``<ns>.manager.heartbeats``: no-ack, straight into :class:`HeartbeatSink`.
* ``<ns>.manager.rpc``: the client API (find, acquire, release, drain,
  status); each request is answered on its ``reply_to`` with its
  ``correlation_id``, then acked.

A ticker feeds ``Tick`` once per ``tick_interval_s`` for heartbeat loss and
lease expiry. Commands are carried out in order: log entries are appended to
the journal and then published on the events exchange; agent messages go to
the agent's control queue with confirms; replies go to the requester.

A message that cannot be decoded is republished to the dead-letter exchange
with its reason code in ``x-mesh-reason``, counted, and acked; if it asked
for a reply, the requester also gets a ``Refusal`` with that reason. Nothing a
peer sends can crash the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from mesh import constants as c
from mesh.core.events import (
    AcceptanceUndelivered,
    AcquireRequested,
    Announce,
    AppendLog,
    Command,
    ConnectionLost,
    ConnectionRestored,
    DeletePod,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FenceAgent,
    FindRequested,
    LogEntry,
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    ScaleObserved,
    ScaleTo,
    SendToAgent,
    Tick,
)
from mesh.core.pool import AgentRecord, PoolCore
from mesh.core.ranking import rank
from mesh.core.shards import shard_of
from mesh.errors import (
    LocalProtocolError,
    MessageRejected,
    PublishNacked,
    PublishTimeout,
    PublishUnroutable,
    TransportError,
)
from mesh.ledger.store import LedgerStore
from mesh.manager.admission import Admitter, ExternalGrantor
from mesh.manager.admission_service import AdmissionService
from mesh.manager.clock import Clock, SystemClock
from mesh.manager.heartbeats import HeartbeatSink
from mesh.manager.journal import Journal, SqliteJournal
from mesh.manager.observe import Observer, vhost_of
from mesh.manager.peers import Peers
from mesh.manager.settings import ManagerSettings
from mesh.scaler.base import Scaler, ScalerError
from mesh.topology import names
from mesh.topology.specs import BindingSpec, Topology
from mesh.transport.amqp import AmqpTransport, url_user, with_heartbeat
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery
from mesh.transport.ports import ManagerTransport, Subscription
from mesh.wire.admission import (
    AdmissionRelease,
    AdmissionRequest,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorShadow,
    ExplainRequest,
)
from mesh.wire.codec import decode_as, encode
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import (
    MAX_STATUS_AGENTS,
    AcquireRequest,
    AdmissionState,
    AdmissionStateRequest,
    AgentRegistration,
    AgentStatus,
    AgentSummary,
    CapabilityLoadStatus,
    Deregistration,
    DrainRequest,
    FindReply,
    FindRequest,
    LeaseGranted,
    LeaseNotice,
    LeaseStateRequest,
    Message,
    PoolStates,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    Released,
    ReleaseRequest,
    ReRegisterRequest,
    ShardOwner,
    Standing,
    StandingRequest,
    StatusReply,
    StatusRequest,
)
from mesh.wire.reasons import Reason

if TYPE_CHECKING:
    from mesh.manager.live_share import SharedLive
    from mesh.manager.shards import ShardOwnership

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Agents that may take an acquire, each with the owner's queue (``None``: this
    registry), in rank order; ``silent``: owners asked that did not answer in time, and
    ``unanswered_shards`` the shards they answer for."""

    found: list[tuple[AgentSummary, str | None]]
    silent: int
    unanswered_shards: int = 0


# An acquire for a capability nobody offers while shards change hands is asked again every
# SETTLING_RETRY_S for at most a lease period, capped here below producers' usual timeouts.
SETTLING_RETRY_S = 0.1
MAX_SETTLING_HOLD_S = 5.0
# A redelivered acquire looks for the lease its ID holds this often while shards move.
_HELD_LOOK_S = 0.25
# Refusals that say nobody offers a capability: with several managers, only one registry's
# word (``_refusal_everywhere``).
_NOBODY_OFFERS = frozenset({Reason.UNKNOWN_CAPABILITY, Reason.CAPABILITY_NOT_OFFERED})
_FENCE_ATTEMPTS = 4
_FENCE_RETRY_S = 2.0  # 4 attempts over 6 s: past one statistics round of the management API
T = TypeVar("T")

_ANNOUNCE_TYPES = (
    AgentRegistration,
    Deregistration,
    DrainRequest,
    StandingRequest,
    AdmissionStateRequest,
    LeaseStateRequest,
)
_RPC_TYPES = (
    FindRequest,
    AcquireRequest,
    ReleaseRequest,
    DrainRequest,
    StatusRequest,
    AdmissionRequest,
    AdmissionRelease,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorShadow,
    ExplainRequest,
)


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
        self.topology = Topology(namespace=settings.namespace)
        self.core = PoolCore(settings.pool)
        self.counters: Counter[str] = Counter()
        self.clock: Clock = clock or SystemClock()
        self._transport = transport
        self._owns_transport = transport is None
        self._journal = journal
        self._on_log = on_log
        self._unfit_seqs: set[int] = set()  # journaled entries kept off the feed (bugs)
        self.scaler = scaler
        self.admission = AdmissionService(self, ledger=ledger, grantors=grantors)
        self._stopping = False
        self._stopped = False
        self._consumers: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Announcements (registrations above all) that arrived together — in one read from
        # the socket, or while the batch before was being handled — handled as one batch (at
        # most ``announce_batch``): one journal commit, their answers and events published
        # together. Each is kept with the queue it came from.
        self._announcements: deque[tuple[Delivery, str]] = deque()
        self._announcing: asyncio.Task[None] | None = None
        self._started_at = self.clock.now().mono
        self.shards: ShardOwnership | None = None  # with settings.shard_count
        self.shared_live: SharedLive | None = None  # with shards and live admission capacity
        self._shard_thread: ThreadPoolExecutor | None = None
        # Several managers: the consumers of each held shard's announce and heartbeat queues.
        self._shard_consumers: dict[int, list[Subscription]] = {}
        self.peers: Peers | None = None  # … and the other owners, asked on lease-path requests
        self._shard_step: asyncio.Task[None] | None = None  # a step run from heartbeats
        self._shard_suspension: asyncio.Task[None] | None = None  # the broker is away
        # The broker user managers publish as: a registration forwarded to its shard's owner
        # carries its agent's user in a header, trusted only from this user (validated).
        self._manager_user = url_user(settings.amqp_url)
        self.observer = Observer(
            manager_id=settings.manager_id,
            namespace=settings.namespace,
            vhost=vhost_of(settings.amqp_url),
            tally=lambda: self.core.tally,
            agent_rows=lambda offset, limit: self.core.status(self.clock.now(), offset, limit),
            offers=lambda capability: capability in self.core.index,
            descriptors=lambda: self.admission.descriptors,
            active_epochs=lambda: self.admitter.active_epochs if self.admitter else {},
            pressure=lambda: self.admitter.pools_seen if self.admitter else {},
            active_generation=settings.admission.active_generation,
            counters=self.counters,
            started_at=self._started_at,
            management_url=settings.management_url,
            queue_poll_interval_s=settings.queue_poll_interval_s,
            shards=lambda: {} if self.shards is None else self.shards.owned(),
            shard_owners=self._shard_owners,
        )
        self.heartbeats = HeartbeatSink(
            self.core,
            self.clock,
            self._spawn,
            self.counters,
            on_heartbeats=self.observer.heartbeats,
            on_rejected=self.observer.heartbeat_rejected,
            verify_identity=settings.agent_identity,
        )

    def _shard_owners(self) -> tuple[int, list[tuple[int, str, int]]] | None:
        if self.shards is None:
            return None
        rows = [(r.shard, r.owner, r.fence) for r in self.shards.owners()]
        return self.shards.leases.shard_count, rows

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
        await self._start_shards()  # after the events exchange exists: transfers are logged
        await self.admission.bind_pool_queues()
        await self.execute(
            [
                AppendLog(
                    LogEntry(at=self.clock.now().wall, kind="manager_started", reason=s.manager_id)
                )
            ]
        )
        await self._observe_deployments()
        # The first tick is the baseline the stall check measures from: without it, a manager
        # stopped (SIGSTOP, a VM pause) before its first periodic tick would judge every
        # agent's silence meanwhile as theirs and evict them all on waking.
        await self._feed(Tick())
        t = self.topology
        self._consumers = [
            await self.transport.consume_acked(
                t.announce_queue, self._announced(t.announce_queue), prefetch=2 * s.announce_batch
            ),
            await self.transport.consume_acked(
                t.rpc_queue, self._requested(t.rpc_queue), prefetch=s.prefetch
            ),
            await self.transport.consume_raw(t.heartbeat_queue, self.heartbeats),
        ]
        self.transport.on_disconnect(self._lost_broker)
        self.transport.on_reconnect(self._after_reconnect)
        self._ticker = asyncio.create_task(self._tick_forever(), name="manager-ticker")
        log.info("manager started", extra={"namespace": s.namespace, "manager_id": s.manager_id})

    async def _start_shards(self) -> None:
        """Hold this manager's share of the registry's shards (``settings.shard_count``)."""
        s = self.settings
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
        self._shard_thread = ThreadPoolExecutor(1, thread_name_prefix="shard-leases")

        def run_blocking(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return loop.run_in_executor(self._shard_thread, fn, *args)

        leases = await run_blocking(
            partial(ShardLeases, schema=s.ledger_schema), s.ledger_url, s.shard_count
        )
        self.shards = ShardOwnership(
            leases,
            s.manager_id,
            lease_s=s.shard_lease_s,
            run_blocking=run_blocking,
            wall_clock=lambda: self.clock.now().wall,
            on_change=self._shards_changed,
            counters=self.counters,
        )
        self.peers = Peers(
            self.transport,
            s.namespace,
            s.manager_id,
            user_id=self._manager_user,
            counters=self.counters,
        )
        await self.peers.start()
        await self.shards.step()  # its first share before it consumes anything
        self.shards.start()
        if s.admission_capacity == "live":
            from mesh.manager.live_share import SharedLive

            self.shared_live = SharedLive(
                self.shards,
                run_blocking=run_blocking,
                own=lambda: self.core.live_capacity(self.clock.now()),
                descriptors=lambda: self.admission.descriptors,
                interval_s=s.live_share_interval_s,
                handover_s=s.live_handover_s,
                counters=self.counters,
            )
            self.admission.share_live()
            await self.shared_live.step()
            self.shared_live.start()

    async def _shards_changed(self, entries: list[LogEntry]) -> None:
        """Shards taken, given back or lost (``ShardOwnership``): journaled, and this
        manager consumes exactly the queues of the shards it holds. A shard it no longer
        holds is left first (its consumers cancelled, its agents forgotten: they register
        with the new owner when it asks), then the new ones are joined."""
        left = await self._leave_shards(
            {int(e.detail["shard"]) for e in entries if e.reason != "taken"}
        )
        await self.execute([AppendLog(e) for e in entries])
        given_back = {int(e.detail["shard"]) for e in entries if e.reason == "given_back"}
        await self._ask_to_register_again(left, given_back)
        taken = {int(e.detail["shard"]) for e in entries if e.reason == "taken"}
        for shard in sorted(taken):
            if not self._stopping:
                await self._join_shard(shard)
        if taken and self.settings.shard_count is not None:
            # The deployments it now scales: their replicas as they are now (another
            # manager may have scaled them since this one last looked).
            count = self.settings.shard_count
            for deployment in self.core.scaling.deployments:
                if shard_of(deployment, count) in taken:
                    await self._observe(deployment)

    async def _join_shard(self, shard: int) -> None:
        if shard in self._shard_consumers:
            return
        t, s = self.topology, self.settings
        announce = t.shard_announce_queue(shard)

        rpc = t.shard_rpc_queue(shard)
        self._shard_consumers[shard] = [
            await self.transport.consume_acked(
                announce, self._announced(announce), prefetch=2 * s.announce_batch
            ),
            await self.transport.consume_raw(
                t.shard_heartbeat_queue(shard), _ShardHeartbeats(self)
            ),
            await self.transport.consume_acked(rpc, self._requested(rpc), prefetch=s.prefetch),
        ]
        log.info("consuming shard", extra={"shard": shard})

    async def _leave_shards(self, shards: set[int]) -> list[AgentRecord]:
        """Stop consuming ``shards``' queues and forget their agents (returned)."""
        if not shards:
            return []
        # Their agents first, in one pass and before any await: a handler running meanwhile
        # (the consumers' cancels yield) must not find them here any more.
        forgotten: list[AgentRecord] = []
        if self.settings.shard_count is not None:
            count = self.settings.shard_count
            forgotten = self.core.hand_over(lambda pool: shard_of(pool, count) in shards)
            log.info(
                "left shards",
                extra={"shards": sorted(shards), "agents_forgotten": len(forgotten)},
            )
        for shard in shards:
            for consumer in self._shard_consumers.pop(shard, []):
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
        count = self.settings.shard_count
        if count is None or self._shard_suspension is not None:
            return
        asked: list[tuple[str, Message]] = [
            (a.agent_id, ReRegisterRequest(agent_id=a.agent_id, reason=why, leases_kept=True))
            for a in agents
            if a.keeps_leases and shard_of(a.deployment, count) in given_back
        ]
        if not asked:
            return
        try:
            await self._send_to_agents(asked)
        except TransportError as exc:
            log.info("hand-over requests not sent", extra={"error": str(exc)})
            return
        self.counters["handed_over_asked"] += len(asked)

    async def _stop_shards(self) -> None:
        broker_away = self._shard_suspension is not None
        if self._shard_suspension is not None:
            self._shard_suspension.cancel()
            await asyncio.gather(self._shard_suspension, return_exceptions=True)
            self._shard_suspension = None
        if self._shard_step is not None:
            await asyncio.gather(self._shard_step, return_exceptions=True)
            self._shard_step = None
        left = await self._leave_shards(set(self._shard_consumers))
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
        if self._shard_thread is not None:
            self._shard_thread.shutdown(wait=True)
            self._shard_thread = None

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
        if self._announcing is not None:  # what was taken is handled, kept and acked
            await asyncio.gather(self._announcing, return_exceptions=True)
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.admission.close_intake()
        await self._stop_shards()
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
        if self.shards is not None and self._shard_suspension is None:
            self._shard_suspension = asyncio.create_task(self._suspend_shards())

    async def _suspend_shards(self) -> None:
        """Cut off from the broker (not from PostgreSQL), a manager still renews leases of
        shards it cannot serve: their agents' heartbeats and registrations would wait in
        their queues until it is back. If the broker is not back within half a lease, it
        gives every shard back (the others take them at their next step, and the agents
        register with them) and rejoins the balance once reconnected."""
        assert self.shards is not None
        await asyncio.sleep(self.settings.shard_lease_s / 2)
        self.counters["shards_suspended"] += 1
        log.warning("the broker is still away: giving every shard back")
        await self.shards.stop(give_back=True)

    async def _resume_shards(self) -> None:
        suspension, self._shard_suspension = self._shard_suspension, None
        if suspension is None or self.shards is None or self._stopping:
            return
        suspension.cancel()
        await asyncio.gather(suspension, return_exceptions=True)
        if not self.shards.running:  # it gave its shards back: take a share again
            assert self.settings.shard_count is not None
            await self.transport.declare(self.topology.manager_shards(self.settings.shard_count))
            await self.shards.step()
            self.shards.start()

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
            await self._feed(ConnectionRestored())
        finally:
            await self.transport.declare(self.topology.manager())
            await self._resume_shards()

    async def _tick_forever(self) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(self.settings.tick_interval_s)
            try:
                await self._feed(Tick())
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

    # ---- inputs ---------------------------------------------------------------------------
    def _announced(self, queue: str) -> Callable[[list[Delivery]], None]:
        """What takes ``queue``'s deliveries (those of one read from the socket): queued to
        be handled a batch at a time (at most ``announce_batch``), in order."""

        def take(deliveries: list[Delivery]) -> None:
            self._announcements.extend((delivery, queue) for delivery in deliveries)
            if self._announcing is None or self._announcing.done():
                self._announcing = asyncio.create_task(self._announce_all(), name="announce")

        return take

    async def _announce_all(self) -> None:
        pending, size = self._announcements, self.settings.announce_batch
        while pending:
            batch = [pending.popleft() for _ in range(min(size, len(pending)))]
            try:
                await self._settle_announcements(batch)
            except Exception:  # pragma: no cover - it settles everything itself
                log.exception("bug while handling announcements")

    def _requested(self, queue: str) -> Callable[[list[Delivery]], None]:
        """What takes ``queue``'s requests (those of one read from the socket): each handled
        on a task of its own — requests wait on the ledger's group commit, side by side — and
        tracked, so that :meth:`stop` lets the ones taken finish (answered and acked)."""

        def take(deliveries: list[Delivery]) -> None:
            for delivery in deliveries:
                task = asyncio.create_task(self._guarded(delivery, queue, self._handle_rpc))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

        return take

    def _step_shards_soon(self) -> None:
        """A shard step in the background (from a synchronous path), one at a time."""
        if self._shard_step is None or self._shard_step.done():
            self._shard_step = asyncio.create_task(self._shards_checked())

    async def _shards_checked(self) -> None:
        """Several managers: before acting on its registry, a manager whose leases may have
        run out by its own clock (it was paused: SIGSTOP, a VM freeze, a starved loop) steps
        first, so it learns what it lost — and forgets those shards' agents — before it
        answers anything with them (``shard_checks_before_acting``)."""
        if self.shards is not None and self.shards.lapsed():
            self.counters["shard_checks_before_acting"] += 1
            await self.shards.step()

    async def _settle_announcements(self, items: list[tuple[Delivery, str]]) -> None:
        """Announcements that arrived together, each handled as it would be alone, in
        order: decoded, its sender checked, fed to the core (or answered, forwarded or
        dead-lettered on its own). What the core returns for all of them is carried out
        together (:meth:`execute_many`: one journal commit, then the events and the answers
        published without waiting on each other); each delivery is acked only after that —
        after what it changed is kept. A transport failure hands the batch's deliveries back
        to be redelivered (the core's handling is idempotent); a bug rejects them. Never
        raises: every delivery is settled here."""
        self.counters["announce_batches"] += 1  # received.* over this: the mean batch
        await self._shards_checked()  # a paused manager learns what it lost first
        fed: list[tuple[Sequence[Command], Delivery]] = []
        for delivery, queue in items:
            try:
                try:
                    event = await self._announce_event(delivery)
                except MessageRejected as exc:
                    await self._dead_letter(delivery, queue, exc)
                    event = None
                if event is not None:
                    await self._shards_checked()  # no await between it and the core: _feed
                    fed.append((self.core.handle(event, self.clock.now()), delivery))
                    continue
            except TransportError as exc:
                await self._hand_back([delivery], queue, exc)
                continue
            except Exception:
                await self._reject_on_bug([delivery], queue)
                continue
            await delivery.ack()
        if not fed:
            return
        deliveries = [delivery for _, delivery in fed]
        try:
            await self.execute_many(fed)
        except TransportError as exc:
            await self._hand_back(deliveries, items[0][1], exc)
            return
        except Exception:
            await self._reject_on_bug(deliveries, items[0][1])
            return
        await asyncio.gather(*(delivery.ack() for delivery in deliveries))

    async def _hand_back(self, deliveries: list[Delivery], queue: str, exc: Exception) -> None:
        """A transport failure while handling: replies and agent messages are best-effort
        (counted where they fail), so this is the channel or broker going away. The messages
        go back to be redelivered (the core's handling is idempotent); if even that fails
        the broker requeues them anyway."""
        log.warning("could not finish a delivery", extra={"queue": queue, "error": str(exc)})
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.reject(requeue=True)

    async def _reject_on_bug(self, deliveries: list[Delivery], queue: str) -> None:
        """A bug while handling (called from an ``except``): counted, logged, rejected."""
        self.counters["handler_errors"] += len(deliveries)
        log.exception("bug while handling a delivery", extra={"queue": queue})
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.reject(requeue=False)

    async def _announce_event(self, delivery: Delivery) -> Event | None:
        """What an announcement asks of the core, or ``None`` when it was answered here
        (a standing or admission-state request, a refused or forwarded registration).
        ``MessageRejected`` for bad input or a sender speaking for another agent."""
        message = decode_as(delivery.body, *_ANNOUNCE_TYPES)
        event: Event
        if isinstance(message, AgentRegistration):
            verified = self.settings.agent_identity  # checked just below, before handling
            event, claimed = RegistrationReceived(message, verified), message.agent_id
        elif isinstance(message, Deregistration):
            event, claimed = DeregistrationReceived(message), message.agent_id
        elif isinstance(message, DrainRequest):
            self._check_drain_names_incarnation(message)
            event, claimed = DrainRequested(message.agent_id, message.reason), message.agent_id
        elif isinstance(message, StandingRequest | AdmissionStateRequest | LeaseStateRequest):
            claimed = message.agent_id
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        publisher = self._publisher_of(delivery)
        if self.settings.agent_identity and claimed != publisher:
            # Someone speaking for another agent: dead-lettered (and refused if it asked),
            # never answered on the named agent's control queue — that agent did not ask.
            raise MessageRejected(
                Reason.NOT_AUTHORIZED,
                f"{message.type} for agent {claimed!r} published by broker user "
                f"{publisher!r}: agents speak only for themselves",
            )
        if isinstance(message, AgentRegistration) and self.shards is not None:
            if not await self._registration_is_mine(message, delivery, publisher):
                return None
        self.counters[f"received.{message.type}"] += 1
        if isinstance(message, StandingRequest):
            await self._send_to_agent(message.agent_id, self._standing(message))
            return None
        if isinstance(message, AdmissionStateRequest):
            await self._send_to_agent(message.agent_id, await self._admission_state(message))
            return None
        if isinstance(message, LeaseStateRequest):
            await self._send_to_agent(message.agent_id, self._lease_state(message))
            return None
        if isinstance(message, AgentRegistration) and not self.admission.understands_epochs(
            message
        ):
            await self._refuse_registration(message, delivery)
            return None
        return event  # a drain request may carry reply_to: its delivery is the request

    def _check_drain_names_incarnation(self, message: DrainRequest) -> None:
        """A drain request on the announce exchange is the agent's own (SIGTERM): it names the
        registered incarnation, or anyone could drain any agent by its ID with identities off
        (and a restarted process could drain its successor). ``MessageRejected``
        (``NOT_AUTHORIZED``: dead-lettered, counted) otherwise. An agent this manager does
        not know is left to the core (``UNKNOWN_AGENT``)."""
        agent = self.core.agents.get(message.agent_id)
        if agent is None or message.incarnation == agent.incarnation:
            return
        self.counters["drain_incarnation_mismatch"] += 1
        named = "no incarnation" if message.incarnation is None else "another incarnation"
        raise MessageRejected(
            Reason.NOT_AUTHORIZED,
            f"drain request for agent {message.agent_id!r} names {named}: on the announce "
            "exchange only the agent itself drains, naming its registered incarnation "
            "(an operator drains through `mesh drain`)",
        )

    def _publisher_of(self, delivery: Delivery) -> str | None:
        """The broker user a message is from: its validated ``user_id``, or for a
        registration another manager forwarded, the agent's user it names — believed only
        from the managers' own user, which no agent can publish as."""
        if self._from_a_manager(delivery):
            forwarded = _header(delivery, c.H_FORWARDED_FOR)
            if forwarded is not None:
                return forwarded
        return delivery.user_id

    def _from_a_manager(self, delivery: Delivery) -> bool:
        """Forwarded by another manager of this namespace: marked so, and published as the
        managers' broker user (validated by RabbitMQ: no agent or producer can)."""
        return (
            _header(delivery, c.H_FORWARDED_BY) is not None
            and self._manager_user is not None
            and delivery.user_id == self._manager_user
        )

    async def _registration_is_mine(
        self, registration: AgentRegistration, delivery: Delivery, publisher: str | None
    ) -> bool:
        """Several managers: a registration is handled by its pool's shard's owner. Any
        manager takes it from the shared announce queue and forwards it to the shard's queue
        when the shard is not its own (the shard's queue keeps it until an owner consumes
        it). An agent that cannot route by shard is refused: its heartbeats would reach a
        manager that does not know it."""
        assert self.shards is not None and self.settings.shard_count is not None
        if c.FEATURE_SHARDS not in registration.features:
            await self._refuse_unsharded(registration)
            return False
        shard = shard_of(registration.deployment, self.settings.shard_count)
        if self.shards.holds(shard):
            return True
        headers = {c.H_FORWARDED_BY: self.settings.manager_id}
        if publisher is not None:
            headers[c.H_FORWARDED_FOR] = publisher
        await self.transport.publish(
            self.topology.announce_exchange,
            names.agent_announce_key(registration.agent_id, "register", shard),
            delivery.body,
            headers=headers,
            persistent=True,
            user_id=self._manager_user,
        )  # confirmed: the delivery is acked only after the shard's queue has it
        self.counters["registrations_forwarded"] += 1
        return False

    async def _refuse_unsharded(self, registration: AgentRegistration) -> None:
        detail = (
            f"this namespace runs several managers, each owning shards of the registry; an "
            f"agent must list the {c.FEATURE_SHARDS!r} feature (route its heartbeats to its "
            "shard's owner): upgrade its SDK"
        )
        await self._refuse_for(registration, Reason.SHARDS_UNSUPPORTED, detail)

    async def _refuse_for(
        self, registration: AgentRegistration, reason: Reason, detail: str
    ) -> None:
        """A final refusal of ``registration`` (it lacks a feature it needs), counted."""
        self.counters[f"registration_refused.{reason}"] += 1
        log.warning(
            "registration refused",
            extra={"agent_id": registration.agent_id, "reason": reason.value},
        )
        refusal = RegistrationRefused(
            agent_id=registration.agent_id,
            incarnation=registration.incarnation,
            reason=reason,
            detail=detail,
        )
        await self._send_to_agent(registration.agent_id, refusal)

    def _standing(self, request: StandingRequest) -> Standing:
        """Whether this incarnation is registered now (it was not declared lost)."""
        agent = self.core.agents.get(request.agent_id)
        registered = agent is not None and agent.incarnation == request.incarnation
        self.counters[f"standing.{'registered' if registered else 'unknown'}"] += 1
        if agent is None or not registered:
            return Standing(
                agent_id=request.agent_id, incarnation=request.incarnation, registered=False
            )
        return Standing(
            agent_id=request.agent_id,
            incarnation=request.incarnation,
            registered=True,
            state=agent.state.value,
            registered_for_s=max(0.0, self.clock.now().mono - agent.registered_at),
        )

    def _lease_state(self, request: LeaseStateRequest) -> LeaseNotice:
        """The notice of ``request.lease_id`` again, if it is a live lease on the asking
        incarnation; otherwise that it ended (nothing is told of other agents' leases)."""
        agent = self.core.agents.get(request.agent_id)
        lease = self.core.leases.get(request.lease_id)
        remaining = 0.0 if lease is None else lease.expires_at - self.clock.now().mono
        live = (
            agent is not None
            and agent.incarnation == request.incarnation
            and lease is not None
            and lease.agent_id == request.agent_id
            and remaining > 0
        )
        self.counters[f"lease_state.{'live' if live else 'ended'}"] += 1
        if not live or lease is None:
            return LeaseNotice(
                agent_id=request.agent_id,
                lease_id=request.lease_id,
                capability=request.capability,
                expires_in_s=0.0,
                ended=True,
            )
        return LeaseNotice(
            agent_id=request.agent_id,
            lease_id=request.lease_id,
            capability=lease.capability,
            expires_in_s=remaining,
        )

    async def _admission_state(self, request: AdmissionStateRequest) -> AdmissionState:
        """The ledger's state of an admission of the asking agent's pool; nothing about
        another pool's admissions, nor to an incarnation that is not registered."""
        agent = self.core.agents.get(request.agent_id)
        pool_id = agent.deployment if agent and agent.incarnation == request.incarnation else None
        found = await self.admission.reservation(request.admission_id)
        if found is None or pool_id is None or found.pool_id != pool_id:
            self.counters["admission_state.unknown"] += 1
            return AdmissionState(agent_id=request.agent_id, admission_id=request.admission_id)
        self.counters[f"admission_state.{found.state.value.lower()}"] += 1
        return AdmissionState(
            agent_id=request.agent_id,
            admission_id=request.admission_id,
            state=found.state.value,
            fence=found.fence,
        )

    async def _refuse_registration(
        self, registration: AgentRegistration, delivery: Delivery
    ) -> None:
        detail = (
            f"pool {registration.deployment!r} has a capability descriptor, so its tasks carry "
            f"grants bound to a descriptor epoch; this agent does not list the "
            f"{c.FEATURE_DESCRIPTOR_EPOCHS!r} feature (an SDK older than epochs?) and would run "
            "tasks of a retired epoch"
        )
        await self._refuse_for(registration, Reason.EPOCHS_UNSUPPORTED, detail)

    async def _handle_rpc(self, delivery: Delivery) -> None:
        message = decode_as(delivery.body, *_RPC_TYPES)
        self.counters[f"received.{message.type}"] += 1
        if isinstance(message, StatusRequest):
            await self._shards_checked()
            if self.peers is not None and not self._from_a_manager(delivery):
                merged = await self._status_everywhere(
                    message, _knows_unanswered(delivery), _knows(delivery, c.FEATURE_SETTLING)
                )
                await self._reply(delivery, merged)
            else:
                await self._reply(delivery, self.status(message))
            return
        if isinstance(
            message,
            AdmissionRequest
            | AdmissionRelease
            | AdmissionRevoke
            | CapabilityDescriptor
            | DescriptorShadow
            | ExplainRequest,
        ):
            await self._reply(delivery, await self.admission.handle(message, delivery))
            return
        await self._lease_path(message, delivery)

    async def _lease_path(self, message: Message, delivery: Delivery) -> None:
        """find, acquire, release, drain: the registry's requests."""
        await self._shards_checked()
        event: Event
        publisher = self._publisher_of(delivery)
        # Several managers: a lease-path request taken from the shared queue may concern
        # agents another manager holds; one another manager forwarded is answered from here.
        everywhere = self.peers is not None and not self._from_a_manager(delivery)
        if isinstance(message, FindRequest):
            if everywhere:
                found = await self._find_everywhere(message, _knows_unanswered(delivery))
                await self._reply(delivery, found)
                return
            event = FindRequested(message)
        elif isinstance(message, AcquireRequest):
            acquire = await self._acquire(message, delivery, publisher, everywhere)
            if acquire is None:  # answered
                return
            event = acquire
        elif isinstance(message, ReleaseRequest):
            release = await self._release(message, delivery, publisher, everywhere)
            if release is None:  # answered
                return
            event = release
        elif isinstance(message, DrainRequest):
            if publisher != self.settings.operator_user:
                # Draining stops an agent: an operator's act (or the agent's own, on the
                # announce exchange), never a producer's.
                await self._refuse_not_operator(delivery, message.type, message.agent_id)
                return
            if everywhere and message.agent_id not in self.core.agents:
                await self._reply(delivery, await self._elsewhere(message, publisher))
                return
            event = DrainRequested(message.agent_id, message.reason)
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        await self._feed(event, delivery)

    async def _acquire(
        self, message: AcquireRequest, delivery: Delivery, publisher: str | None, everywhere: bool
    ) -> AcquireRequested | None:
        """An acquire: the event for this registry's core, or ``None`` once answered here —
        across shards (a redelivered request first gets the lease its ID already holds,
        :meth:`_lease_granted_before`), or a forwarded "held only" query for a lease not
        held here."""
        lease_id = self._lease_id_of(delivery)
        if everywhere:
            before = None
            if delivery.redelivered:
                before = await self._lease_granted_before(message, lease_id, publisher)
            if before is not None:
                self.counters["acquires_redelivered_answered_again"] += 1
                await self._reply(delivery, before)
            else:
                await self._acquire_everywhere(message, lease_id, publisher, delivery)
            return None
        if _header(delivery, c.H_HELD_ONLY) is not None and lease_id not in self.core.leases:
            detail = f"lease {lease_id!r} is not held here"
            await self._reply(delivery, Refusal(reason=Reason.UNKNOWN_LEASE, detail=detail))
            return None
        return AcquireRequested(message, lease_id, holder=publisher)

    async def _release(
        self, message: ReleaseRequest, delivery: Delivery, publisher: str | None, everywhere: bool
    ) -> ReleaseRequested | None:
        """A release: the event for this registry's core, or ``None`` once answered here —
        by another owner, or, for a redelivered request (the manager it went to stopped
        before acking it, maybe after answering ``released``), as ``released`` when no
        registry holds the lease any more: it was released, by this request's first handling
        or since (its registry may have died with the record of it). Otherwise the request
        would be answered twice, differently (``released``, then ``UNKNOWN_LEASE``)."""
        here = message.lease_id in self.core.leases
        if not delivery.redelivered:
            if everywhere and not here:
                await self._reply(delivery, await self._elsewhere(message, publisher))
                return None
            return ReleaseRequested(message.lease_id, by=publisher or "")
        if everywhere and not here:
            answer = await self._elsewhere(message, publisher)
        else:
            answer = await self._answer_here(ReleaseRequested(message.lease_id, by=publisher or ""))
        if isinstance(answer, Refusal) and answer.reason is Reason.UNKNOWN_LEASE:
            self.counters["releases_redelivered_answered_again"] += 1
            answer = Released(lease_id=message.lease_id)
        await self._reply(delivery, answer)
        return None

    # ---- several managers: the lease path across shards -------------------------------------
    def _peer_queues(self) -> list[str]:
        """RPC queues that reach every shard this manager does not hold: one of each other
        owner's as it last read the lease table (an owner answers for all its shards), and
        the shard's own for a shard that table says nobody else holds — a view a step old
        may still name this manager, or nobody, for a shard another has taken since. An
        owner reached twice answers twice: the callers merge by agent."""
        return list(self._peer_routes())

    def _peer_routes(self) -> dict[str, list[int]]:
        """:meth:`_peer_queues`, each with the shards it answers for (as last read)."""
        assert self.shards is not None and self.settings.shard_count is not None
        me, held = self.settings.manager_id, self.shards.owned()
        view = self.shards.last_view
        owners = {} if view is None else view.owners()
        by_owner: dict[str, list[int]] = {}
        routes: dict[int, list[int]] = {}  # by the shard whose queue reaches them
        for shard in range(self.settings.shard_count):
            owner = owners.get(shard)
            if shard in held:
                continue
            if owner is None or owner == me:
                routes[shard] = [shard]
            else:
                by_owner.setdefault(owner, []).append(shard)
        for shards in by_owner.values():
            routes[min(shards)] = shards
        return {self.topology.shard_rpc_queue(s): routes[s] for s in sorted(routes)}

    def _forward_headers(self, publisher: str | None, **extra: str) -> dict[str, str]:
        headers = {c.H_FORWARDED_BY: self.settings.manager_id, **extra}
        if publisher is not None:
            headers[c.H_FORWARDED_FOR] = publisher
        return headers

    async def _answer_here(self, event: Event) -> Message:
        """The core's answer to ``event``; its other commands carried out."""
        await self._shards_checked()  # as in _feed
        commands = self.core.handle(event, self.clock.now())
        await self.execute([cmd for cmd in commands if not isinstance(cmd, Reply)])
        (reply,) = [cmd.message for cmd in commands if isinstance(cmd, Reply)]
        return reply

    async def _find_everywhere(self, request: FindRequest, say_unanswered: bool = False) -> Message:
        """This registry's candidates and every other owner's, in the one order (cheapest
        cost class, then least loaded), cut at ``limit``. An owner that does not answer in
        time is left out (counted: ``find_shards_unanswered``; find is a view, acquire
        re-checks); with ``say_unanswered`` (the client knows the field) the reply says how
        many shards' agents are missing (``unanswered_shards``)."""
        candidates = await self._candidates(request)
        if isinstance(candidates, Refusal):
            return candidates
        if candidates.unanswered_shards:
            self.counters["find_shards_unanswered"] += candidates.unanswered_shards
        extra = {"unanswered_shards": candidates.unanswered_shards} if say_unanswered else {}
        agents = [agent for agent, _ in candidates.found]
        return FindReply(
            agents=agents if request.limit is None else agents[: request.limit], **extra
        )

    async def _candidates(self, request: FindRequest) -> _Candidates | Refusal:
        """Candidates from here (queue ``None``) and from each other owner (its queue), and
        how many owners did not answer."""
        assert self.peers is not None
        here = await self._answer_here(FindRequested(request))
        if not isinstance(here, FindReply):
            return here if isinstance(here, Refusal) else Refusal(reason=Reason.NOT_FOUND)
        found: list[tuple[AgentSummary, str | None]] = [(a, None) for a in here.agents]
        routes = self._peer_routes()
        queues = list(routes)
        answers = await self.peers.ask_all(
            queues,
            request,
            headers=self._forward_headers(None),
            timeout_s=self.settings.peer_timeout_s,
        )
        for queue, answer in answers:
            if isinstance(answer, FindReply):
                found += [(agent, queue) for agent in answer.agents]
        found.sort(key=lambda pair: rank(pair[0].cost_class, pair[0].in_flight))
        seen: set[str] = set()  # an owner reached through two queues answers twice
        unique: list[tuple[AgentSummary, str | None]] = []
        for agent, via in found:
            if agent.agent_id not in seen:
                seen.add(agent.agent_id)
                unique.append((agent, via))
        silent, unanswered = _unanswered(routes, answers)
        return _Candidates(unique, silent, unanswered)

    async def _acquire_everywhere(
        self, request: AcquireRequest, lease_id: str, holder: str | None, delivery: Delivery
    ) -> None:
        """A slot on the best agent of any owner: named, the agent's owner leases it (the one
        that knows it); by capability, the candidates of every owner in order, each asked
        for by name until one is leased. The lease ID is this request's, on every owner, so
        a redelivered request gets the lease it already holds."""
        assert self.peers is not None
        if request.agent_id is not None:
            if request.agent_id in self.core.agents:
                await self._feed(AcquireRequested(request, lease_id, holder=holder), delivery)
            else:
                await self._reply(delivery, await self._elsewhere(request, holder, lease_id))
            return
        limit = self.settings.peer_acquire_candidates
        find = FindRequest(
            capability=request.capability, version_spec=request.version_spec, limit=limit
        )
        answer: Message | None = None
        hold_until = time.monotonic() + self._settling_hold_s()
        held = False
        silent = 0
        while True:
            candidates = await self._candidates(find)
            if not isinstance(candidates, Refusal):
                silent = candidates.silent
                for agent, queue in candidates.found[:limit]:
                    named = request.model_copy(update={"agent_id": agent.agent_id})
                    if queue is None:
                        answer = await self._answer_here(AcquireRequested(named, lease_id, holder))
                    else:
                        answer = await self.peers.ask(
                            queue,
                            named,
                            headers=self._forward_headers(holder, **{c.H_LEASE_ID: lease_id}),
                            timeout_s=self.settings.peer_timeout_s,
                        )
                    if isinstance(answer, LeaseGranted):
                        break
            nobody_offers = not isinstance(candidates, Refusal) and not candidates.found
            if (
                isinstance(answer, LeaseGranted)
                or not nobody_offers
                or not await self._moving_for(request.capability, hold_until, look=not held)
            ):
                break
            # Nobody offers it while shards change hands: its agents may be registering
            # again with a new owner. Ask again shortly rather than answer that nobody does.
            if not held:
                held = True
                self.counters["acquires_held_while_shards_move"] += 1
            await asyncio.sleep(SETTLING_RETRY_S)
        if not isinstance(answer, LeaseGranted):
            # Nobody had room: the refusal this registry gives (it records the miss for the
            # scale planner and says when to retry), as the namespace's answer.
            answer = self._refusal_everywhere(
                await self._answer_here(AcquireRequested(request, lease_id, holder)),
                silent,
                request.capability,
            )
        delivered = await self._reply(delivery, answer)
        if not delivered and isinstance(answer, LeaseGranted):
            self.counters["leases_released_unclaimed"] += 1
            await self._elsewhere(ReleaseRequest(lease_id=answer.lease.lease_id), holder)

    async def _lease_granted_before(
        self, request: AcquireRequest, lease_id: str, holder: str | None
    ) -> Message | None:
        """For a redelivered acquire (the manager it went to stopped before acking it, maybe
        after answering): the lease its ID already holds, wherever it is, so the request is
        answered the same again rather than decided anew (a grant, then "no agent available").
        While an owner is silent or shards are changing hands, that lease may be on its way
        to a new owner (its agents register again with the leases they hold): it is looked
        for again every ``_HELD_LOOK_S`` for up to a lease and a hand-over. ``None``: held
        nowhere (no grant was given, or it has ended) — decide it as any request."""
        assert self.peers is not None and self.shards is not None
        give_up_at = time.monotonic() + self.settings.shard_lease_s + self.settings.live_handover_s
        headers = self._forward_headers(holder, **{c.H_LEASE_ID: lease_id, c.H_HELD_ONLY: "1"})
        while True:
            if lease_id in self.core.leases:
                return await self._answer_here(AcquireRequested(request, lease_id, holder))
            routes = self._peer_routes()
            answers = await self.peers.ask_all(
                list(routes), request, headers=headers, timeout_s=self.settings.peer_timeout_s
            )
            for _, answer in answers:
                if isinstance(answer, LeaseGranted):
                    return answer
            silent, _ = _unanswered(routes, answers)
            moving = silent or self.shards.moving() or self._handing_over(request.capability)
            if not moving or time.monotonic() >= give_up_at:
                return None
            await asyncio.sleep(_HELD_LOOK_S)
            await self.shards.look()

    def _refusal_everywhere(self, answer: Message, silent: int, capability: str) -> Message:
        """This registry's refusal as every manager's. "Nobody offers it"
        (``_NOBODY_OFFERS``) is only this registry's word, so it is said only when no other
        owner may hold such an agent: when an owner did not answer (dead or frozen, its
        lease not yet run out), shards changed hands within a (default) heartbeat interval,
        or the shared live rows still count agents of the capability in a shard whose new
        owner has not caught up (their agents are registering again with it), the answer is
        ``NO_AGENT_AVAILABLE`` with a retry hint instead — a producer retries rather than
        gives up on a capability that is there. Counted: ``acquires_refused_for_now.<reason>``."""
        assert self.shards is not None
        if not isinstance(answer, Refusal) or answer.reason not in _NOBODY_OFFERS:
            return answer
        if silent:
            why = f"{silent} other manager(s) did not answer"
        elif self.shards.settling(c.DEFAULT_HEARTBEAT_INTERVAL_S) or self._handing_over(capability):
            why = "shards changed hands just now and their agents are registering again"
        else:
            return answer
        self.counters[f"acquires_refused_for_now.{answer.reason.value}"] += 1
        return Refusal(
            reason=Reason.NO_AGENT_AVAILABLE,
            detail=f"{answer.detail} here, for now: {why}",
            retry_after_ms=max(1, round(1000 * self._settling_hold_s())),
        )

    async def _partial(
        self,
        unanswered: int,
        say_unanswered: bool,
        say_settling: bool,
        theirs: list[ShardOwner],
    ) -> dict[str, Any]:
        """What a merged status says of its own completeness, in the fields the client knows:
        shards whose owners did not answer, shards whose agents may be registering again
        (``theirs``: the other owners' holdings as their replies say)."""
        extra: dict[str, Any] = {"unanswered_shards": unanswered} if say_unanswered else {}
        if say_settling:
            assert self.shards is not None
            await self.shards.look()  # moves since its last step count too (one read)
            extra["settling_shards"] = self.shards.settling_shards(
                c.DEFAULT_HEARTBEAT_INTERVAL_S, theirs, self._shards_handing_over()
            )
        return extra

    def _shards_handing_over(self, capability: str | None = None) -> set[int]:
        """The shards (with agents of ``capability``, if named) whose new owner has not yet
        caught up with the agents the shared live rows count (ShardOwnership.handing_over);
        none without shared live capacity."""
        if self.shards is None or self.shared_live is None:
            return set()
        return self.shards.handing_over(self.shared_live.shared.values(), capability)

    def _handing_over(self, capability: str) -> bool:
        return bool(self._shards_handing_over(capability))

    def _settling_hold_s(self) -> float:
        """How long an acquire for a capability nobody offers is held while shards move:
        a lease period (a dead owner's shards are taken within it, and their agents asked to
        register again), at most ``MAX_SETTLING_HOLD_S`` (producers' own timeouts)."""
        return min(self.settings.shard_lease_s, MAX_SETTLING_HOLD_S)

    async def _moving_for(self, capability: str, hold_until: float, *, look: bool) -> bool:
        """:meth:`_unknown_while_moving`; with ``look``, after reading the lease table (about
        to say nobody offers it: a shard may have moved since this manager's last step)."""
        if look:
            assert self.shards is not None
            await self.shards.look()
        return self._unknown_while_moving(capability, hold_until)

    def _unknown_while_moving(self, capability: str, hold_until: float) -> bool:
        """Whether no registry offers ``capability`` only because shards are moving (and the
        request may still be held)."""
        assert self.shards is not None
        return (
            capability not in self.core.index
            and (self.shards.moving() or self._handing_over(capability))
            and time.monotonic() < hold_until
        )

    async def _elsewhere(
        self, request: Message, publisher: str | None, lease_id: str | None = None
    ) -> Message:
        """A request about one agent or lease that this registry does not hold, asked of
        every other owner: the one that holds it answers; if none does, this registry's
        own answer (unknown agent or lease)."""
        assert self.peers is not None
        extra = {} if lease_id is None else {c.H_LEASE_ID: lease_id}
        answers = await self.peers.ask_all(
            self._peer_queues(),
            request,
            headers=self._forward_headers(publisher, **extra),
            timeout_s=self.settings.peer_timeout_s,
        )
        for _, answer in answers:
            if not isinstance(answer, Refusal) or answer.reason not in _NOT_HELD_HERE:
                return answer
        event: Event
        if isinstance(request, ReleaseRequest):
            event = ReleaseRequested(request.lease_id, by=publisher or "")
        elif isinstance(request, DrainRequest):
            event = DrainRequested(request.agent_id, request.reason)
        else:
            assert isinstance(request, AcquireRequest)
            event = AcquireRequested(request, lease_id or uuid.uuid4().hex, holder=publisher)
        return await self._answer_here(event)

    async def _status_everywhere(
        self, request: StatusRequest, say_unanswered: bool = False, say_settling: bool = False
    ) -> StatusReply:
        """Several managers: the fleet over every owner's registry. The summaries (totals,
        pools by state, capabilities) are added up — each a running tally, so this stays
        cheap at any fleet size; the page of agent rows is the slice of all owners' rows in
        agent-ID order (each owner sends its first ``offset + limit``), the pools' live
        figures added up too. Counters are this manager's. An owner that does not answer in
        time is left out (counted: ``status_shards_unanswered``); with ``say_unanswered``
        (the client knows the field) the reply says how many shards' agents are missing
        (``unanswered_shards``)."""
        assert self.peers is not None
        mine = self.status(_first_rows(request))
        replies = [mine]
        routes = self._peer_routes()
        answers = await self.peers.ask_all(
            list(routes),
            _first_rows(request),
            headers=self._forward_headers(None),
            timeout_s=self.settings.peer_timeout_s,
        )
        _, unanswered = _unanswered(routes, answers)
        if unanswered:
            self.counters["status_shards_unanswered"] += unanswered
        for _, answer in answers:
            # An owner reached through two of its queues answers twice: counted once.
            if isinstance(answer, StatusReply) and all(
                answer.manager_id != r.manager_id for r in replies
            ):
                replies.append(answer)
        theirs = [
            row for r in replies[1:] for row in r.shards or [] if row.owner == r.manager_id
        ]  # fmt: skip
        extra = await self._partial(unanswered, say_unanswered, say_settling, theirs)
        offset = request.agents_offset or 0
        rows = sorted((row for reply in replies for row in reply.agents), key=_agent_key)
        if request.agents_limit is None:  # an older client: every row, no summary
            return mine.model_copy(update={"agents": rows, **extra})
        states: dict[str, Counter[str]] = {}
        loads: dict[str, list[int]] = {}
        for reply in replies:
            for pool in reply.pool_states or []:
                states.setdefault(pool.pool_id, Counter()).update(pool.states)
            for load in reply.capability_loads or []:
                summed = loads.setdefault(load.name, [0, 0, 0, 0])
                for i, n in enumerate(
                    (load.agents, load.taking_work, load.in_flight, load.capacity)
                ):
                    summed[i] += n
        # Each pool's live figures come from its owner's registry (the others count none of
        # its agents): added up; the ledger's figures (granted, model slots) are shared.
        live: dict[tuple[str, str], tuple[int, int]] = {}
        for reply in replies:
            for figure in reply.pools:
                agents, slots = live.get((figure.pool_id, figure.capability), (0, 0))
                live[figure.pool_id, figure.capability] = (
                    agents + figure.live_agents,
                    slots + figure.live_slots,
                )
        pools = []
        for figure in mine.pools:
            agents, slots = live[figure.pool_id, figure.capability]
            pools.append(figure.model_copy(update={"live_agents": agents, "live_slots": slots}))
        return mine.model_copy(
            update={
                "pools": pools,
                "agents": rows[offset : offset + request.agents_limit],
                "agents_offset": offset,
                "agents_total": sum(reply.agents_total or 0 for reply in replies),
                "pool_states": [
                    PoolStates(pool_id=p, states=dict(sorted(c.items())))
                    for p, c in sorted(states.items())
                ],
                "capability_loads": [
                    CapabilityLoadStatus(
                        name=name, agents=n[0], taking_work=n[1], in_flight=n[2], capacity=n[3]
                    )
                    for name, n in sorted(loads.items())
                ],
                **extra,
            }
        )

    def _lease_id_of(self, delivery: Delivery) -> str:
        """The request's lease ID: a forwarded acquire carries the one its first manager
        derived (so every owner leases under the same ID), any other is derived here."""
        if self._from_a_manager(delivery):
            forwarded = _header(delivery, c.H_LEASE_ID)
            if forwarded is not None:
                return forwarded
        return _lease_id(delivery)

    async def _refuse_not_operator(self, delivery: Delivery, what: str, subject: str) -> None:
        self.counters[f"not_authorized.{what}"] += 1
        log.warning(
            "request refused: only the operator may send it",
            extra={"message_type": what, "subject": subject, "user_id": delivery.user_id},
        )
        detail = (
            f"{what} is accepted only from the operator user {self.settings.operator_user!r}; "
            f"this came from {delivery.user_id!r}"
        )
        await self._reply(delivery, Refusal(reason=Reason.NOT_AUTHORIZED, detail=detail))

    async def _guarded(
        self, delivery: Delivery, queue: str, handle: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        """Handle, then ack. Bad input is dead-lettered with its reason; nothing escapes —
        not even a failure to dead-letter it (the message then goes back to the queue). A
        delivery whose channel is gone before it is handled (this process was frozen, and the
        broker gave it to another manager) is left alone: nothing decided, journaled or
        answered for it here."""
        if not delivery.held():
            self.counters["deliveries_dropped_channel_gone"] += 1
            return
        try:
            try:
                await handle(delivery)
            except MessageRejected as exc:
                await self._dead_letter(delivery, queue, exc)
        except TransportError as exc:
            await self._hand_back([delivery], queue, exc)
            return
        except Exception:
            await self._reject_on_bug([delivery], queue)
            return
        await delivery.ack()

    async def _dead_letter(self, delivery: Delivery, queue: str, exc: MessageRejected) -> None:
        self.counters["dead_lettered"] += 1
        self.observer.dead_lettered(exc.reason)
        self.counters[f"dead_lettered.{exc.reason}"] += 1
        log.warning(
            "message dead-lettered",
            extra={"queue": queue, "reason": exc.reason, "detail": exc.detail},
        )
        await self.transport.dead_letter(
            delivery,
            dead_letter_exchange=self.topology.dead_letter_exchange,
            source_queue=queue,
            reason=exc.reason,
            detail=exc.detail,
        )
        if delivery.reply_to:
            await self._reply(delivery, Refusal(reason=Reason(exc.reason), detail=exc.detail))

    # ---- the core and its commands --------------------------------------------------------
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
        }
        if self.shards is not None:
            common["shard_count"] = self.shards.leases.shard_count
            common["shards"] = self.shards.owners()
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

    async def _feed(self, event: Event, request: Delivery | None = None) -> None:
        # Checked again right here, with no await before the core acts: a handler that was
        # under way when the process froze must not act with shards it lost meanwhile.
        await self._shards_checked()
        commands = self.core.handle(event, self.clock.now())
        await self.execute(commands, request)

    def _spawn(self, commands: list[Command]) -> None:
        """Carry out commands from a synchronous path (the heartbeat sink) in the background."""
        task = asyncio.create_task(self.execute(commands))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def execute(self, commands: Sequence[Command], request: Delivery | None = None) -> None:
        """Carry the commands out in order. A bug in one is logged and counted
        (``command_errors``) and the rest still run — above all the reply its requester
        waits for; a transport failure propagates (the delivery is redelivered, and the
        core's handling is idempotent)."""
        await self.execute_many([(commands, request)])

    async def execute_many(
        self, batches: Sequence[tuple[Sequence[Command], Delivery | None]]
    ) -> None:
        """Several requests' commands, as :meth:`execute` would carry out each: their log
        entries journaled in one commit (in order); the live feed's events (those entries,
        then the capability announcements) published in one write; then each request's other
        commands in order — the requests side by side, so their publishes wait for their
        confirms together. The first transport failure propagates once all have run."""
        logs = [
            cmd.entry for commands, _ in batches for cmd in commands if isinstance(cmd, AppendLog)
        ]
        stored = self.append(logs) if logs else []
        feed = [(names.log_key(event.agent_id, event.kind), event) for event in stored]
        for commands, _ in batches:
            for cmd in commands:
                if isinstance(cmd, Announce):
                    event, fits = self._wire_event(cmd.entry)
                    if fits:
                        feed.append((names.capability_key(cmd.capability, cmd.agent_id), event))
        await self.publish_events(feed)
        if len(batches) > 1 and all(
            isinstance(cmd, AppendLog | Announce | SendToAgent)
            for commands, _ in batches
            for cmd in commands
        ):
            # Only messages to agents are left (a batch of registrations: an acceptance each):
            # one write, their confirms awaited together.
            await self._send_to_agents(
                [
                    (cmd.agent_id, cmd.message)
                    for c, _ in batches
                    for cmd in c
                    if isinstance(cmd, SendToAgent)
                ]
            )
            return
        if len(batches) == 1:
            await self._carry_out_all(*batches[0])
            return
        outcomes = await asyncio.gather(
            *(self._carry_out_all(commands, request) for commands, request in batches),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _carry_out_all(self, commands: Sequence[Command], request: Delivery | None) -> None:
        for cmd in commands:
            try:
                await self._carry_out(cmd, request)
            except TransportError:
                raise
            except Exception:
                self.counters["command_errors"] += 1
                log.exception(
                    "bug while carrying out a command; the next ones still run",
                    extra={"command": type(cmd).__name__},
                )

    async def _carry_out(self, cmd: Command, request: Delivery | None) -> None:
        if isinstance(cmd, SendToAgent):
            await self._send_to_agent(cmd.agent_id, self._outgoing(cmd.message))
        elif isinstance(cmd, Reply):
            if request is not None:
                delivered = await self._reply(request, cmd.message)
                if not delivered and isinstance(cmd.message, LeaseGranted):
                    await self._release_unclaimed(cmd.message.lease.lease_id)
        elif isinstance(cmd, Announce):
            pass  # published with the feed's other events (execute_many)
        elif isinstance(cmd, ScaleTo | DeletePod):
            await self._scale(cmd)
        elif isinstance(cmd, FenceAgent):
            task = asyncio.create_task(self._fence(cmd))  # it may retry: not inline
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def append(self, entries: list[LogEntry]) -> list[OrchestrationEvent]:
        if self._journal is None:
            raise LocalProtocolError("the manager is not started")
        made = [self._wire_event(e) for e in entries]
        stored = self._journal.append_many(event for event, _ in made)
        for (_, fits), event in zip(made, stored, strict=True):
            if not fits and event.seq is not None:
                self._unfit_seqs.add(event.seq)  # journaled, kept off the feed
        # The journal and the live feed are the record; a log line per event is for
        # debugging (at INFO, a fleet registering wrote a line per agent, at thousands a
        # second).
        debugging = log.isEnabledFor(logging.DEBUG)
        for event in stored:
            if debugging:
                log.debug(
                    "orchestration event",
                    extra={"kind": event.kind, "agent_id": event.agent_id, "seq": event.seq},
                )
            if self._on_log is not None:
                self._on_log(event)
        return stored

    def _wire_event(self, entry: LogEntry) -> tuple[OrchestrationEvent, bool]:
        """The entry as an event, and whether it fits its kind's schema. One that does not is
        a bug here: it is journaled as written (nothing is lost), counted and logged, and
        kept off the live feed, whose readers would refuse it — and the commands after it (a
        reply a requester waits for) still run."""
        try:
            return _to_wire(entry), True
        except ValidationError as exc:
            self.counters["events_unfit"] += 1
            log.error(
                "an orchestration entry does not fit its kind's schema; journaled, not published",
                extra={"kind": entry.kind, "error": str(exc)[:500]},
            )
            return OrchestrationEvent.as_stored(_wire_fields(entry)), False

    async def publish_event(self, routing_key: str, event: OrchestrationEvent) -> None:
        await self.publish_events([(routing_key, event)])

    async def publish_events(self, events: Sequence[tuple[str, OrchestrationEvent]]) -> None:
        """Put ``(routing key, event)`` pairs on the live feed, in order, in one write. The
        journal holds the durable copy; the events exchange is a live feed, and feed entries
        lost while the broker is away must not stop the commands after them (counted)."""
        wanted = []
        for routing_key, event in events:
            if event.seq is not None and event.seq in self._unfit_seqs:
                self._unfit_seqs.discard(event.seq)  # journaled only: see _wire_event
                continue
            wanted.append((routing_key, encode(event)))
        if not wanted:
            return
        try:
            await self.transport.publish_fast_many(self.topology.events_exchange, wanted)
        except TransportError:
            self.counters["events_unpublished"] += len(wanted)

    # ---- scaling ----------------------------------------------------------------------------
    async def _observe_deployments(self) -> None:
        """Tell the core how many replicas each managed deployment has now."""
        for deployment in self.core.scaling.deployments:
            await self._observe(deployment)

    async def _observe(self, deployment: str) -> None:
        if self.scaler is None:
            log.warning(
                "scaling policies are set but no scaler is: nothing will be scaled",
                extra={"deployment": deployment},
            )
            return
        try:
            replicas = await self.scaler.current_replicas(deployment)
        except ScalerError as exc:
            self.counters["scaler_errors"] += 1
            log.error("cannot read replicas", extra={"deployment": deployment, "error": str(exc)})
            return
        if replicas is None:
            log.error("managed deployment does not exist", extra={"deployment": deployment})
        self.core.handle(ScaleObserved(deployment, replicas), self.clock.now())

    async def _fence(self, cmd: FenceAgent) -> None:
        """Close a lost agent's connections through the management API: the broker requeues
        what it held at once, and if it is only frozen it wakes up disconnected. The API lists
        a new connection only after its next statistics round (5 s by default), so finding
        none is tried again for a while."""
        for attempt in range(_FENCE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_FENCE_RETRY_S)
                back = self.core.agents.get(cmd.agent_id)
                if back is not None and back.incarnation == cmd.incarnation:
                    # Back meanwhile (a silence it survived): its connection stays.
                    self.counters["fence_skipped_back"] += 1
                    return
            closed = await self.observer.close_agent_connections(
                cmd.agent_id, cmd.incarnation, cmd.reason
            )
            if closed is None:
                self.counters["fence_unavailable"] += 1
                return
            if closed:
                self.counters["agent_connections_closed"] += closed
                log.info(
                    "lost agent cut off the broker",
                    extra={"agent_id": cmd.agent_id, "closed": closed},
                )
                return
        self.counters["fence_found_no_connection"] += 1
        log.info("lost agent has no connection left to close", extra={"agent_id": cmd.agent_id})

    async def _scale(self, cmd: ScaleTo | DeletePod) -> None:
        if self.scaler is None:
            return
        if self.shards is not None and self.settings.shard_count is not None:
            # Several managers: only the owner of the pool's shard has the pool's agents in
            # its registry, so only it may scale the pool's deployment (the others would see
            # none of its agents and scale it up).
            if not self.shards.holds(shard_of(cmd.deployment, self.settings.shard_count)):
                self.counters["scaling_left_to_the_owner"] += 1
                return
        try:
            if isinstance(cmd, ScaleTo):
                log.info(
                    "scaling",
                    extra={
                        "deployment": cmd.deployment,
                        "replicas": cmd.replicas,
                        "remove_first": cmd.remove_first,
                        "reason": cmd.reason,
                    },
                )
                await self.scaler.scale_to(
                    cmd.deployment, cmd.replicas, remove_first=cmd.remove_first
                )
                self.counters["scaled"] += 1
            else:
                log.info("deleting lost pod", extra={"deployment": cmd.deployment, "pod": cmd.pod})
                await self.scaler.delete_pod(cmd.deployment, cmd.pod)
                self.counters["pods_deleted"] += 1
        except ScalerError as exc:
            self.counters["scaler_errors"] += 1
            log.error("scaler failed", extra={"deployment": cmd.deployment, "error": str(exc)})
            await self._observe(cmd.deployment)  # resync the core with what really is

    async def _release_unclaimed(self, lease_id: str) -> None:
        """A lease whose grant never reached its requester would pin a slot until its TTL."""
        self.counters["leases_released_unclaimed"] += 1
        commands = self.core.release(lease_id, self.clock.now(), "requester gone")
        await self.execute([cmd for cmd in commands if not isinstance(cmd, Reply)])

    def _with_pool_epoch(self, message: Message) -> Message:
        """A registration's acceptance carries the agent's pool's active epoch, for an agent
        that lists the ``pool-epoch`` feature (an older one would refuse the field). The core
        that accepts it knows agents, not descriptors."""
        if not isinstance(message, RegistrationAccepted) or message.pool_epoch is not None:
            return message
        agent = self.core.agents.get(message.agent_id)
        if agent is None or not agent.takes_pool_epoch:
            return message
        epoch = self.admission.pool_epoch(agent.deployment)
        return message if epoch is None else message.model_copy(update={"pool_epoch": epoch})

    def _with_shard(self, message: Message) -> Message:
        """Several managers: an acceptance tells an agent with the ``shards`` feature its
        shard, the last word of its heartbeat and announce keys from then on."""
        count = self.settings.shard_count
        if count is None or not isinstance(message, RegistrationAccepted):
            return message
        agent = self.core.agents.get(message.agent_id)
        if agent is None or not agent.takes_shard:
            return message
        return message.model_copy(update={"shard": shard_of(agent.deployment, count)})

    def _outgoing(self, message: Message) -> Message:
        """A core's message to an agent as sent: an acceptance carries the pool's epoch and
        the agent's shard where the agent takes them."""
        return self._with_shard(self._with_pool_epoch(message))

    async def _send_to_agent(self, agent_id: str, message: Message) -> None:
        try:
            await self.transport.publish(self.topology.agents_exchange, agent_id, message)
        except (PublishNacked, PublishTimeout, PublishUnroutable) as exc:
            self._not_delivered(agent_id, message, exc)

    async def _send_to_agents(self, messages: Sequence[tuple[str, Message]]) -> None:
        """:meth:`_send_to_agent` for several, in one write (``publish_many``); a transport
        failure propagates once all are settled."""
        sent = [(agent_id, self._outgoing(message)) for agent_id, message in messages]
        outcomes = await self.transport.publish_many(self.topology.agents_exchange, sent)
        failed: TransportError | None = None
        for (agent_id, message), outcome in zip(sent, outcomes, strict=True):
            if isinstance(outcome, PublishNacked | PublishTimeout | PublishUnroutable):
                self._not_delivered(agent_id, message, outcome)
            elif outcome is not None:
                failed = outcome
        if failed is not None:
            raise failed

    def _not_delivered(self, agent_id: str, message: Message, error: TransportError) -> None:
        if isinstance(error, PublishUnroutable):
            self.counters["agent_unreachable"] += 1
            log.info(
                "agent has no control queue",
                extra={"agent_id": agent_id, "message_type": message.type},
            )
            if isinstance(message, RegistrationAccepted):
                # Not Ready until it heard so: take the registration back.
                undelivered = AcceptanceUndelivered(agent_id, message.incarnation)
                self._spawn(self.core.handle(undelivered, self.clock.now()))
            return
        self.counters["agent_message_failed"] += 1
        log.warning(
            "message to agent not confirmed",
            extra={"agent_id": agent_id, "message_type": message.type, "error": str(error)},
        )

    async def _reply(self, request: Delivery, message: Message) -> bool:
        """Best-effort: a reply that cannot be delivered is counted, never retried forever.
        No reply for a request whose channel is gone since it arrived: the broker has given it
        back to the queue, and whoever takes it answers (two answers could disagree)."""
        if not request.reply_to:
            return False
        if not request.held():
            self.counters["replies_withheld_channel_gone"] += 1
            return False
        try:
            await self.transport.publish(
                DEFAULT_EXCHANGE,
                request.reply_to,
                message,
                correlation_id=request.correlation_id,
            )
        except PublishUnroutable:
            self.counters["requester_gone"] += 1
            return False
        except (PublishNacked, PublishTimeout):
            self.counters["reply_failed"] += 1
            return False
        return True


def _connection_url(settings: ManagerSettings) -> str:
    """With shards, an AMQP heartbeat of half the lease unless the URL names one
    (``ManagerSettings.shard_lease_s``): a frozen owner's shard queues move with its lease."""
    if settings.shard_count is None:
        return settings.amqp_url
    return with_heartbeat(settings.amqp_url, max(1, int(settings.shard_lease_s / 2)))


def _first_rows(request: StatusRequest) -> StatusRequest:
    """What to ask each owner for a merged page: its first ``offset + limit`` rows (at most
    a page's worth: deeper pages than that over several managers are cut)."""
    if request.agents_limit is None:
        return request
    wanted = (request.agents_offset or 0) + request.agents_limit
    return StatusRequest(agents_offset=0, agents_limit=min(wanted, MAX_STATUS_AGENTS))


def _agent_key(row: AgentStatus) -> str:
    return row.agent_id


class _ShardHeartbeats:
    """A shard's heartbeats into the manager's sink — unless its leases may have run out by
    its own clock (it was paused): then they are dropped (``heartbeats_held_back``; the next
    ones count) and a step runs first, so a woken manager books nothing for shards it lost.
    Heartbeats are synchronous, so they cannot wait for that step."""

    def __init__(self, service: ManagerService) -> None:
        self._service = service

    def __call__(self, body: bytes, user_id: str | None = None) -> None:
        self.ingest_many(((body, user_id),))

    def ingest_many(self, bodies: Iterable[tuple[bytes, str | None]]) -> None:
        service = self._service
        if service.shards is not None and service.shards.lapsed():
            batch = list(bodies)
            service.counters["heartbeats_held_back"] += len(batch)
            service._step_shards_soon()
            return
        service.heartbeats.ingest_many(bodies)


_NOT_HELD_HERE = frozenset({Reason.UNKNOWN_AGENT, Reason.UNKNOWN_LEASE})
"""Refusals that mean "another manager may hold it" when asked of every owner."""


def _unanswered(
    routes: Mapping[str, list[int]], answers: Sequence[tuple[str, object]]
) -> tuple[int, int]:
    """Of the peer queues asked (``routes``: each with the shards it answers for), how many
    did not answer, and how many shards those answer for."""
    answered = {queue for queue, _ in answers}
    silent = [shards for queue, shards in routes.items() if queue not in answered]
    return len(silent), sum(len(shards) for shards in silent)


def _knows_unanswered(delivery: Delivery) -> bool:
    """The client lists ``unanswered-shards`` in its request's features
    (``x-mesh-features``)."""
    return _knows(delivery, c.FEATURE_UNANSWERED)


def _knows(delivery: Delivery, feature: str) -> bool:
    """The client lists ``feature`` in its request's features (``x-mesh-features``)."""
    features = _header(delivery, c.H_FEATURES) or ""
    return feature in (f.strip() for f in features.split(","))


def _header(delivery: Delivery, name: str) -> str | None:
    value = delivery.headers.get(name)
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _lease_id(request: Delivery) -> str:
    """Stable per request, so a redelivered acquire gets the same lease (the core is
    idempotent per lease ID); scoped by reply queue, so two clients can never collide."""
    if not request.correlation_id:
        return uuid.uuid4().hex
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{request.reply_to}|{request.correlation_id}").hex


def _wire_fields(entry: LogEntry) -> dict[str, Any]:
    return {
        "at": entry.at,
        "kind": entry.kind,
        "agent_id": entry.agent_id,
        "from_state": entry.from_state,
        "to_state": entry.to_state,
        "capability": entry.capability,
        "reason": entry.reason,
        "detail": dict(entry.detail),
    }


def _to_wire(entry: LogEntry) -> OrchestrationEvent:
    """The entry as an event, its detail checked against its kind's schema."""
    return OrchestrationEvent(
        at=entry.at,
        kind=entry.kind,
        agent_id=entry.agent_id,
        from_state=entry.from_state,
        to_state=entry.to_state,
        capability=entry.capability,
        reason=entry.reason,
        detail=dict(entry.detail),
    )
