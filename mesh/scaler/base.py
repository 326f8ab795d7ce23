"""The scaler port: what the manager asks of whatever runs agent processes.

The manager's core decides *when* and *how far* to scale (coalescing capacity
misses over a window, counting replicas that started but have not registered,
picking only idle agents to remove); a scaler only carries the decision out.
Two implementations: :class:`~mesh.scaler.kubernetes.KubernetesScaler` (patches
``apps/v1`` Deployment scale, deletes ``core/v1`` pods) and
:class:`~mesh.scaler.local.LocalProcessScaler` (agent processes on this machine).

An agent's ID is its pod name (Kubernetes passes it through the downward API as
``AGENT_ID``), and its ``deployment`` field names the Deployment it belongs to.
"""

from __future__ import annotations

from typing import Protocol

from mesh.errors import MeshError


class ScalerError(MeshError):
    """The scaler could not carry out a decision (API refused, process failed to start)."""


class Scaler(Protocol):
    async def current_replicas(self, deployment: str) -> int | None:
        """The deployment's desired replica count, or ``None`` if it does not exist."""
        ...

    async def scale_to(
        self, deployment: str, replicas: int, *, remove_first: str | None = None
    ) -> None:
        """Set the desired replica count. When scaling down, ``remove_first`` names the pod
        (agent ID) that must be the one to go: it holds no work and is already Draining.
        Kubernetes marks it with ``controller.kubernetes.io/pod-deletion-cost: "-1000"``
        before patching the scale; the local scaler stops that process."""
        ...

    async def delete_pod(self, deployment: str, pod: str) -> None:
        """Remove a pod that was declared lost; its controller replaces it."""
        ...

    async def close(self) -> None: ...
