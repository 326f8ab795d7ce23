"""The asyncio shell around an :class:`~mesh.agent.Agent`: register, heartbeat, work, drain.

What it decides — the phase, the next heartbeat, the self-fence, the grant checks — is
:class:`~mesh.agent.core.AgentCore` (sans I/O). The I/O around it is split into rooms, each
with its own theory of operation, which this runtime wires together, starts and stops:

* :mod:`mesh.agent.registration` — register, and again when the manager asks;
* :mod:`mesh.agent.liveness` — heartbeats, the work report, the self-fence after a silence;
* :mod:`mesh.agent.control` — the control queue: what the managers say, checked;
* :mod:`mesh.agent.credentials` — no credentials, no work: lease notices and questions;
* :mod:`mesh.agent.tasks` — each task run, answered and settled, exactly once where it can be;
* :mod:`mesh.agent.pool_queue` — the pool's shared task queue;
* :mod:`mesh.agent.pool_events` — our pool's new epochs and revoked grants, carried out;
* :mod:`mesh.agent.work` — the one count of the work under way.

Theory of operation
-------------------
``start()`` connects (unless given a transport), declares the agent's queues
(``<ns>.agent.<id>.control``, auto-deleted, and ``<ns>.agent.<id>.tasks``, bounded at twice
the total ``max_concurrency`` as slack: the manager's leases are the exact capacity), consumes
the control queue and registers. Only after acceptance do heartbeats and the task consumers
start and ``ready`` get set.

Control messages (each acked; garbage dead-lettered), dispatched here:

* ``RegistrationAccepted`` / ``RegistrationRefused`` answer the pending registration;
* ``ReRegisterRequest`` (the manager restarted or forgot us): register again
  with the same incarnation in the background; ignored while one is running;
* ``DrainNotice``: draining - ``ready`` cleared; the pool consumer is cancelled at once (see
  :mod:`mesh.agent.pool_queue`). Tasks on the agent's own queue are still worked (they were
  leased before the drain);
* ``DrainComplete``: the manager released every lease - finish shutting down;
* ``LeaseNotice``: a lease on one of our slots was issued or ended;
* ``grant_revoked`` / ``descriptor_active`` events of our pool: a revoked grant's handler is
  stopped; a newer epoch is consumed.

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
import logging
import random
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from mesh import constants as c
from mesh.agent.base import Agent
from mesh.agent.control import CONTROL_PREFETCH, ControlInbox
from mesh.agent.core import AgentCore, Phase
from mesh.agent.credentials import Credentials
from mesh.agent.http import AgentHttpServer
from mesh.agent.leaving import Leaving
from mesh.agent.liveness import Liveness
from mesh.agent.pool_events import PoolEvents
from mesh.agent.pool_queue import PoolQueue
from mesh.agent.registration import Registration
from mesh.agent.settings import AgentSettings, Identity, backoff_delay
from mesh.agent.settling import cancel_quietly, wait_until
from mesh.agent.tasks import TaskRunner
from mesh.agent.work import Work
from mesh.errors import LocalProtocolError, MeshError
from mesh.leases import LeaseVerifier
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.transport.amqp import url_user
from mesh.transport.ports import Subscription
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import (
    AdmissionState,
    DrainComplete,
    DrainNotice,
    LeaseNotice,
    Message,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    Standing,
)
from mesh.wire.reasons import Reason

__all__ = ["AgentRuntime", "AgentSettings", "backoff_delay", "run_agent"]

log = logging.getLogger(__name__)


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
        self.settings = s = settings or AgentSettings()
        self.topology = topology = Topology(s.namespace)
        self.counters: Counter[str] = Counter()
        self._transport = transport
        self._owns_transport = transport is None
        # On a connection of its own the agent signs what it says about itself with its
        # broker user (RabbitMQ validates user_id): a manager with agent identity on checks
        # that the user is the agent named. A transport handed in signs nothing.
        self._identity = me = Identity(
            agent_id=agent.agent_id,
            deployment=agent.deployment,
            incarnation=uuid.uuid4().hex,
            user_id=url_user(s.amqp_url) if transport is None else None,
        )
        rng = rng or random.Random()
        self._capabilities = agent.bind()
        keys = s.lease_public_keys
        # The decisions (phase, heartbeats, self-fence, grant checks), sans I/O.
        self.core = AgentCore(
            agent.agent_id,
            agent.deployment,
            heartbeat_interval_s=agent.heartbeat_interval_s,
            self_fence_after_s=s.self_fence_after_s,
            leases=LeaseVerifier.from_files(keys) if keys else None,
        )
        self._task_queue = topology.agent_task_queue(agent.agent_id)
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._drain_complete = asyncio.Event()
        self._draining = False
        self._background: set[asyncio.Task[Any]] = set()
        self._task_consumer: Subscription | None = None
        self._control_consumer: Subscription | None = None
        self._reregistration: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._fatal: MeshError | None = None
        self._starting: asyncio.Task[Any] | None = None
        self._http: AgentHttpServer | None = None
        self._work = Work(self._capabilities)
        self._registration = Registration(
            agent,
            me,
            s,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            rng=rng,
            on_pool_epoch=lambda event: self._pool_events.on_event(event),
        )
        self.credentials = Credentials(
            me,
            s,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            shard=lambda: self._registration.shard,
            spawn=self._spawn,
        )
        self._liveness = Liveness(
            me,
            s,
            core=self.core,
            heartbeat_interval_s=agent.heartbeat_interval_s,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            work=self._work,
            shard=lambda: self._registration.shard,
            pool_closed=lambda: self._pool.closed,
            forget_leases=self.credentials.forget_leases,
            spawn=self._spawn,
        )
        self._pool = PoolQueue(
            me,
            capabilities=self._capabilities,
            prefetch=agent.total_concurrency,
            core=self.core,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            work=self._work,
            liveness=self._liveness,
            on_task=lambda delivery: self.tasks.on_pool_task(delivery),
            accepted=lambda: self._registration.accepted,
            draining=lambda: self._draining,
            spawn=self._spawn,
        )
        self.tasks = TaskRunner(
            me,
            s,
            capabilities=self._capabilities,
            core=self.core,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            rng=rng,
            work=self._work,
            credentials=self.credentials,
            liveness=self._liveness,
            pool=self._pool,
        )
        self._pool_events = PoolEvents(
            me,
            core=self.core,
            pool=self._pool,
            counters=self.counters,
            stop_running=self.tasks.stop_running,
            spawn=self._spawn,
        )
        self._leaving = Leaving(
            me,
            s,
            topology=topology,
            transport=lambda: self.transport,
            work=self._work,
            shard=lambda: self._registration.shard,
            refuse_all=self.tasks.refuse_all,
        )
        self._inbox = ControlInbox(
            me,
            manager_user=s.manager_user,
            topology=topology,
            transport=lambda: self.transport,
            counters=self.counters,
            awaiting_acceptance=lambda: self._registration.awaiting_answer,
            dispatch=self._dispatch_control,
        )

    # ---- public state ---------------------------------------------------------------------
    @property
    def agent_id(self) -> str:
        """The agent's ID (also its routing-key word and queue-name part)."""
        return self.agent.agent_id

    @property
    def incarnation(self) -> str:
        """A fresh hex UUID per runtime (process start); re-registration keeps it."""
        return self._identity.incarnation

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
        return dict(self._work.in_flight)

    @property
    def phase(self) -> Phase:
        """``new``, ``starting``, ``running``, ``stopping`` or ``stopped``."""
        return self.core.phase

    @property
    def http_port(self) -> int | None:
        """The port the HTTP endpoints listen on, while they do (``None`` otherwise)."""
        return None if self._http is None else self._http.port

    @property
    def shard(self) -> int | None:
        """Several managers: the shard the acceptance told us (``None``: one manager)."""
        return self._registration.shard

    @property
    def manager_user(self) -> str | None:
        """The managers' broker user control messages are taken from (``None``: not known
        yet, nothing checked)."""
        return self._inbox.manager_user

    @property
    def self_fence_after_s(self) -> float:
        return self.core.self_fence_after_s

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

    @property
    def transport(self) -> AgentTransport:
        """The transport in use; :class:`LocalProtocolError` before ``start()``."""
        if self._transport is None:
            raise LocalProtocolError("the runtime is not started")
        return self._transport

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
            self._http = AgentHttpServer.for_settings(self, self.settings, self.agent_id)
            if self._http is not None:
                await self._http.start()
            transport = await self._connect()
            bound = 2 * self.agent.total_concurrency
            own = self.topology.agent_queues(self.agent_id, bound) + self._inbox.grant_feed()
            if self.settings.shared_topology == "check":
                await transport.check_exchanges(self.topology.shared_exchanges())
            else:
                own = self.topology.shared() + own
            await transport.declare(own)
            self._control_consumer = await transport.consume(
                self._inbox.queue, self._inbox.on_control, prefetch=CONTROL_PREFETCH
            )
            await self._registration.register()
            self._liveness.start()
            self._task_consumer = await transport.consume(
                self._task_queue, self.tasks.on_task, prefetch=self.agent.total_concurrency
            )
            await self._pool.consume()
        except BaseException:
            await self._abort()
            raise
        self.core.advance("running")
        if not self._draining:
            self._ready.set()
        log.info("agent ready", extra=self._identity.extra(capabilities=sorted(self._capabilities)))

    async def _connect(self) -> AgentTransport:
        if self._transport is None:
            self._transport = await AmqpTransport.connect(
                self.settings.amqp_url,
                name=f"agent:{self.agent_id}",
                properties={c.CLIENT_PROPERTY_INCARNATION: self._identity.incarnation},
                publish_timeout_s=self.settings.publish_timeout_s,
                connect_timeout_s=self.settings.connect_timeout_s,
                liveness_probe_s=self.settings.liveness_probe_s,
            )
        self._transport.on_reconnect(self._on_reconnect)
        return self._transport

    async def _on_reconnect(self) -> None:
        if self.core.phase in ("new", "stopped"):
            return
        log.warning("agent transport reconnected", extra=self._identity.extra())
        self.counters["reconnects"] += 1
        if self.core.phase == "running":
            self._spawn(self._liveness.send(), "heartbeat")  # a forgetful manager asks sooner

    # ---- what the managers say ------------------------------------------------------------
    def _dispatch_control(self, message: Message) -> None:
        if isinstance(message, RegistrationAccepted | RegistrationRefused):
            self._registration.on_reply(message)
        elif isinstance(message, ReRegisterRequest):
            self._on_reregister_request(message)
        elif isinstance(message, DrainNotice):
            self._begin_drain(message.reason or "drain notice from the manager")
        elif isinstance(message, DrainComplete):
            log.info("manager released every lease", extra=self._identity.extra())
            self._begin_drain("drain complete")
            self._drain_complete.set()
        elif isinstance(message, LeaseNotice):
            self.credentials.on_lease_notice(message)
        elif isinstance(message, Refusal):
            self._on_refusal(message)
        elif isinstance(message, OrchestrationEvent):
            self._pool_events.on_event(message)
        elif isinstance(message, Standing):
            self._liveness.on_standing(message)
        elif isinstance(message, AdmissionState):
            self.credentials.on_admission_state(message)
        else:
            log.info("drain accepted by the manager", extra=self._identity.extra())

    def _on_reregister_request(self, request: ReRegisterRequest) -> None:
        extra = self._identity.extra
        if self._draining and request.leases_kept:
            # Handed to another manager mid-drain: our leases stay valid and a task under
            # one may still be on its way, so the drain is not over; the new owner, not
            # knowing us, says so at our next heartbeat.
            log.info("shard handed over while draining", extra=extra())
        elif self._draining:
            # The manager holds no leases on an agent it does not know: the drain is complete.
            log.info("manager forgot us while draining", extra=extra(reason=request.reason))
            self._drain_complete.set()
        elif self.core.phase != "running" or self._registering():
            log.debug("re-register request ignored: registration in progress", extra=extra())
        else:
            if request.leases_kept:
                # Our shard moved to another manager: the leases we were told of were
                # granted and stay valid (a task under one may still be on its way); only
                # the registry that counts us changes.
                self.counters["handed_over"] += 1
                log.info("registering with our shard's new manager", extra=extra())
            else:
                self._liveness.forgotten()
                self.credentials.forget_leases("the manager does not know us")
                log.warning("manager asked us to re-register", extra=extra(reason=request.reason))
            self._ready.clear()
            self._reregistration = self._spawn(self._reregister(), "re-register")

    def _registering(self) -> bool:
        background = self._reregistration is not None and not self._reregistration.done()
        return background or self._registration.in_progress

    async def _reregister(self) -> None:
        try:
            await self._registration.register()
        except MeshError as exc:
            log.error(
                "re-registration failed; stopping", extra=self._identity.extra(error=str(exc))
            )
            self._fatal = exc
            self._spawn(self._shutdown(f"re-registration failed: {exc}", deregister=False), "stop")
            return
        if not self._draining:
            self._ready.set()

    def _on_refusal(self, refusal: Refusal) -> None:
        """The manager's reply to our DrainRequest: it does not know us, so nothing is leased."""
        log.info("drain request refused", extra=self._identity.extra(reason=refusal.reason.value))
        if self._draining and refusal.reason in (Reason.UNKNOWN_AGENT, Reason.AGENT_TERMINATED):
            self._drain_complete.set()

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
        log.info("draining", extra=self._identity.extra(reason=reason))
        # Pool tasks are the pool's, not ours: the other agents take them from now on.
        self._spawn(self._pool.close(), "pool consumer")
        timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self._shutdown_task = self._spawn(self._drain_then_stop(reason, timeout, request), "drain")

    async def _drain_then_stop(self, reason: str, timeout_s: float, request: bool) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        if request:
            await self._leaving.request_drain(reason)
        if await wait_until(self._drain_complete, deadline):
            self._liveness.stop()  # the manager has forgotten us: heartbeats would be news
            await self._leaving.let_queue_empty(deadline)
        else:
            log.warning(
                "no DrainComplete from the manager in time; stopping anyway",
                extra=self._identity.extra(timeout_s=timeout_s),
            )
        await self._shutdown(reason, deregister=True)

    async def _shutdown(self, reason: str, *, deregister: bool) -> None:
        if self.core.phase in ("stopping", "stopped"):
            return
        self.core.advance("stopping")
        self._ready.clear()
        try:
            await self._pool.stop_consumer()
            await cancel_quietly(self._task_consumer)
            self._task_consumer = None
            await self._leaving.finish_in_flight()
            self._liveness.stop()
            if deregister:
                await self._leaving.deregister(reason)
            await cancel_quietly(self._control_consumer)
            self._control_consumer = None
            await self._leaving.delete_task_queue_if_empty()
        finally:
            await self._close()
        log.info("agent stopped", extra=self._identity.extra(reason=reason))

    async def _abort(self) -> None:
        """Tear down whatever ``start()`` opened, without the drain protocol."""
        if self.core.phase == "stopped":
            return
        self._liveness.stop()
        await self._pool.stop_consumer()
        for consumer in (self._task_consumer, self._control_consumer):
            await cancel_quietly(consumer)
        self._task_consumer = self._control_consumer = None
        if self._transport is not None:
            if self._registration.accepted:
                # Stopped (SIGTERM, a failure) after the manager accepted us, before start()
                # was done: it would hand us work until it declared us lost; say goodbye. (A
                # registration still unanswered is abandoned: if it is accepted later, the
                # silence ends it.)
                await self._leaving.deregister("stopped while starting")
            await self._leaving.delete_task_queue_if_empty()
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
                log.warning(
                    "closing the transport failed", extra=self._identity.extra(error=str(exc))
                )
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
                extra=self._identity.extra(task=task.get_name()),
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
