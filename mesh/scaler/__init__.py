"""Scalers: the port and its implementations (Kubernetes, local processes)."""

from mesh.scaler.base import Scaler, ScalerError

__all__ = ["Scaler", "ScalerError"]
