"""RabbitMQ transport: the only package that imports aio-pika."""

from mesh.transport.amqp import (
    DEFAULT_EXCHANGE,
    AmqpTransport,
    Consumer,
    Delivery,
    Handler,
    RawConsumer,
    redact,
)
from mesh.transport.ports import Subscription, Transport

__all__ = [
    "DEFAULT_EXCHANGE",
    "AmqpTransport",
    "Consumer",
    "Delivery",
    "Handler",
    "RawConsumer",
    "Subscription",
    "Transport",
    "redact",
]
