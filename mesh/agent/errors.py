"""Errors the agent SDK raises on purpose (all under :class:`mesh.errors.MeshError`)."""

from __future__ import annotations

from mesh.errors import MeshError


class RegistrationRefusedError(MeshError):
    """The manager refused this agent's registration; ``reason`` is its machine-readable code."""

    def __init__(self, agent_id: str, reason: str, detail: str) -> None:
        super().__init__(f"registration of {agent_id} refused: {reason}: {detail}")
        self.agent_id = agent_id
        self.reason = reason
        self.detail = detail


class RegistrationTimeoutError(MeshError):
    """No manager accepted the registration within the configured number of attempts."""
