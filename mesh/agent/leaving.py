"""Leaving: the steps of an agent's shutdown that talk to the broker — ask the manager to
drain us, let the task queue empty (answering what is left ``AGENT_SHUTDOWN`` at the
deadline), wait for the work in flight (cancelling it after ``shutdown_grace_s``), deregister,
and delete the task queue if it is empty. The runtime (:mod:`mesh.agent.runtime`) decides when
each runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mesh.agent.settings import AgentSettings, Identity
from mesh.agent.settling import wait_until
from mesh.agent.work import Work
from mesh.errors import TransportError
from mesh.topology import Topology, names
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.models import Deregistration, DrainRequest

log = logging.getLogger(__name__)

_SETTLE_POLL_S = 0.2


class Leaving:
    """What an agent says and waits for on its way out."""

    def __init__(
        self,
        identity: Identity,
        settings: AgentSettings,
        *,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        work: Work,
        shard: Callable[[], int | None],
        refuse_all: Callable[[], None],
    ) -> None:
        self._identity = identity
        self._settings = settings
        self._topology = topology
        self._task_queue = topology.agent_task_queue(identity.agent_id)
        self._control_queue = topology.agent_control_queue(identity.agent_id)
        self._transport = transport
        self._work = work
        self._shard = shard
        self._refuse_all = refuse_all

    async def request_drain(self, reason: str) -> None:
        try:
            await self._transport().publish(
                self._topology.announce_exchange,
                names.agent_announce_key(self._identity.agent_id, "drain", self._shard()),
                DrainRequest(
                    agent_id=self._identity.agent_id,
                    reason=reason[:500],
                    incarnation=self._identity.incarnation,
                ),
                reply_to=self._control_queue,
                correlation_id=self._identity.incarnation,
                persistent=True,
                timeout_s=self._settings.publish_timeout_s,
                user_id=self._identity.user_id,
            )
        except TransportError as exc:
            log.warning("drain request not delivered", extra=self._identity.extra(error=str(exc)))

    async def let_queue_empty(self, deadline: float) -> None:
        """Work off tasks still queued (from leases that expired) before leaving."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                depth = await self._transport().queue_depth(self._task_queue)
            except Exception as exc:
                log.debug("queue depth unavailable", extra=self._identity.extra(error=str(exc)))
                return
            if depth == 0 and not self._work.active:
                return
            if loop.time() >= deadline:
                log.warning(
                    "task queue not empty at the drain deadline; giving up what is left",
                    extra=self._identity.extra(depth=depth),
                )
                await self._give_up_queued(loop.time() + self._settings.publish_timeout_s)
                return
            await asyncio.sleep(min(_SETTLE_POLL_S, max(0.0, deadline - loop.time())))

    async def _give_up_queued(self, deadline: float) -> None:
        """Answer every task still queued with AGENT_SHUTDOWN, through the running consumer."""
        self._refuse_all()
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            try:
                if await self._transport().queue_depth(self._task_queue) == 0:
                    return
            except Exception as exc:
                log.debug("queue depth unavailable", extra=self._identity.extra(error=str(exc)))
                return
            await asyncio.sleep(_SETTLE_POLL_S)

    async def finish_in_flight(self) -> None:
        grace = self._settings.shutdown_grace_s
        if await wait_until(self._work.idle, asyncio.get_running_loop().time() + grace):
            return
        log.error(
            "in-flight tasks did not finish in time; cancelling them (answered AGENT_SHUTDOWN, "
            "dead-lettered)",
            extra=self._identity.extra(in_flight=dict(self._work.in_flight), grace_s=grace),
        )
        for task in list(self._work.active):
            task.cancel()
        if self._work.active:
            # Each cancelled task answers its producer and dead-letters itself first.
            await asyncio.wait(
                list(self._work.active), timeout=2 * self._settings.publish_timeout_s
            )

    async def deregister(self, reason: str) -> None:
        try:
            await self._transport().publish(
                self._topology.announce_exchange,
                names.agent_announce_key(self._identity.agent_id, "deregister", self._shard()),
                Deregistration(
                    agent_id=self._identity.agent_id,
                    incarnation=self._identity.incarnation,
                    reason=reason[:500],
                ),
                persistent=True,
                timeout_s=self._settings.publish_timeout_s,
                user_id=self._identity.user_id,
            )
        except TransportError as exc:
            log.warning("deregistration not delivered", extra=self._identity.extra(error=str(exc)))

    async def delete_task_queue_if_empty(self) -> None:
        # A passive count ignores unacked messages: never delete while a handler may still
        # hold one. (A quorum queue refuses an if-empty delete; after the drain nothing is
        # leased on us, so nothing should arrive between the count and the delete.)
        if self._work.active:
            log.info("task queue kept: tasks still held", extra=self._identity.extra())
            return
        try:
            if await self._transport().queue_depth(self._task_queue) == 0:
                await self._transport().delete_queue(self._task_queue)
        except Exception as exc:
            log.info("task queue kept", extra=self._identity.extra(error=str(exc)))
