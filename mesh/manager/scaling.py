"""The manager's hands on the platform: scaling a pool's deployment, deleting a lost pod, and
fencing a lost agent (closing its broker connections), as the pool core commands.

Several managers: only the owner of a pool's shard has the pool's agents in its registry, so
only it scales the pool's deployment (``holds_pool``; the others would see none of its agents
and scale it up).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from mesh.core.events import DeletePod, FenceAgent, ScaleObserved, ScaleTo
from mesh.core.pool import PoolCore
from mesh.manager.clock import Clock
from mesh.scaler.base import Scaler, ScalerError

log = logging.getLogger(__name__)

_FENCE_ATTEMPTS = 4
_FENCE_RETRY_S = 2.0  # 4 attempts over 6 s: past one statistics round of the management API


class Scaling:
    """Carries out ``ScaleTo``, ``DeletePod`` and ``FenceAgent`` and reports replicas back."""

    def __init__(
        self,
        *,
        core: PoolCore,
        clock: Clock,
        counters: Counter[str],
        scaler: Scaler | None,
        holds_pool: Callable[[str], bool],
        close_agent_connections: Callable[[str, str, str], Awaitable[int | None]],
    ) -> None:
        self._core = core
        self._clock = clock
        self._counters = counters
        self._scaler = scaler
        self._holds_pool = holds_pool
        self._close_agent_connections = close_agent_connections

    async def observe_all(self) -> None:
        """Tell the core how many replicas each managed deployment has now."""
        for deployment in self._core.scaling.deployments:
            await self.observe(deployment)

    async def observe(self, deployment: str) -> None:
        """Tell the core how many replicas ``deployment`` has now."""
        if self._scaler is None:
            log.warning(
                "scaling policies are set but no scaler is: nothing will be scaled",
                extra={"deployment": deployment},
            )
            return
        try:
            replicas = await self._scaler.current_replicas(deployment)
        except ScalerError as exc:
            self._counters["scaler_errors"] += 1
            log.error("cannot read replicas", extra={"deployment": deployment, "error": str(exc)})
            return
        if replicas is None:
            log.error("managed deployment does not exist", extra={"deployment": deployment})
        self._core.handle(ScaleObserved(deployment, replicas), self._clock.now())

    async def fence(self, cmd: FenceAgent) -> None:
        """Close a lost agent's connections through the management API: the broker requeues
        what it held at once, and if it is only frozen it wakes up disconnected. The API lists
        a new connection only after its next statistics round (5 s by default), so finding
        none is tried again for a while."""
        for attempt in range(_FENCE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(_FENCE_RETRY_S)
                back = self._core.agents.get(cmd.agent_id)
                if back is not None and back.incarnation == cmd.incarnation:
                    # Back meanwhile (a silence it survived): its connection stays.
                    self._counters["fence_skipped_back"] += 1
                    return
            closed = await self._close_agent_connections(cmd.agent_id, cmd.incarnation, cmd.reason)
            if closed is None:
                self._counters["fence_unavailable"] += 1
                return
            if closed:
                self._counters["agent_connections_closed"] += closed
                log.info(
                    "lost agent cut off the broker",
                    extra={"agent_id": cmd.agent_id, "closed": closed},
                )
                return
        self._counters["fence_found_no_connection"] += 1
        log.info("lost agent has no connection left to close", extra={"agent_id": cmd.agent_id})

    async def scale(self, cmd: ScaleTo | DeletePod) -> None:
        """Scale a deployment or delete a lost pod; on failure, read what really is."""
        if self._scaler is None:
            return
        if not self._holds_pool(cmd.deployment):
            self._counters["scaling_left_to_the_owner"] += 1
            return
        try:
            if isinstance(cmd, ScaleTo):
                log.info(
                    "scaling",
                    extra={
                        "deployment": cmd.deployment,
                        "replicas": cmd.replicas,
                        "remove_first": cmd.remove_first,
                        "reason": cmd.reason,
                    },
                )
                await self._scaler.scale_to(
                    cmd.deployment, cmd.replicas, remove_first=cmd.remove_first
                )
                self._counters["scaled"] += 1
            else:
                log.info("deleting lost pod", extra={"deployment": cmd.deployment, "pod": cmd.pod})
                await self._scaler.delete_pod(cmd.deployment, cmd.pod)
                self._counters["pods_deleted"] += 1
        except ScalerError as exc:
            self._counters["scaler_errors"] += 1
            log.error("scaler failed", extra={"deployment": cmd.deployment, "error": str(exc)})
            await self.observe(cmd.deployment)  # resync the core with what really is
