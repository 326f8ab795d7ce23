"""No credentials, no work: whether a task may run on this agent for want of credentials.

A task runs only if it carries an admission ``grant`` (checked by
:meth:`~mesh.agent.core.AgentCore.grant_problem`) or, on the agent's own queue, a ``lease_id``
the manager told this agent of (``LeaseNotice``, sent before the producer gets the lease). A
task that races ahead of its notice waits up to ``lease_notice_wait_s`` for it, asking the
manager — ``LeaseStateRequest`` — when it is late: a notice published while the control queue
was being declared again after a broker restart is lost. Anything else — no credentials, a
lease issued to another agent or already ended, a task on the pool queue without a grant — is
refused (``NOT_AUTHORIZED`` or ``UNKNOWN_LEASE``). ``open_tasks`` lifts this for a mesh that
runs without admission and leases (development only).

A redelivered pool task this agent has no answer for asks the manager whether the ledger
settled its admission already (:meth:`Credentials.settled_already`): then it ran elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from mesh.agent.settings import AgentSettings, Identity
from mesh.errors import TransportError
from mesh.topology import Topology, names
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.models import (
    AdmissionState,
    AdmissionStateRequest,
    LeaseNotice,
    LeaseStateRequest,
    Task,
)
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

# A task under a lease we were not told of: the notice is usually a moment behind the task;
# after this long the manager is asked (LeaseStateRequest), and again as often until the wait
# ends (the question or its answer may be lost too, e.g. just after a broker restart).
_LEASE_ASK_AFTER_S = 0.25
_LEASE_ASK_EVERY_S = 0.5
_ENDED_LEASES_KEPT = 4096
# How long a redelivered pool task waits for the ledger's word on its admission before it
# runs anyway (its grant checked as always).
ADMISSION_STATE_WAIT_S = 2.0
_SETTLED = (
    "its admission is settled in the ledger already ({state}, fence {fence}): the task was "
    "answered, or its producer gave up on it"
)


class Credentials:
    """The leases the manager told this incarnation of, and the questions asked about them."""

    def __init__(
        self,
        identity: Identity,
        settings: AgentSettings,
        *,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        shard: Callable[[], int | None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ) -> None:
        self._identity = identity
        self._settings = settings
        self._topology = topology
        self._transport = transport
        self._counters = counters
        self._shard = shard
        self._spawn = spawn
        self.issued: dict[str, float] = {}
        """Lease ID -> the loop time it ends (by its ``LeaseNotice``)."""
        self.ended: OrderedDict[str, None] = OrderedDict()
        """Lease IDs the manager said ended (the most recent ``_ENDED_LEASES_KEPT``): a task
        of one is refused at once, not after waiting for a notice that will not come."""
        self._noticed = asyncio.Event()  # pulsed on every lease notice
        # admission ID -> the manager's answer awaited on a redelivered pool task
        self._admission_states: dict[str, asyncio.Future[AdmissionState]] = {}

    # ---- leases -----------------------------------------------------------------------------
    def on_lease_notice(self, notice: LeaseNotice) -> None:
        """A lease on one of our slots was issued (remembered until its expiry) or ended."""
        now = asyncio.get_running_loop().time()
        if notice.ended:
            self.issued.pop(notice.lease_id, None)
            self.ended[notice.lease_id] = None
            if len(self.ended) > _ENDED_LEASES_KEPT:
                self.ended.popitem(last=False)
        else:
            self.issued[notice.lease_id] = now + notice.expires_in_s
        for lease_id in [k for k, until in self.issued.items() if until <= now]:
            del self.issued[lease_id]  # expired without an end notice (a lost one)
        event, self._noticed = self._noticed, asyncio.Event()
        event.set()

    def forget_leases(self, why: str) -> None:
        """The manager forgot this registration (it declared us lost, or restarted): the
        leases it told us of went with it, so a task of one — requeued after a withheld
        result, or still queued — is refused, not run again for a producer that may have
        given up on it."""
        if self.issued:
            log.info(
                "leases of the earlier registration forgotten",
                extra=self._identity.extra(why=why, leases=len(self.issued)),
            )
            self._counters["leases_forgotten"] += len(self.issued)
            self.issued.clear()

    async def problem(self, task: Task, from_pool: bool) -> tuple[Reason, str] | None:
        """Why ``task`` may not run here for want of credentials, and its reason code
        (``None``: it may; a grant it carries is checked on its own).

        A lease this incarnation was not told of, or that ended, is ``UNKNOWN_LEASE``: a
        producer may ask for a new lease and send the task again (a task queued for an
        earlier incarnation under our ID, whose leases ended with it, is refused so). No
        credentials at all is ``NOT_AUTHORIZED``."""
        if task.grant is not None or self._settings.open_tasks:
            return None
        if from_pool:
            return Reason.NOT_AUTHORIZED, "a task of the pool queue without a grant"
        if task.lease_id is None:
            return Reason.NOT_AUTHORIZED, "the task carries neither a grant nor a lease"
        if await self._lease_known(task.lease_id, task.capability):
            return None
        return (
            Reason.UNKNOWN_LEASE,
            f"lease {task.lease_id!r} was not issued to this incarnation of "
            f"{self._identity.agent_id}, or has ended",
        )

    async def _lease_known(self, lease_id: str, capability: str) -> bool:
        """Whether the manager issued ``lease_id`` to this agent and it has not ended, by its
        notice — or, when the notice is late or lost (sent while our control queue was being
        declared again after a broker restart), by the manager's answer to a
        ``LeaseStateRequest`` (the notice again, or that the lease ended). Waits at most
        ``lease_notice_wait_s``; no word by then: not known."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._settings.lease_notice_wait_s
        ask_at = started + _LEASE_ASK_AFTER_S
        while True:
            now = loop.time()
            until = self.issued.get(lease_id)
            if until is not None and until > now:
                return True
            if lease_id in self.ended or now >= deadline:
                return False
            if now >= ask_at:
                ask_at = now + _LEASE_ASK_EVERY_S
                self._spawn(self._ask_lease_state(lease_id, capability), "lease-state")
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(deadline, ask_at) - now):
                    await self._noticed.wait()

    async def _ask_lease_state(self, lease_id: str, capability: str) -> None:
        """Ask the manager about a lease we were not told of (answered with a LeaseNotice on
        our control queue); a question that cannot be published is asked again later."""
        self._counters["lease_state_asked"] += 1
        me = self._identity
        request = LeaseStateRequest(
            agent_id=me.agent_id,
            incarnation=me.incarnation,
            lease_id=lease_id,
            capability=capability,
        )
        try:
            await self._transport().publish(
                self._topology.announce_exchange,
                names.agent_announce_key(me.agent_id, "standing", self._shard()),
                request,
                timeout_s=self._settings.publish_timeout_s,
                user_id=me.user_id,
            )
        except TransportError as exc:
            log.info("could not ask about a lease", extra=me.extra(error=str(exc)))

    # ---- the ledger's word on an admission ------------------------------------------------
    def on_admission_state(self, answer: AdmissionState) -> None:
        """The manager's answer to :meth:`settled_already`'s question."""
        waiting = self._admission_states.get(answer.admission_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)

    async def settled_already(self, task: Task) -> str | None:
        """For a redelivered pool task this agent has no answer for: has the ledger settled
        its admission (released, or expired, at or past this grant's fence)? Then why it is
        not run. An agent that was live heard the release as a revocation (the grant check
        refused the task already); one started since asks the manager, waiting at most
        ``ADMISSION_STATE_WAIT_S``. No answer: not known to be settled, and the task runs —
        effects kept with :func:`mesh.agent.once` still happen once."""
        grant = task.grant
        if grant is None:
            return None
        me = self._identity
        admission_id = grant.admission_id
        waiting = self._admission_states.get(admission_id)
        asking = waiting is None
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            self._admission_states[admission_id] = waiting
        try:
            if asking:
                request = AdmissionStateRequest(
                    agent_id=me.agent_id, incarnation=me.incarnation, admission_id=admission_id
                )
                await self._transport().publish(  # answered on our control queue
                    self._topology.announce_exchange,
                    names.agent_announce_key(me.agent_id, "admission"),
                    request,
                    timeout_s=self._settings.publish_timeout_s,
                    user_id=me.user_id,
                )
            async with asyncio.timeout(ADMISSION_STATE_WAIT_S):
                answer = await asyncio.shield(waiting)
        except (TimeoutError, TransportError):
            self._counters["admission_state_unanswered"] += 1
            return None
        finally:
            if asking:
                self._admission_states.pop(admission_id, None)
        if answer.state in ("RELEASED", "EXPIRED") and (answer.fence or 0) >= grant.fence:
            return _SETTLED.format(state=answer.state, fence=answer.fence)
        return None
