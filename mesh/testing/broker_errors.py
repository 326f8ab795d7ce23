"""What the in-memory broker raises where RabbitMQ would close a channel or refuse a call.

Kept apart from the broker so that a test can catch these by name without reading the
broker's state machine; all are :class:`~mesh.errors.TransportError` or
:class:`~mesh.errors.LocalProtocolError`, as the real transport's failures are.
"""

from __future__ import annotations

from mesh.errors import LocalProtocolError, TopologyMissing, TransportError

__all__ = [
    "AccessRefused",
    "BrokerRefused",
    "DeliverySettleError",
    "NotFound",
    "PreconditionFailed",
    "ResourceLocked",
    "TransportClosed",
]


class BrokerRefused(TransportError):
    """The in-memory broker refused an operation where RabbitMQ would close the channel."""


class PreconditionFailed(BrokerRefused):
    """406: a redeclaration with other properties, or ``delete_queue(if_empty=True)`` of a
    queue that holds messages."""


class NotFound(BrokerRefused, TopologyMissing):
    """404: the exchange or queue does not exist."""


class ResourceLocked(BrokerRefused):
    """405: the queue is exclusive to another connection."""


class AccessRefused(BrokerRefused):
    """403: the default exchange and ``amq.*`` names cannot be declared or bound."""


class TransportClosed(TransportError):
    """The transport is closed or disconnected."""


class DeliverySettleError(LocalProtocolError):
    """A delivery was acked or rejected twice, or settled although consumed with ``no_ack``."""
