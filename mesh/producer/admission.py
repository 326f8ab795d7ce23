"""The admission path of the producer SDK: admit, run on the granted pool, settle.

:class:`AdmissionPath` holds what :meth:`MeshClient.submit <mesh.producer.MeshClient.submit>`
and :meth:`~mesh.producer.MeshClient.admit` need beyond one request: the loop that asks
again while deferred (its timing is :func:`mesh.producer.retry.submit_delay_s`), the task's
publish to the pool queue and its result, exactly one settlement per grant (asked again in
the background while the ledger is away), and the admission IDs a call still waits on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mesh import constants as c
from mesh import tracing
from mesh.backoff import Backoff
from mesh.errors import (
    AdmissionRefused,
    PublishNacked,
    PublishUnroutable,
    RequestTimeout,
    SubmitDeadlineExceeded,
    TaskRefused,
    TransportError,
)
from mesh.ids import new_admission_id
from mesh.producer.replies import Request, expect
from mesh.producer.retry import QUEUE_FULL_RETRY_MS, submit_delay_s
from mesh.producer.tasks import Submitted, TaskSender, output_of
from mesh.topology import names
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionGrant,
    AdmissionReason,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
    TaskRequirements,
)
from mesh.wire.models import Message, Task, TaskResult
from mesh.wire.reasons import Reason

__all__ = ["AdmissionPath", "OnDeferred"]

log = logging.getLogger(__name__)

OnDeferred = Callable[[AdmissionDecision], "bool | Awaitable[bool]"]

# Releases asked again, spread so that producers do not come back together after a failover.
_SETTLE_BACKOFF = Backoff(base_s=0.25, cap_s=4.0, spread=0.5)
_SETTLE_RETRY_S = 60.0  # a release is asked again this long (a ledger failover, a manager's)


class AdmissionPath:
    """Admissions asked through ``request``; tasks sent with ``sender``, their results awaited
    in ``pending`` (task ID -> future, resolved by :class:`~mesh.producer.replies.Replies`)."""

    def __init__(
        self,
        request: Request,
        sender: TaskSender,
        pending: dict[str, asyncio.Future[Message]],
        counters: Counter[str],
    ) -> None:
        self._request = request
        self._sender = sender
        self._pending = pending
        self._counters = counters
        # Admission IDs a call here still waits on (admit, or a whole submit): a grant for
        # one of them that arrives late is its retry's, not to be released.
        self._awaited: Counter[str] = Counter()
        # Releases being asked again (see settle_quietly); cancelled by stop_settling().
        self._retrying: set[asyncio.Task[None]] = set()

    def is_awaited(self, admission_id: str) -> bool:
        """Whether a call here still waits on ``admission_id``."""
        return bool(self._awaited[admission_id])

    async def stop_settling(self) -> None:
        """Stop asking releases again: their reservations expire on their own."""
        for retry in self._retrying:
            retry.cancel()
        if self._retrying:
            await asyncio.gather(*self._retrying, return_exceptions=True)

    # ---- one request each -----------------------------------------------------------------
    async def admit(
        self,
        requirements: TaskRequirements,
        *,
        admission_id: str | None = None,
        timeout_s: float = 10.0,
    ) -> AdmissionDecision:
        """:meth:`MeshClient.admit <mesh.producer.MeshClient.admit>`."""
        request = AdmissionRequest(
            admission_id=admission_id or new_admission_id(), requirements=requirements
        )
        self._await(request.admission_id)
        try:
            return expect(await self._request(request, timeout_s=timeout_s), AdmissionDecision)
        finally:
            self._stop_awaiting(request.admission_id)

    def _await(self, admission_id: str) -> str:
        self._awaited[admission_id] += 1
        return admission_id

    def _stop_awaiting(self, admission_id: str) -> None:
        self._awaited[admission_id] -= 1
        if self._awaited[admission_id] <= 0:
            del self._awaited[admission_id]

    async def release(
        self,
        grant: AdmissionGrant,
        *,
        actual_tokens: int | None = None,
        actual_duration_s: float | None = None,
        finished_at: float | None = None,
    ) -> AdmissionReleaseReply:
        """:meth:`MeshClient.release_admission
        <mesh.producer.MeshClient.release_admission>`."""
        release = AdmissionRelease(
            admission_id=grant.admission_id,
            fence=grant.fence,
            actual_tokens=actual_tokens,
            actual_duration_s=actual_duration_s,
            finished_at=finished_at,
        )
        return expect(await self._request(release), AdmissionReleaseReply)

    # ---- submit ---------------------------------------------------------------------------
    async def submit(
        self,
        requirements: TaskRequirements,
        payload: dict[str, Any],
        *,
        timeout_s: float,
        backoff: Backoff,
        on_deferred: OnDeferred | None,
        rand: Callable[[], float],
    ) -> Submitted:
        """:meth:`MeshClient.submit <mesh.producer.MeshClient.submit>`, in a span of its own
        (``submit {capability}``): each deferral waited out is an event on it."""
        with tracing.operation("submit", requirements.capability.name) as span:
            done = await self._submit(
                requirements, payload, span, timeout_s, backoff, on_deferred, rand
            )
            granted = done.decision.grant
            span.note("mesh.admission_id", done.decision.admission_id)
            span.note("mesh.pool", granted.pool_id if granted else None)
            span.note("mesh.attempts", done.attempts)
            span.note("gen_ai.agent.id", done.result.agent_id)
            return done

    async def _submit(
        self,
        requirements: TaskRequirements,
        payload: dict[str, Any],
        span: tracing.Traced,
        timeout_s: float,
        backoff: Backoff,
        on_deferred: OnDeferred | None,
        rand: Callable[[], float],
    ) -> Submitted:
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
                    raise _gave_up(last, attempts)
                attempts += 1
                try:
                    decision = await self.admit(
                        requirements, admission_id=admission_id, timeout_s=min(10.0, remaining)
                    )
                except (RequestTimeout, TransportError) as exc:
                    # No answer (the manager or the broker away): again, same ID, same grant.
                    self._counters["submit_request_retries"] += 1
                    delay = submit_delay_s(None, refusals, backoff, rand)
                    assert delay is not None  # no answer is always asked again
                    refusals += 1
                    if time.time() + delay >= deadline:
                        log.info("submit gave up: no answer", extra={"error": str(exc)})
                        raise _gave_up(last, attempts) from None
                    await asyncio.sleep(delay)
                    continue
                if decision.outcome == "admitted":
                    assert decision.grant is not None  # the model's invariant
                    waited = time.monotonic() - called
                    ran = await self._run_granted(decision, requirements, payload, deadline)
                    if isinstance(ran, TaskResult):
                        output = output_of(ran, allowed=requirements.allowed_degradations)
                        return Submitted(output, ran, decision, attempts, waited)
                    decision = ran  # queue full, or evicted: a refusal like the others
                    self._stop_awaiting(admission_id)  # that grant is settled: a new phase
                    admission_id = self._await(new_admission_id())
                last = decision
                delay = submit_delay_s(decision, refusals, backoff, rand)
                if delay is None or not await _keep_waiting(on_deferred, decision):
                    raise AdmissionRefused(decision)
                span.deferred(decision, attempts)
                if decision.position is not None:
                    self._counters["submit_waits_in_line"] += 1
                refusals += 1
                self._counters["submit_retries"] += 1
                if time.time() + delay >= deadline:
                    raise _gave_up(last, attempts)
                await asyncio.sleep(delay)
        finally:
            self._stop_awaiting(admission_id)

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
                await self._sender.publish(
                    names.pool_task_key(grant.pool_id),
                    task,
                    {c.H_ADMISSION_ID: grant.admission_id},
                    deadline,
                )
            except PublishNacked:
                self._counters["queue_full"] += 1
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
            result = expect(reply, TaskResult)
            if result.error is not None and result.error.code is Reason.EVICTED:
                # The manager took the grant back (and released it) for more urgent work; the
                # task declared itself recoverable: ask again, under a new admission.
                self._counters["evicted"] += 1
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
                await self.settle_quietly(grant, actuals)

    # ---- settlement -----------------------------------------------------------------------
    async def settle_quietly(
        self,
        grant: AdmissionGrant,
        actuals: Mapping[str, Any] | None = None,
        *,
        again: bool = False,
    ) -> None:
        """Release ``grant``. When the manager cannot reach its ledger or does not answer, it
        is asked again in the background (a release is fenced and idempotent: asking twice
        changes nothing) for up to ``_SETTLE_RETRY_S``, so the caller has its result at once;
        :meth:`stop_settling` stops those retries, and the reservation then expires on its
        own. Never raises: the task's outcome is not masked by its settlement."""
        give_up_at = time.monotonic() + (_SETTLE_RETRY_S if again else 0.0)
        attempt = 0
        while True:
            transient = True
            try:
                reply = await self.release(grant, **(actuals or {}))
            except (TransportError, OSError) as exc:
                failure = str(exc)
            except Exception as exc:  # not a transient fault: no use asking again
                transient, give_up_at, failure = False, 0.0, str(exc)
            else:
                if reply.reason is not AdmissionReason.LEDGER_UNAVAILABLE:
                    if not reply.released:
                        self._counters["settle_refused"] += 1
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
                self._counters["settle_failed"] += 1
                log.warning(
                    "settlement failed; the reservation expires on its own",
                    extra={"admission_id": grant.admission_id, "error": failure},
                )
                return
            self._counters["settle_retried"] += 1
            await asyncio.sleep(pause)

    async def _settle_again(self, grant: AdmissionGrant, actuals: Mapping[str, Any] | None) -> None:
        self._counters["settle_retried"] += 1
        await asyncio.sleep(0.25)
        await self.settle_quietly(grant, actuals, again=True)


def _gave_up(last: AdmissionDecision | None, attempts: int) -> SubmitDeadlineExceeded:
    reason = last.reason.value if last is not None and last.reason else None
    return SubmitDeadlineExceeded(
        f"not admitted before the deadline after {attempts} attempts"
        + (f"; last refusal: {reason} ({last.detail})" if last is not None else ""),
        last_reason=reason,
        decision=last,
        attempts=attempts,
    )


async def _keep_waiting(on_deferred: OnDeferred | None, decision: AdmissionDecision) -> bool:
    if on_deferred is None:
        return True
    keep = on_deferred(decision)
    return keep if isinstance(keep, bool) else await keep
