"""Heartbeats, and the self-fence they time.

Heartbeats go out every ``heartbeat_interval_s`` without confirms (each one is superseded by
the next); a failed heartbeat is logged and the next one tried. They also report the work the
manager cannot see for itself: ``pool_in_flight``, the pool tasks (admission path) that have
started, per capability. When that count changes a heartbeat goes out early (coalesced over
``_WORK_REPORT_DELAY_S``), so the manager's one count of work — free slots, Busy, drain
completion, idleness — follows within milliseconds; each report is a full count, so one that
is lost is corrected by the next.

Self-fencing. The manager declares an agent lost once it has heard nothing for
``missed_heartbeats_before_lost`` heartbeat intervals, and the broker gives the agent's unacked
tasks to others once its connection is gone. An agent that was frozen (``SIGSTOP``, a paused
VM, an event loop blocked) for that long must not deliver the work it held when it wakes: that
work has moved on. So the runtime times the gaps between its own heartbeats (monotonic clock,
:meth:`~mesh.agent.core.AgentCore.note_silence`); a gap longer than ``self_fence_after_s``
makes every task claimed before it ended suspect. Before delivering such a result the runtime
asks the manager (``StandingRequest`` on ``agent.<id>.standing``, one question per silence):
if this incarnation is still registered and the manager has not asked it to register again
since the task was claimed, the silence was one the manager sat out too (a broker outage) and
the result goes out; otherwise — declared lost, forgotten, or no answer within a few seconds —
the result is withheld and the task requeued (:mod:`mesh.agent.tasks`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from mesh.agent.core import AgentCore
from mesh.agent.settings import AgentSettings, Identity
from mesh.agent.work import Work
from mesh.errors import TransportError
from mesh.topology import Topology, names
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.codec import encode
from mesh.wire.models import Standing, StandingRequest

log = logging.getLogger(__name__)

_WORK_REPORT_DELAY_S = 0.02  # pool-work changes within this are one report


class Liveness:
    """Sends heartbeats, and says whether work claimed before a silence may still deliver."""

    def __init__(
        self,
        identity: Identity,
        settings: AgentSettings,
        *,
        core: AgentCore,
        heartbeat_interval_s: float,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        work: Work,
        shard: Callable[[], int | None],
        pool_closed: Callable[[], bool],
        forget_leases: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ) -> None:
        self._identity = identity
        self._settings = settings
        self._core = core
        self._interval_s = heartbeat_interval_s
        self._topology = topology
        self._transport = transport
        self._counters = counters
        self._work = work
        self._shard = shard
        self._pool_closed = pool_closed
        self._forget_leases = forget_leases
        self._spawn = spawn
        self._loop_task: asyncio.Task[None] | None = None
        self._report_pending = False
        self._forgotten_at = -math.inf  # monotonic: the manager last asked us to re-register
        self._standing: asyncio.Future[Standing] | None = None  # the answer awaited
        self._standing_check: asyncio.Future[float | None] | None = None  # last silence's
        self._checked_for = -math.inf  # the silence (fenced_before) that check is about

    @property
    def running(self) -> bool:
        """Whether heartbeats go out (from acceptance until the drain is complete)."""
        return self._loop_task is not None

    def start(self) -> None:
        self._loop_task = self._spawn(self._beat_forever(), "heartbeats")

    def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None

    def forgotten(self) -> None:
        """The manager asked us to register again without our leases: work claimed before
        now may not deliver."""
        self._forgotten_at = time.monotonic()

    async def _beat_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            await self.send()
            next_at = max(next_at + self._interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def send(self) -> None:
        """One heartbeat now, with the work under way; a failure is counted, never raised."""
        self.note_silence(time.monotonic())
        me = self._identity
        heartbeat = self._core.heartbeat(
            me.incarnation,
            in_flight=self._work.in_flight,
            pool_in_flight=self._work.pool_started,
            draining=self._pool_closed(),
            wall=time.time(),
        )
        try:
            async with asyncio.timeout(self._settings.publish_timeout_s):
                await self._transport().publish_fast(
                    self._topology.heartbeat_exchange,
                    names.heartbeat_key(me.agent_id, self._shard()),
                    encode(heartbeat),
                    user_id=me.user_id,
                )
        except Exception as exc:  # never let a heartbeat kill the agent
            self._counters["heartbeats_failed"] += 1
            log.warning(
                "heartbeat failed; next one in one interval",
                extra=me.extra(seq=heartbeat.seq, error=f"{type(exc).__name__}: {exc}"),
            )
        else:
            self._counters["heartbeats_sent"] += 1
            self._core.beat_sent(time.monotonic())

    def report_work(self) -> None:
        """Our pool work changed: heartbeat soon (one report for the changes of a moment)."""
        if self._report_pending or self._loop_task is None:
            return
        self._report_pending = True
        self._spawn(self._send_work_report(), "work report")

    async def _send_work_report(self) -> None:
        try:
            await asyncio.sleep(_WORK_REPORT_DELAY_S)
        finally:
            self._report_pending = False
        if self._loop_task is not None:
            await self.send()

    # ---- the self-fence -----------------------------------------------------------------------
    def note_silence(self, now: float) -> None:
        """If we have been silent longer than the manager tolerates, fence out every task
        claimed until ``now`` (called before each heartbeat and before each result)."""
        silent_s = self._core.note_silence(now)
        if silent_s is None:
            return
        self._counters["silences"] += 1
        log.warning(
            "this agent was silent long enough to be declared lost; the work it held is "
            "fenced out (results withheld, tasks requeued)",
            extra=self._identity.extra(
                silent_s=round(silent_s, 1), fence_after_s=self._core.self_fence_after_s
            ),
        )

    async def still_registered(self, claimed: float) -> bool:
        """After a silence: was this agent declared lost? The manager answers a
        ``StandingRequest``; a task claimed before the silence may still deliver its result
        only if this incarnation's registration is older than the claim (registered before
        it, and not forgotten and registered again since — the manager lost or restarted)
        and the manager did not ask us to register again since. No answer in time counts as
        lost: withholding is the safe side. One question per silence, shared."""
        if self._forgotten_at >= claimed:
            return False
        check = self._standing_check
        if check is None or (check.done() and self._core.fenced_before > self._checked_for):
            self._checked_for = self._core.fenced_before
            check = self._standing_check = asyncio.ensure_future(self._ask_standing())
        since = await asyncio.shield(check)
        if since is not None and since <= claimed and self._forgotten_at < claimed:
            self._counters["silences_survived"] += 1
            log.info(
                "result delivered after a silence: still registered", extra=self._identity.extra()
            )
            return True
        return False

    def on_standing(self, answer: Standing) -> None:
        """The manager's answer to our ``StandingRequest``."""
        waiting = self._standing
        if answer.incarnation == self._identity.incarnation and waiting is not None:
            if not waiting.done():
                waiting.set_result(answer)

    async def _ask_standing(self) -> float | None:
        """When (our monotonic clock) the manager's registration of this incarnation began,
        by its answer; ``None``: not registered, or no answer."""
        me = self._identity
        request = StandingRequest(agent_id=me.agent_id, incarnation=me.incarnation)
        deadline = time.monotonic() + max(self._settings.registration_timeout_s * 3, 5.0)
        while time.monotonic() < deadline:
            answer: asyncio.Future[Standing] = asyncio.get_running_loop().create_future()
            self._standing = answer
            asked = time.monotonic()
            try:
                await self._transport().publish(  # answered on our control queue
                    self._topology.announce_exchange,
                    names.agent_announce_key(me.agent_id, "standing", self._shard()),
                    request,
                    timeout_s=self._settings.publish_timeout_s,
                    user_id=me.user_id,
                )
                async with asyncio.timeout(self._settings.registration_timeout_s):
                    standing = await answer
            except (TimeoutError, TransportError) as exc:
                log.info("no answer on our standing yet", extra=me.extra(error=str(exc)))
                await asyncio.sleep(0.2)
                continue
            finally:
                self._standing = None
            log.warning(
                "asked the manager after a silence",
                extra=me.extra(
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
        self._counters["standing_unanswered"] += 1
        return None
