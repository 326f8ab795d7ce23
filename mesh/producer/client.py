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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from mesh import constants as c
from mesh.backoff import Backoff
from mesh.errors import (
    AdmissionRefused,
    LocalProtocolError,
    PublishNacked,
    PublishUnroutable,
    RequestTimeout,
    SubmitDeadlineExceeded,
    TaskFailed,
    TaskInputInvalid,
    TaskRefused,
    TaskTimeout,
    TransportError,
)
from mesh.ids import IdSequence, new_admission_id
from mesh.producer.retry import QUEUE_FULL_RETRY_MS, retry_delay_s, submit_delay_s
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.amqp import AmqpTransport, url_user
from mesh.transport.delivery import Delivery
from mesh.transport.ports import ClientTransport, Subscription
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionGrant,
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
    TaskRequirements,
)
from mesh.wire.codec import decode
from mesh.wire.models import (
    AcquireRequest,
    AgentSummary,
    AppliedDegradation,
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
    Task,
    TaskResult,
)
from mesh.wire.reasons import Reason
from mesh.wire.status import StatusReply, StatusRequest

log = logging.getLogger(__name__)

_FEATURES: Mapping[str, str] = MappingProxyType(
    {c.H_FEATURES: f"{c.FEATURE_UNANSWERED},{c.FEATURE_SETTLING}"}
)
"""The header naming the reply fields added since their messages' release that this client
knows (docs/protocol.md 1.2), sent with the requests whose replies have such fields."""

REPLY_MAX_BYTES = 64 * 1024 * 1024
_ASK_AGAIN_FOR_S = 15.0  # after a reconnect, while the manager's request queue is not back
# Releases asked again, spread so that producers do not come back together after a failover.
_SETTLE_BACKOFF = Backoff(base_s=0.25, cap_s=4.0, spread=0.5)
_SETTLE_RETRY_S = 60.0  # a release is asked again this long (a ledger failover, a manager's)
_ANSWERED_KEPT = 10_000  # answered correlation IDs remembered, to tell duplicates from late

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


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """A finished task: its output, and which agent and lease produced it."""

    output: dict[str, Any]
    result: TaskResult
    lease: Lease


@dataclass(frozen=True, slots=True)
class Submitted:
    """A task done on the admission path: its output, the result, and the admission."""

    output: dict[str, Any]
    result: TaskResult
    decision: AdmissionDecision  # the admitting one (grant, pool, fence)
    attempts: int  # admissions asked for, this one included
    admission_wait_s: float = 0.0  # from the call to the grant (deferrals waited out)

    @property
    def degradations(self) -> list[AppliedDegradation]:
        """What the handler gave up (each allowed by the requirements); empty: full result."""
        return self.result.degradations

    @property
    def missing_evidence(self) -> list[str]:
        """Everything the output does not rest on, over all degradations applied."""
        return [item for d in self.result.degradations for item in d.missing_evidence]


OnDeferred = Callable[[AdmissionDecision], "bool | Awaitable[bool]"]


def _answer_of(reply: Message | None) -> tuple[str, str | None]:
    """What a reply says, to tell a repeated answer (the same) from a different one: its type
    and what it grants."""
    return ("", None) if reply is None else (reply.type, _granted(reply))


def _said(reply: Message | None) -> str:
    """One line for a log or a test's output: a reply's type, outcome, reason and grant."""
    if reply is None:
        return "(undecodable)"
    parts = [reply.type]
    for field in ("outcome", "reason"):
        value = getattr(reply, field, None)
        if value:
            parts.append(str(value))
    granted = _granted(reply)
    if granted:
        parts.append(granted)
    return " ".join(parts)


def _granted(reply: Message) -> str | None:
    """What ``reply`` grants, as a key that tells two grants apart (``None``: nothing)."""
    if isinstance(reply, LeaseGranted):
        return f"lease:{reply.lease.lease_id}"
    if isinstance(reply, AdmissionDecision) and reply.grant is not None:
        return f"admission:{reply.admission_id}:{reply.grant.fence}"
    return None


class MeshClient:
    """Find, acquire, release, drain, status; and run tasks. One per process is plenty."""

    def __init__(self, transport: ClientTransport, topology: Topology, reply_queue: str) -> None:
        self.transport = transport
        self.topology = topology
        self.reply_queue = reply_queue
        self.counters: Counter[str] = Counter()
        self._pending: dict[str, asyncio.Future[Message]] = {}
        # The requests waiting for their answers (correlation ID -> what was sent), asked
        # again after a reconnect: one in a queue on a broker node that died is gone.
        self._asked: dict[str, tuple[Message, str, Mapping[str, str] | None]] = {}
        self._correlation_ids = IdSequence()
        # Correlation IDs answered lately (bounded), each with its answer's type and the grant
        # it carried, and the answer in one line: a second answer to one is a duplicate, and
        # counted if it differs.
        self._answered: OrderedDict[str, tuple[tuple[str, str | None], str]] = OrderedDict()
        # The last requests answered twice differently: (correlation ID, first, second).
        self.answered_differently: deque[tuple[str, str, str]] = deque(maxlen=20)
        self._consumer: Subscription | None = None
        self._owns_transport = False
        self._background: set[asyncio.Task[None]] = set()
        # Releases being asked again (see _settle_quietly); cancelled by close().
        self._retrying: set[asyncio.Task[None]] = set()
        # Admission IDs a call here still waits on (admit, or a whole submit): a grant for
        # one of them that arrives late is its retry's, not to be released.
        self._awaited: Counter[str] = Counter()
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
        client._consumer = await transport.consume_replies(queue, client._on_replies)
        transport.on_reconnect(client._ask_again)
        return client

    async def close(self) -> None:
        for retry in self._retrying:  # releases asked again: their reservations expire
            retry.cancel()
        if self._retrying:
            await asyncio.gather(*self._retrying, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
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
    def _on_replies(self, deliveries: list[Delivery]) -> None:
        """Replies that arrived together; one that cannot be handled loses only itself."""
        for delivery in deliveries:
            try:
                self._on_reply(delivery)
            except Exception:  # pragma: no cover - _on_reply catches what it expects
                log.exception("a reply could not be handled")

    def _on_reply(self, delivery: Delivery) -> None:
        fut = self._pending.pop(delivery.correlation_id or "", None)
        if fut is None or fut.done():
            self.counters["late_replies"] += 1
            self._release_late_grant(delivery)
            return
        try:
            # Replies come from the manager and agents, not strangers: a status of thousands
            # of agents is legitimately larger than the inbound limit for untrusted input.
            reply = decode(delivery.body, max_bytes=REPLY_MAX_BYTES)
        except Exception as exc:  # a bad reply fails its caller, not the consumer
            self._remember_answer(delivery.correlation_id, None)
            fut.set_exception(exc)
            return
        self._remember_answer(delivery.correlation_id, reply)
        fut.set_result(reply)

    def _remember_answer(self, correlation_id: str | None, reply: Message | None) -> None:
        self._answered[correlation_id or ""] = (_answer_of(reply), _said(reply))
        if len(self._answered) > _ANSWERED_KEPT:
            self._answered.popitem(last=False)

    def _release_late_grant(self, delivery: Delivery) -> None:
        """A grant that arrives after its caller gave up would pin a slot until its TTL; a
        second answer to a request already answered is counted and changes nothing."""
        try:
            reply = decode(delivery.body)
        except Exception:
            return
        correlation_id = delivery.correlation_id or ""
        answered = self._answered.get(correlation_id)
        if answered is not None:
            first, first_said = answered
            # A second answer: the manager that answered first died before acknowledging the
            # request, and another manager answered it again. An admission is answered from
            # the ledger — the same grant, which the caller holds and will settle: releasing
            # it here would take it away from under its holder. Only a grant other than the
            # first answer's (a second lease) is nobody's. A second result: the task ran twice.
            self.counters["duplicate_replies"] += 1
            if _answer_of(reply) != first:  # a grant then a refusal, two leases…: not true
                self.counters["duplicate_replies_differing"] += 1
                self.answered_differently.append((correlation_id, first_said, _said(reply)))
                log.warning(
                    "a request answered twice, differently",
                    extra={
                        "correlation_id": correlation_id,
                        "first": first_said,
                        "second": _said(reply),
                    },
                )
            if isinstance(reply, TaskResult):
                self.counters["duplicate_results"] += 1
                log.warning("a second result for a task", extra={"task_id": reply.task_id})
            if _granted(reply) in (None, first[1]):
                return
        if isinstance(reply, LeaseGranted):
            self.counters["late_grants_released"] += 1
            self._in_background(self._release_quietly(reply.lease.lease_id))
        elif (
            isinstance(reply, AdmissionDecision)
            and reply.grant is not None
            and not self._awaited[reply.admission_id]
        ):
            # Admitted after its caller gave up (the manager was away longer than the
            # request's timeout): nobody will use or settle it, so give it back now rather
            # than leave its slots held until the grant's TTL.
            self.counters["late_admissions_released"] += 1
            self._in_background(self._settle_quietly(reply.grant))

    async def _settle_again(self, grant: AdmissionGrant, actuals: Mapping[str, Any] | None) -> None:
        self.counters["settle_retried"] += 1
        await asyncio.sleep(0.25)
        await self._settle_quietly(grant, actuals, again=True)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        correlation_id = self._correlation_ids.next()
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = fut
        self._asked[correlation_id] = (message, method, headers)
        try:
            await self._ask(correlation_id, message, method, headers, timeout_s)
            async with asyncio.timeout(timeout_s):  # cheaper than wait_for: no inner task
                return await fut
        except PublishUnroutable:
            raise RequestTimeout(
                "no manager is listening (its request queue does not exist); start `mesh manager`"
            ) from None
        except TimeoutError:
            raise RequestTimeout(
                f"the manager did not answer {method} within {timeout_s:g} s; is it running?"
            ) from None
        finally:
            self._pending.pop(correlation_id, None)
            self._asked.pop(correlation_id, None)

    async def _ask(
        self,
        correlation_id: str,
        message: Message,
        method: str,
        headers: Mapping[str, str] | None,
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

    async def _ask_again(self) -> None:
        """After a reconnect, every request still waiting for its answer is sent again,
        under the same correlation ID: a request (or its answer) in a classic queue on a
        broker node that died is gone, and would otherwise cost its caller the whole request
        timeout. Asking twice is safe: the manager answers a repeated admission from the
        ledger and a repeated acquire with the same lease (its ID comes from the
        correlation ID); a second answer is counted and dropped. In the background, a few
        time while the manager's request queue is not back yet (unroutable)."""
        waiting = list(self._asked.items())
        if waiting:
            self._in_background(self._ask_all_again(waiting))

    async def _ask_all_again(
        self, waiting: list[tuple[str, tuple[Message, str, Mapping[str, str] | None]]]
    ) -> None:
        give_up_at = time.monotonic() + _ASK_AGAIN_FOR_S
        for attempt in itertools.count():
            left = []
            for correlation_id, (message, method, headers) in waiting:
                if correlation_id not in self._pending:
                    continue  # answered meanwhile
                try:
                    await self._ask(correlation_id, message, method, headers, 5.0)
                    self.counters["requests_asked_again"] += 1
                except PublishUnroutable:
                    left.append((correlation_id, (message, method, headers)))
                except TransportError as exc:  # the broker away again: its next reconnect
                    log.info("a request not asked again", extra={"error": str(exc)})
            if not left or time.monotonic() >= give_up_at:
                return
            waiting = left
            await asyncio.sleep(min(0.25 * (attempt + 1), 2.0))

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
        return _expect(reply, FindReply)

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
        return _expect(reply, LeaseGranted).lease

    async def release(self, lease_id: str) -> Released | Refusal:
        reply = await self.request(ReleaseRequest(lease_id=lease_id))
        return reply if isinstance(reply, Refusal) else _expect(reply, Released)

    async def drain(self, agent_id: str, reason: str = "") -> DrainAccepted | Refusal:
        reply = await self.request(DrainRequest(agent_id=agent_id, reason=reason))
        return reply if isinstance(reply, Refusal) else _expect(reply, DrainAccepted)

    async def status(
        self, *, timeout_s: float = 10.0, agents_offset: int = 0, agents_limit: int = 1_000
    ) -> StatusReply:
        """The fleet's summary and one page of agent rows (``agents_limit`` from
        ``agents_offset``, in agent-ID order; at most 5,000; 0: the summary alone). With
        several managers, ``unanswered_shards`` says how many shards' owners did not answer
        in time (their agents are missing); ``None`` from a manager that predates it."""
        request = StatusRequest(agents_offset=agents_offset, agents_limit=agents_limit)
        reply = await self.request(request, timeout_s=timeout_s, headers=_FEATURES)
        return _expect(reply, StatusReply)

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
        request = AdmissionRequest(
            admission_id=admission_id or new_admission_id(), requirements=requirements
        )
        self._await(request.admission_id)
        try:
            return _expect(await self.request(request, timeout_s=timeout_s), AdmissionDecision)
        finally:
            self._stop_awaiting(request.admission_id)

    def _await(self, admission_id: str) -> str:
        self._awaited[admission_id] += 1
        return admission_id

    def _stop_awaiting(self, admission_id: str) -> None:
        self._awaited[admission_id] -= 1
        if self._awaited[admission_id] <= 0:
            del self._awaited[admission_id]

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
        release = AdmissionRelease(
            admission_id=grant.admission_id,
            fence=grant.fence,
            actual_tokens=actual_tokens,
            actual_duration_s=actual_duration_s,
            finished_at=finished_at,
        )
        return _expect(await self.request(release), AdmissionReleaseReply)

    async def revoke_admission(self, admission_id: str, reason: str) -> AdmissionReleaseReply:
        """Operators only: take a grant back for a security reason — its attempt is cancelled
        where it runs and its result refused (the manager checks who sent it)."""
        revoke = AdmissionRevoke(admission_id=admission_id, reason=reason)
        return _expect(await self.request(revoke), AdmissionReleaseReply)

    async def shadow_descriptor(
        self, pool_id: str, descriptor: CapabilityDescriptor | None
    ) -> DescriptorAccepted | Refusal:
        """Operators only: evaluate every admission also against ``descriptor`` (a candidate
        next epoch) and record the difference, enforcing nothing; ``None`` removes it."""
        reply = await self.request(DescriptorShadow(pool_id=pool_id, descriptor=descriptor))
        return reply if isinstance(reply, Refusal) else _expect(reply, DescriptorAccepted)

    async def publish_descriptor(
        self, descriptor: CapabilityDescriptor
    ) -> DescriptorAccepted | Refusal:
        """Operators only: make a pool's descriptor active (the manager checks who sent it)."""
        reply = await self.request(descriptor)
        return reply if isinstance(reply, Refusal) else _expect(reply, DescriptorAccepted)

    async def explain(self, admission_id: str) -> ExplainReply:
        """Why an admission was decided as it was (``mesh explain``)."""
        return _expect(await self.request(ExplainRequest(admission_id=admission_id)), ExplainReply)

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
        called = time.monotonic()
        deadline = time.time() + timeout_s
        if requirements.deadline is not None:
            deadline = min(deadline, requirements.deadline)
        else:
            # The manager is told when this call gives up, so work it sheds or cannot finish
            # in time is refused DEADLINE_UNREACHABLE now instead of deferred until then.
            requirements = requirements.model_copy(update={"deadline": deadline})
        # Held from the first request to the last use: a late grant of this ID is this call's.
        admission_id, attempts, refusals = self._await(new_admission_id()), 0, 0
        last: AdmissionDecision | None = None
        try:
            while True:
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise self._gave_up(last, attempts)
                attempts += 1
                try:
                    decision = await self.admit(
                        requirements, admission_id=admission_id, timeout_s=min(10.0, remaining)
                    )
                except (RequestTimeout, TransportError) as exc:
                    # No answer (the manager or the broker away): again, same ID, same grant.
                    self.counters["submit_request_retries"] += 1
                    delay = submit_delay_s(None, refusals, backoff, rand)
                    assert delay is not None  # no answer is always asked again
                    refusals += 1
                    if time.time() + delay >= deadline:
                        log.info("submit gave up: no answer", extra={"error": str(exc)})
                        raise self._gave_up(last, attempts) from None
                    await asyncio.sleep(delay)
                    continue
                if decision.outcome == "admitted":
                    assert decision.grant is not None  # the model's invariant
                    waited = time.monotonic() - called
                    ran = await self._run_granted(decision, requirements, payload, deadline)
                    if isinstance(ran, TaskResult):
                        output = _output_of(ran, allowed=requirements.allowed_degradations)
                        return Submitted(output, ran, decision, attempts, waited)
                    decision = ran  # queue full, or evicted: a refusal like the others
                    self._stop_awaiting(admission_id)  # that grant is settled: a new phase
                    admission_id = self._await(new_admission_id())
                last = decision
                delay = submit_delay_s(decision, refusals, backoff, rand)
                if delay is None or not await _keep_waiting(on_deferred, decision):
                    raise AdmissionRefused(decision)
                if decision.position is not None:
                    self.counters["submit_waits_in_line"] += 1
                refusals += 1
                self.counters["submit_retries"] += 1
                if time.time() + delay >= deadline:
                    raise self._gave_up(last, attempts)
                await asyncio.sleep(delay)
        finally:
            self._stop_awaiting(admission_id)

    @staticmethod
    def _gave_up(last: AdmissionDecision | None, attempts: int) -> SubmitDeadlineExceeded:
        reason = last.reason.value if last is not None and last.reason else None
        return SubmitDeadlineExceeded(
            f"not admitted before the deadline after {attempts} attempts"
            + (f"; last refusal: {reason} ({last.detail})" if last is not None else ""),
            last_reason=reason,
            decision=last,
            attempts=attempts,
        )

    async def _run_granted(
        self,
        decision: AdmissionDecision,
        requirements: TaskRequirements,
        payload: dict[str, Any],
        deadline: float,
    ) -> TaskResult | AdmissionDecision:
        """Publish the task with its grant to the pool's queue, await the result, settle.
        A full queue (nack) settles the grant and comes back as a ``QUEUE_FULL`` refusal."""
        grant = decision.grant
        assert grant is not None
        task = Task(
            task_id=uuid.uuid4().hex,
            capability=requirements.capability.name,
            payload=payload,
            deadline=deadline,
            submitted_at=time.time(),
            grant=grant,
            allowed_degradations=requirements.allowed_degradations,
        )
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[task.task_id] = fut
        actuals: dict[str, float] = {}  # none: settled as a cancellation
        evicted = False
        try:
            try:
                await self._publish_task(
                    names.pool_task_key(grant.pool_id),
                    task,
                    {c.H_ADMISSION_ID: grant.admission_id},
                    deadline,
                )
            except PublishNacked:
                self.counters["queue_full"] += 1
                return AdmissionDecision(
                    admission_id=grant.admission_id,
                    outcome="deferred",
                    reason=AdmissionReason.QUEUE_FULL,
                    detail=f"the task queue of pool {grant.pool_id} is full (the broker nacked)",
                    retry_after_ms=QUEUE_FULL_RETRY_MS,
                    allowed_degradations=decision.allowed_degradations,
                )
            except PublishUnroutable:
                raise TaskRefused(
                    Reason.UNROUTABLE.value, f"pool {grant.pool_id} has no task queue"
                ) from None
            try:
                reply = await asyncio.wait_for(fut, max(0.0, deadline - time.time()))
            except TimeoutError:
                raise SubmitDeadlineExceeded(
                    f"no result from pool {grant.pool_id} before the deadline",
                    last_reason=None,
                    decision=decision,
                    attempts=0,
                ) from None
            result = _expect(reply, TaskResult)
            if result.error is not None and result.error.code is Reason.EVICTED:
                # The manager took the grant back (and released it) for more urgent work; the
                # task declared itself recoverable: ask again, under a new admission.
                self.counters["evicted"] += 1
                evicted = True
                return AdmissionDecision(
                    admission_id=grant.admission_id,
                    outcome="deferred",
                    reason=AdmissionReason.EVICTED,
                    detail=result.error.message[:1000],
                    allowed_degradations=decision.allowed_degradations,
                )
            actuals = {
                "actual_duration_s": max(0.0, result.finished_at - result.started_at),
                "finished_at": result.finished_at,
            }
            return result
        finally:  # exactly one settlement, whatever happened: the slot goes back
            self._pending.pop(task.task_id, None)
            if not evicted:  # an evicted grant is released already
                await self._settle_quietly(grant, actuals)

    async def _settle_quietly(
        self,
        grant: AdmissionGrant,
        actuals: Mapping[str, Any] | None = None,
        *,
        again: bool = False,
    ) -> None:
        """Release ``grant``. When the manager cannot reach its ledger or does not answer, it
        is asked again in the background (a release is fenced and idempotent: asking twice
        changes nothing) for up to ``_SETTLE_RETRY_S``, so the caller has its result at once;
        :meth:`close` stops those retries, and the reservation then expires on its own.
        Never raises: the task's outcome is not masked by its settlement."""
        give_up_at = time.monotonic() + (_SETTLE_RETRY_S if again else 0.0)
        attempt = 0
        while True:
            transient = True
            try:
                reply = await self.release_admission(grant, **(actuals or {}))
            except (TransportError, OSError) as exc:
                failure = str(exc)
            except Exception as exc:  # not a transient fault: no use asking again
                transient, give_up_at, failure = False, 0.0, str(exc)
            else:
                if reply.reason is not AdmissionReason.LEDGER_UNAVAILABLE:
                    if not reply.released:
                        self.counters["settle_refused"] += 1
                    return
                failure = reply.detail
            if not again and transient:
                retry = asyncio.create_task(self._settle_again(grant, actuals))
                self._retrying.add(retry)
                retry.add_done_callback(self._retrying.discard)
                return
            pause = _SETTLE_BACKOFF.delay_s(attempt, random.random)
            attempt += 1
            if time.monotonic() + pause > give_up_at:
                self.counters["settle_failed"] += 1
                log.warning(
                    "settlement failed; the reservation expires on its own",
                    extra={"admission_id": grant.admission_id, "error": failure},
                )
                return
            self.counters["settle_retried"] += 1
            await asyncio.sleep(pause)

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
        :meth:`_publish_task`). Only when the deadline comes first does the last
        :class:`~mesh.errors.TransportError` reach the caller.

        An agent that answers ``UNKNOWN_LEASE`` did not run the task: it does not know the
        lease (it restarted under its ID after the lease was granted to its predecessor, whose
        leases ended with it). The task is sent again under a new lease, until the deadline;
        so is a task the agent's queue refused (``QUEUE_FULL``: full, or a channel RabbitMQ
        3.10 keeps refusing after a queue leader's death), after a pause — backpressure is a
        wait, as on the admission path. Always the same task (one task ID, so one idempotency
        key): if its first copy ran after all (a refused publish RabbitMQ enqueued; a
        predecessor killed mid-run), effects kept with :func:`mesh.agent.once` happen once.
        """
        deadline = time.time() + timeout_s
        task_id = uuid.uuid4().hex
        refused = 0  # publishes the agents' queues refused, so far
        while True:
            lease = await self._acquire_until(capability, version_spec, deadline)
            if isinstance(lease, Refusal):
                raise TaskRefused(
                    lease.reason.value, lease.detail, retry_after_ms=lease.retry_after_ms
                )
            full: TaskRefused | None = None
            try:
                result = await self._send_and_wait(lease, payload, deadline, task_id)
            except TaskRefused as refusal:
                if refusal.code != Reason.QUEUE_FULL.value:
                    raise
                full = refusal
            finally:
                await self._release_quietly(lease.lease_id)
            if full is not None:
                delay = retry_delay_s(QUEUE_FULL_RETRY_MS, refused, Backoff(), random.random)
                if time.time() + delay >= deadline:
                    raise full
                refused += 1
                self.counters["run_task_queue_full_retries"] += 1
                await asyncio.sleep(delay)
                continue
            if not _lease_unknown(result) or time.time() >= deadline:
                return TaskOutcome(_output_of(result), result, lease)
            self.counters["run_task_lease_retries"] += 1
            log.info(
                "the agent did not know our lease; sending the task under a new one",
                extra={"agent_id": lease.agent_id, "lease_id": lease.lease_id},
            )

    async def _send_and_wait(
        self, lease: Lease, payload: dict[str, Any], deadline: float, task_id: str | None = None
    ) -> TaskResult:
        task = Task(
            task_id=task_id or uuid.uuid4().hex,
            capability=lease.capability,
            lease_id=lease.lease_id,
            payload=payload,
            deadline=deadline,
            submitted_at=time.time(),
        )
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[task.task_id] = fut
        try:
            await self._publish_task(lease.agent_id, task, {c.H_LEASE_ID: lease.lease_id}, deadline)
            reply = await asyncio.wait_for(fut, max(0.0, deadline - time.time()))
        except PublishNacked:
            raise TaskRefused(
                Reason.QUEUE_FULL.value, f"{lease.agent_id}'s task queue is full"
            ) from None
        except PublishUnroutable:
            raise TaskRefused(
                Reason.UNROUTABLE.value, f"{lease.agent_id} has no task queue"
            ) from None
        except TimeoutError:
            raise TaskTimeout(
                Reason.DEADLINE_EXCEEDED.value,
                f"no result from {lease.agent_id} before the deadline",
                task_id=task.task_id,
            ) from None
        finally:
            self._pending.pop(task.task_id, None)
        return _expect(reply, TaskResult)

    async def _acquire_until(
        self, capability: str, version_spec: str, deadline: float
    ) -> Lease | Refusal:
        """``acquire``, asked again after a timeout or a transport error until ``deadline``."""
        retries = 0
        while True:
            remaining = max(0.1, deadline - time.time())
            try:
                answer = await self.acquire(
                    capability, version_spec, ttl_s=remaining + 5, timeout_s=min(10.0, remaining)
                )
                if not (isinstance(answer, Refusal) and answer.reason is Reason.UNKNOWN_LEASE):
                    return answer
                # The request was asked again after a reconnect, and the lease its first ask
                # was granted is gone (its grant could not be delivered: released at once).
                # A new request is a new lease.
                self.counters["acquire_lease_gone_retries"] += 1
                delay = retry_delay_s(None, retries, Backoff(), random.random)
                retries += 1
                if time.time() + delay >= deadline:
                    return answer
                await asyncio.sleep(delay)
                continue
            except (RequestTimeout, TransportError):
                delay = retry_delay_s(None, retries, Backoff(), random.random)
                retries += 1
                if time.time() + delay >= deadline:
                    raise
                self.counters["acquire_retries"] += 1
                await asyncio.sleep(delay)

    async def _publish_task(
        self, key: str, task: Task, headers: dict[str, Any], deadline: float
    ) -> None:
        """Publish a task to the tasks exchange; a publish whose outcome is unknown (no
        confirm in time, the connection lost mid-publish) is published again until
        ``deadline``. The task may then arrive twice: one task ID and one idempotency key, so
        the agent that answered it answers again from its record, and effects kept with
        :func:`mesh.agent.once` happen once. A nack or a return is an answer: raised."""
        retries = 0
        while True:
            try:
                await self.transport.publish(
                    self.topology.tasks_exchange,
                    key,
                    task,
                    reply_to=self.reply_queue,
                    correlation_id=task.task_id,
                    headers=headers,
                    persistent=True,
                )
                return
            except (PublishNacked, PublishUnroutable):
                raise
            except TransportError:
                delay = retry_delay_s(None, retries, Backoff(), random.random)
                retries += 1
                if time.time() + delay >= deadline:
                    raise
                self.counters["task_publish_retries"] += 1
                await asyncio.sleep(delay)

    async def _release_quietly(self, lease_id: str) -> None:
        try:
            await self.release(lease_id)
        except Exception as exc:  # the lease expires on its own; never mask the task's outcome
            self.counters["release_failed"] += 1
            log.warning("release failed", extra={"lease_id": lease_id, "error": str(exc)})


def _lease_unknown(result: TaskResult) -> bool:
    """The agent refused the task at claim for a lease it does not know: not run."""
    return result.error is not None and result.error.code is Reason.UNKNOWN_LEASE


def _output_of(result: TaskResult, allowed: Sequence[str] = ()) -> dict[str, Any]:
    """The output of a successful result; a failed one raises TaskInputInvalid / TaskFailed
    with the agent's machine-readable code, and so does one degraded beyond ``allowed``."""
    if result.status == "ok" and result.output is not None:
        widened = sorted({d.kind for d in result.degradations} - set(allowed))
        if widened:
            raise TaskFailed(
                Reason.DEGRADATION_NOT_ALLOWED.value,
                f"agent {result.agent_id} degraded the result by {', '.join(widened)}, "
                f"which the task did not allow; the output is withheld",
                task_id=result.task_id,
            )
        return result.output
    error = result.error
    code = error.code if error else Reason.HANDLER_ERROR
    message = error.message if error else "no output"
    cls = TaskInputInvalid if code is Reason.INPUT_SCHEMA_VIOLATION else TaskFailed
    raise cls(code.value, message, task_id=result.task_id)


async def _keep_waiting(on_deferred: OnDeferred | None, decision: AdmissionDecision) -> bool:
    if on_deferred is None:
        return True
    keep = on_deferred(decision)
    return keep if isinstance(keep, bool) else await keep


M = TypeVar("M", bound=Message)


def _expect(reply: Message, cls: type[M]) -> M:
    if not isinstance(reply, cls):
        raise LocalProtocolError(f"expected {cls.TYPE}, got {reply.type}")
    return reply
