"""The asyncio shell around an :class:`~mesh.agent.Agent`: register, heartbeat, work, drain.

What it decides — the phase, the next heartbeat, the self-fence, the grant checks — is
:class:`~mesh.agent.core.AgentCore` (sans I/O); this module does the I/O around it.

Theory of operation
-------------------
``start()`` connects (unless given a transport), declares the agent's queues
(``<ns>.agent.<id>.control``, auto-deleted, and ``<ns>.agent.<id>.tasks``,
bounded at twice the total ``max_concurrency`` as slack: the manager's leases
are the exact capacity), consumes the control queue and publishes an
``AgentRegistration`` (persistent, confirmed) on ``agent.<id>.register``. It
then waits for a ``RegistrationAccepted`` carrying this process's incarnation,
re-publishing with jittered exponential backoff (capped) while nobody answers.
A ``RegistrationRefused`` raises :class:`RegistrationRefusedError`, unless it carries
``retry_after_ms`` (``AGENT_ID_IN_USE``: a live incarnation holds the ID), which is waited
out before registering again. Only after
acceptance do heartbeats and the task consumer start and ``ready`` get set.

Heartbeats go out every ``heartbeat_interval_s`` without confirms (each one is
superseded by the next); a failed heartbeat is logged and the next one tried.
They also report the work the manager cannot see for itself: ``pool_in_flight``,
the pool tasks (admission path) that have started, per capability. When that
count changes a heartbeat goes out early (coalesced over ``work_report_delay_s``),
so the manager's one count of work — free slots, Busy, drain completion,
idleness — follows within milliseconds; each report is a full count, so one that
is lost is corrected by the next.

Tasks are consumed with ``prefetch = sum(max_concurrency)``; the transport runs
one handler per delivery, so tasks run concurrently and each capability's
semaphore bounds its own share. Each delivery is decoded (garbage is
dead-lettered with its reason, then acked), handed to
:func:`~mesh.agent.processing.process_task`, and its ``TaskResult`` published
to the producer's ``reply_to`` queue with ``correlation_id = task_id``. The task
is acked only after that publish is confirmed, or failed for good (the producer
is gone); if the broker's answer stays unknown the task is requeued, so a result
may arrive twice but is never silently lost. A cancelled handler (the channel
closed) acks nothing, and the broker redelivers the task.

No credentials, no work. A task runs only if it carries an admission ``grant`` (checked
below) or, on the agent's own queue, a ``lease_id`` the manager told this agent of
(``LeaseNotice``, sent before the producer gets the lease; a task that races ahead of its
notice waits up to ``lease_notice_wait_s`` for it, asking the manager — ``LeaseStateRequest``
— when it is late: a notice published while the control queue was being declared again after
a broker restart is lost). Anything else — no credentials, a lease
issued to another agent or already ended, a task on the pool queue without a grant — is
answered ``NOT_AUTHORIZED`` (so its producer does not wait), dead-lettered with that reason,
counted (``tasks_without_credentials``) and never run. ``open_tasks`` lifts this for a mesh
that runs without admission and leases (development only).

Tasks carrying an admission ``grant`` are revalidated at claim (before the handler runs)
and at the consumption point (before the result is published): a foreign, expired, revoked or
stale-epoch grant answers ``GRANT_INVALID``, is logged, counted (``grants_refused``) and the
task acked. The control queue is also bound to ``grant.<deployment>.#`` on the events exchange,
where the manager announces revoked grants (``grant_revoked``) and the pool's active descriptor
epoch (``descriptor_active``); see
:mod:`mesh.agent.grants` for the rules. A task without a grant: "No credentials, no work".

Self-fencing. The manager declares an agent lost once it has heard nothing for
``missed_heartbeats_before_lost`` heartbeat intervals, and the broker gives the agent's unacked
tasks to others once its connection is gone. An agent that was frozen (``SIGSTOP``, a paused
VM, an event loop blocked) for that long must not deliver the work it held when it wakes: that
work has moved on. So the runtime times the gaps between its own heartbeats (monotonic clock);
a gap longer than ``self_fence_after_s`` (default: the manager's default rule,
``MISSED_HEARTBEATS_BEFORE_LOST`` intervals, less half an interval of margin) makes every task
claimed before it ended suspect. Before delivering such a result the runtime asks the manager
(``StandingRequest`` on ``agent.<id>.standing``, one question per silence): if this incarnation
is still registered and the manager has not asked it to register again since the task was
claimed, the silence was one the manager sat out too (a broker outage) and the result goes
out; otherwise — declared lost, forgotten, or no answer within a few seconds — the result is
withheld (counted ``results_fenced``, logged) and the task requeued: a no-op if the broker
already took it back, else the way it reaches an agent the manager still counts. Fencing too
eagerly costs a rerun, never a loss; effects a rerun must not repeat go through
:func:`mesh.agent.effects.once`. A task this agent already answered (its ack lost, the broker
brought it back) is answered again from the result it published, not run again
(``ANSWERS_KEPT`` most recent, by task ID and idempotency key).

Control messages (each acked; garbage dead-lettered):

* ``RegistrationAccepted`` / ``RegistrationRefused`` answer the pending registration;
* ``ReRegisterRequest`` (the manager restarted or forgot us): register again
  with the same incarnation in the background; ignored while one is running;
* ``DrainNotice``: draining - ``ready`` cleared; the pool consumer is cancelled
  at once, pool tasks prefetched but not started go back to the pool queue
  (requeued) for the other agents, started ones finish; then a heartbeat says
  ``draining`` with what still runs, which is the manager's cue that no pool task
  will start here any more. Tasks on the agent's own queue are still worked
  (they were leased before the drain);
* ``DrainComplete``: the manager released every lease - finish shutting down;
* ``LeaseNotice``: a lease on one of our slots was issued (remembered until its expiry) or
  ended (forgotten).

With ``http_port`` set, :class:`~mesh.agent.http.AgentHttpServer` serves ``/ready``,
``/healthz`` and ``/drain`` (the preStop hook) from the beginning of ``start()`` to the very
end of the shutdown, just before ``stopped`` is set.

``drain()`` (and SIGTERM in the CLI) publishes a ``DrainRequest`` on
``agent.<id>.drain`` and then behaves as on a ``DrainNotice``. Shutdown, after
``DrainComplete`` or ``drain_timeout_s``: let the task queue empty, cancel the
task consumer, wait for in-flight tasks (at most ``shutdown_grace_s``), publish
a ``Deregistration`` on ``agent.<id>.deregister``, delete the task queue if it
is empty, and close the transport if this runtime opened it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from mesh import constants as c
from mesh.agent.base import Agent
from mesh.agent.context import idempotency_key
from mesh.agent.core import AgentCore, Phase
from mesh.agent.errors import RegistrationRefusedError, RegistrationTimeoutError
from mesh.agent.http import AgentHttpServer, default_drain_deadline_s
from mesh.agent.processing import process_task
from mesh.backoff import Backoff
from mesh.errors import (
    LocalProtocolError,
    MeshError,
    MessageRejected,
    PublishNacked,
    PublishUnroutable,
    TransportError,
)
from mesh.leases import LeaseVerifier
from mesh.logs import checked
from mesh.topology import BindingSpec, Declarations, Topology, names
from mesh.transport import DEFAULT_EXCHANGE, AmqpTransport, Delivery
from mesh.transport.amqp import url_user
from mesh.transport.ports import ReportsBrokerCancel, Subscription
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.codec import decode_as, encode
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import (
    AdmissionState,
    AdmissionStateRequest,
    Deregistration,
    DrainAccepted,
    DrainComplete,
    DrainNotice,
    DrainRequest,
    ErrorInfo,
    LeaseNotice,
    LeaseStateRequest,
    Message,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    Standing,
    StandingRequest,
    Task,
    TaskResult,
)
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

RegistrationReply = RegistrationAccepted | RegistrationRefused

_CONTROL_TYPES: tuple[type[Message], ...] = (
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    DrainNotice,
    DrainComplete,
    DrainAccepted,
    Refusal,
    LeaseNotice,
    OrchestrationEvent,  # grant revocations from the events exchange
    Standing,
    AdmissionState,
)
_CONTROL_PREFETCH = 16
# A deleted pool queue is looked for again after 0.5 s, then at doubling intervals up to 5 s.
_POOL_BACK_FIRST_S = 0.5
_POOL_BACK_MAX_S = 5.0
ANSWERS_KEPT = 4096  # published results remembered for redeliveries of the same task
# Results that are no answer to the task's work: a redelivery must run it after all.
# (GRANT_INVALID: this copy's grant or lease was refused, which says nothing of the task: the
# producer may send the same task under a new lease.)
_NOT_DONE = frozenset(
    {Reason.AGENT_SHUTDOWN, Reason.EVICTED, Reason.DEADLINE_EXCEEDED, Reason.GRANT_INVALID}
)
_SETTLE_POLL_S = 0.2
# How long a redelivered pool task waits for the ledger's word on its admission before it
# runs anyway (its grant checked as always).
ADMISSION_STATE_WAIT_S = 2.0
_SETTLED = (
    "its admission is settled in the ledger already ({state}, fence {fence}): the task was "
    "answered, or its producer gave up on it"
)
_WORK_REPORT_DELAY_S = 0.02  # pool-work changes within this are one report
# A task under a lease we were not told of: the notice is usually a moment behind the task;
# after this long the manager is asked (LeaseStateRequest), and again as often until the wait
# ends (the question or its answer may be lost too, e.g. just after a broker restart).
_LEASE_ASK_AFTER_S = 0.25
_LEASE_ASK_EVERY_S = 0.5
_ENDED_LEASES_KEPT = 4096


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How an agent runtime connects, registers and drains."""

    amqp_url: str = c.DEFAULT_AMQP_URL
    namespace: str = c.DEFAULT_NAMESPACE
    registration_timeout_s: float = 5.0
    """How long one registration attempt waits for the manager's answer."""
    registration_backoff_cap_s: float = 10.0
    """The longest pause between registration attempts."""
    max_registration_attempts: int | None = None
    """Give up with :class:`RegistrationTimeoutError` after this many attempts (None: never)."""
    drain_timeout_s: float = 60.0
    """The longest wait for the manager's ``DrainComplete`` (and the task queue to empty)."""
    stop_timeout_s: float = 5.0
    """``drain_timeout_s`` for :meth:`AgentRuntime.stop`, which is a drain in a hurry."""
    shutdown_grace_s: float = 30.0
    """After the drain, how long in-flight tasks may still run before they are cancelled."""
    publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S
    result_publish_attempts: int = 3
    """Attempts to publish a result whose outcome was unknown before the task is requeued."""
    connect_timeout_s: float = 10.0
    http_host: str = "0.0.0.0"
    http_port: int | None = None
    """Serve ``/ready``, ``/healthz`` and ``/drain`` on this port (0: any free one; None: no)."""
    http_drain_deadline_s: float | None = None
    """When ``/drain`` answers at the latest (None: ``drain_timeout_s + shutdown_grace_s - 2``)."""
    lease_public_keys: tuple[Path, ...] = ()
    """The managers' lease public keys (``<lease key>.pub``). Set: every granted task must
    carry a valid invocation lease for its admission, checked at claim and before the result,
    and a result goes out at most once per lease (:mod:`mesh.leases`). Empty: not checked."""
    self_fence_after_s: float | None = None
    """A gap this long between two of our heartbeats fences out the tasks claimed before it
    (see the module doc). None: ``MISSED_HEARTBEATS_BEFORE_LOST`` intervals less half of one,
    matching a manager with the default rule; set it below a manager's own rule."""
    shared_topology: Literal["declare", "check"] = "declare"
    """``declare``: declare the namespace's shared exchanges (idempotent; needs configure
    permission on them). ``check``: only check they exist (passive declares) and declare
    nothing but the agent's own queues — for an agent whose broker user has exactly its own
    permissions (``mesh broker add-agent``; docs/security.md). Then the manager must have
    declared the topology first, else start fails with :class:`mesh.errors.TopologyMissing`."""
    liveness_probe_s: float | None = None
    """Probe the broker this often and reconnect when it stops answering (None: off). A
    handler that blocks the event loop for this long would be taken for a dead broker:
    keep it well above the longest synchronous stretch of your handlers."""
    open_tasks: bool = False
    """Run tasks that carry neither a grant nor a lease the manager issued to this agent — for
    a mesh without admission and leases (development). Off: such tasks are refused
    ``NOT_AUTHORIZED`` and dead-lettered (see the module doc; docs/security.md)."""
    manager_user: str | None = None
    """The managers' broker user. Control messages — answers to a registration, drain
    notices, requests to register again, lease notices, events — are taken only with this
    RabbitMQ-validated ``user_id`` (others are dead-lettered ``NOT_AUTHORIZED`` and counted:
    ``control_not_from_manager``), so a broker user that may publish to the agents or events
    exchange cannot drain an agent or make it drop its leases. None: the user that signed
    the acceptance of this agent's first registration (answering the incarnation it had just
    sent); if that acceptance is unsigned (an older manager), nothing is checked."""
    lease_notice_wait_s: float = 2.0
    """How long a lease-path task waits for the manager's word on its lease: the notice (sent
    before the producer gets the lease, so only a reordering makes one wait) or, from 0.25 s
    on, its answer to a ``LeaseStateRequest`` (a notice lost, e.g. just after a broker
    restart)."""


def backoff_delay(
    attempt: int, *, rng: random.Random, base_s: float = 0.5, cap_s: float = 10.0
) -> float:
    """The agent's retries (registration, result publishes): :mod:`mesh.backoff` with equal
    jitter — half of each step fixed and half random, so retries spread out but never
    collapse to 0."""
    return Backoff(base_s, cap_s, spread=0.5).delay_s(attempt, rng.random)


class AgentRuntime:
    """Runs one :class:`Agent` on the mesh. See the module documentation for the protocol."""

    def __init__(
        self,
        agent: Agent,
        settings: AgentSettings | None = None,
        transport: AgentTransport | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.agent = agent
        self.settings = settings or AgentSettings()
        self.topology = Topology(self.settings.namespace)
        self.counters: Counter[str] = Counter()
        self._transport = transport
        self._owns_transport = transport is None
        # On a connection of its own the agent signs what it says about itself with its
        # broker user (RabbitMQ validates user_id): a manager with agent identity on checks
        # that the user is the agent named. A transport handed in signs nothing.
        self._user_id = url_user(self.settings.amqp_url) if transport is None else None
        self._incarnation = uuid.uuid4().hex
        self._rng = rng or random.Random()
        self._capabilities = agent.bind()
        keys = self.settings.lease_public_keys
        # The decisions (phase, heartbeats, self-fence, grant checks), sans I/O.
        self.core = AgentCore(
            agent.agent_id,
            agent.deployment,
            heartbeat_interval_s=agent.heartbeat_interval_s,
            self_fence_after_s=self.settings.self_fence_after_s,
            leases=LeaseVerifier.from_files(keys) if keys else None,
        )
        self._task_queue = self.topology.agent_task_queue(agent.agent_id)
        self._control_queue = self.topology.agent_control_queue(agent.agent_id)
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._drain_complete = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active: set[asyncio.Task[Any]] = set()
        self._in_flight: dict[str, int] = dict.fromkeys(self._capabilities, 0)
        self._pool_started: dict[str, int] = dict.fromkeys(self._capabilities, 0)
        self._work_changed = asyncio.Event()  # pulsed when a slot may have freed or we drain
        self._report_pending = False
        self._draining = False
        self._pool_closed = False  # draining, and the pool consumer is cancelled
        self._refusing = False  # past the drain deadline: answer queued tasks, do not run them
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._control_consumer: Subscription | None = None
        self._task_consumer: Subscription | None = None
        self._pool_consumer: Subscription | None = None  # our pool's shared task queue
        self._pool_return: asyncio.Task[None] | None = None  # waiting for it after a delete
        self._pool_epoch: int | None = None  # the newest descriptor epoch known when it began
        self._pool_lock = asyncio.Lock()
        self._registration: asyncio.Future[RegistrationReply] | None = None
        self._reregistration: asyncio.Task[None] | None = None
        self._forgotten_at = -math.inf  # monotonic: the manager last asked us to re-register
        self._manager_user = self.settings.manager_user  # control messages only from it
        self._accepted = False  # the manager accepted a registration of this incarnation
        self._shard: int | None = None  # several managers: told in the acceptance
        self._standing: asyncio.Future[Standing] | None = None  # the answer awaited
        # idempotency key and task ID -> the result published (ANSWERS_KEPT most recent)
        self._answered: OrderedDict[str, TaskResult] = OrderedDict()
        # ... and the results of finished tasks not published yet (the broker away): a
        # redelivery publishes it rather than running the handler again (ANSWERS_KEPT most recent)
        self._unpublished: OrderedDict[str, _Finished] = OrderedDict()
        # ... and the tasks being handled here now (done when that handling ends): a
        # redelivery of one waits for it instead of running the task a second time at once
        self._handling: dict[str, asyncio.Future[None]] = {}
        # admission ID -> the manager's answer awaited on a redelivered pool task
        self._admission_states: dict[str, asyncio.Future[AdmissionState]] = {}
        self._standing_check: asyncio.Future[float | None] | None = None  # last silence's
        self._checked_for = -math.inf  # the silence (fenced_before) that check is about
        self._shutdown_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._fatal: MeshError | None = None
        self._starting: asyncio.Task[Any] | None = None
        self._http: AgentHttpServer | None = None
        self._issued: dict[str, float] = {}  # lease ID -> loop time it ends (LeaseNotice)
        # lease IDs the manager said ended (the most recent _ENDED_LEASES_KEPT): a task of one
        # is refused at once, not after waiting for a notice that will not come
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._lease_noticed = asyncio.Event()  # pulsed on every lease notice
        # admission ID -> the asyncio task running its handler (to stop it if evicted)
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._evicting: set[str] = set()  # admission IDs whose handler was cancelled for it

    # ---- public state ---------------------------------------------------------------------
    @property
    def agent_id(self) -> str:
        """The agent's ID (also its routing-key word and queue-name part)."""
        return self.agent.agent_id

    @property
    def incarnation(self) -> str:
        """A fresh hex UUID per runtime (process start); re-registration keeps it."""
        return self._incarnation

    @property
    def ready(self) -> asyncio.Event:
        """Set while the manager has accepted us and we are not draining (the /ready probe)."""
        return self._ready

    @property
    def stopped(self) -> asyncio.Event:
        """Set once the runtime has shut down, however that happened."""
        return self._stopped

    @property
    def draining(self) -> bool:
        """True from the drain request or notice on: no new leases, queued work still runs."""
        return self._draining

    @property
    def in_flight(self) -> dict[str, int]:
        """Tasks being worked per capability (received and not yet acked)."""
        return dict(self._in_flight)

    @property
    def phase(self) -> Phase:
        """``new``, ``starting``, ``running``, ``stopping`` or ``stopped``."""
        return self.core.phase

    @property
    def http_port(self) -> int | None:
        """The port the HTTP endpoints listen on, while they do (``None`` otherwise)."""
        return None if self._http is None else self._http.port

    def _extra(self, **more: Any) -> dict[str, Any]:
        """Log fields: the agent's identity and ``more`` (refused at once if reserved)."""
        return checked({"agent_id": self.agent_id, "incarnation": self._incarnation, **more})

    # ---- start ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, declare, register and wait for acceptance; then heartbeat and take tasks.

        Raises :class:`RegistrationRefusedError`, :class:`RegistrationTimeoutError` or
        :class:`mesh.errors.BrokerUnavailable`; on any failure everything opened is closed.
        """
        if self.core.phase != "new":
            raise LocalProtocolError(f"start() called on a runtime that is {self.core.phase}")
        self.core.advance("starting")
        self._starting = asyncio.current_task()
        try:
            await self._start_http()
            transport = await self._connect()
            bound = 2 * self.agent.total_concurrency
            own = self.topology.agent_queues(self.agent_id, bound) + self._grant_feed()
            if self.settings.shared_topology == "check":
                await transport.check_exchanges(self.topology.shared_exchanges())
            else:
                own = self.topology.shared() + own
            await transport.declare(own)
            self._control_consumer = await transport.consume(
                self._control_queue, self._on_control, prefetch=_CONTROL_PREFETCH
            )
            await self._register()
            self._heartbeat_task = self._spawn(self._heartbeat_loop(), "heartbeats")
            self._task_consumer = await transport.consume(
                self._task_queue, self._on_task, prefetch=self.agent.total_concurrency
            )
            await self._consume_pool()
        except BaseException:
            await self._abort()
            raise
        self.core.advance("running")
        if not self._draining:
            self._ready.set()
        log.info("agent ready", extra=self._extra(capabilities=sorted(self._capabilities)))

    async def _consume_pool(self, epoch: int | None = None) -> None:
        """Take admitted tasks from our pool's queue (``<ns>.pool.<deployment>.tasks``),
        alongside the other agents of the pool. The manager declares it when the pool's
        descriptor is published; until then there is nothing to take, and each announcement
        of a newer epoch (:meth:`_on_event`, ``epoch``) tries again — subscribing afresh,
        which also recovers from an operator deleting and the manager declaring the queue
        again. Not when the consumer there began at that epoch or later, or before any
        epoch was known (the start's subscription and the first announcement race): a
        subscription replaced hands its prefetched tasks back to the queue, where they
        come again marked redelivered."""
        async with self._pool_lock:
            if self._draining or self.core.phase not in ("starting", "running"):
                return
            if not self._accepted:
                # A descriptor_active event can come while our registration is deferred (a
                # live incarnation holds our ID): nothing is ours to take before the manager
                # accepted this incarnation; the start subscribes once it has.
                return
            if self._pool_consumer is not None and (
                epoch is None or self._pool_epoch is None or epoch <= self._pool_epoch
            ):
                if self._pool_epoch is None:
                    self._pool_epoch = epoch  # the first epoch learned: the queue consumed
                return
            old, self._pool_consumer = self._pool_consumer, None
            await _cancel_quietly(old)
            queue = self.topology.pool_task_queue(self.agent.deployment)
            try:
                self._pool_consumer = await self.transport.consume(
                    queue, self._on_pool_task, prefetch=self.agent.total_concurrency
                )
            except Exception as exc:  # 404 on the passive declare: not declared yet
                log.debug("no pool queue to consume yet", extra=self._extra(error=str(exc)))
                return
            if self._draining:  # began draining meanwhile
                await self._stop_pool_consumer()
                return
            self._pool_epoch = self.core.active_epoch
            if isinstance(self._pool_consumer, ReportsBrokerCancel):
                self._pool_consumer.on_broker_cancel = partial(
                    self._pool_queue_gone, self._pool_consumer
                )
        self.counters["pool_subscriptions"] += 1
        log.info("taking tasks from the pool queue", extra=self._extra(queue=queue))

    def _pool_queue_gone(self, consumer: Subscription) -> None:
        """The broker cancelled our pool consumer: the pool queue was deleted (an operator in
        the management UI, say). We are not subscribed any more, and try again until the
        queue is back — the manager declares a described pool's queue again when it finds
        it gone — rather than wait for a newer epoch that may never come."""
        if self._pool_consumer is not consumer:
            return
        self._pool_consumer = None
        self.counters["pool_queue_lost"] += 1
        log.warning(
            "our pool queue was deleted; subscribing again once it is back", extra=self._extra()
        )
        if self._pool_return is None or self._pool_return.done():
            self._pool_return = self._spawn(self._pool_back(), "pool queue back")

    async def _pool_back(self) -> None:
        delay = _POOL_BACK_FIRST_S
        while self._pool_consumer is None and not self._draining and self.core.phase == "running":
            await asyncio.sleep(delay)
            await self._consume_pool()
            delay = min(2 * delay, _POOL_BACK_MAX_S)

    async def _stop_pool_consumer(self) -> None:
        consumer, self._pool_consumer = self._pool_consumer, None
        await _cancel_quietly(consumer)

    async def _close_pool(self) -> None:
        """Draining: take no more pool tasks, hand back the prefetched ones not started, and
        tell the manager (a heartbeat saying ``draining``) what still runs here."""
        await self._stop_pool_consumer()
        async with self._pool_lock:  # a (re)subscription under way has finished or seen us
            self._pool_closed = True
        self._pulse_work_changed()  # pool tasks waiting for a slot go back to the queue
        if self._heartbeat_task is not None:
            await self._send_heartbeat()

    def _pulse_work_changed(self) -> None:
        event, self._work_changed = self._work_changed, asyncio.Event()
        event.set()

    def _report_work(self) -> None:
        """Our pool work changed: heartbeat soon (one report for the changes of a moment)."""
        if self._report_pending or self._heartbeat_task is None:
            return
        self._report_pending = True
        self._spawn(self._send_work_report(), "work report")

    async def _send_work_report(self) -> None:
        try:
            await asyncio.sleep(_WORK_REPORT_DELAY_S)
        finally:
            self._report_pending = False
        if self._heartbeat_task is not None:
            await self._send_heartbeat()

    async def _wait_to_start(self, capability: str) -> bool:
        """Wait for a free slot of ``capability`` for a pool task; ``False`` if we began
        draining first (the task goes back to the pool queue, not started)."""
        bound = self._capabilities.get(capability)
        while not self._draining and bound is not None and bound.semaphore.locked():
            await self._work_changed.wait()
        return not self._draining

    def _grant_feed(self) -> Declarations:
        """Our control queue hears every grant revocation of our pool."""
        binding = BindingSpec(
            self._control_queue,
            self.topology.events_exchange,
            names.grant_binding(self.agent.deployment),
        )
        return Declarations(bindings=(binding,))

    async def _start_http(self) -> None:
        s = self.settings
        if s.http_port is None:
            return
        deadline = s.http_drain_deadline_s
        self._http = AgentHttpServer(
            self,
            host=s.http_host,
            port=s.http_port,
            drain_deadline_s=(
                default_drain_deadline_s(s.drain_timeout_s, s.shutdown_grace_s)
                if deadline is None
                else deadline
            ),
            agent_id=self.agent_id,
        )
        await self._http.start()

    async def _connect(self) -> AgentTransport:
        if self._transport is None:
            self._transport = await AmqpTransport.connect(
                self.settings.amqp_url,
                name=f"agent:{self.agent_id}",
                properties={c.CLIENT_PROPERTY_INCARNATION: self._incarnation},
                publish_timeout_s=self.settings.publish_timeout_s,
                connect_timeout_s=self.settings.connect_timeout_s,
                liveness_probe_s=self.settings.liveness_probe_s,
            )
        self._transport.on_reconnect(self._on_reconnect)
        return self._transport

    @property
    def transport(self) -> AgentTransport:
        """The transport in use; :class:`LocalProtocolError` before ``start()``."""
        if self._transport is None:
            raise LocalProtocolError("the runtime is not started")
        return self._transport

    # ---- registration ---------------------------------------------------------------------
    async def _register(self) -> None:
        """Publish the registration until the manager answers; raise if it refuses for good.

        A temporary refusal (``retry_after_ms`` set: another live incarnation holds our ID,
        say the one a kill -9 left behind) is waited out and the same registration sent again.
        """
        registration = self.agent.registration(self._incarnation)
        limit = self.settings.max_registration_attempts
        attempt = 0
        while True:
            answer: asyncio.Future[RegistrationReply] = asyncio.get_running_loop().create_future()
            self._registration = answer
            try:
                while not answer.done():
                    attempt += 1
                    self.counters["registration_attempts"] += 1
                    if await self._publish_registration(registration, attempt):
                        await asyncio.wait({answer}, timeout=self.settings.registration_timeout_s)
                    if answer.done():
                        break
                    hint = self._unanswered_hint()
                    self._check_attempts(attempt, limit, hint)
                    delay = backoff_delay(
                        attempt - 1, rng=self._rng, cap_s=self.settings.registration_backoff_cap_s
                    )
                    log.warning(
                        "no answer to registration; retrying",
                        extra=self._extra(attempt=attempt, retry_in_s=round(delay, 3), hint=hint),
                    )
                    await asyncio.wait({answer}, timeout=delay)
                reply = answer.result()
            finally:
                self._registration = None
                answer.cancel()
            if not isinstance(reply, RegistrationRefused):
                break
            if reply.retry_after_ms is None:
                raise RegistrationRefusedError(self.agent_id, reply.reason.value, reply.detail)
            self._check_attempts(attempt, limit, f"the last refusal: {reply.detail}")
            self.counters["registration_deferred"] += 1
            delay = reply.retry_after_ms / 1000 * (1 + 0.1 * self._rng.random())
            log.warning(
                "registration deferred; retrying",
                extra=self._extra(
                    reason=reply.reason.value, detail=reply.detail, retry_in_s=round(delay, 3)
                ),
            )
            await asyncio.sleep(delay)
        log.info("registration accepted", extra=self._extra(attempt=attempt, shard=reply.shard))
        self._accepted = True
        # Several managers: our shard's owner gets our heartbeats and announcements (all but
        # a registration, which any manager takes and forwards, and admission questions,
        # which any manager answers from the shared ledger).
        self._shard = reply.shard
        if reply.pool_epoch is not None:  # our pool's epoch now, not at the next announcement
            self._on_event(
                OrchestrationEvent(
                    at=time.time(),
                    kind=c.EVENT_DESCRIPTOR_ACTIVE,
                    reason="told in the registration's acceptance",
                    detail=reply.pool_epoch.model_dump(exclude_none=True),
                )
            )

    def _unanswered_hint(self) -> str:
        """Why a registration may go unanswered. A manager run with ``--agent-identity on``
        dead-letters (``NOT_AUTHORIZED``) a registration published by a broker user other
        than the agent it names, and answers nothing: a refusal sent to the named agent would
        let anyone who forges its registration stop it. So the agent says it here, where
        its broker user is not its agent ID (a pool's shared user)."""
        why = f"is `mesh manager` running on namespace {self.settings.namespace!r}?"
        user = self._user_id
        if user is None or user == self.agent_id:
            return why
        return (
            f"{why} This agent logs in as broker user {user!r}, not as its agent ID: a manager "
            "run with --agent-identity on dead-letters its registrations (NOT_AUTHORIZED). "
            "Run the managers with identity off for a pool's shared user "
            "(mesh broker add-pool-agents), or give each agent a user named as it "
            "(mesh broker add-agent)."
        )

    def _check_attempts(self, attempt: int, limit: int | None, why: str) -> None:
        if limit is not None and attempt >= limit:
            raise RegistrationTimeoutError(
                f"no manager accepted {self.agent_id} after {attempt} attempts; {why}"
            )

    async def _publish_registration(self, registration: Message, attempt: int) -> bool:
        log.info("registering", extra=self._extra(attempt=attempt))
        try:
            await self.transport.publish(
                self.topology.announce_exchange,
                names.agent_announce_key(self.agent_id, "register"),
                registration,
                persistent=True,
                timeout_s=self.settings.publish_timeout_s,
                user_id=self._user_id,
            )
        except PublishUnroutable:
            log.warning(
                "no manager queue is bound for registrations yet",
                extra=self._extra(attempt=attempt),
            )
            return False
        except TransportError as exc:
            log.warning(
                "registration publish failed", extra=self._extra(attempt=attempt, error=str(exc))
            )
            return False
        return True

    def _on_registration_reply(self, reply: RegistrationReply) -> None:
        pending = self._registration
        if reply.incarnation != self._incarnation or pending is None or pending.done():
            log.debug("stale registration reply ignored", extra=self._extra(type=reply.type))
            return
        pending.set_result(reply)

    def _on_reregister_request(self, request: ReRegisterRequest) -> None:
        if self._draining and request.leases_kept:
            # Handed to another manager mid-drain: our leases stay valid and a task under
            # one may still be on its way, so the drain is not over; the new owner, not
            # knowing us, says so at our next heartbeat.
            log.info("shard handed over while draining", extra=self._extra())
        elif self._draining:
            # The manager holds no leases on an agent it does not know: the drain is complete.
            log.info("manager forgot us while draining", extra=self._extra(reason=request.reason))
            self._drain_complete.set()
        elif self.core.phase != "running" or self._registering():
            log.debug("re-register request ignored: registration in progress", extra=self._extra())
        else:
            if request.leases_kept:
                # Our shard moved to another manager: the leases we were told of were
                # granted and stay valid (a task under one may still be on its way); only
                # the registry that counts us changes.
                self.counters["handed_over"] += 1
                log.info("registering with our shard's new manager", extra=self._extra())
            else:
                self._forgotten_at = time.monotonic()
                self._forget_leases("the manager does not know us")
                log.warning(
                    "manager asked us to re-register", extra=self._extra(reason=request.reason)
                )
            self._ready.clear()
            self._reregistration = self._spawn(self._reregister(), "re-register")

    def _forget_leases(self, why: str) -> None:
        """The manager forgot this registration (it declared us lost, or restarted): the
        leases it told us of went with it, so a task of one — requeued after a withheld
        result, or still queued — is refused, not run again for a producer that may have
        given up on it."""
        if self._issued:
            log.info(
                "leases of the earlier registration forgotten",
                extra=self._extra(why=why, leases=len(self._issued)),
            )
            self.counters["leases_forgotten"] += len(self._issued)
            self._issued.clear()

    def _registering(self) -> bool:
        background = self._reregistration is not None and not self._reregistration.done()
        return background or self._registration is not None

    async def _reregister(self) -> None:
        try:
            await self._register()
        except MeshError as exc:
            log.error("re-registration failed; stopping", extra=self._extra(error=str(exc)))
            self._fatal = exc
            self._spawn(self._shutdown(f"re-registration failed: {exc}", deregister=False), "stop")
            return
        if not self._draining:
            self._ready.set()

    async def _on_reconnect(self) -> None:
        if self.core.phase in ("new", "stopped"):
            return
        log.warning("agent transport reconnected", extra=self._extra())
        self.counters["reconnects"] += 1
        if self.core.phase == "running":
            self._spawn(self._send_heartbeat(), "heartbeat")  # a forgetful manager asks sooner

    # ---- heartbeats -----------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.agent.heartbeat_interval_s
        next_at = loop.time()
        while True:
            await self._send_heartbeat()
            next_at = max(next_at + interval, loop.time())
            await asyncio.sleep(next_at - loop.time())

    @property
    def self_fence_after_s(self) -> float:
        return self.core.self_fence_after_s

    def _note_silence(self, now: float) -> None:
        """If we have been silent longer than the manager tolerates, fence out every task
        claimed until ``now`` (called before each heartbeat and before each result)."""
        silent_s = self.core.note_silence(now)
        if silent_s is None:
            return
        self.counters["silences"] += 1
        log.warning(
            "this agent was silent long enough to be declared lost; the work it held is "
            "fenced out (results withheld, tasks requeued)",
            extra=self._extra(silent_s=round(silent_s, 1), fence_after_s=self.self_fence_after_s),
        )

    async def _still_registered(self, claimed: float) -> bool:
        """After a silence: was this agent declared lost? The manager answers a
        ``StandingRequest``; a task claimed before the silence may still deliver its result
        only if this incarnation's registration is older than the claim (registered before
        it, and not forgotten and registered again since — the manager lost or restarted)
        and the manager did not ask us to register again since. No answer in time counts as
        lost: withholding is the safe side. One question per silence, shared."""
        if self._forgotten_at >= claimed:
            return False
        check = self._standing_check
        if check is None or (check.done() and self.core.fenced_before > self._checked_for):
            self._checked_for = self.core.fenced_before
            check = self._standing_check = asyncio.ensure_future(self._ask_standing())
        since = await asyncio.shield(check)
        if since is not None and since <= claimed and self._forgotten_at < claimed:
            self.counters["silences_survived"] += 1
            log.info("result delivered after a silence: still registered", extra=self._extra())
            return True
        return False

    async def _ask_standing(self) -> float | None:
        """When (our monotonic clock) the manager's registration of this incarnation began,
        by its answer; ``None``: not registered, or no answer."""
        request = StandingRequest(agent_id=self.agent_id, incarnation=self._incarnation)
        deadline = time.monotonic() + max(self.settings.registration_timeout_s * 3, 5.0)
        while time.monotonic() < deadline:
            answer: asyncio.Future[Standing] = asyncio.get_running_loop().create_future()
            self._standing = answer
            asked = time.monotonic()
            try:
                await self.transport.publish(  # answered on our control queue
                    self.topology.announce_exchange,
                    names.agent_announce_key(self.agent_id, "standing", self._shard),
                    request,
                    timeout_s=self.settings.publish_timeout_s,
                    user_id=self._user_id,
                )
                async with asyncio.timeout(self.settings.registration_timeout_s):
                    standing = await answer
            except (TimeoutError, TransportError) as exc:
                log.info("no answer on our standing yet", extra=self._extra(error=str(exc)))
                await asyncio.sleep(0.2)
                continue
            finally:
                self._standing = None
            log.warning(
                "asked the manager after a silence",
                extra=self._extra(
                    registered=standing.registered,
                    state=standing.state,
                    registered_for_s=standing.registered_for_s,
                ),
            )
            if not standing.registered or standing.registered_for_s is None:
                self._forget_leases("declared lost")
                return None
            # The registration began at least this long before we asked (the answer's
            # travel only makes it look younger: the safe side).
            return asked - standing.registered_for_s
        self.counters["standing_unanswered"] += 1
        return None

    async def _send_heartbeat(self) -> None:
        self._note_silence(time.monotonic())
        heartbeat = self.core.heartbeat(
            self._incarnation,
            in_flight=self._in_flight,
            pool_in_flight=self._pool_started,
            draining=self._pool_closed,
            wall=time.time(),
        )
        try:
            async with asyncio.timeout(self.settings.publish_timeout_s):
                await self.transport.publish_fast(
                    self.topology.heartbeat_exchange,
                    names.heartbeat_key(self.agent_id, self._shard),
                    encode(heartbeat),
                    user_id=self._user_id,
                )
        except Exception as exc:  # never let a heartbeat kill the agent
            self.counters["heartbeats_failed"] += 1
            log.warning(
                "heartbeat failed; next one in one interval",
                extra=self._extra(seq=heartbeat.seq, error=f"{type(exc).__name__}: {exc}"),
            )
        else:
            self.counters["heartbeats_sent"] += 1
            self.core.beat_sent(time.monotonic())

    # ---- control messages -----------------------------------------------------------------
    async def _on_control(self, delivery: Delivery) -> None:
        try:
            message = decode_as(delivery.body, *_CONTROL_TYPES)
            if not isinstance(message, OrchestrationEvent):  # events are for the whole pool
                self._check_addressee(message)
        except MessageRejected as exc:
            if delivery.exchange == self.topology.events_exchange:
                # The grant feed: an event of a kind (or a detail) this SDK does not know —
                # a newer manager's — is ignored, as the kinds it does not act on are.
                self.counters["events_ignored"] += 1
                log.debug("event ignored", extra=self._extra(error=str(exc)[:200]))
                await _ack(delivery, self._extra())
                return
            self.counters["control_dead_lettered"] += 1
            await self._dead_letter(delivery, self._control_queue, exc)
            return
        sender = self._check_sender(message, delivery.user_id)
        if sender is None:
            self.counters["control_not_from_manager"] += 1
            await self._dead_letter(
                delivery,
                self._control_queue,
                MessageRejected(
                    Reason.NOT_AUTHORIZED,
                    f"{message.type} from {delivery.user_id or 'an unsigned publisher'!r}, "
                    f"not the managers' user {self._manager_user!r}",
                ),
            )
            return
        self._dispatch_control(sender)
        await _ack(delivery, self._extra())

    def _check_sender(self, message: Message, user_id: str | None) -> Message | None:
        """``message`` if the managers' user sent it (or nothing is checked yet), else None.
        An unsigned request to register again is taken as one that keeps the leases: doing
        what it asks cannot hurt (an older manager's, mid-upgrade, must still be heard),
        forgetting our leases on anyone's word could. The first signed acceptance of our
        pending registration names the managers' user when the settings do not."""
        expected = self._manager_user
        if expected is None:
            if (
                isinstance(message, RegistrationAccepted)
                and user_id is not None
                and message.incarnation == self._incarnation
                and self._registration is not None
                and not self._registration.done()
            ):
                self._manager_user = user_id
                log.info("the managers' user learned", extra=self._extra(manager_user=user_id))
            return message
        if user_id == expected:
            return message
        if isinstance(message, ReRegisterRequest) and user_id is None:
            self.counters["control_unsigned_reregister"] += 1
            return message.model_copy(update={"leases_kept": True})
        return None

    def _check_addressee(self, message: Message) -> None:
        addressee = getattr(message, "agent_id", self.agent_id)
        if addressee != self.agent_id:
            raise MessageRejected(
                Reason.UNKNOWN_AGENT, f"addressed to {addressee!r}, received by {self.agent_id!r}"
            )

    def _dispatch_control(self, message: Message) -> None:
        if isinstance(message, RegistrationAccepted | RegistrationRefused):
            self._on_registration_reply(message)
        elif isinstance(message, ReRegisterRequest):
            self._on_reregister_request(message)
        elif isinstance(message, DrainNotice):
            self._begin_drain(message.reason or "drain notice from the manager")
        elif isinstance(message, DrainComplete):
            log.info("manager released every lease", extra=self._extra())
            self._begin_drain("drain complete")
            self._drain_complete.set()
        elif isinstance(message, LeaseNotice):
            self._on_lease_notice(message)
        elif isinstance(message, Refusal):
            self._on_refusal(message)
        elif isinstance(message, OrchestrationEvent):
            self._on_event(message)
        elif isinstance(message, Standing | AdmissionState):
            self._on_answer(message)
        else:
            log.info("drain accepted by the manager", extra=self._extra())

    def _on_answer(self, message: Standing | AdmissionState) -> None:
        """The manager's answer to a question we asked (our standing, an admission's state)."""
        if isinstance(message, Standing):
            waiting: asyncio.Future[Any] | None = self._standing
            if message.incarnation != self._incarnation:
                return
        else:
            waiting = self._admission_states.get(message.admission_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(message)

    def _on_lease_notice(self, notice: LeaseNotice) -> None:
        now = asyncio.get_running_loop().time()
        if notice.ended:
            self._issued.pop(notice.lease_id, None)
            self._ended[notice.lease_id] = None
            if len(self._ended) > _ENDED_LEASES_KEPT:
                self._ended.popitem(last=False)
        else:
            self._issued[notice.lease_id] = now + notice.expires_in_s
        for lease_id in [k for k, until in self._issued.items() if until <= now]:
            del self._issued[lease_id]  # expired without an end notice (a lost one)
        event, self._lease_noticed = self._lease_noticed, asyncio.Event()
        event.set()

    async def _credentials_problem(self, task: Task, from_pool: bool) -> tuple[Reason, str] | None:
        """Why ``task`` may not run here for want of credentials, and its reason code
        (``None``: it may; a grant it carries is checked on its own, :meth:`_grant_problem`).

        A lease this incarnation was not told of, or that ended, is ``UNKNOWN_LEASE``: a
        producer may ask for a new lease and send the task again (a task queued for an
        earlier incarnation under our ID, whose leases ended with it, is refused so). No
        credentials at all is ``NOT_AUTHORIZED``."""
        if task.grant is not None or self.settings.open_tasks:
            return None
        if from_pool:
            return Reason.NOT_AUTHORIZED, "a task of the pool queue without a grant"
        if task.lease_id is None:
            return Reason.NOT_AUTHORIZED, "the task carries neither a grant nor a lease"
        if await self._lease_known(task.lease_id, task.capability):
            return None
        return (
            Reason.UNKNOWN_LEASE,
            f"lease {task.lease_id!r} was not issued to this incarnation of "
            f"{self.agent_id}, or has ended",
        )

    async def _lease_known(self, lease_id: str, capability: str) -> bool:
        """Whether the manager issued ``lease_id`` to this agent and it has not ended, by its
        notice — or, when the notice is late or lost (sent while our control queue was being
        declared again after a broker restart), by the manager's answer to a
        ``LeaseStateRequest`` (the notice again, or that the lease ended). Waits at most
        ``lease_notice_wait_s``; no word by then: not known."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.settings.lease_notice_wait_s
        ask_at = started + _LEASE_ASK_AFTER_S
        while True:
            now = loop.time()
            until = self._issued.get(lease_id)
            if until is not None and until > now:
                return True
            if lease_id in self._ended or now >= deadline:
                return False
            if now >= ask_at:
                ask_at = now + _LEASE_ASK_EVERY_S
                self._spawn(self._ask_lease_state(lease_id, capability), "lease-state")
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(deadline, ask_at) - now):
                    await self._lease_noticed.wait()

    async def _ask_lease_state(self, lease_id: str, capability: str) -> None:
        """Ask the manager about a lease we were not told of (answered with a LeaseNotice on
        our control queue); a question that cannot be published is asked again later."""
        self.counters["lease_state_asked"] += 1
        request = LeaseStateRequest(
            agent_id=self.agent_id,
            incarnation=self._incarnation,
            lease_id=lease_id,
            capability=capability,
        )
        try:
            await self.transport.publish(
                self.topology.announce_exchange,
                names.agent_announce_key(self.agent_id, "standing", self._shard),
                request,
                timeout_s=self.settings.publish_timeout_s,
                user_id=self._user_id,
            )
        except TransportError as exc:
            log.info("could not ask about a lease", extra=self._extra(error=str(exc)))

    async def _refuse_without_credentials(
        self,
        delivery: Delivery,
        task: Task,
        problem: tuple[Reason, str],
        from_pool: bool,
        extra: dict[str, Any],
    ) -> None:
        """Answer with the problem's reason (the producer does not wait for nothing),
        dead-letter the task with it; it never runs."""
        reason, why = problem
        self.counters["tasks_without_credentials"] += 1
        log.warning(
            "task refused: no credentials",
            extra={**extra, "problem": why, "reason": reason.value},
        )
        queue = self.topology.pool_task_queue(self.agent.deployment) if from_pool else None
        await self._answer_and_dead_letter(
            delivery,
            task,
            reason,
            f"{self.agent_id}, at claim: {why}",
            queue,
            extra,
        )

    async def _answer_and_dead_letter(
        self,
        delivery: Delivery,
        task: Task,
        code: Reason,
        message: str,
        queue: str | None,
        extra: dict[str, Any],
    ) -> None:
        """A task that will not run here: its producer gets a ``code`` error result now (not
        a timeout later), and the task is dead-lettered with that reason (``queue``: where it
        came from; the agent's own by default), then acked."""
        now = time.time()
        result = TaskResult(
            task_id=task.task_id,
            agent_id=self.agent_id,
            capability=task.capability,
            status="error",
            error=ErrorInfo(code=code, message=message),
            started_at=now,
            finished_at=now,
        )
        await self._send_result(delivery, result, extra)
        await self._dead_letter(delivery, queue or self._task_queue, MessageRejected(code, message))

    def _on_refusal(self, refusal: Refusal) -> None:
        """The manager's reply to our DrainRequest: it does not know us, so nothing is leased."""
        log.info("drain request refused", extra=self._extra(reason=refusal.reason.value))
        if self._draining and refusal.reason in (Reason.UNKNOWN_AGENT, Reason.AGENT_TERMINATED):
            self._drain_complete.set()

    def _on_event(self, event: OrchestrationEvent) -> None:
        """A ``grant_revoked`` event for our pool: remember the highest revoked fence (and stop
        the handler of an evicted or security-revoked grant); a ``descriptor_active`` one:
        remember the highest epoch, and consume the pool queue (again)."""
        seen = self.core.on_event(event, pool_consumed=self._pool_consumer is not None)
        if seen.kind == "ignored":
            self.counters["events_ignored"] += 1
            log.debug("event ignored", extra=self._extra(kind=event.kind))
            return
        if seen.kind == "epoch":
            if seen.newer:
                log.info("descriptor epoch", extra=self._extra(descriptor_epoch=seen.epoch))
            if seen.resubscribe:  # a new epoch may come with a new queue
                self._spawn(self._consume_pool(seen.epoch), "pool consumer")
            return
        self.counters["grants_revoked_seen"] += 1
        log.info(
            "grant revoked",
            extra=self._extra(
                admission_id=seen.admission_id, fence=seen.fence, evicted=seen.evicted
            ),
        )
        running = self._running.get(seen.admission_id or "")
        if seen.stop_running and running is not None and seen.admission_id is not None:
            self._evicting.add(seen.admission_id)
            running.cancel()

    @property
    def draining_allowlist(self) -> frozenset[str]:
        """Admissions whose grants of an older epoch this agent still honours."""
        return self.core.draining_allowlist

    @property
    def active_epoch(self) -> int | None:
        """Our pool's descriptor epoch as last announced by the manager (``None``: not yet)."""
        return self.core.active_epoch

    def revoked_fence(self, admission_id: str) -> int | None:
        """The highest fence of ``admission_id`` this agent has seen revoked, or ``None``."""
        return self.core.revoked.fence(admission_id)

    def _grant_problem(self, task: Task) -> str | None:
        return self.core.grant_problem(task, time.time())

    async def _settled_already(self, task: Task) -> str | None:
        """For a redelivered pool task this agent has no answer for: has the ledger settled
        its admission (released, or expired, at or past this grant's fence)? Then why it is
        not run. An agent that was live heard the release as a revocation (the grant check
        refused the task already); one started since asks the manager, waiting at most
        ``ADMISSION_STATE_WAIT_S``. No answer: not known to be settled, and the task runs —
        effects kept with :func:`mesh.agent.once` still happen once."""
        grant = task.grant
        if grant is None:
            return None
        admission_id = grant.admission_id
        waiting = self._admission_states.get(admission_id)
        asking = waiting is None
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            self._admission_states[admission_id] = waiting
        try:
            if asking:
                request = AdmissionStateRequest(
                    agent_id=self.agent_id, incarnation=self._incarnation, admission_id=admission_id
                )
                await self.transport.publish(  # answered on our control queue
                    self.topology.announce_exchange,
                    names.agent_announce_key(self.agent_id, "admission"),
                    request,
                    timeout_s=self.settings.publish_timeout_s,
                    user_id=self._user_id,
                )
            async with asyncio.timeout(ADMISSION_STATE_WAIT_S):
                answer = await asyncio.shield(waiting)
        except (TimeoutError, TransportError):
            self.counters["admission_state_unanswered"] += 1
            return None
        finally:
            if asking:
                self._admission_states.pop(admission_id, None)
        if answer.state in ("RELEASED", "EXPIRED") and (answer.fence or 0) >= grant.fence:
            return _SETTLED.format(state=answer.state, fence=answer.fence)
        return None

    def _grant_refused(
        self, task: Task, problem: str, where: str, started_at: float, extra: dict[str, Any]
    ) -> TaskResult:
        grant = task.grant
        evicted = self.core.evicted(task)
        self.counters["tasks_evicted" if evicted else "grants_refused"] += 1
        log.warning(
            "task evicted" if evicted else "task refused: grant invalid",
            extra={
                **extra,
                "at": where,
                "admission_id": grant.admission_id if grant else None,
                "fence": grant.fence if grant else None,
                "problem": problem,
            },
        )
        return self.core.refusal(task, problem, where, started_at, time.time())

    async def _refuse_at_claim(
        self, delivery: Delivery, task: Task, problem: str, extra: dict[str, Any]
    ) -> None:
        result = self._grant_refused(task, problem, "at claim", time.time(), extra)
        if await self._send_result(delivery, result, extra):
            await _ack(delivery, extra)
        else:
            await _requeue(delivery, extra)

    def _at_consumption(self, task: Task, result: TaskResult, extra: dict[str, Any]) -> TaskResult:
        """Revalidate the grant before the result goes out: a void grant's output is withheld."""
        if result.error is not None and result.error.code in (Reason.EVICTED, Reason.GRANT_INVALID):
            return result  # already refused on the way
        problem = self._grant_problem(task)
        if problem is None:
            problem = self.core.consume_lease(task, time.time())  # once per lease
        if problem is None:
            return result
        return self._grant_refused(task, problem, "before the result", result.started_at, extra)

    # ---- tasks ----------------------------------------------------------------------------
    async def _on_task(self, delivery: Delivery, *, from_pool: bool = False) -> None:
        current = asyncio.current_task()
        if current is not None:
            self._active.add(current)
        self._idle.clear()
        try:
            await self._handle_task(delivery, from_pool)
        finally:
            if current is not None:
                self._active.discard(current)
            if not self._active:
                self._idle.set()
            self._pulse_work_changed()

    async def _on_pool_task(self, delivery: Delivery) -> None:
        await self._on_task(delivery, from_pool=True)

    async def _handle_task(self, delivery: Delivery, from_pool: bool = False) -> None:
        try:
            task = decode_as(delivery.body, Task)
        except MessageRejected as exc:
            self.counters["tasks_dead_lettered"] += 1
            await self._dead_letter(delivery, self._task_queue, exc)
            return
        extra = self._extra(task_id=task.task_id, capability=task.capability)
        if self._refusing:
            await self._give_up_task(delivery, task, "the agent is leaving (drain deadline)")
            return
        if delivery.redelivered:
            log.info("task redelivered; running it again", extra=extra)
        uncredentialed = await self._credentials_problem(task, from_pool)
        if uncredentialed is not None:
            await self._refuse_without_credentials(delivery, task, uncredentialed, from_pool, extra)
            return
        problem = self._grant_problem(task)
        if problem is not None:  # at claim: the task never runs
            await self._refuse_at_claim(delivery, task, problem, extra)
            return
        key = _answer_key(task)
        while (earlier := self._handling.get(key)) is not None:
            # Redelivered (its connection was lost) while its first run here still goes on —
            # its handler, or the publish of its result waiting for the broker: the task is
            # not run twice at once; once that run is done, it answers this delivery.
            self.counters["redeliveries_waited_for_first_run"] += 1
            log.info("task redelivered while its first run here goes on: waiting", extra=extra)
            await asyncio.wait([earlier])  # (awaiting it bare would cancel it with us)
        handling = self._handling[key] = asyncio.get_running_loop().create_future()
        try:
            await self._handle_once_here(delivery, task, from_pool, extra)
        finally:
            del self._handling[key]
            handling.set_result(None)

    async def _handle_once_here(
        self, delivery: Delivery, task: Task, from_pool: bool, extra: dict[str, Any]
    ) -> None:
        """Answer a task no other delivery of is being handled here: from an earlier run, or
        by running it."""
        if await self._done_before(delivery, task, from_pool, extra):
            return
        counted = task.capability in self._in_flight
        if from_pool and counted and not await self._start_pool_task(delivery, task, extra):
            return
        if counted:
            self._in_flight[task.capability] += 1
        try:
            await self._run_and_answer(delivery, task, extra)
        finally:
            if counted:
                self._in_flight[task.capability] -= 1
            if from_pool and counted:
                self._pool_started[task.capability] -= 1
                self._report_work()

    async def _done_before(
        self, delivery: Delivery, task: Task, from_pool: bool, extra: dict[str, Any]
    ) -> bool:
        """A task that ran to an answer before (its ack was lost) is not run again: answered
        from our record if it ran here, refused at claim if the ledger settled its admission
        (it ran elsewhere). ``True``: handled."""
        key = _answer_key(task)
        unpublished = self._unpublished.pop(key, None)
        if unpublished is not None:  # finished here, its result never went out: send it now
            self.counters["tasks_finished_answered_later"] += 1
            log.info("task finished here before; publishing its kept result", extra=extra)
            await self._publish_answer(delivery, task, unpublished, extra)
            return True
        answered = self._answered.get(key)
        if answered is not None:  # done here before: the same answer
            self.counters["tasks_answered_again"] += 1
            log.info("task done here before; answered from its recorded result", extra=extra)
            if await self._send_result(delivery, answered, extra):
                await _ack(delivery, extra)
            else:
                await _requeue(delivery, extra)
            return True
        if from_pool and delivery.redelivered:
            settled = await self._settled_already(task)
            if settled is not None:  # done elsewhere
                self.counters["tasks_settled_before_claim"] += 1
                await self._refuse_at_claim(delivery, task, settled, extra)
                return True
        return False

    async def _run_and_answer(self, delivery: Delivery, task: Task, extra: dict[str, Any]) -> None:
        """Run the handler, revalidate, publish the result, then ack (or requeue)."""
        claimed = time.monotonic()
        result = await self._run_handler(delivery, task, extra)
        self.counters[f"tasks_{result.status}"] += 1
        if result.error is not None:
            log.info("task failed", extra={**extra, "code": result.error.code.value})
        await self._publish_answer(delivery, task, _Finished(claimed, result), extra)

    async def _publish_answer(
        self, delivery: Delivery, task: Task, finished: _Finished, extra: dict[str, Any]
    ) -> None:
        """Fence, revalidate at the consumption point, publish the result, then ack. A result
        that cannot be published (the broker away) is kept and the task requeued: its
        redelivery here (the broker brings it back to this agent's own queue, or to this
        consumer of the pool queue) publishes the kept result instead of running the handler
        again."""
        self._note_silence(time.monotonic())
        if self.core.fenced(finished.claimed) and not await self._still_registered(
            finished.claimed
        ):
            self.counters["results_fenced"] += 1
            log.warning(
                "result withheld: claimed before a silence in which this agent was declared "
                "lost (or the manager could not say it was not); requeued",
                extra=extra,
            )
            await _requeue(delivery, extra)
            return
        answer = self._at_consumption(task, finished.result, extra)
        try:
            sent = await self._send_result(delivery, answer, extra)
        except asyncio.CancelledError:
            # The channel closed under the publish (aio-pika cancels a closed channel's
            # handlers): the broker takes the task back and brings it here again.
            self._keep_unpublished(task, finished)
            raise
        if sent:
            self._remember_answer(task, answer)
            await _ack(delivery, extra)
            return
        self._keep_unpublished(task, finished)
        await _requeue(delivery, extra)

    async def _start_pool_task(self, delivery: Delivery, task: Task, extra: dict[str, Any]) -> bool:
        """Wait for a free slot for a pool task and count it as started (reported to the
        manager); ``False`` if we began draining first: it goes back to the pool queue."""
        if not await self._wait_to_start(task.capability):
            self.counters["pool_tasks_handed_back"] += 1
            log.info("draining: pool task handed back, not started", extra=extra)
            await _requeue(delivery, extra)
            return False
        self._pool_started[task.capability] += 1
        self._report_work()
        return True

    async def _run_handler(
        self, delivery: Delivery, task: Task, extra: dict[str, Any]
    ) -> TaskResult:
        """``process_task``, stoppable by an eviction of the task's grant (then an
        ``EVICTED`` result); any other cancellation propagates (the task is requeued)."""
        admission_id = task.grant.admission_id if task.grant else None
        current = asyncio.current_task()
        if admission_id is not None and current is not None:
            self._running[admission_id] = current
        try:
            return await process_task(
                task, self._capabilities, agent_id=self.agent_id, attempt=_attempt(delivery)
            )
        except asyncio.CancelledError:
            if admission_id in self._evicting and current is not None:
                current.uncancel()  # stopped for a revocation: answer it, do not requeue
                why = self.core.revoked.security_reason(admission_id)
                stopped = "the handler was stopped" + (
                    f": revoked for security ({why})" if why else ""
                )
                return self._grant_refused(task, stopped, "while running", time.time(), extra)
            if self.core.phase == "stopping":
                # Cancelled at the end of the shutdown grace: answer and keep the task.
                await self._give_up_task(delivery, task, "cancelled at the shutdown deadline")
            raise
        finally:
            if admission_id is not None:
                self._running.pop(admission_id, None)
                self._evicting.discard(admission_id)

    async def _give_up_task(self, delivery: Delivery, task: Task, why: str) -> None:
        """A task this agent will not finish: the producer gets an AGENT_SHUTDOWN result now
        (not a timeout later) and the task is dead-lettered with that reason, then acked."""
        self.counters["tasks_given_up"] += 1
        extra = self._extra(task_id=task.task_id, capability=task.capability, why=why)
        log.warning("giving up a task", extra=extra)
        await self._answer_and_dead_letter(
            delivery, task, Reason.AGENT_SHUTDOWN, f"{self.agent_id}: {why}", None, extra
        )

    def _remember_answer(self, task: Task, result: TaskResult) -> None:
        """Keep a published result (bounded, most recent): a redelivery of the same task to
        this agent — its ack lost in a broker restart or a cut connection — is answered with
        it instead of running the handler again."""
        if result.error is not None and result.error.code in _NOT_DONE:
            return  # it did not run to an answer: a redelivery should run it
        key = _answer_key(task)
        self._answered[key] = result
        self._answered.move_to_end(key)
        while len(self._answered) > ANSWERS_KEPT:
            self._answered.popitem(last=False)

    def _keep_unpublished(self, task: Task, finished: _Finished) -> None:
        """Keep a finished task's result that could not be published (bounded, most recent),
        unless it did not run to an answer (a redelivery should run it). Its lease was not
        spent after all: the redelivery passes the consumption point again."""
        if self.core.result_point is not None and task.grant and task.grant.lease:
            self.core.result_point.give_back(task.grant.lease)
        error = finished.result.error
        if error is not None and error.code in _NOT_DONE:
            return
        key = _answer_key(task)
        self._unpublished[key] = finished
        self._unpublished.move_to_end(key)
        while len(self._unpublished) > ANSWERS_KEPT:
            self._unpublished.popitem(last=False)

    async def _send_result(
        self, delivery: Delivery, result: TaskResult, extra: dict[str, Any]
    ) -> bool:
        """Publish the result; ``True`` if the task can be acked, ``False`` to requeue it."""
        if not delivery.reply_to:
            self.counters["results_without_reply_to"] += 1
            log.warning("task has no reply_to; its result is dropped", extra=extra)
            return True
        attempts = max(1, self.settings.result_publish_attempts)
        for attempt in range(1, attempts + 1):
            try:
                await self.transport.publish(
                    DEFAULT_EXCHANGE,
                    delivery.reply_to,
                    result,
                    correlation_id=result.task_id,
                    headers={c.H_AGENT_ID: self.agent_id},
                    timeout_s=self.settings.publish_timeout_s,
                )
                return True
            except PublishUnroutable:
                self.counters["results_unroutable"] += 1
                log.warning("the producer's reply queue is gone; result dropped", extra=extra)
                return True
            except PublishNacked as exc:
                self.counters["results_refused"] += 1
                log.error("broker refused the result", extra={**extra, "error": str(exc)})
                return True
            except TransportError as exc:
                log.warning(
                    "result publish outcome unknown",
                    extra={**extra, "attempt": attempt, "error": str(exc)},
                )
                if attempt < attempts:
                    await asyncio.sleep(backoff_delay(attempt - 1, rng=self._rng, cap_s=2.0))
        self.counters["results_requeued"] += 1
        log.error("could not publish the result; requeueing the task", extra=extra)
        return False

    async def _dead_letter(self, delivery: Delivery, queue: str, exc: MessageRejected) -> None:
        extra = self._extra(queue=queue, reason=exc.reason, detail=exc.detail[:200])
        log.warning("message dead-lettered", extra=extra)
        try:
            await self.transport.dead_letter(
                delivery,
                dead_letter_exchange=self.topology.dead_letter_exchange,
                source_queue=queue,
                reason=exc.reason,
                detail=exc.detail,
            )
        except MeshError as err:
            log.error("dead-lettering failed; rejecting", extra={**extra, "error": str(err)})
            await _reject(delivery, extra)
            return
        await _ack(delivery, extra)

    # ---- drain and stop -------------------------------------------------------------------
    async def drain(
        self, reason: str = "drain requested", *, timeout_s: float | None = None
    ) -> None:
        """Ask the manager to drain us, finish the work already leased, deregister and stop.

        Returns once the runtime has stopped. ``timeout_s`` defaults to ``drain_timeout_s``.
        Called while ``start()`` is still registering, it cancels ``start()`` instead.
        """
        if self.core.phase == "new":
            await self._close()
            return
        if self.core.phase == "starting":
            if self._starting is not None and self._starting is not asyncio.current_task():
                self._starting.cancel()  # start() raises CancelledError and cleans up
            await self._stopped.wait()
            return
        if self._shutdown_task is None:
            self._begin_drain(reason, timeout_s=timeout_s, request=True)
        if self._shutdown_task is not None:
            await asyncio.shield(self._shutdown_task)
        await self._stopped.wait()

    async def stop(self) -> None:
        """A drain in a hurry: wait at most ``stop_timeout_s`` for the manager's leases."""
        if self.core.phase == "stopped":
            return
        await self.drain("stopping", timeout_s=self.settings.stop_timeout_s)

    async def run_until_stopped(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set (then drain) or the manager drains us; re-raise a fatal
        error (a refused re-registration)."""
        waiters = {
            asyncio.ensure_future(stop.wait()),
            asyncio.ensure_future(self._stopped.wait()),
        }
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if not self._stopped.is_set():
            await self.drain("stop requested")
        if self._fatal is not None:
            raise self._fatal

    def _begin_drain(
        self, reason: str, *, timeout_s: float | None = None, request: bool = False
    ) -> None:
        if self._shutdown_task is not None or self.core.phase in ("stopping", "stopped"):
            return
        self._draining = True
        self._ready.clear()
        if self._reregistration is not None:
            self._reregistration.cancel()
        log.info("draining", extra=self._extra(reason=reason))
        # Pool tasks are the pool's, not ours: the other agents take them from now on.
        self._spawn(self._close_pool(), "pool consumer")
        timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self._shutdown_task = self._spawn(self._drain_then_stop(reason, timeout, request), "drain")

    async def _drain_then_stop(self, reason: str, timeout_s: float, request: bool) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        if request:
            await self._publish_drain_request(reason)
        if await _wait_until(self._drain_complete, deadline):
            self._stop_heartbeats()  # the manager has forgotten us: heartbeats would be news
            await self._let_queue_empty(deadline)
        else:
            log.warning(
                "no DrainComplete from the manager in time; stopping anyway",
                extra=self._extra(timeout_s=timeout_s),
            )
        await self._shutdown(reason, deregister=True)

    async def _publish_drain_request(self, reason: str) -> None:
        try:
            await self.transport.publish(
                self.topology.announce_exchange,
                names.agent_announce_key(self.agent_id, "drain", self._shard),
                DrainRequest(
                    agent_id=self.agent_id, reason=reason[:500], incarnation=self._incarnation
                ),
                reply_to=self._control_queue,
                correlation_id=self._incarnation,
                persistent=True,
                timeout_s=self.settings.publish_timeout_s,
                user_id=self._user_id,
            )
        except TransportError as exc:
            log.warning("drain request not delivered", extra=self._extra(error=str(exc)))

    async def _let_queue_empty(self, deadline: float) -> None:
        """Work off tasks still queued (from leases that expired) before leaving."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                depth = await self.transport.queue_depth(self._task_queue)
            except Exception as exc:
                log.debug("queue depth unavailable", extra=self._extra(error=str(exc)))
                return
            if depth == 0 and not self._active:
                return
            if loop.time() >= deadline:
                log.warning(
                    "task queue not empty at the drain deadline; giving up what is left",
                    extra=self._extra(depth=depth),
                )
                await self._give_up_queued(loop.time() + self.settings.publish_timeout_s)
                return
            await asyncio.sleep(min(_SETTLE_POLL_S, max(0.0, deadline - loop.time())))

    async def _give_up_queued(self, deadline: float) -> None:
        """Answer every task still queued with AGENT_SHUTDOWN, through the running consumer."""
        self._refusing = True
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            try:
                if await self.transport.queue_depth(self._task_queue) == 0:
                    return
            except Exception as exc:
                log.debug("queue depth unavailable", extra=self._extra(error=str(exc)))
                return
            await asyncio.sleep(_SETTLE_POLL_S)

    async def _shutdown(self, reason: str, *, deregister: bool) -> None:
        if self.core.phase in ("stopping", "stopped"):
            return
        self.core.advance("stopping")
        self._ready.clear()
        try:
            await self._stop_pool_consumer()
            await _cancel_quietly(self._task_consumer)
            self._task_consumer = None
            await self._finish_in_flight()
            self._stop_heartbeats()
            if deregister:
                await self._deregister(reason)
            await _cancel_quietly(self._control_consumer)
            self._control_consumer = None
            await self._delete_task_queue_if_empty()
        finally:
            await self._close()
        log.info("agent stopped", extra=self._extra(reason=reason))

    async def _finish_in_flight(self) -> None:
        grace = self.settings.shutdown_grace_s
        if await _wait_until(self._idle, asyncio.get_running_loop().time() + grace):
            return
        log.error(
            "in-flight tasks did not finish in time; cancelling them (answered AGENT_SHUTDOWN, "
            "dead-lettered)",
            extra=self._extra(in_flight=self.in_flight, grace_s=grace),
        )
        for task in list(self._active):
            task.cancel()
        if self._active:
            # Each cancelled task answers its producer and dead-letters itself first.
            await asyncio.wait(list(self._active), timeout=2 * self.settings.publish_timeout_s)

    async def _deregister(self, reason: str) -> None:
        try:
            await self.transport.publish(
                self.topology.announce_exchange,
                names.agent_announce_key(self.agent_id, "deregister", self._shard),
                Deregistration(
                    agent_id=self.agent_id, incarnation=self._incarnation, reason=reason[:500]
                ),
                persistent=True,
                timeout_s=self.settings.publish_timeout_s,
                user_id=self._user_id,
            )
        except TransportError as exc:
            log.warning("deregistration not delivered", extra=self._extra(error=str(exc)))

    async def _delete_task_queue_if_empty(self) -> None:
        # A passive count ignores unacked messages: never delete while a handler may still
        # hold one. (A quorum queue refuses an if-empty delete; after the drain nothing is
        # leased on us, so nothing should arrive between the count and the delete.)
        if self._active:
            log.info("task queue kept: tasks still held", extra=self._extra())
            return
        try:
            if await self.transport.queue_depth(self._task_queue) == 0:
                await self.transport.delete_queue(self._task_queue)
        except Exception as exc:
            log.info("task queue kept", extra=self._extra(error=str(exc)))

    def _stop_heartbeats(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None

    async def _abort(self) -> None:
        """Tear down whatever ``start()`` opened, without the drain protocol."""
        if self.core.phase == "stopped":
            return
        self._stop_heartbeats()
        for consumer in (self._pool_consumer, self._task_consumer, self._control_consumer):
            await _cancel_quietly(consumer)
        self._pool_consumer = self._task_consumer = self._control_consumer = None
        if self._transport is not None:
            if self._accepted:
                # Stopped (SIGTERM, a failure) after the manager accepted us, before start()
                # was done: it would hand us work until it declared us lost; say goodbye. (A
                # registration still unanswered is abandoned: if it is accepted later, the
                # silence ends it.)
                await self._deregister("stopped while starting")
            await self._delete_task_queue_if_empty()
        await self._close()

    async def _close(self) -> None:
        current = asyncio.current_task()
        for task in list(self._background):
            if task is not current and task is not self._shutdown_task:
                task.cancel()
        if self._owns_transport and self._transport is not None:
            try:
                await self._transport.close()
            except Exception as exc:
                log.warning("closing the transport failed", extra=self._extra(error=str(exc)))
        if self._http is not None:
            await self._http.close()  # answers a pending /drain before we report "stopped"
        self.core.advance("stopped")
        self._ready.clear()
        self._stopped.set()

    # ---- helpers --------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"agent:{self.agent_id}:{what}")
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "agent background task failed",
                exc_info=task.exception(),
                extra=self._extra(task=task.get_name()),
            )


async def run_agent(
    agent: Agent, settings: AgentSettings | None = None, stop_event: asyncio.Event | None = None
) -> AgentRuntime:
    """Start ``agent``, serve until ``stop_event`` is set (then drain), and return the runtime.

    Setting ``stop_event`` while the agent is still registering abandons the registration.
    """
    runtime = AgentRuntime(agent, settings)
    stop = stop_event or asyncio.Event()
    starting = asyncio.ensure_future(runtime.start())
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
            return runtime
        if starting.cancelled() and runtime.stopped.is_set():
            return runtime  # drained while registering (the /drain hook): nothing to serve
        starting.result()
        await runtime.run_until_stopped(stop)
    finally:
        stop_wait.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
        await runtime.stop()
    return runtime


async def _wait_until(event: asyncio.Event, deadline: float) -> bool:
    """Wait for ``event`` until the loop-time ``deadline``; ``True`` if it was set."""
    if event.is_set():
        return True
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return False
    try:
        async with asyncio.timeout(remaining):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def _cancel_quietly(consumer: Subscription | None) -> None:
    if consumer is None:
        return
    try:
        await consumer.cancel()
    except Exception as exc:
        log.debug("consumer cancel failed", extra={"error": str(exc)})


async def _ack(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.ack()
    except Exception as exc:  # the channel is gone: the broker redelivers
        log.warning(
            "ack failed; the message will be redelivered", extra={**extra, "error": str(exc)}
        )


async def _requeue(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.reject(requeue=True)
    except Exception as exc:
        log.warning("requeue failed", extra={**extra, "error": str(exc)})


async def _reject(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.reject(requeue=False)
    except Exception as exc:
        log.warning("reject failed", extra={**extra, "error": str(exc)})


@dataclass(frozen=True, slots=True)
class _Finished:
    """A task's result as its handler left it, and when the task was claimed (monotonic: a
    silence after it fences the result)."""

    claimed: float
    result: TaskResult


def _answer_key(task: Task) -> str:
    """A redelivery is the same message: the same task ID, under the same grant. (Two tasks a
    producer sends under one grant share the idempotency key but are answered each.)"""
    return f"{idempotency_key(task)}/{task.task_id}"


def _attempt(delivery: Delivery) -> int:
    """Which delivery of its message this is: a quorum queue counts the earlier ones in
    ``x-delivery-count``; elsewhere the redelivered flag says only "not the first"."""
    count = delivery.headers.get("x-delivery-count")
    if isinstance(count, int) and count >= 0:
        return count + 1
    return 2 if delivery.redelivered else 1
