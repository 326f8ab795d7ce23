"""Exchanges, queues and bindings as data, and the pure naming rules behind them."""

from mesh.topology.specs import (
    BindingSpec,
    Declarations,
    ExchangeSpec,
    QueueArguments,
    QueueSpec,
    Topology,
)

__all__ = [
    "BindingSpec",
    "Declarations",
    "ExchangeSpec",
    "QueueArguments",
    "QueueSpec",
    "Topology",
]
