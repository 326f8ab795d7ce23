"""Scalers: the port and its implementations.

:class:`LocalProcessScaler` runs agent processes on this machine;
``mesh.scaler.kubernetes.KubernetesScaler`` (imported from its module, so the
Kubernetes client loads only when used) patches Deployments.
"""

from mesh.scaler.base import Scaler, ScalerError
from mesh.scaler.local import LocalProcessScaler, sample_command

__all__ = ["LocalProcessScaler", "Scaler", "ScalerError", "sample_command"]
