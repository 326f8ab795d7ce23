"""The manager service: the asyncio shell around :class:`~mesh.core.PoolCore`.

Theory of operation
-------------------
Three consumers feed the core, all on one event loop, so the core never needs
a lock (its ``handle`` is synchronous and never interleaves):

* ``<ns>.manager.announce`` (quorum): registrations, deregistrations, drain
  requests from agents. Acked only after the core's commands were carried out.
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
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from mesh import constants as c
from mesh.core.capacity import LiveCapacity, live_slots_resource
from mesh.core.eligibility import MODEL_SLOTS
from mesh.core.events import (
    AcquireRequested,
    Announce,
    AppendLog,
    CapacityMissed,
    Command,
    ConnectionLost,
    ConnectionRestored,
    DeletePod,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FenceAgent,
    FindRequested,
    Instant,
    LogEntry,
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    ScaleObserved,
    ScaleTo,
    SendToAgent,
    Tick,
)
from mesh.core.lifecycle import AgentState
from mesh.core.pool import PoolCore
from mesh.core.pressure import StageChange
from mesh.errors import (
    LocalProtocolError,
    MessageRejected,
    PublishNacked,
    PublishTimeout,
    PublishUnroutable,
    TransportError,
)
from mesh.leases import LeaseSigner
from mesh.ledger.sqlite import SqliteLedger
from mesh.ledger.store import LedgerStore, Usage
from mesh.manager.admission import Admitter, DecisionRecord, Eviction, ExternalGrantor
from mesh.manager.batching import GroupCommit
from mesh.manager.clock import Clock, SystemClock
from mesh.manager.heartbeats import HeartbeatSink
from mesh.manager.journal import Journal, SqliteJournal
from mesh.manager.observe import Observer, vhost_of
from mesh.manager.settings import ManagerSettings, open_ledger
from mesh.scaler.base import Scaler, ScalerError
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.amqp import AmqpTransport
from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery
from mesh.transport.ports import ManagerTransport, Subscription
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorAccepted,
    DescriptorShadow,
    ExplainReply,
    ExplainRequest,
)
from mesh.wire.codec import decode_as, encode
from mesh.wire.models import (
    AcquireRequest,
    AgentRegistration,
    Deregistration,
    DrainRequest,
    FindRequest,
    LeaseGranted,
    Message,
    OrchestrationEvent,
    PoolCapacity,
    Refusal,
    RegistrationRefused,
    ReleaseRequest,
    StatusReply,
    StatusRequest,
)
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

MAX_DRAINING_ANNOUNCED = 4096
"""Admission IDs a ``descriptor_active`` event carries at most (~150 KB); past that, the rest
of an epoch's draining attempts are refused by their agents as of an older epoch."""
_FENCE_ATTEMPTS = 4
_FENCE_RETRY_S = 2.0  # 4 attempts over 6 s: past one statistics round of the management API
T = TypeVar("T")

_ANNOUNCE_TYPES = (AgentRegistration, Deregistration, DrainRequest)
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


_TAKING_WORK = frozenset({AgentState.READY, AgentState.BUSY})


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
        self.scaler = scaler
        self._ledger = ledger
        self._owns_ledger = ledger is None
        self._grantors = grantors
        self.admitter: Admitter | None = None
        # Admissions are decided in batches (group commit: one ledger transaction per batch),
        # serialised in arrival order: on the loop itself for SQLite (``ledger_inline``), else
        # on one worker thread. Housekeeping (open, checkpoint, close) always uses the thread.
        self._ledger_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._ledger_inline = False
        self._epochs_announced_at = float("-inf")  # monotonic; announced on the first tick
        self._pool_slots: dict[str, int] = {}  # the model slots each pool queue is bound to
        self._pool_queues_polled_at = float("-inf")  # monotonic
        self._usage: Usage | None = None  # the ledger's counters as the last tick read them
        self._admissions: GroupCommit[tuple[AdmissionRequest, str], AdmissionDecision] = (
            GroupCommit(
                self._admit_batch,
                max_batch=settings.admission_batch,
                linger_s=settings.admission_linger_s,
            )
        )
        self._consumers: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._started_at = self.clock.now().mono
        self.observer = Observer(
            manager_id=settings.manager_id,
            namespace=settings.namespace,
            vhost=vhost_of(settings.amqp_url),
            agents=lambda: self.core.status(self.clock.now()),
            offers=lambda capability: capability in self.core.index,
            ready_agents=lambda: sum(
                1 for a in self.core.agents.values() if a.state in _TAKING_WORK
            ),
            descriptors=lambda: self.admitter.descriptors if self.admitter else {},
            active_epochs=lambda: self.admitter.active_epochs if self.admitter else {},
            pressure=lambda: self.admitter.pressure.pools if self.admitter else {},
            active_generation=settings.admission.active_generation,
            counters=self.counters,
            started_at=self._started_at,
            management_url=settings.management_url,
            queue_poll_interval_s=settings.queue_poll_interval_s,
        )
        self.heartbeats = HeartbeatSink(
            self.core,
            self.clock,
            self._spawn,
            self.counters,
            on_heartbeat=lambda hb, now: self.observer.heartbeat(hb.sent_at, now),
            on_rejected=self.observer.heartbeat_rejected,
            verify_identity=settings.agent_identity,
        )

    @property
    def transport(self) -> ManagerTransport:
        if self._transport is None:
            raise LocalProtocolError("the manager is not started")
        return self._transport

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        if self._transport is None:
            self._transport = await AmqpTransport.connect(
                s.amqp_url,
                name=f"manager:{s.manager_id}",
                publish_timeout_s=s.publish_timeout_s,
                liveness_probe_s=s.liveness_probe_s,
            )
        if self._journal is None:
            self._journal = SqliteJournal(s.journal_path)
        if self._ledger is None:
            self._ledger = await self._in_ledger_thread(open_ledger, s.ledger_url)
        self._ledger_inline = (
            isinstance(self._ledger, SqliteLedger) if s.ledger_inline is None else s.ledger_inline
        )
        self.admitter = Admitter(self._ledger, s.admission, self._grantors)
        if s.lease_key_file is not None:
            self.admitter.lease_signer = LeaseSigner.load_or_create(s.lease_key_file)
            log.info(
                "signing invocation leases",
                extra={"key_id": self.admitter.lease_signer.key_id, "file": str(s.lease_key_file)},
            )
        adopted = await self._on_ledger(self.admitter.load_descriptors)
        held = await self._on_ledger(self.admitter.recover_pressure, self.clock.now().wall)
        log.info("descriptors loaded from the ledger", extra={"pools": adopted, "grants": held})
        await self.transport.declare(self.topology.manager())
        await self._ensure_pool_queues(list(self.admitter.descriptors.values()))
        await self._execute(
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
            await self.transport.consume(t.announce_queue, self._on_announce, prefetch=s.prefetch),
            await self.transport.consume(t.rpc_queue, self._on_rpc, prefetch=s.prefetch),
            await self.transport.consume_raw(t.heartbeat_queue, self.heartbeats),
        ]
        self.transport.on_disconnect(self._lost_broker)
        self.transport.on_reconnect(self._after_reconnect)
        self._ticker = asyncio.create_task(self._tick_forever(), name="manager-ticker")
        if s.http_port is not None:
            url = await self.observer.serve(s.http_host, s.http_port)
            log.info("status page", extra={"url": url, "metrics": f"{url}metrics"})
        log.info("manager started", extra={"namespace": s.namespace, "manager_id": s.manager_id})

    async def stop(self) -> None:
        if self.scaler is not None:
            # First: agents the scaler runs drain through this manager while it still listens.
            await self.scaler.close()
        for consumer in self._consumers:
            await consumer.cancel()
        self._consumers = []
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._admissions.close()
        await self.observer.close()
        if self._owns_transport and self._transport is not None:
            await self._transport.close()
        # A tick cancelled above may have left a checkpoint running on the ledger thread (a
        # cancelled await does not stop the thread), on connections closed next: closing one
        # under it crashed the process (SIGSEGV in sqlite3). The thread runs one call at a
        # time, in order, so a call of nothing returns once whatever ran before it is done.
        await self._in_ledger_thread(_nothing)
        if self._journal is not None:
            self._journal.close()
        if self._owns_ledger and self._ledger is not None:
            await self._in_ledger_thread(self._ledger.close)
        self._ledger_thread.shutdown(wait=False)
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
        log.warning("lost the broker; no agent is evicted for silence until it is back")
        self.core.handle(ConnectionLost(), self.clock.now())

    async def _after_reconnect(self) -> None:
        self.counters["reconnects"] += 1
        try:
            await self._feed(ConnectionRestored())
        finally:
            await self.transport.declare(self.topology.manager())

    async def _tick_forever(self) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(self.settings.tick_interval_s)
            try:
                await self._feed(Tick())
                await self._expire_admissions()
                await self._observe_tick()
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
    async def _on_announce(self, delivery: Delivery) -> None:
        await self._guarded(delivery, self.topology.announce_queue, self._handle_announce)

    async def _on_rpc(self, delivery: Delivery) -> None:
        await self._guarded(delivery, self.topology.rpc_queue, self._handle_rpc)

    async def _handle_announce(self, delivery: Delivery) -> None:
        message = decode_as(delivery.body, *_ANNOUNCE_TYPES)
        event: Event
        if isinstance(message, AgentRegistration):
            event, claimed = RegistrationReceived(message), message.agent_id
        elif isinstance(message, Deregistration):
            event, claimed = DeregistrationReceived(message), message.agent_id
        elif isinstance(message, DrainRequest):
            event, claimed = DrainRequested(message.agent_id, message.reason), message.agent_id
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        if self.settings.agent_identity and claimed != delivery.user_id:
            # Someone speaking for another agent: dead-lettered (and refused if it asked),
            # never answered on the named agent's control queue — that agent did not ask.
            raise MessageRejected(
                Reason.NOT_AUTHORIZED,
                f"{message.type} for agent {claimed!r} published by broker user "
                f"{delivery.user_id!r}: agents speak only for themselves",
            )
        self.counters[f"received.{message.type}"] += 1
        if isinstance(message, AgentRegistration) and not self._understands_epochs(message):
            await self._refuse_registration(message, delivery)
            return
        await self._feed(event, delivery)  # a drain request may carry reply_to

    def _understands_epochs(self, registration: AgentRegistration) -> bool:
        """A pool with a descriptor hands out grants bound to its active epoch: its agents
        must refuse older ones, and say so (``features``)."""
        descriptors = self.admitter.descriptors if self.admitter is not None else {}
        described = registration.deployment in descriptors
        return not described or c.FEATURE_DESCRIPTOR_EPOCHS in registration.features

    async def _refuse_registration(
        self, registration: AgentRegistration, delivery: Delivery
    ) -> None:
        detail = (
            f"pool {registration.deployment!r} has a capability descriptor, so its tasks carry "
            f"grants bound to a descriptor epoch; this agent does not list the "
            f"{c.FEATURE_DESCRIPTOR_EPOCHS!r} feature (an SDK older than epochs?) and would run "
            "tasks of a retired epoch"
        )
        self.counters[f"registration_refused.{Reason.EPOCHS_UNSUPPORTED}"] += 1
        log.warning(
            "registration refused",
            extra={"agent_id": registration.agent_id, "reason": Reason.EPOCHS_UNSUPPORTED.value},
        )
        refusal = RegistrationRefused(
            agent_id=registration.agent_id,
            incarnation=registration.incarnation,
            reason=Reason.EPOCHS_UNSUPPORTED,
            detail=detail,
        )
        await self._send_to_agent(registration.agent_id, refusal)

    async def _handle_rpc(self, delivery: Delivery) -> None:
        message = decode_as(delivery.body, *_RPC_TYPES)
        self.counters[f"received.{message.type}"] += 1
        if isinstance(message, StatusRequest):
            await self._reply(delivery, self.status())
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
            await self._reply(delivery, await self._admission(message, delivery))
            return
        event: Event
        if isinstance(message, FindRequest):
            event = FindRequested(message)
        elif isinstance(message, AcquireRequest):
            lease_id = _lease_id(delivery)
            event = AcquireRequested(message, lease_id, holder=delivery.user_id)
        elif isinstance(message, ReleaseRequest):
            event = ReleaseRequested(message.lease_id, by=delivery.user_id or "")
        elif isinstance(message, DrainRequest):
            if delivery.user_id != self.settings.operator_user:
                # Draining stops an agent: an operator's act (or the agent's own, on the
                # announce exchange), never a producer's.
                await self._refuse_not_operator(delivery, message.type, message.agent_id)
                return
            event = DrainRequested(message.agent_id, message.reason)
        else:  # pragma: no cover - decode_as admits only the types above
            raise AssertionError(message.type)
        await self._feed(event, delivery)

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
        not even a failure to dead-letter it (the message then goes back to the queue)."""
        try:
            try:
                await handle(delivery)
            except MessageRejected as exc:
                await self._dead_letter(delivery, queue, exc)
        except TransportError as exc:
            # Replies and agent messages are best-effort (counted where they fail), so this is
            # the channel or broker going away: hand the message back to be redelivered (the
            # core's handling is idempotent); if even that fails the broker requeues it anyway.
            log.warning("could not finish a delivery", extra={"queue": queue, "error": str(exc)})
            with contextlib.suppress(Exception):
                await delivery.reject(requeue=True)
            return
        except Exception:
            self.counters["handler_errors"] += 1
            log.exception("bug while handling a delivery", extra={"queue": queue})
            await delivery.reject(requeue=False)
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
    def status(self) -> StatusReply:
        now = self.clock.now()
        counters = Counter(self.core.counters)
        counters.update(self.counters)
        return StatusReply(
            manager_id=self.settings.manager_id,
            uptime_s=now.mono - self._started_at,
            agents=self.core.status(now),
            counters=dict(sorted(counters.items())),
            pools=self._pool_capacities(now),
        )

    def _pool_capacities(self, now: Instant) -> list[PoolCapacity]:
        """Per described pool and capability: the registry's live figure and the ledger's
        counts as the last tick read them (how capacity is counted, docs/admission.md)."""
        if self.admitter is None:
            return []
        live = self.core.live_capacity(now)
        usage = self._usage or {}
        out = []
        for pool_id, descriptor in sorted(self.admitter.descriptors.items()):
            model = usage.get((pool_id, MODEL_SLOTS))
            for offered in descriptor.capabilities:
                held = usage.get((pool_id, live_slots_resource(offered.name)))
                out.append(
                    PoolCapacity(
                        pool_id=pool_id,
                        capability=offered.name,
                        live_agents=live.agents(pool_id, offered.name, offered.version_spec),
                        live_slots=live.free(pool_id, offered.name, offered.version_spec),
                        granted=None if held is None else held[0],
                        model_slots=None if model is None else model[1],
                        model_slots_granted=None if model is None else model[0],
                    )
                )
        return out

    async def _feed(self, event: Event, request: Delivery | None = None) -> None:
        commands = self.core.handle(event, self.clock.now())
        await self._execute(commands, request)

    def _spawn(self, commands: list[Command]) -> None:
        """Carry out commands from a synchronous path (the heartbeat sink) in the background."""
        task = asyncio.create_task(self._execute(commands))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _execute(self, commands: Sequence[Command], request: Delivery | None = None) -> None:
        """Carry the commands out in order. A bug in one is logged and counted
        (``command_errors``) and the rest still run — above all the reply its requester
        waits for; a transport failure propagates (the delivery is redelivered, and the
        core's handling is idempotent)."""
        logs = [cmd.entry for cmd in commands if isinstance(cmd, AppendLog)]
        stored = self._append(logs) if logs else []
        for event in stored:
            await self._publish_event(names.log_key(event.agent_id, event.kind), event)
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
            await self._send_to_agent(cmd.agent_id, cmd.message)
        elif isinstance(cmd, Reply):
            if request is not None:
                delivered = await self._reply(request, cmd.message)
                if not delivered and isinstance(cmd.message, LeaseGranted):
                    await self._release_unclaimed(cmd.message.lease.lease_id)
        elif isinstance(cmd, Announce):
            key = names.capability_key(cmd.capability, cmd.agent_id)
            await self._publish_event(key, _to_wire(cmd.entry))
        elif isinstance(cmd, ScaleTo | DeletePod):
            await self._scale(cmd)
        elif isinstance(cmd, FenceAgent):
            task = asyncio.create_task(self._fence(cmd))  # it may retry: not inline
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _append(self, entries: list[LogEntry]) -> list[OrchestrationEvent]:
        if self._journal is None:
            raise LocalProtocolError("the manager is not started")
        stored = self._journal.append_many(_to_wire(e) for e in entries)
        for event in stored:
            log.info(
                "orchestration event",
                extra={"kind": event.kind, "agent_id": event.agent_id, "seq": event.seq},
            )
            if self._on_log is not None:
                self._on_log(event)
        return stored

    async def _publish_event(self, routing_key: str, event: OrchestrationEvent) -> None:
        # The journal holds the durable copy; the events exchange is a live feed, and a feed
        # entry lost while the broker is away must not stop the commands after it.
        try:
            await self.transport.publish_fast(
                self.topology.events_exchange, routing_key, encode(event)
            )
        except TransportError:
            self.counters["events_unpublished"] += 1

    # ---- admission --------------------------------------------------------------------------
    async def _in_ledger_thread(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._ledger_thread, partial(fn, *args))

    async def _on_ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an admission-path call where the ledger's calls run (see ``ledger_inline``)."""
        if self._ledger_inline:
            return fn(*args)
        return await self._in_ledger_thread(fn, *args)

    async def _admission(
        self,
        message: AdmissionRequest
        | AdmissionRelease
        | AdmissionRevoke
        | CapabilityDescriptor
        | DescriptorShadow
        | ExplainRequest,
        request: Delivery,
    ) -> Message:
        admitter = self.admitter
        if admitter is None:
            raise LocalProtocolError("the manager is not started")
        now = self.clock.now().wall
        if isinstance(message, ExplainRequest):
            return await self._on_ledger(_explain, admitter, message.admission_id)
        if isinstance(message, CapabilityDescriptor):
            return await self._publish_descriptor(admitter, message, request, now)
        if isinstance(message, AdmissionRevoke):
            return await self._revoke_admission(admitter, message, request, now)
        if isinstance(message, DescriptorShadow):
            return await self._shadow_descriptor(admitter, message, request, now)
        if isinstance(message, AdmissionRelease):
            started = self.clock.now().mono
            record = await self._on_ledger(admitter.recorded, message.admission_id)
            if not self._may_release(record, request.user_id):
                self.counters["not_authorized.admission_release"] += 1
                return AdmissionReleaseReply(
                    admission_id=message.admission_id,
                    released=False,
                    reason=AdmissionReason.NOT_AUTHORIZED,
                    detail="an admission is released by the tenant it was granted to (or the "
                    f"operator); this came from {request.user_id!r}",
                )
            reply, released_now = await self._on_ledger(
                admitter.settle, message.admission_id, message.fence, now
            )
            if released_now:  # a retried release is answered the same, and counted once
                self.observer.metrics.release_latency.observe(self.clock.now().mono - started)
                self.observer.metrics.settled(
                    record.estimate if record else None,
                    message.actual_tokens,
                    message.actual_duration_s,
                    message.finished_at,
                )
                held = await self._on_ledger(admitter.ledger.get, message.admission_id)
                if held is not None:
                    await self._publish_revocation(
                        held.pool_id, message.admission_id, message.fence, "RELEASED", now
                    )
            return reply
        tenant = request.user_id  # validated by RabbitMQ against the connection's user
        if not tenant:
            self.counters["admission_unauthenticated"] += 1
            return AdmissionDecision(
                admission_id=message.admission_id,
                outcome="rejected",
                reason=AdmissionReason.INVALID_REQUEST,
                detail="no authenticated producer: publish with user_id set to your broker user",
            )
        return await self._admissions.submit((message, tenant))

    def _may_release(self, record: DecisionRecord | None, user_id: str | None) -> bool:
        """The tenant an admission was decided for, or the operator, may release it (a
        record the ledger no longer has, or one without a tenant, is left to the fence)."""
        tenant = None if record is None else record.tenant
        return tenant is None or user_id in (tenant, self.settings.operator_user)

    async def _admit_batch(
        self, requests: list[tuple[AdmissionRequest, str]]
    ) -> list[AdmissionDecision]:
        """Decide every admission that queued up meanwhile: one ledger transaction, one
        thread hand-off and one journal commit for the lot."""
        admitter = self.admitter
        if admitter is None:
            raise LocalProtocolError("the manager is not started")
        at = self.clock.now()
        now = at.wall
        batch = await self._on_ledger(admitter.admit_batch, requests, now, self._live(at))
        decisions = batch.decisions
        self.counters["admission_batches"] += 1
        for pool_id, reason in batch.misses:  # capacity misses for the scaler
            self.core.handle(CapacityMissed(pool_id, reason), at)
        entries = []
        for (request, tenant), decision, record in zip(
            requests, decisions, batch.records, strict=True
        ):
            self.counters[f"admission.{decision.outcome}"] += 1
            self.observer.admitted(
                now, request.requirements, decision, record.eligibility if record else None
            )
            grant = decision.grant
            entries.append(
                LogEntry(
                    at=now,
                    kind="admission",
                    reason=decision.reason.value if decision.reason else decision.outcome,
                    detail={
                        "admission_id": decision.admission_id,
                        "outcome": decision.outcome,
                        "tenant": tenant,
                        "pool_id": grant.pool_id if grant else None,
                        "fence": grant.fence if grant else None,
                    },
                )
            )
        evictions = batch.evictions
        entries += [_eviction_entry(e) for e in evictions]
        # Every decision is journaled (``mesh log``) and recorded in the ledger (``mesh
        # explain``); the live feed carries only the refusals — what someone following it can
        # act on — so a busy mesh does not pay one more broker message per grant.
        for event in self._append(entries):
            if event.detail.get("outcome") != "admitted":
                await self._publish_event(names.log_key(event.agent_id, event.kind), event)
        for eviction in evictions:  # after the journal: the producer learns of it from here on
            victim = eviction.victim
            self.counters["admissions_evicted"] += 1
            self.observer.metrics.evictions.labels(victim.pool_id, eviction.recoverability).inc()
            await self._publish_revocation(
                victim.pool_id, victim.admission_id, victim.fence, "RELEASED", now, evicted=True
            )
        return decisions

    def _live(self, now: Instant) -> LiveCapacity | None:
        """The registry's live capacity for admission (``None``: the descriptors alone bound
        it, ``admission_capacity="descriptor"``)."""
        if self.settings.admission_capacity != "live":
            return None
        return self.core.live_capacity(now)

    async def _revoke_admission(
        self, admitter: Admitter, message: AdmissionRevoke, request: Delivery, now: float
    ) -> AdmissionReleaseReply:
        """A security revocation: release whatever holds the admission, at its current fence,
        and tell its pool — the attempt is cancelled where it runs and its result refused."""
        if request.user_id != self.settings.operator_user:
            self.counters["revoke_not_authorized"] += 1
            return AdmissionReleaseReply(
                admission_id=message.admission_id,
                released=False,
                reason=AdmissionReason.NOT_AUTHORIZED,
                detail=f"only the operator user may revoke; this came from {request.user_id!r}",
            )
        held = await self._on_ledger(admitter.ledger.get, message.admission_id)
        if held is None or held.state not in ("PREPARING", "ACTIVE"):
            state = "unknown" if held is None else held.state
            return AdmissionReleaseReply(
                admission_id=message.admission_id,
                released=False,
                reason=AdmissionReason.NOT_FOUND,
                detail=f"nothing to revoke: the admission is {state}",
            )
        reply, released_now = await self._on_ledger(
            admitter.settle, held.admission_id, held.fence, now
        )
        if released_now:
            self.counters["admissions_revoked"] += 1
            self._append(
                [
                    LogEntry(
                        at=now,
                        kind="admission_revoked",
                        reason=message.reason,
                        detail={
                            "admission_id": held.admission_id,
                            "pool_id": held.pool_id,
                            "fence": held.fence,
                            "by": request.user_id,
                        },
                    )
                ]
            )
            log.warning(
                "admission revoked",
                extra={"admission_id": held.admission_id, "reason": message.reason},
            )
            await self._publish_revocation(
                held.pool_id, held.admission_id, held.fence, "RELEASED", now,
                security=message.reason,
            )  # fmt: skip
        return reply

    async def _shadow_descriptor(
        self, admitter: Admitter, message: DescriptorShadow, request: Delivery, now: float
    ) -> Message:
        if request.user_id != self.settings.operator_user:
            self.counters["descriptor_not_authorized"] += 1
            return Refusal(
                reason=Reason.NOT_AUTHORIZED,
                detail=f"shadows are accepted only from {self.settings.operator_user!r}",
            )
        descriptor, pool_id = message.descriptor, message.pool_id
        if descriptor is None:
            await self._on_ledger(admitter.drop_shadow, pool_id)
            log.info("shadow removed", extra={"pool_id": pool_id})
            active = admitter.active_epochs.get(pool_id, 1)
            return DescriptorAccepted(pool_id=pool_id, descriptor_epoch=active)
        problem = await self._on_ledger(admitter.set_shadow, descriptor, now)
        if problem is not None:
            return Refusal(reason=Reason.SCHEMA_VIOLATION, detail=problem)
        self.counters["shadows_set"] += 1
        self._append(
            [
                LogEntry(
                    at=now,
                    kind="descriptor_shadow",
                    reason=f"{pool_id} epoch {descriptor.descriptor_epoch} in shadow",
                    detail={"pool_id": pool_id, "epoch": descriptor.descriptor_epoch},
                )
            ]
        )
        return DescriptorAccepted(pool_id=pool_id, descriptor_epoch=descriptor.descriptor_epoch)

    async def _publish_descriptor(
        self, admitter: Admitter, descriptor: CapabilityDescriptor, request: Delivery, now: float
    ) -> Message:
        if request.user_id != self.settings.operator_user:
            self.counters["descriptor_not_authorized"] += 1
            log.warning(
                "descriptor from a non-operator refused",
                extra={"pool_id": descriptor.pool_id, "user_id": request.user_id},
            )
            return Refusal(
                reason=Reason.NOT_AUTHORIZED,
                detail=f"descriptors are accepted only from {self.settings.operator_user!r}",
            )
        problem = await self._on_ledger(admitter.publish_descriptor, descriptor, now)
        if problem is not None:
            return Refusal(reason=Reason.SCHEMA_VIOLATION, detail=problem)
        self.counters["descriptors_published"] += 1
        announced = await self._announce_epochs([descriptor])
        detail: dict[str, Any] = {
            "pool_id": descriptor.pool_id,
            "epoch": descriptor.descriptor_epoch,
        }
        if descriptor.pool_id in announced:  # the epoch advanced: what may finish under the old
            detail["draining"] = announced[descriptor.pool_id]
        entry = LogEntry(
            at=now,
            kind="descriptor",
            reason=f"{descriptor.pool_id} epoch {descriptor.descriptor_epoch}",
            detail=detail,
        )
        await self._execute([AppendLog(entry)])
        return DescriptorAccepted(
            pool_id=descriptor.pool_id, descriptor_epoch=descriptor.descriptor_epoch
        )

    async def _observe_tick(self) -> None:
        usage = None
        if self.admitter is not None:
            usage = self._usage = await self._on_ledger(self.admitter.ledger.usage)
        await self.observer.tick(usage)
        if self.admitter is not None and usage is not None:
            await self._observe_pressure(self.admitter, usage)

    async def _observe_pressure(self, admitter: Admitter, usage: Usage) -> None:
        """Feed the pressure board what the tick saw — the ledger's counters (other managers'
        grants too), the broker's alarm, and every ``queue_poll_interval_s`` each pool queue's
        depth (passive declare: ready tasks) and head age (the management API, when
        configured) — and journal every stage change with the time it happened. The board is
        the admitter's: fed where the admitter runs."""
        now = self.clock.now()
        queues = None
        if now.mono - self._pool_queues_polled_at >= self.settings.queue_poll_interval_s:
            self._pool_queues_polled_at = now.mono
            queues = await self._pool_queue_depths(admitter)
        changes = await self._on_ledger(
            partial(
                admitter.observe, now.wall, usage,
                queues=queues, broker_blocked=self.transport.blocked,
            )
        )  # fmt: skip
        await self._journal_stage_changes(changes)

    async def _pool_queue_depths(self, admitter: Admitter) -> dict[str, tuple[int, float | None]]:
        """``pool -> (ready tasks, head age)`` of every described pool's queue that answers."""
        ages = {q.name: q.oldest_age_s for q in self.observer.view.queues}
        found = {}
        for pool_id in list(admitter.descriptors):
            queue = self.topology.pool_task_queue(pool_id)
            try:
                depth = await self.transport.queue_depth(queue)
            except Exception as exc:  # not declared yet, or the broker is away: next poll
                log.debug("pool queue depth unavailable", extra={"queue": queue, "error": str(exc)})
                continue
            found[pool_id] = (depth, ages.get(queue))
        return found

    async def _journal_stage_changes(self, changes: list[StageChange]) -> None:
        entries = []
        for change in changes:
            self.observer.metrics.stage_changed(change)
            log.info(
                "pressure stage",
                extra={"pool_id": change.pool_id, "stage": change.new.name, "cause": change.cause},
            )
            entries.append(
                LogEntry(
                    at=change.at,
                    kind="pressure_stage",
                    reason=f"{change.pool_id}: {change.old.name} -> {change.new.name} "
                    f"({change.cause})",
                    detail={
                        "pool_id": change.pool_id,
                        "from": change.old.name,
                        "to": change.new.name,
                        "cause": change.cause,
                    },
                )
            )
        if entries:
            await self._execute([AppendLog(e) for e in entries])

    async def _ensure_pool_queues(self, descriptors: Sequence[CapabilityDescriptor]) -> None:
        """Each pool's bounded task queue, bound to its model slots. A queue bound to other
        slots (the descriptor changed) is replaced once it is empty; until then it keeps its
        old bound (the ledger enforces the new capacity regardless)."""
        for descriptor in descriptors:
            pool_id, slots = descriptor.pool_id, descriptor.model_limits.slots
            if self._pool_slots.get(pool_id) == slots:
                continue
            declarations = self.topology.pool(pool_id, slots)
            try:
                done = await self.transport.try_declare(declarations)
                if not done:
                    queue = self.topology.pool_task_queue(pool_id)
                    if await self.transport.queue_depth(queue) == 0:
                        await self.transport.delete_queue(queue, if_empty=True)
                        done = await self.transport.try_declare(declarations)
            except Exception as exc:
                self.counters["pool_queue_declare_failed"] += 1
                log.warning(
                    "pool queue not declared", extra={"pool_id": pool_id, "error": str(exc)}
                )
                continue
            if done:
                self._pool_slots[pool_id] = slots
            else:
                self.counters["pool_queue_rebound_pending"] += 1
                log.warning(
                    "pool queue holds tasks under its old bound; rebinding once it is empty",
                    extra={"pool_id": pool_id, "model_slots": slots},
                )

    async def _announce_epochs(
        self, descriptors: Sequence[CapabilityDescriptor]
    ) -> dict[str, list[str]]:
        """Tell each pool's agents its active descriptor epoch (``grant.<pool>``), so they
        refuse grants issued under an older one (:mod:`mesh.agent.grants`). Returns the
        draining allowlists announced, by pool (pools this manager did not advance: none)."""
        await self._ensure_pool_queues(descriptors)
        now = self.clock.now()
        self._epochs_announced_at = now.mono
        announced: dict[str, list[str]] = {}
        for descriptor in descriptors:
            detail: dict[str, Any] = {
                "pool_id": descriptor.pool_id,
                "descriptor_epoch": descriptor.descriptor_epoch,
                "policy_generation": self.settings.admission.active_generation,
            }
            draining = (  # the admitter's state lives on the ledger thread
                await self._on_ledger(
                    self.admitter.draining_allowlist, descriptor.pool_id, now.wall
                )
                if self.admitter is not None
                else None
            )
            if draining is not None:  # only the manager that advanced the epoch knows it
                detail["draining"] = announced[descriptor.pool_id] = draining[
                    :MAX_DRAINING_ANNOUNCED
                ]
            event = OrchestrationEvent(
                at=now.wall,
                kind=c.EVENT_DESCRIPTOR_ACTIVE,
                reason=f"epoch {descriptor.descriptor_epoch}",
                detail=detail,
            )
            await self._publish_event(names.pool_grant_key(descriptor.pool_id), event)
        return announced

    async def _expire_admissions(self) -> None:
        if self.admitter is None:
            return
        adopted = await self._on_ledger(self.admitter.load_descriptors)
        due = self.clock.now().mono - self._epochs_announced_at
        if adopted or due >= self.settings.epoch_announce_interval_s:
            await self._announce_epochs(list(self.admitter.descriptors.values()))
        live = self._live(self.clock.now())
        if live is not None:
            await self._on_ledger(self.admitter.sync_live, live, self.clock.now().wall)
        expired = await self._on_ledger(self.admitter.expire, self.clock.now().wall)
        # WAL checkpoints off the commit path, on the worker thread (own connections).
        await self._in_ledger_thread(self.admitter.ledger.maintain)
        if self._journal is not None:
            await self._in_ledger_thread(self._journal.maintain)
        if expired:
            self.counters["admissions_expired"] += len(expired)
            await self._execute(
                [
                    AppendLog(
                        LogEntry(
                            at=self.clock.now().wall,
                            kind="admission_expired",
                            reason=f"fence {r.fence}",
                            detail={"admission_id": r.admission_id, "pool_id": r.pool_id},
                        )
                    )
                    for r in expired
                ]
            )
            for r in expired:  # the new, higher fence: it covers the one the holder has
                await self._publish_revocation(
                    r.pool_id, r.admission_id, r.fence, "EXPIRED", self.clock.now().wall
                )

    async def _publish_revocation(
        self,
        pool_id: str,
        admission_id: str,
        fence: int,
        state: str,
        now: float,
        *,
        evicted: bool = False,
        security: str | None = None,
    ) -> None:
        """Tell the pool's agents that grants of ``admission_id`` up to ``fence`` are void
        (``evicted``: taken back for more urgent work, so its agent stops it if running).

        Fire-and-forget on the events exchange (``grant.<pool>.<admission>``): the ledger is the
        truth, and an agent that misses it still refuses the grant once it expires.
        """
        detail: dict[str, Any] = {"admission_id": admission_id, "pool_id": pool_id, "fence": fence}
        if evicted:
            detail["evicted"] = True
        if security is not None:
            detail["security"] = security  # the operator's reason
        event = OrchestrationEvent(
            at=now,
            kind=c.EVENT_GRANT_REVOKED,
            to_state=state,
            reason=f"fence {fence}" + (" (evicted)" if evicted else ""),
            detail=detail,
        )
        self.counters["grants_revoked"] += 1
        await self._publish_event(names.grant_key(pool_id, admission_id), event)

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
                if cmd.agent_id in self.core.agents:  # back meanwhile: its new connection stays
                    self.counters["fence_skipped_back"] += 1
                    return
            closed = await self.observer.close_agent_connections(cmd.agent_id, cmd.reason)
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
        await self._execute([cmd for cmd in commands if not isinstance(cmd, Reply)])

    async def _send_to_agent(self, agent_id: str, message: Message) -> None:
        try:
            await self.transport.publish(self.topology.agents_exchange, agent_id, message)
        except (PublishNacked, PublishTimeout) as exc:
            self.counters["agent_message_failed"] += 1
            log.warning(
                "message to agent not confirmed",
                extra={"agent_id": agent_id, "message_type": message.type, "error": str(exc)},
            )
        except PublishUnroutable:
            self.counters["agent_unreachable"] += 1
            log.info(
                "agent has no control queue",
                extra={"agent_id": agent_id, "message_type": message.type},
            )

    async def _reply(self, request: Delivery, message: Message) -> bool:
        """Best-effort: a reply that cannot be delivered is counted, never retried forever."""
        if not request.reply_to:
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


def _nothing() -> None:
    """A call that waits its turn on the ledger thread (a barrier)."""


def _lease_id(request: Delivery) -> str:
    """Stable per request, so a redelivered acquire gets the same lease (the core is
    idempotent per lease ID); scoped by reply queue, so two clients can never collide."""
    if not request.correlation_id:
        return uuid.uuid4().hex
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{request.reply_to}|{request.correlation_id}").hex


def _to_wire(entry: LogEntry) -> OrchestrationEvent:
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


def _explain(admitter: Admitter, admission_id: str) -> ExplainReply:
    record = admitter.recorded(admission_id)
    if record is not None:
        record = admitter.with_eligibility(record)
    reservation = admitter.ledger.get(admission_id)
    held = (
        None
        if reservation is None
        else {
            "state": reservation.state,
            "fence": reservation.fence,
            "pool_id": reservation.pool_id,
            "expires_at": reservation.expires_at,
            "created_at": reservation.created_at,
            "updated_at": reservation.updated_at,
            # When it stopped holding: released by its holder, or expired by the sweep.
            "released_at": None if reservation.holding else reservation.updated_at,
            "items": [list(item) for item in reservation.items],
        }
    )
    if record is None:
        return ExplainReply(admission_id=admission_id, found=held is not None, reservation=held)
    return ExplainReply(
        admission_id=admission_id,
        found=True,
        decision=record.decision,
        eligibility=record.eligibility,
        reservation=held,
        tenant=record.tenant,
    )


def _eviction_entry(eviction: Eviction) -> LogEntry:
    victim = eviction.victim
    return LogEntry(
        at=eviction.at,
        kind="admission_evicted",
        reason=f"{victim.pool_id}: fence {victim.fence} released for {eviction.for_admission}",
        detail={
            "admission_id": victim.admission_id,
            "pool_id": victim.pool_id,
            "fence": victim.fence,
            "tenant": eviction.holding.tenant,
            "for_admission": eviction.for_admission,
        },
    )
