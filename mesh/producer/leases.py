"""The lease path of the producer SDK: acquire a slot on one agent, send, await, release.

:class:`LeasePath` carries :meth:`MeshClient.run_task <mesh.producer.MeshClient.run_task>`:
the acquire asked again while the manager or the broker is away, the task sent under a new
lease when the agent does not know the old one or its queue is full, and a release that
never masks the task's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mesh import constants as c
from mesh import tracing
from mesh.backoff import Backoff
from mesh.errors import (
    PublishNacked,
    PublishUnroutable,
    RequestTimeout,
    TaskRefused,
    TaskTimeout,
    TransportError,
)
from mesh.producer.replies import expect
from mesh.producer.retry import QUEUE_FULL_RETRY_MS, retry_delay_s
from mesh.producer.tasks import TaskOutcome, TaskSender, lease_unknown, output_of
from mesh.wire.models import Lease, Message, Refusal, Released, Task, TaskResult
from mesh.wire.reasons import Reason

__all__ = ["Acquire", "LeasePath"]

log = logging.getLogger(__name__)


class Acquire(Protocol):
    """:meth:`MeshClient.acquire <mesh.producer.MeshClient.acquire>`."""

    def __call__(
        self,
        capability: str,
        version_spec: str = ">=0",
        *,
        agent_id: str | None = None,
        ttl_s: float | None = None,
        timeout_s: float = 10.0,
    ) -> Awaitable[Lease | Refusal]: ...


class LeasePath:
    """Leases released through ``release``; tasks sent with ``sender``, their results
    awaited in ``pending`` (task ID -> future, resolved by
    :class:`~mesh.producer.replies.Replies`)."""

    def __init__(
        self,
        release: Callable[[str], Awaitable[Released | Refusal]],
        sender: TaskSender,
        pending: dict[str, asyncio.Future[Message]],
        counters: Counter[str],
    ) -> None:
        self._release = release
        self._sender = sender
        self._pending = pending
        self._counters = counters

    async def run_task(
        self,
        acquire: Acquire,
        capability: str,
        payload: dict[str, Any],
        *,
        version_spec: str,
        timeout_s: float,
    ) -> TaskOutcome:
        """:meth:`MeshClient.run_task <mesh.producer.MeshClient.run_task>`, leases taken
        with ``acquire``, in a span of its own (``run_task {capability}``)."""
        with tracing.operation("run_task", capability) as span:
            done = await self._run_task(acquire, capability, payload, version_spec, timeout_s)
            span.note("mesh.lease_id", done.lease.lease_id)
            span.note("gen_ai.agent.id", done.lease.agent_id)
            return done

    async def _run_task(
        self,
        acquire: Acquire,
        capability: str,
        payload: dict[str, Any],
        version_spec: str,
        timeout_s: float,
    ) -> TaskOutcome:
        deadline = time.time() + timeout_s
        task_id = uuid.uuid4().hex
        refused = 0  # publishes the agents' queues refused, so far
        while True:
            lease = await self._acquire_until(acquire, capability, version_spec, deadline)
            if isinstance(lease, Refusal):
                raise TaskRefused(
                    lease.reason.value, lease.detail, retry_after_ms=lease.retry_after_ms
                )
            full: TaskRefused | None = None
            try:
                result = await self.send_and_wait(lease, payload, deadline, task_id)
            except TaskRefused as refusal:
                if refusal.code != Reason.QUEUE_FULL.value:
                    raise
                full = refusal
            finally:
                await self.release_quietly(lease.lease_id)
            if full is not None:
                delay = retry_delay_s(QUEUE_FULL_RETRY_MS, refused, Backoff(), random.random)
                if time.time() + delay >= deadline:
                    raise full
                refused += 1
                self._counters["run_task_queue_full_retries"] += 1
                await asyncio.sleep(delay)
                continue
            if not lease_unknown(result) or time.time() >= deadline:
                return TaskOutcome(output_of(result), result, lease)
            self._counters["run_task_lease_retries"] += 1
            log.info(
                "the agent did not know our lease; sending the task under a new one",
                extra={"agent_id": lease.agent_id, "lease_id": lease.lease_id},
            )

    async def send_and_wait(
        self, lease: Lease, payload: dict[str, Any], deadline: float, task_id: str | None = None
    ) -> TaskResult:
        """Send one task under ``lease`` to its agent's queue and wait for the result."""
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
            await self._sender.publish(
                lease.agent_id, task, {c.H_LEASE_ID: lease.lease_id}, deadline
            )
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
        return expect(reply, TaskResult)

    async def _acquire_until(
        self, acquire: Acquire, capability: str, version_spec: str, deadline: float
    ) -> Lease | Refusal:
        """``acquire``, asked again after a timeout or a transport error until ``deadline``."""
        retries = 0
        while True:
            remaining = max(0.1, deadline - time.time())
            try:
                answer = await acquire(
                    capability, version_spec, ttl_s=remaining + 5, timeout_s=min(10.0, remaining)
                )
                if not (isinstance(answer, Refusal) and answer.reason is Reason.UNKNOWN_LEASE):
                    return answer
                # The request was asked again after a reconnect, and the lease its first ask
                # was granted is gone (its grant could not be delivered: released at once).
                # A new request is a new lease.
                self._counters["acquire_lease_gone_retries"] += 1
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
                self._counters["acquire_retries"] += 1
                await asyncio.sleep(delay)

    async def release_quietly(self, lease_id: str) -> None:
        """Release a lease; a failure is counted and logged, never raised."""
        try:
            await self._release(lease_id)
        except Exception as exc:  # the lease expires on its own; never mask the task's outcome
            self._counters["release_failed"] += 1
            log.warning("release failed", extra={"lease_id": lease_id, "error": str(exc)})
