"""RabbitMQ transport: the only package that imports aio-pika.

The AMQP transport (:mod:`mesh.transport.amqp`) is loaded on first use of one of its names,
so code that only needs deliveries and the ports (the in-memory broker of
:mod:`mesh.testing`) does not load aio-pika.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mesh.transport.delivery import DEFAULT_EXCHANGE, Delivery, Handler
from mesh.transport.ports import Subscription, Transport

if TYPE_CHECKING:
    from mesh.transport.amqp import AmqpTransport, Consumer, redact

_AMQP_NAMES = frozenset({"AmqpTransport", "Consumer", "redact"})

__all__ = [
    "DEFAULT_EXCHANGE",
    "AmqpTransport",
    "Consumer",
    "Delivery",
    "Handler",
    "Subscription",
    "Transport",
    "redact",
]


def __getattr__(name: str) -> Any:
    if name in _AMQP_NAMES:
        from mesh.transport import amqp

        return getattr(amqp, name)
    raise AttributeError(f"module 'mesh.transport' has no attribute {name!r}")
