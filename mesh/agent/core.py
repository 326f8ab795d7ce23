"""The agent's decisions, sans I/O: its phase, its heartbeats, self-fencing, and what it knows
of its pool's grants.

Theory of operation
-------------------
:class:`AgentCore` is what :class:`~mesh.agent.runtime.AgentRuntime` decides with; the runtime
is the asyncio shell that connects, consumes, publishes, runs handlers and logs. The core
reads no clock (every ``now`` is an argument: ``mono`` for gaps, ``wall`` for grants) and does
no I/O, so it is tested by calling it.

* **Phases** (:data:`PHASES`): ``new → starting → running → stopping → stopped``; ``new``
  may go straight to ``stopped`` (stopped before it started), ``starting`` to ``stopping`` or
  ``stopped`` (a start that failed), ``running`` to ``stopped`` (torn down after a fatal
  error), and ``stopped`` is final. :meth:`AgentCore.advance` refuses anything else.
* **Heartbeats**: :meth:`AgentCore.heartbeat` builds the next one (``seq`` grows by one per
  heartbeat built) from the counts the shell gives; :meth:`AgentCore.beat_sent` notes that one
  reached the broker.
* **Self-fencing**: the manager declares an agent lost after
  ``MISSED_HEARTBEATS_BEFORE_LOST`` silent intervals; a gap between heartbeats sent longer than
  :attr:`AgentCore.self_fence_after_s` (that, less half an interval, unless configured) fences
  every task claimed before it ended (:meth:`AgentCore.note_silence`,
  :meth:`AgentCore.fenced`): the shell asks the manager whether the agent was declared lost,
  and withholds their results and requeues them unless it was not.
* **Grants**: the pool's active descriptor epoch, its draining allowlist and the revocations
  seen, from the ``grant.<pool>.#`` feed (:meth:`AgentCore.on_event` says what an event changed);
  :meth:`AgentCore.grant_problem` is the whole check of a task's grant (and its invocation
  lease, when the agent verifies them) — see :mod:`mesh.agent.grants` for the rules — and
  :meth:`AgentCore.refusal` the ``TaskResult`` that answers a refused one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

from mesh import constants as c
from mesh.agent.grants import (
    DESCRIPTOR_ACTIVE,
    GRANT_REVOKED,
    RevokedGrants,
    check_grant,
    parse_draining,
    parse_epoch,
    parse_revocation,
)
from mesh.errors import LocalProtocolError
from mesh.leases import ConsumptionPoint, LeaseVerifier
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import ErrorInfo, Heartbeat, Task, TaskResult
from mesh.wire.reasons import Reason

Phase = Literal["new", "starting", "running", "stopping", "stopped"]

PHASES: Final[dict[Phase, frozenset[Phase]]] = {
    "new": frozenset({"starting", "stopped"}),  # stopped: stop() before start()
    "starting": frozenset({"running", "stopping", "stopped"}),
    "running": frozenset({"stopping", "stopped"}),  # stopped: torn down after a fatal error
    "stopping": frozenset({"stopped"}),
    "stopped": frozenset(),
}
"""The phases a runtime may move to from each phase."""


@dataclass(frozen=True, slots=True)
class EventSeen:
    """What an event on the pool's grant feed changed.

    ``kind``: ``epoch`` (``newer``: a higher epoch than known; ``resubscribe``: the shell should
    (re)consume the pool queue — the first announcement may be the queue's first), ``revoked`` (the
    admission, fence, and whether its running handler must be stopped: evicted or revoked for
    security), or ``ignored`` (another pool's, or malformed)."""

    kind: Literal["epoch", "revoked", "ignored"]
    epoch: int | None = None
    newer: bool = False
    resubscribe: bool = False
    admission_id: str | None = None
    fence: int | None = None
    evicted: bool = False
    stop_running: bool = False


class AgentCore:
    """One agent's phase, heartbeat schedule, self-fence and grant knowledge. Not
    thread-safe: its runtime calls it from the event loop."""

    def __init__(
        self,
        agent_id: str,
        deployment: str,
        *,
        heartbeat_interval_s: float,
        self_fence_after_s: float | None = None,
        leases: LeaseVerifier | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.deployment = deployment
        self.heartbeat_interval_s = heartbeat_interval_s
        self._self_fence_after_s = self_fence_after_s
        self.leases = leases
        self.result_point = (
            ConsumptionPoint(leases, f"the results of {agent_id}") if leases is not None else None
        )
        self.phase: Phase = "new"
        self.heartbeat_seq = 0
        self.last_beat: float | None = None  # monotonic time of the last heartbeat sent
        self.fenced_before = -math.inf  # tasks claimed before this (monotonic) are fenced
        self.revoked = RevokedGrants()
        self.active_epoch: int | None = None  # the pool's, as the manager last announced it
        self.draining_allowlist: frozenset[str] = frozenset()  # older-epoch grants still good

    # ---- phases ---------------------------------------------------------------------------
    def advance(self, to: Phase) -> None:
        """Move to phase ``to``; :class:`LocalProtocolError` if :data:`PHASES` does not allow
        it from the current one."""
        if to not in PHASES[self.phase]:
            raise LocalProtocolError(f"an agent runtime that is {self.phase} cannot be {to}")
        self.phase = to

    # ---- heartbeats and self-fencing ------------------------------------------------------
    @property
    def self_fence_after_s(self) -> float:
        if self._self_fence_after_s is not None:
            return self._self_fence_after_s
        interval = self.heartbeat_interval_s
        return c.MISSED_HEARTBEATS_BEFORE_LOST * interval - interval / 2

    def heartbeat(
        self,
        incarnation: str,
        *,
        in_flight: dict[str, int],
        pool_in_flight: dict[str, int],
        draining: bool,
        wall: float,
    ) -> Heartbeat:
        """The next heartbeat (its ``seq`` taken): every count is a full count, so one that is
        lost is corrected by the next."""
        heartbeat = Heartbeat(
            agent_id=self.agent_id,
            incarnation=incarnation,
            seq=self.heartbeat_seq,
            in_flight=dict(in_flight),
            pool_in_flight={cap: n for cap, n in pool_in_flight.items() if n > 0},
            draining=draining,
            sent_at=wall,
        )
        self.heartbeat_seq += 1
        return heartbeat

    def beat_sent(self, mono: float) -> None:
        self.last_beat = mono

    def note_silence(self, mono: float) -> float | None:
        """If the agent has been silent longer than the manager tolerates, fence out every
        task claimed until ``mono``; returns how long it was silent when it fences (once per
        silence), else ``None``. Call it before each heartbeat and before each result."""
        last = self.last_beat
        if last is None or mono - last <= self.self_fence_after_s or self.fenced_before >= last:
            return None
        self.fenced_before = mono
        return mono - last

    def fenced(self, claimed_at: float) -> bool:
        """True if a task claimed at ``claimed_at`` (monotonic) is fenced out by a silence."""
        return claimed_at <= self.fenced_before

    # ---- the pool's grants ----------------------------------------------------------------
    def on_event(self, event: OrchestrationEvent, *, pool_consumed: bool) -> EventSeen:
        """Take in an event of the grant feed (``pool_consumed``: the shell consumes the pool
        queue now)."""
        if event.kind == DESCRIPTOR_ACTIVE:
            epoch = parse_epoch(event.detail)
            if epoch is None or epoch[0] != self.deployment:
                return EventSeen("ignored")
            newer = self.active_epoch is None or epoch[1] > self.active_epoch
            draining = parse_draining(event.detail)
            if draining is not None and (newer or epoch[1] == self.active_epoch):
                self.draining_allowlist = draining
            if newer:
                self.active_epoch = epoch[1]
            return EventSeen(
                "epoch", epoch=epoch[1], newer=newer, resubscribe=newer or not pool_consumed
            )
        parsed = parse_revocation(event.detail) if event.kind == GRANT_REVOKED else None
        if parsed is None or parsed[1] != self.deployment:
            return EventSeen("ignored")
        admission_id, _, fence = parsed
        evicted = event.detail.get("evicted") is True
        security = event.detail.get("security")
        security = security[:500] if isinstance(security, str) and security else None
        self.revoked.revoke(admission_id, fence, evicted=evicted, security=security)
        return EventSeen(
            "revoked",
            admission_id=admission_id,
            fence=fence,
            evicted=evicted,
            # Evicted work declared itself rebuildable or retryable: stop it, free the slot.
            # A security revocation stops it whatever it declared.
            stop_running=evicted or security is not None,
        )

    def grant_problem(self, task: Task, wall: float) -> str | None:
        """Why ``task``'s grant (and invocation lease) is not good here now, or ``None``. A
        task without a grant is the lease path's: its lease is the runtime's to check."""
        grant = task.grant
        if grant is None:
            return None
        problem = check_grant(
            grant,
            pool_id=self.deployment,
            now=wall,
            revoked_fence=self.revoked.fence(grant.admission_id),
            active_epoch=self.active_epoch,
            draining=self.draining_allowlist,
        )
        if problem is not None:
            why = self.revoked.security_reason(grant.admission_id)
            return f"{problem}, for security: {why}" if why and "revoked" in problem else problem
        if self.leases is None:
            return None
        lease = grant.lease
        if lease is None:
            return "no invocation lease (this agent requires one: mesh manager --lease-key)"
        assert self.result_point is not None
        if self.result_point.consumed(lease):
            return "lease replayed: a result was already published under it here"
        return self.leases.check(
            lease, now=wall, admission_id=grant.admission_id, fence=grant.fence,
            pool_id=self.deployment,
        )  # fmt: skip

    def consume_lease(self, task: Task, wall: float) -> str | None:
        """Spend ``task``'s invocation lease at the result point (once per lease); why not,
        or ``None`` (also when the agent verifies no leases or the task carries none)."""
        lease = task.grant.lease if task.grant is not None else None
        if self.result_point is None or lease is None:
            return None
        return self.result_point.consume(lease, now=wall)

    def evicted(self, task: Task) -> bool:
        return task.grant is not None and self.revoked.evicted(task.grant)

    def refusal(
        self, task: Task, problem: str, where: str, started_at: float, wall: float
    ) -> TaskResult:
        """The answer to a task whose grant was refused ``where`` (at claim, while running,
        before the result): ``EVICTED`` (resubmit it) or ``GRANT_INVALID``."""
        evicted = self.evicted(task)
        return TaskResult(
            task_id=task.task_id,
            agent_id=self.agent_id,
            capability=task.capability,
            status="error",
            error=ErrorInfo(
                code=Reason.EVICTED if evicted else Reason.GRANT_INVALID,
                message=f"{where}: {problem}"
                + (" (evicted for more urgent work; resubmit it)" if evicted else ""),
            ),
            started_at=started_at,
            finished_at=max(wall, started_at),
        )
