"""``mesh agent echo`` with one protocol defect, for the conformance kit's own tests: each
defect must fail the kit's matching check (``test_conformance.py``).

Usage: ``python broken_agent.py DEFECT`` (the kit's environment names the agent and broker):

* ``seq``: every heartbeat carries ``seq`` 0 (it must increase);
* ``seq-leap``: ``seq`` is the time in milliseconds — increasing, but by more per heartbeat
  than the manager lets one heartbeat move it (the bound that makes a forged ``seq`` 10^9
  harmless), so its heartbeats after the first are refused;
* ``revocations``: ``grant_revoked`` events are ignored (a revoked grant's task runs);
* ``drain``: results of tasks still running when a drain begins are never sent (the tasks
  are acked: lost for their producers);
* ``hand-over``: asked to register again with its shard's new manager, it forgets the leases
  it was told of (tasks granted just before the hand-over are refused);
* ``signed``: control messages are taken from anyone, not only from the managers' user;
* ``pool-queue``: the broker's cancel of its pool consumer (the queue was deleted) goes
  unheeded: it still counts itself subscribed, and never consumes the queue declared again;
* ``trace``: a task's ``traceparent``/``tracestate`` are not carried onto its result (the
  producer's trace breaks at the agent).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mesh import tracing
from mesh.agent.control import ControlInbox
from mesh.agent.core import AgentCore
from mesh.agent.pool_events import PoolEvents
from mesh.agent.pool_queue import PoolQueue
from mesh.agent.runtime import AgentRuntime
from mesh.agent.tasks import TaskRunner
from mesh.cli import main
from mesh.wire import Heartbeat, Message, OrchestrationEvent, ReRegisterRequest


def heartbeats_without_seq() -> None:
    original = AgentCore.heartbeat

    def heartbeat(self: AgentCore, *args: Any, **kwargs: Any) -> Heartbeat:
        return original(self, *args, **kwargs).model_copy(update={"seq": 0})

    AgentCore.heartbeat = heartbeat  # type: ignore[method-assign]


def heartbeats_leaping() -> None:
    original = AgentCore.heartbeat

    def heartbeat(self: AgentCore, *args: Any, **kwargs: Any) -> Heartbeat:
        leap = int(time.time() * 1000)
        return original(self, *args, **kwargs).model_copy(update={"seq": leap})

    AgentCore.heartbeat = heartbeat  # type: ignore[method-assign]


def ignoring_revocations() -> None:
    original = PoolEvents.on_event

    def on_event(self: PoolEvents, event: OrchestrationEvent) -> None:
        if event.kind != "grant_revoked":
            original(self, event)

    PoolEvents.on_event = on_event  # type: ignore[method-assign]


def dropping_tasks_on_drain() -> None:
    original = TaskRunner._send_result

    async def send_result(self: TaskRunner, delivery: Any, result: Any, extra: Any) -> bool:
        if self._pool.closed:  # draining
            return True  # "sent": acked, and nobody hears of it
        return await original(self, delivery, result, extra)

    TaskRunner._send_result = send_result  # type: ignore[method-assign]


def forgetting_leases_on_hand_over() -> None:
    original = AgentRuntime._on_reregister_request

    def on_reregister_request(self: AgentRuntime, request: ReRegisterRequest) -> None:
        original(self, request.model_copy(update={"leases_kept": None}))

    AgentRuntime._on_reregister_request = on_reregister_request  # type: ignore[method-assign]


def trusting_any_sender() -> None:
    def check_sender(self: ControlInbox, message: Message, user_id: str | None) -> Message:
        return message

    ControlInbox._check_sender = check_sender  # type: ignore[method-assign]


def deaf_to_pool_cancels() -> None:
    def pool_queue_gone(self: PoolQueue, consumer: Any) -> None:
        return None

    PoolQueue._gone = pool_queue_gone  # type: ignore[method-assign]


def dropping_trace_context() -> None:
    def result_headers(received: Any, headers: dict[str, Any]) -> dict[str, Any]:
        return headers

    tracing.result_headers = result_headers  # type: ignore[assignment]


DEFECTS = {
    "seq": heartbeats_without_seq,
    "seq-leap": heartbeats_leaping,
    "revocations": ignoring_revocations,
    "drain": dropping_tasks_on_drain,
    "hand-over": forgetting_leases_on_hand_over,
    "signed": trusting_any_sender,
    "pool-queue": deaf_to_pool_cancels,
    "trace": dropping_trace_context,
}

if __name__ == "__main__":
    DEFECTS[sys.argv[1]]()
    sys.exit(main(["agent", "echo"]))
