"""Tasks: each delivery decoded, its credentials checked, run, answered, and settled.

Tasks are consumed with ``prefetch = sum(max_concurrency)``; the transport runs one handler per
delivery, so tasks run concurrently and each capability's semaphore bounds its own share. Each
delivery is decoded (garbage is dead-lettered with its reason, then acked), checked for
credentials (:mod:`mesh.agent.credentials`: a task without is answered, dead-lettered and never
run), handed to :func:`~mesh.agent.processing.process_task`, and its ``TaskResult`` published
to the producer's ``reply_to`` queue with ``correlation_id = task_id``. The task is acked only
after that publish is confirmed, or failed for good (the producer is gone); if the broker's
answer stays unknown the task is requeued, so a result may arrive twice but is never silently
lost. A cancelled handler (the channel closed) acks nothing, and the broker redelivers the
task.

Tasks carrying an admission ``grant`` are revalidated at claim (before the handler runs) and
at the consumption point (before the result is published): a foreign, expired, revoked or
stale-epoch grant answers ``GRANT_INVALID``, is logged, counted (``grants_refused``) and the
task acked (see :mod:`mesh.agent.grants` for the rules). A grant revoked while its handler
runs (an eviction) stops the handler: :meth:`TaskRunner.stop_running`.

A result claimed before a silence in which this agent may have been declared lost is withheld
and the task requeued (:mod:`mesh.agent.liveness`): fencing too eagerly costs a rerun, never a
loss; effects a rerun must not repeat go through :func:`mesh.agent.effects.once`. A task this
agent already answered (its ack lost, the broker brought it back) is answered again from the
result it published, not run again (``ANSWERS_KEPT`` most recent, by task ID and idempotency
key); one whose result could not be published is published on its redelivery.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mesh import constants as c
from mesh import tracing
from mesh.agent.base import BoundCapability
from mesh.agent.context import idempotency_key
from mesh.agent.core import AgentCore
from mesh.agent.credentials import Credentials
from mesh.agent.liveness import Liveness
from mesh.agent.pool_queue import PoolQueue
from mesh.agent.processing import process_task
from mesh.agent.settings import AgentSettings, Identity, backoff_delay
from mesh.agent.settling import ack, dead_letter, requeue
from mesh.agent.work import Work
from mesh.errors import MessageRejected, PublishNacked, PublishUnroutable, TransportError
from mesh.topology import Topology
from mesh.transport import DEFAULT_EXCHANGE, Delivery
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.codec import decode_as
from mesh.wire.models import ErrorInfo, Task, TaskResult
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

ANSWERS_KEPT = 4096  # published results remembered for redeliveries of the same task
# Results that are no answer to the task's work: a redelivery must run it after all.
# (GRANT_INVALID: this copy's grant or lease was refused, which says nothing of the task: the
# producer may send the same task under a new lease.)
_NOT_DONE = frozenset(
    {Reason.AGENT_SHUTDOWN, Reason.EVICTED, Reason.DEADLINE_EXCEEDED, Reason.GRANT_INVALID}
)


class TaskRunner:
    """Handles the deliveries of the agent's task queue and of its pool's queue."""

    def __init__(
        self,
        identity: Identity,
        settings: AgentSettings,
        *,
        capabilities: Mapping[str, BoundCapability],
        core: AgentCore,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        rng: random.Random,
        work: Work,
        credentials: Credentials,
        liveness: Liveness,
        pool: PoolQueue,
    ) -> None:
        self._identity = identity
        self._settings = settings
        self._capabilities = capabilities
        self._core = core
        self._topology = topology
        self._task_queue = topology.agent_task_queue(identity.agent_id)
        self._transport = transport
        self._counters = counters
        self._rng = rng
        self._work = work
        self._credentials = credentials
        self._liveness = liveness
        self._pool = pool
        self._refusing = False  # past the drain deadline: answer queued tasks, do not run them
        # idempotency key and task ID -> the result published (ANSWERS_KEPT most recent)
        self._answered: OrderedDict[str, TaskResult] = OrderedDict()
        # ... and the results of finished tasks not published yet (the broker away): a
        # redelivery publishes it rather than running the handler again (ANSWERS_KEPT most recent)
        self._unpublished: OrderedDict[str, _Finished] = OrderedDict()
        # ... and the tasks being handled here now (done when that handling ends): a
        # redelivery of one waits for it instead of running the task a second time at once
        self._handling: dict[str, asyncio.Future[None]] = {}
        # admission ID -> the asyncio task running its handler (to stop it if evicted)
        self.running: dict[str, asyncio.Task[Any]] = {}
        self._evicting: set[str] = set()  # admission IDs whose handler was cancelled for it

    def refuse_all(self) -> None:
        """Past the drain deadline: answer every task taken from now on ``AGENT_SHUTDOWN``."""
        self._refusing = True

    def stop_running(self, admission_id: str) -> None:
        """Stop the handler running under ``admission_id`` (its grant was revoked); it is
        answered ``EVICTED`` (or revoked for security), not requeued."""
        running = self.running.get(admission_id)
        if running is not None:
            self._evicting.add(admission_id)
            running.cancel()

    async def _dead_letter(self, delivery: Delivery, queue: str, exc: MessageRejected) -> None:
        await dead_letter(
            self._transport(), self._topology, delivery, queue, exc, self._identity.extra()
        )

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
        self._counters["tasks_without_credentials"] += 1
        log.warning(
            "task refused: no credentials",
            extra={**extra, "problem": why, "reason": reason.value},
        )
        queue = self._topology.pool_task_queue(self._identity.deployment) if from_pool else None
        await self._answer_and_dead_letter(
            delivery,
            task,
            reason,
            f"{self._identity.agent_id}, at claim: {why}",
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
            agent_id=self._identity.agent_id,
            capability=task.capability,
            status="error",
            error=ErrorInfo(code=code, message=message),
            started_at=now,
            finished_at=now,
        )
        await self._send_result(delivery, result, extra)
        await self._dead_letter(delivery, queue or self._task_queue, MessageRejected(code, message))

    def _grant_problem(self, task: Task) -> str | None:
        return self._core.grant_problem(task, time.time())

    def _grant_refused(
        self, task: Task, problem: str, where: str, started_at: float, extra: dict[str, Any]
    ) -> TaskResult:
        grant = task.grant
        evicted = self._core.evicted(task)
        self._counters["tasks_evicted" if evicted else "grants_refused"] += 1
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
        return self._core.refusal(task, problem, where, started_at, time.time())

    async def _refuse_at_claim(
        self, delivery: Delivery, task: Task, problem: str, extra: dict[str, Any]
    ) -> None:
        result = self._grant_refused(task, problem, "at claim", time.time(), extra)
        if await self._send_result(delivery, result, extra):
            await ack(delivery, extra)
        else:
            await requeue(delivery, extra)

    def _at_consumption(self, task: Task, result: TaskResult, extra: dict[str, Any]) -> TaskResult:
        """Revalidate the grant before the result goes out: a void grant's output is withheld."""
        if result.error is not None and result.error.code in (Reason.EVICTED, Reason.GRANT_INVALID):
            return result  # already refused on the way
        problem = self._grant_problem(task)
        if problem is None:
            problem = self._core.consume_lease(task, time.time())  # once per lease
        if problem is None:
            return result
        return self._grant_refused(task, problem, "before the result", result.started_at, extra)

    async def on_task(self, delivery: Delivery, *, from_pool: bool = False) -> None:
        """A task from our own queue (or, ``from_pool``, the pool's): handled, answered, settled."""
        current = asyncio.current_task()
        self._work.began(current)
        try:
            await self._handle_task(delivery, from_pool)
        finally:
            self._work.ended(current)

    async def on_pool_task(self, delivery: Delivery) -> None:
        await self.on_task(delivery, from_pool=True)

    async def _handle_task(self, delivery: Delivery, from_pool: bool = False) -> None:
        try:
            task = decode_as(delivery.body, Task)
        except MessageRejected as exc:
            self._counters["tasks_dead_lettered"] += 1
            await self._dead_letter(delivery, self._task_queue, exc)
            return
        extra = self._identity.extra(task_id=task.task_id, capability=task.capability)
        if self._refusing:
            await self.give_up_task(delivery, task, "the agent is leaving (drain deadline)")
            return
        if delivery.redelivered:
            log.info("task redelivered; running it again", extra=extra)
        uncredentialed = await self._credentials.problem(task, from_pool)
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
            self._counters["redeliveries_waited_for_first_run"] += 1
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
        counted = task.capability in self._work.in_flight
        if from_pool and counted and not await self._start_pool_task(delivery, task, extra):
            return
        if counted:
            self._work.in_flight[task.capability] += 1
        try:
            await self._run_and_answer(delivery, task, extra)
        finally:
            if counted:
                self._work.in_flight[task.capability] -= 1
            if from_pool and counted:
                self._work.pool_started[task.capability] -= 1
                self._liveness.report_work()

    async def _done_before(
        self, delivery: Delivery, task: Task, from_pool: bool, extra: dict[str, Any]
    ) -> bool:
        """A task that ran to an answer before (its ack was lost) is not run again: answered
        from our record if it ran here, refused at claim if the ledger settled its admission
        (it ran elsewhere). ``True``: handled."""
        key = _answer_key(task)
        unpublished = self._unpublished.pop(key, None)
        if unpublished is not None:  # finished here, its result never went out: send it now
            self._counters["tasks_finished_answered_later"] += 1
            log.info("task finished here before; publishing its kept result", extra=extra)
            await self._publish_answer(delivery, task, unpublished, extra)
            return True
        answered = self._answered.get(key)
        if answered is not None:  # done here before: the same answer
            self._counters["tasks_answered_again"] += 1
            log.info("task done here before; answered from its recorded result", extra=extra)
            if await self._send_result(delivery, answered, extra):
                await ack(delivery, extra)
            else:
                await requeue(delivery, extra)
            return True
        if from_pool and delivery.redelivered:
            settled = await self._credentials.settled_already(task)
            if settled is not None:  # done elsewhere
                self._counters["tasks_settled_before_claim"] += 1
                await self._refuse_at_claim(delivery, task, settled, extra)
                return True
        return False

    async def _run_and_answer(self, delivery: Delivery, task: Task, extra: dict[str, Any]) -> None:
        """Run the handler, revalidate, publish the result, then ack (or requeue)."""
        claimed = time.monotonic()
        agent, pool = self._identity.agent_id, self._identity.deployment
        with tracing.invoke(delivery.headers, task, agent_id=agent, agent_name=pool) as span:
            result = await self._run_handler(delivery, task, extra)
            span.ran(result)
            self._counters[f"tasks_{result.status}"] += 1
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
        self._liveness.note_silence(time.monotonic())
        if self._core.fenced(finished.claimed) and not await self._liveness.still_registered(
            finished.claimed
        ):
            self._counters["results_fenced"] += 1
            log.warning(
                "result withheld: claimed before a silence in which this agent was declared "
                "lost (or the manager could not say it was not); requeued",
                extra=extra,
            )
            await requeue(delivery, extra)
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
            await ack(delivery, extra)
            return
        self._keep_unpublished(task, finished)
        await requeue(delivery, extra)

    async def _start_pool_task(self, delivery: Delivery, task: Task, extra: dict[str, Any]) -> bool:
        """Wait for a free slot for a pool task and count it as started (reported to the
        manager); ``False`` if we began draining first: it goes back to the pool queue."""
        if not await self._pool.wait_to_start(task.capability):
            self._counters["pool_tasks_handed_back"] += 1
            log.info("draining: pool task handed back, not started", extra=extra)
            await requeue(delivery, extra)
            return False
        self._work.pool_started[task.capability] += 1
        self._liveness.report_work()
        return True

    async def _run_handler(
        self, delivery: Delivery, task: Task, extra: dict[str, Any]
    ) -> TaskResult:
        """``process_task``, stoppable by an eviction of the task's grant (then an
        ``EVICTED`` result); any other cancellation propagates (the task is requeued)."""
        admission_id = task.grant.admission_id if task.grant else None
        current = asyncio.current_task()
        if admission_id is not None and current is not None:
            self.running[admission_id] = current
        try:
            return await process_task(
                task,
                self._capabilities,
                agent_id=self._identity.agent_id,
                attempt=_attempt(delivery),
            )
        except asyncio.CancelledError:
            if admission_id in self._evicting and current is not None:
                current.uncancel()  # stopped for a revocation: answer it, do not requeue
                why = self._core.revoked.security_reason(admission_id)
                stopped = "the handler was stopped" + (
                    f": revoked for security ({why})" if why else ""
                )
                return self._grant_refused(task, stopped, "while running", time.time(), extra)
            if self._core.phase == "stopping":
                # Cancelled at the end of the shutdown grace: answer and keep the task.
                await self.give_up_task(delivery, task, "cancelled at the shutdown deadline")
            raise
        finally:
            if admission_id is not None:
                self.running.pop(admission_id, None)
                self._evicting.discard(admission_id)

    async def give_up_task(self, delivery: Delivery, task: Task, why: str) -> None:
        """A task this agent will not finish: the producer gets an AGENT_SHUTDOWN result now
        (not a timeout later) and the task is dead-lettered with that reason, then acked."""
        self._counters["tasks_given_up"] += 1
        extra = self._identity.extra(task_id=task.task_id, capability=task.capability, why=why)
        log.warning("giving up a task", extra=extra)
        await self._answer_and_dead_letter(
            delivery, task, Reason.AGENT_SHUTDOWN, f"{self._identity.agent_id}: {why}", None, extra
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
        if self._core.result_point is not None and task.grant and task.grant.lease:
            self._core.result_point.give_back(task.grant.lease)
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
            self._counters["results_without_reply_to"] += 1
            log.warning("task has no reply_to; its result is dropped", extra=extra)
            return True
        attempts = max(1, self._settings.result_publish_attempts)
        for attempt in range(1, attempts + 1):
            try:
                await self._transport().publish(
                    DEFAULT_EXCHANGE,
                    delivery.reply_to,
                    result,
                    correlation_id=result.task_id,
                    # The task's trace context goes on (this run's span's, when tracing).
                    headers=tracing.result_headers(
                        delivery.headers, {c.H_AGENT_ID: self._identity.agent_id}
                    ),
                    timeout_s=self._settings.publish_timeout_s,
                )
                return True
            except PublishUnroutable:
                self._counters["results_unroutable"] += 1
                log.warning("the producer's reply queue is gone; result dropped", extra=extra)
                return True
            except PublishNacked as exc:
                self._counters["results_refused"] += 1
                log.error("broker refused the result", extra={**extra, "error": str(exc)})
                return True
            except TransportError as exc:
                log.warning(
                    "result publish outcome unknown",
                    extra={**extra, "attempt": attempt, "error": str(exc)},
                )
                if attempt < attempts:
                    await asyncio.sleep(backoff_delay(attempt - 1, rng=self._rng, cap_s=2.0))
        self._counters["results_requeued"] += 1
        log.error("could not publish the result; requeueing the task", extra=extra)
        return False


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
