"""The questions an agent asks the manager about itself: am I still registered (``standing``),
is this lease of mine live (``lease_state``), what is this admission of my pool's state
(``admission_state``). Each is answered to the asking incarnation only, from the registry or
the ledger, and tells nothing about other agents' leases or other pools' admissions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

from mesh.core.pool import PoolCore
from mesh.ledger.model import Reservation
from mesh.manager.clock import Clock
from mesh.wire.models import (
    AdmissionState,
    AdmissionStateRequest,
    LeaseNotice,
    LeaseStateRequest,
    Standing,
    StandingRequest,
)

Question = StandingRequest | AdmissionStateRequest | LeaseStateRequest
Answer = Standing | AdmissionState | LeaseNotice


class AgentQuestions:
    """Answers an agent's questions about its own standing, leases and admissions."""

    def __init__(
        self,
        *,
        core: PoolCore,
        clock: Clock,
        counters: Counter[str],
        reservation: Callable[[str], Awaitable[Reservation | None]],
    ) -> None:
        self._core = core
        self._clock = clock
        self._counters = counters
        self._reservation = reservation

    async def answer(self, question: Question) -> Answer:
        if isinstance(question, StandingRequest):
            return self.standing(question)
        if isinstance(question, LeaseStateRequest):
            return self.lease_state(question)
        return await self.admission_state(question)

    def standing(self, request: StandingRequest) -> Standing:
        """Whether this incarnation is registered now (it was not declared lost)."""
        agent = self._core.agents.get(request.agent_id)
        registered = agent is not None and agent.incarnation == request.incarnation
        self._counters[f"standing.{'registered' if registered else 'unknown'}"] += 1
        if agent is None or not registered:
            return Standing(
                agent_id=request.agent_id, incarnation=request.incarnation, registered=False
            )
        return Standing(
            agent_id=request.agent_id,
            incarnation=request.incarnation,
            registered=True,
            state=agent.state.value,
            registered_for_s=max(0.0, self._clock.now().mono - agent.registered_at),
        )

    def lease_state(self, request: LeaseStateRequest) -> LeaseNotice:
        """The notice of ``request.lease_id`` again, if it is a live lease on the asking
        incarnation; otherwise that it ended (nothing is told of other agents' leases)."""
        agent = self._core.agents.get(request.agent_id)
        lease = self._core.leases.get(request.lease_id)
        remaining = 0.0 if lease is None else lease.expires_at - self._clock.now().mono
        live = (
            agent is not None
            and agent.incarnation == request.incarnation
            and lease is not None
            and lease.agent_id == request.agent_id
            and remaining > 0
        )
        self._counters[f"lease_state.{'live' if live else 'ended'}"] += 1
        if not live or lease is None:
            return LeaseNotice(
                agent_id=request.agent_id,
                lease_id=request.lease_id,
                capability=request.capability,
                expires_in_s=0.0,
                ended=True,
            )
        return LeaseNotice(
            agent_id=request.agent_id,
            lease_id=request.lease_id,
            capability=lease.capability,
            expires_in_s=remaining,
        )

    async def admission_state(self, request: AdmissionStateRequest) -> AdmissionState:
        """The ledger's state of an admission of the asking agent's pool; nothing about
        another pool's admissions, nor to an incarnation that is not registered."""
        agent = self._core.agents.get(request.agent_id)
        pool_id = agent.deployment if agent and agent.incarnation == request.incarnation else None
        found = await self._reservation(request.admission_id)
        if found is None or pool_id is None or found.pool_id != pool_id:
            self._counters["admission_state.unknown"] += 1
            return AdmissionState(agent_id=request.agent_id, admission_id=request.admission_id)
        self._counters[f"admission_state.{found.state.value.lower()}"] += 1
        return AdmissionState(
            agent_id=request.agent_id,
            admission_id=request.admission_id,
            state=found.state.value,
            fence=found.fence,
        )
