"""Registration: an ``AgentRegistration`` (persistent, confirmed) on ``agent.<id>.register``,
then a wait for a ``RegistrationAccepted`` carrying this process's incarnation, published
again with jittered exponential backoff (capped) while nobody answers. A
``RegistrationRefused`` raises :class:`~mesh.agent.errors.RegistrationRefusedError`, unless it
carries ``retry_after_ms`` (``AGENT_ID_IN_USE``: a live incarnation holds the ID), which is
waited out before registering again. The acceptance may tell the agent its shard (several
managers: the last word of its heartbeat and announce keys) and its pool's descriptor epoch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable

from mesh import constants as c
from mesh.agent.base import Agent
from mesh.agent.errors import RegistrationRefusedError, RegistrationTimeoutError
from mesh.agent.settings import AgentSettings, Identity, backoff_delay
from mesh.errors import PublishUnroutable, TransportError
from mesh.topology import Topology, names
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import Message, RegistrationAccepted, RegistrationRefused

log = logging.getLogger(__name__)

RegistrationReply = RegistrationAccepted | RegistrationRefused


class Registration:
    """Registers this incarnation with the manager, as often as it is asked to."""

    def __init__(
        self,
        agent: Agent,
        identity: Identity,
        settings: AgentSettings,
        *,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        rng: random.Random,
        on_pool_epoch: Callable[[OrchestrationEvent], None],
    ) -> None:
        self._agent = agent
        self._identity = identity
        self._settings = settings
        self._topology = topology
        self._transport = transport
        self._counters = counters
        self._rng = rng
        self._on_pool_epoch = on_pool_epoch
        self._pending: asyncio.Future[RegistrationReply] | None = None
        self.accepted = False
        """The manager accepted a registration of this incarnation."""
        self.shard: int | None = None
        """Several managers: our shard, told in the acceptance."""

    @property
    def awaiting_answer(self) -> bool:
        """A registration is out and its answer has not come."""
        return self._pending is not None and not self._pending.done()

    @property
    def in_progress(self) -> bool:
        return self._pending is not None

    async def register(self) -> None:
        """Publish the registration until the manager answers; raise if it refuses for good.

        A temporary refusal (``retry_after_ms`` set: another live incarnation holds our ID,
        say the one a kill -9 left behind) is waited out and the same registration sent again.
        """
        me = self._identity
        registration = self._agent.registration(me.incarnation)
        limit = self._settings.max_registration_attempts
        attempt = 0
        while True:
            answer: asyncio.Future[RegistrationReply] = asyncio.get_running_loop().create_future()
            self._pending = answer
            try:
                while not answer.done():
                    attempt += 1
                    self._counters["registration_attempts"] += 1
                    if await self._publish(registration, attempt):
                        await asyncio.wait({answer}, timeout=self._settings.registration_timeout_s)
                    if answer.done():
                        break
                    hint = self._unanswered_hint()
                    self._check_attempts(attempt, limit, hint)
                    delay = backoff_delay(
                        attempt - 1, rng=self._rng, cap_s=self._settings.registration_backoff_cap_s
                    )
                    log.warning(
                        "no answer to registration; retrying",
                        extra=me.extra(attempt=attempt, retry_in_s=round(delay, 3), hint=hint),
                    )
                    await asyncio.wait({answer}, timeout=delay)
                reply = answer.result()
            finally:
                self._pending = None
                answer.cancel()
            if not isinstance(reply, RegistrationRefused):
                break
            if reply.retry_after_ms is None:
                raise RegistrationRefusedError(me.agent_id, reply.reason.value, reply.detail)
            self._check_attempts(attempt, limit, f"the last refusal: {reply.detail}")
            self._counters["registration_deferred"] += 1
            delay = reply.retry_after_ms / 1000 * (1 + 0.1 * self._rng.random())
            log.warning(
                "registration deferred; retrying",
                extra=me.extra(
                    reason=reply.reason.value, detail=reply.detail, retry_in_s=round(delay, 3)
                ),
            )
            await asyncio.sleep(delay)
        log.info("registration accepted", extra=me.extra(attempt=attempt, shard=reply.shard))
        self.accepted = True
        # Several managers: our shard's owner gets our heartbeats and announcements (all but
        # a registration, which any manager takes and forwards, and admission questions,
        # which any manager answers from the shared ledger).
        self.shard = reply.shard
        if reply.pool_epoch is not None:  # our pool's epoch now, not at the next announcement
            self._on_pool_epoch(
                OrchestrationEvent(
                    at=time.time(),
                    kind=c.EVENT_DESCRIPTOR_ACTIVE,
                    reason="told in the registration's acceptance",
                    detail=reply.pool_epoch.model_dump(exclude_none=True),
                )
            )

    def on_reply(self, reply: RegistrationReply) -> None:
        """The manager's answer to the registration out (a stale one is ignored)."""
        pending = self._pending
        if reply.incarnation != self._identity.incarnation or pending is None or pending.done():
            log.debug(
                "stale registration reply ignored", extra=self._identity.extra(type=reply.type)
            )
            return
        pending.set_result(reply)

    def _unanswered_hint(self) -> str:
        """Why a registration may go unanswered. A manager run with ``--agent-identity on``
        dead-letters (``NOT_AUTHORIZED``) a registration published by a broker user other
        than the agent it names, and answers nothing: a refusal sent to the named agent would
        let anyone who forges its registration stop it. So the agent says it here, where
        its broker user is not its agent ID (a pool's shared user)."""
        why = f"is `mesh manager` running on namespace {self._settings.namespace!r}?"
        user = self._identity.user_id
        if user is None or user == self._identity.agent_id:
            return why
        return (
            f"{why} This agent logs in as broker user {user!r}, not as its agent ID: a manager "
            "run with --agent-identity on dead-letters its registrations (NOT_AUTHORIZED). "
            "Run the managers with identity off for a pool's shared user "
            "(mesh broker add-pool-agents), or give each agent a user named as it "
            "(mesh broker add-agent)."
        )

    def _check_attempts(self, attempt: int, limit: int | None, why: str) -> None:
        if limit is not None and attempt >= limit:
            raise RegistrationTimeoutError(
                f"no manager accepted {self._identity.agent_id} after {attempt} attempts; {why}"
            )

    async def _publish(self, registration: Message, attempt: int) -> bool:
        me = self._identity
        log.info("registering", extra=me.extra(attempt=attempt))
        try:
            await self._transport().publish(
                self._topology.announce_exchange,
                names.agent_announce_key(me.agent_id, "register"),
                registration,
                persistent=True,
                timeout_s=self._settings.publish_timeout_s,
                user_id=me.user_id,
            )
        except PublishUnroutable:
            log.warning(
                "no manager queue is bound for registrations yet",
                extra=me.extra(attempt=attempt),
            )
            return False
        except TransportError as exc:
            log.warning(
                "registration publish failed", extra=me.extra(attempt=attempt, error=str(exc))
            )
            return False
        return True
