"""Matching the manager's and agents' replies to the calls waiting for them.

Each request goes out under a fresh correlation ID with a future in ``pending``; a task's
result comes back under its task ID the same way. :class:`Replies` resolves those futures,
remembers lately answered IDs so that a second answer is told from a late one, gives back
a grant whose caller gave up (it would pin a slot until its TTL), and after a reconnect asks
again every request still waiting. Kept apart from :class:`~mesh.producer.MeshClient` so the
rules for late, duplicate and lost answers can be read in one place.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from mesh import tracing
from mesh.errors import LocalProtocolError, PublishUnroutable, RequestTimeout, TransportError
from mesh.ids import IdSequence
from mesh.topology import names
from mesh.transport.delivery import Delivery
from mesh.wire.admission import AdmissionDecision, AdmissionGrant
from mesh.wire.codec import decode
from mesh.wire.models import LeaseGranted, Message, TaskResult

__all__ = ["REPLY_MAX_BYTES", "Ask", "Replies", "Request", "expect"]

log = logging.getLogger(__name__)

REPLY_MAX_BYTES = 64 * 1024 * 1024
_rpc_key = functools.lru_cache(maxsize=64)(names.rpc_key)  # a request's key: made once
_ASK_AGAIN_FOR_S = 15.0  # after a reconnect, while the manager's request queue is not back
_ANSWERED_KEPT = 10_000  # answered correlation IDs remembered, to tell duplicates from late

_Asked = tuple[Message, str, Mapping[str, Any] | None]  # a request, its method, its headers


class Ask(Protocol):
    """Publish one request to the manager under ``correlation_id`` (``method``: its
    ``rpc.<method>`` key)."""

    def __call__(
        self,
        correlation_id: str,
        message: Message,
        method: str,
        headers: Mapping[str, Any] | None,
        timeout_s: float,
    ) -> Awaitable[None]: ...


class Request(Protocol):
    """:meth:`MeshClient.request <mesh.producer.MeshClient.request>`: one request, its reply."""

    def __call__(
        self,
        message: Message,
        *,
        timeout_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
    ) -> Awaitable[Message]: ...


class Replies:
    """The futures waiting for answers and what arrives for them.

    ``pending`` (correlation ID or task ID -> future) is shared with the paths that wait for
    task results. ``release_lease`` and ``settle_grant`` give back a grant that arrived after
    its caller gave up; ``awaited`` says whether a call still waits on an admission ID (a late
    grant of it is that call's retry's, not to be given back)."""

    def __init__(
        self,
        pending: dict[str, asyncio.Future[Message]],
        counters: Counter[str],
        *,
        ask: Ask,
        release_lease: Callable[[str], Coroutine[Any, Any, None]],
        settle_grant: Callable[[AdmissionGrant], Coroutine[Any, Any, None]],
        awaited: Callable[[str], bool],
        destination: str = "",
    ) -> None:
        self.pending = pending
        self._destination = destination  # the exchange requests go to (for their spans)
        self._counters = counters
        self._ask = ask
        self._release_lease = release_lease
        self._settle_grant = settle_grant
        self._awaited = awaited
        # The requests waiting for their answers (correlation ID -> what was sent), asked
        # again after a reconnect: one in a queue on a broker node that died is gone.
        self._asked: dict[str, _Asked] = {}
        self._correlation_ids = IdSequence()
        # Correlation IDs answered lately (bounded), each with its answer's type and the grant
        # it carried, and the answer in one line: a second answer to one is a duplicate, and
        # counted if it differs.
        self._answered: OrderedDict[str, tuple[tuple[str, str | None], str]] = OrderedDict()
        # The last requests answered twice differently: (correlation ID, first, second).
        self.answered_differently: deque[tuple[str, str, str]] = deque(maxlen=20)
        self._background: set[asyncio.Task[None]] = set()

    async def wait_background(self) -> None:
        """Wait for the work started in the background (grants given back, asking again)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ---- asking ---------------------------------------------------------------------------
    async def request(
        self,
        message: Message,
        method: str,
        *,
        timeout_s: float,
        headers: Mapping[str, Any] | None,
    ) -> Message:
        """Send ``message`` as ``rpc.<method>`` and wait for its reply."""
        correlation_id = self._correlation_ids.next()
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.pending[correlation_id] = fut
        try:
            # Its trace context is kept with it: asked again, it is the same message.
            with tracing.send(
                self._destination, _rpc_key(method), conversation_id=correlation_id
            ) as sent:
                headers = sent.headers(headers)
                self._asked[correlation_id] = (message, method, headers)
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
            self.pending.pop(correlation_id, None)
            self._asked.pop(correlation_id, None)

    async def ask_again(self) -> None:
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

    async def _ask_all_again(self, waiting: list[tuple[str, _Asked]]) -> None:
        give_up_at = time.monotonic() + _ASK_AGAIN_FOR_S
        for attempt in itertools.count():
            left = []
            for correlation_id, (message, method, headers) in waiting:
                if correlation_id not in self.pending:
                    continue  # answered meanwhile
                try:
                    await self._ask(correlation_id, message, method, headers, 5.0)
                    self._counters["requests_asked_again"] += 1
                except PublishUnroutable:
                    left.append((correlation_id, (message, method, headers)))
                except TransportError as exc:  # the broker away again: its next reconnect
                    log.info("a request not asked again", extra={"error": str(exc)})
            if not left or time.monotonic() >= give_up_at:
                return
            waiting = left
            await asyncio.sleep(min(0.25 * (attempt + 1), 2.0))

    # ---- answers --------------------------------------------------------------------------
    def on_replies(self, deliveries: list[Delivery]) -> None:
        """Replies that arrived together; one that cannot be handled loses only itself."""
        for delivery in deliveries:
            try:
                self._on_reply(delivery)
            except Exception:  # pragma: no cover - _on_reply catches what it expects
                log.exception("a reply could not be handled")

    def _on_reply(self, delivery: Delivery) -> None:
        fut = self.pending.pop(delivery.correlation_id or "", None)
        if fut is None or fut.done():
            self._counters["late_replies"] += 1
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
            self._counters["duplicate_replies"] += 1
            if _answer_of(reply) != first:  # a grant then a refusal, two leases…: not true
                self._counters["duplicate_replies_differing"] += 1
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
                self._counters["duplicate_results"] += 1
                log.warning("a second result for a task", extra={"task_id": reply.task_id})
            if _granted(reply) in (None, first[1]):
                return
        if isinstance(reply, LeaseGranted):
            self._counters["late_grants_released"] += 1
            self._in_background(self._release_lease(reply.lease.lease_id))
        elif (
            isinstance(reply, AdmissionDecision)
            and reply.grant is not None
            and not self._awaited(reply.admission_id)
        ):
            # Admitted after its caller gave up (the manager was away longer than the
            # request's timeout): nobody will use or settle it, so give it back now rather
            # than leave its slots held until the grant's TTL.
            self._counters["late_admissions_released"] += 1
            self._in_background(self._settle_grant(reply.grant))

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


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


M = TypeVar("M", bound=Message)


def expect(reply: Message, cls: type[M]) -> M:
    """``reply`` as a ``cls``; any other message is a :class:`~mesh.errors.LocalProtocolError`."""
    if not isinstance(reply, cls):
        raise LocalProtocolError(f"expected {cls.TYPE}, got {reply.type}")
    return reply
