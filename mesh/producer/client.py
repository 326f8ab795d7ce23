"""The client API over RabbitMQ, and the producer helper built on it.

:class:`MeshClient` talks to the manager by request/reply: each request goes
to the control exchange (``rpc.<method>``) with ``reply_to`` set to this
client's exclusive reply queue and a fresh ``correlation_id``; replies are
matched back to the waiting call by that ID. A reply that arrives after its
caller gave up is counted and dropped.

:meth:`MeshClient.submit` is the producer's one call on the admission path: ask the manager
to admit the task by its requirements (capability and version range, never an agent); while
the answer is ``deferred``, wait ``retry_after_ms`` plus a jittered exponential backoff
(:mod:`mesh.producer.retry`) and ask again with the same admission ID; once admitted, publish the
task with its grant to the pool's bounded queue (confirmed: a nack — the queue is full — gives
the grant back and counts as a ``QUEUE_FULL`` refusal, retried like the others under a new
admission ID), await the result, and settle the grant with what the work really took. It gives
up at the deadline with :class:`~mesh.errors.SubmitDeadlineExceeded` carrying the last reason
code; a ``rejected`` answer raises :class:`~mesh.errors.AdmissionRefused` with the whole reply.
Callers that want to decide for themselves pass ``on_deferred`` (return ``False`` to stop
waiting) or call :meth:`MeshClient.admit` directly.

:meth:`MeshClient.run_task` is the lease path's helper: acquire a slot on the
best agent for a capability and version range, publish the task to that
agent's bounded task queue (confirmed), await the result, release the slot.
Refusals and failures raise typed errors carrying the machine-readable code.

:class:`MeshClient` is the facade; its rooms receive what they need from it:
:mod:`mesh.producer.replies` (matching replies to calls, late and duplicate answers, asking
again after a reconnect), :mod:`mesh.producer.admission` (``submit`` and settling grants),
:mod:`mesh.producer.leases` (``run_task``) and :mod:`mesh.producer.tasks` (a task's publish
and its result).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from mesh import constants as c
from mesh.backoff import Backoff
from mesh.errors import LocalProtocolError
from mesh.producer.admission import AdmissionPath, OnDeferred
from mesh.producer.leases import LeasePath
from mesh.producer.replies import Replies, expect
from mesh.producer.tasks import Submitted, TaskOutcome, TaskSender
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.amqp import AmqpTransport, url_user
from mesh.transport.ports import ClientTransport, Subscription
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionGrant,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorAccepted,
    DescriptorShadow,
    ExplainReply,
    ExplainRequest,
    TaskRequirements,
)
from mesh.wire.models import (
    AcquireRequest,
    AgentSummary,
    DrainAccepted,
    DrainRequest,
    FindReply,
    FindRequest,
    Lease,
    LeaseGranted,
    Message,
    Refusal,
    Released,
    ReleaseRequest,
    TaskResult,
)
from mesh.wire.status import StatusReply, StatusRequest

__all__ = ["MeshClient", "OnDeferred", "Submitted", "TaskOutcome"]

log = logging.getLogger(__name__)

_FEATURES: Mapping[str, str] = MappingProxyType(
    {c.H_FEATURES: f"{c.FEATURE_UNANSWERED},{c.FEATURE_SETTLING},{c.FEATURE_POOL_SIGNALS}"}
)
"""The header naming the reply fields added since their messages' release that this client
knows (docs/protocol.md 1.2), sent with the requests whose replies have such fields."""

_METHODS: dict[type[Message], str] = {
    FindRequest: "find",
    AcquireRequest: "acquire",
    ReleaseRequest: "release",
    DrainRequest: "drain",
    StatusRequest: "status",
    AdmissionRequest: "admit",
    AdmissionRelease: "admission-release",
    AdmissionRevoke: "admission-revoke",
    CapabilityDescriptor: "descriptor",
    DescriptorShadow: "descriptor-shadow",
    ExplainRequest: "explain",
}


class MeshClient:
    """Find, acquire, release, drain, status; and run tasks. One per process is plenty."""

    def __init__(self, transport: ClientTransport, topology: Topology, reply_queue: str) -> None:
        self.transport = transport
        self.topology = topology
        self.reply_queue = reply_queue
        self.counters: Counter[str] = Counter()
        # Correlation ID (a request's) or task ID -> the future its answer resolves.
        self._pending: dict[str, asyncio.Future[Message]] = {}
        sender = TaskSender(transport, topology.tasks_exchange, reply_queue, self.counters)
        self._admissions = AdmissionPath(self.request, sender, self._pending, self.counters)
        self._leases = LeasePath(self.release, sender, self._pending, self.counters)
        self._replies = Replies(
            self._pending,
            self.counters,
            ask=self._ask,
            release_lease=self._leases.release_quietly,
            settle_grant=self._admissions.settle_quietly,
            awaited=self._admissions.is_awaited,
            destination=topology.control_exchange,
        )
        # The last requests answered twice differently: (correlation ID, first, second).
        self.answered_differently = self._replies.answered_differently
        self._consumer: Subscription | None = None
        self._owns_transport = False
        self.user_id: str | None = None  # the broker user: our tenant, as RabbitMQ validates it

    @classmethod
    async def connect(
        cls,
        url: str = c.DEFAULT_AMQP_URL,
        *,
        namespace: str = c.DEFAULT_NAMESPACE,
        name: str = "client",
        transport: ClientTransport | None = None,
        user_id: str | None = None,
        declare: bool = True,
    ) -> MeshClient:
        """Connect to ``url`` (or use ``transport``). Requests carry ``user_id``: on a
        connection of its own, the URL's user (RabbitMQ validates it); with a transport
        handed in, ``user_id`` — the in-memory broker of :mod:`mesh.testing` takes it as
        said, so a test can speak as its manager's operator. ``declare``: declare the
        namespace's shared exchanges (any client may); ``False`` only checks they exist, so a
        read-only caller (``mesh status``) changes nothing on the broker, and a namespace no
        manager ever set up raises :class:`~mesh.errors.TopologyMissing`."""
        owns = transport is None
        if transport is None:
            transport = await AmqpTransport.connect(url, name=name)
        topology = Topology(namespace=namespace)
        try:
            if declare:
                await transport.declare(topology.shared())
            else:
                await transport.check_exchanges(topology.shared_exchanges())
        except BaseException:
            if owns:
                await transport.close()
            raise
        queue = names.reply_queue(namespace, name.replace(":", "-"), uuid.uuid4().hex[:8])
        client = cls(transport, topology, queue)
        client._owns_transport = owns
        client.user_id = url_user(url) if owns else user_id  # as RabbitMQ decodes it
        # Declared where it is read (over AMQP: the consume-only connection, which hands a
        # read's replies over at once instead of a task and pamqp objects for each).
        client._consumer = await transport.consume_replies(queue, client._replies.on_replies)
        transport.on_reconnect(client._replies.ask_again)
        return client

    async def close(self) -> None:
        await self._admissions.stop_settling()  # releases asked again: their reservations expire
        await self._replies.wait_background()
        if self._consumer is not None:
            await self._consumer.cancel()
        for fut in self._pending.values():
            fut.cancel()
        if self._owns_transport:
            await self.transport.close()

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # ---- request/reply --------------------------------------------------------------------
    async def request(
        self,
        message: Message,
        *,
        timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> Message:
        """Send one request to the manager and wait for its reply (``headers``: AMQP
        headers to send with it, such as the features this client knows)."""
        method = _METHODS.get(type(message))
        if method is None:
            raise LocalProtocolError(f"{message.type} is not a manager request")
        return await self._replies.request(message, method, timeout_s=timeout_s, headers=headers)

    async def _ask(
        self,
        correlation_id: str,
        message: Message,
        method: str,
        headers: Mapping[str, Any] | None,
        timeout_s: float,
    ) -> None:
        await self.transport.publish(
            self.topology.control_exchange,
            names.rpc_key(method),
            message,
            reply_to=self.reply_queue,
            correlation_id=correlation_id,
            headers=headers,
            timeout_s=timeout_s,
            user_id=self.user_id,
        )

    # ---- the API --------------------------------------------------------------------------
    async def find(
        self, capability: str, version_spec: str = ">=0", limit: int | None = None
    ) -> list[AgentSummary]:
        """Agents that can take work now, best first. Empty is a normal answer. With several
        managers, a list missing the agents of owners that did not answer in time is logged
        as a warning (:meth:`find_reply` gives the count)."""
        reply = await self.find_reply(capability, version_spec, limit)
        if reply.unanswered_shards:
            log.warning(
                "find %s %s is partial: the owners of %d shard(s) did not answer in time, "
                "their agents are missing",
                capability, version_spec, reply.unanswered_shards,
            )  # fmt: skip
        return reply.agents

    async def find_reply(
        self, capability: str, version_spec: str = ">=0", limit: int | None = None
    ) -> FindReply:
        """:meth:`find`'s whole reply: the agents, and with several managers
        ``unanswered_shards``, how many shards' owners did not answer in time (their agents
        are missing; ``None`` from a manager that predates the field)."""
        reply = await self.request(
            FindRequest(capability=capability, version_spec=version_spec, limit=limit),
            headers=_FEATURES,
        )
        if isinstance(reply, Refusal):
            raise LocalProtocolError(f"{reply.reason}: {reply.detail}")
        return expect(reply, FindReply)

    async def acquire(
        self,
        capability: str,
        version_spec: str = ">=0",
        *,
        agent_id: str | None = None,
        ttl_s: float | None = None,
        timeout_s: float = 10.0,
    ) -> Lease | Refusal:
        """A lease on one slot, or a refusal with a reason code (a value, not an error)."""
        reply = await self.request(
            AcquireRequest(
                capability=capability, version_spec=version_spec, agent_id=agent_id, ttl_s=ttl_s
            ),
            timeout_s=timeout_s,
        )
        if isinstance(reply, Refusal):
            return reply
        return expect(reply, LeaseGranted).lease

    async def release(self, lease_id: str) -> Released | Refusal:
        reply = await self.request(ReleaseRequest(lease_id=lease_id))
        return reply if isinstance(reply, Refusal) else expect(reply, Released)

    async def drain(self, agent_id: str, reason: str = "") -> DrainAccepted | Refusal:
        reply = await self.request(DrainRequest(agent_id=agent_id, reason=reason))
        return reply if isinstance(reply, Refusal) else expect(reply, DrainAccepted)

    async def status(
        self, *, timeout_s: float = 10.0, agents_offset: int = 0, agents_limit: int = 1_000
    ) -> StatusReply:
        """The fleet's summary and one page of agent rows (``agents_limit`` from
        ``agents_offset``, in agent-ID order; at most 5,000; 0: the summary alone). With
        several managers, ``unanswered_shards`` says how many shards' owners did not answer
        in time (their agents are missing); ``None`` from a manager that predates it."""
        request = StatusRequest(agents_offset=agents_offset, agents_limit=agents_limit)
        reply = await self.request(request, timeout_s=timeout_s, headers=_FEATURES)
        return expect(reply, StatusReply)

    # ---- admission --------------------------------------------------------------------------
    async def admit(
        self,
        requirements: TaskRequirements,
        *,
        admission_id: str | None = None,
        timeout_s: float = 10.0,
    ) -> AdmissionDecision:
        """Ask the manager to admit a task: ``admitted`` with a grant, or ``rejected`` /
        ``deferred`` with a reason code (and ``retry_after_ms`` when retrying can help).
        Retrying with the same ``admission_id`` and requirements is safe: same decision.
        Without one, a fresh time-ordered ID is made (:func:`mesh.ids.new_admission_id`);
        choose your own the same way if you can — random IDs cost the ledger more."""
        return await self._admissions.admit(
            requirements, admission_id=admission_id, timeout_s=timeout_s
        )

    async def release_admission(
        self,
        grant: AdmissionGrant,
        *,
        actual_tokens: int | None = None,
        actual_duration_s: float | None = None,
        finished_at: float | None = None,
    ) -> AdmissionReleaseReply:
        """Settle a phase: give the grant's reservations back (fenced: a stale grant cannot).

        Report what the work really cost when it completed (the manager's metrics compare it
        with the estimates and the deadline); without it the release counts as a cancellation.
        """
        return await self._admissions.release(
            grant,
            actual_tokens=actual_tokens,
            actual_duration_s=actual_duration_s,
            finished_at=finished_at,
        )

    async def revoke_admission(self, admission_id: str, reason: str) -> AdmissionReleaseReply:
        """Operators only: take a grant back for a security reason — its attempt is cancelled
        where it runs and its result refused (the manager checks who sent it)."""
        revoke = AdmissionRevoke(admission_id=admission_id, reason=reason)
        return expect(await self.request(revoke), AdmissionReleaseReply)

    async def shadow_descriptor(
        self, pool_id: str, descriptor: CapabilityDescriptor | None
    ) -> DescriptorAccepted | Refusal:
        """Operators only: evaluate every admission also against ``descriptor`` (a candidate
        next epoch) and record the difference, enforcing nothing; ``None`` removes it."""
        reply = await self.request(DescriptorShadow(pool_id=pool_id, descriptor=descriptor))
        return reply if isinstance(reply, Refusal) else expect(reply, DescriptorAccepted)

    async def publish_descriptor(
        self, descriptor: CapabilityDescriptor
    ) -> DescriptorAccepted | Refusal:
        """Operators only: make a pool's descriptor active (the manager checks who sent it)."""
        reply = await self.request(descriptor)
        return reply if isinstance(reply, Refusal) else expect(reply, DescriptorAccepted)

    async def explain(self, admission_id: str) -> ExplainReply:
        """Why an admission was decided as it was (``mesh explain``)."""
        return expect(await self.request(ExplainRequest(admission_id=admission_id)), ExplainReply)

    # ---- the admission path: submit ---------------------------------------------------------
    async def submit(
        self,
        requirements: TaskRequirements,
        payload: dict[str, Any],
        *,
        timeout_s: float = 30.0,
        backoff: Backoff = Backoff(),
        on_deferred: OnDeferred | None = None,
        rand: Callable[[], float] = random.random,
    ) -> Submitted:
        """Admit by requirements, run on the granted pool, await the result, settle.

        Gives up at the earlier of ``requirements.deadline`` and ``timeout_s`` from now, and
        sends that deadline with the requirements when they carry none.
        Raises :class:`AdmissionRefused` (``rejected``, or ``on_deferred`` said stop),
        :class:`SubmitDeadlineExceeded` (with the last reason code), ``TaskFailed`` /
        ``TaskInputInvalid`` (the agent's answer, or ``DEGRADATION_NOT_ALLOWED``: degraded
        beyond ``requirements.allowed_degradations``) or ``TaskRefused`` (``UNROUTABLE``: the
        pool has no queue). A full pool queue (``QUEUE_FULL``) and an eviction (``EVICTED``,
        only of work declared ``rebuildable`` or ``retryable``) are retried like deferrals,
        under a new admission ID. A request that gets no answer in time, or cannot be sent
        (the manager or the broker away), is asked again with the **same** admission ID
        until the deadline — the ledger decides an ID once, so a retry never takes a second
        grant. A deferral with a ``position`` (a place in the pool's line) is retried, with
        the same ID, after exactly its ``retry_after_ms``, which keeps the place; others
        after ``retry_after_ms`` and a jittered backoff. ``Submitted.degradations`` says what
        the result gave up.
        """
        return await self._admissions.submit(
            requirements,
            payload,
            timeout_s=timeout_s,
            backoff=backoff,
            on_deferred=on_deferred,
            rand=rand,
        )

    # ---- the lease path -----------------------------------------------------------------
    async def run_task(
        self,
        capability: str,
        payload: dict[str, Any],
        *,
        version_spec: str = ">=0",
        timeout_s: float = 30.0,
    ) -> TaskOutcome:
        """Acquire, send, await, release. Raises TaskRefused/TaskInputInvalid/TaskFailed/
        TaskTimeout with the machine-readable code; a refused lease's ``retry_after_ms``
        (the manager's hint of when a slot should be free) is on the ``TaskRefused``.

        Gives up at ``timeout_s`` from now. A lease request that gets no answer in time, or
        cannot be sent (the manager or the broker away), is asked again until then — a lease
        granted to a request given up on is released when its late answer comes
        (``counters["late_grants_released"]``) — and so is a task publish whose outcome is
        unknown: the same task, under the same ID, which the agent answers once (see
        :meth:`TaskSender.publish <mesh.producer.tasks.TaskSender.publish>`). Only when the
        deadline comes first does the last :class:`~mesh.errors.TransportError` reach the
        caller.

        An agent that answers ``UNKNOWN_LEASE`` did not run the task: it does not know the
        lease (it restarted under its ID after the lease was granted to its predecessor, whose
        leases ended with it). The task is sent again under a new lease, until the deadline;
        so is a task the agent's queue refused (``QUEUE_FULL``: full, or a channel RabbitMQ
        3.10 keeps refusing after a queue leader's death), after a pause — backpressure is a
        wait, as on the admission path. Always the same task (one task ID, so one idempotency
        key): if its first copy ran after all (a refused publish RabbitMQ enqueued; a
        predecessor killed mid-run), effects kept with :func:`mesh.agent.once` happen once.
        """
        return await self._leases.run_task(
            self.acquire, capability, payload, version_spec=version_spec, timeout_s=timeout_s
        )

    async def _send_and_wait(
        self, lease: Lease, payload: dict[str, Any], deadline: float, task_id: str | None = None
    ) -> TaskResult:
        """One task under ``lease``, its result awaited (tests send tasks this way)."""
        return await self._leases.send_and_wait(lease, payload, deadline, task_id)
