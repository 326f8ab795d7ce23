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

__all__ = [
    "DEFAULT_EXCHANGE",
    "AmqpTransport",
    "Consumer",
    "Delivery",
    "Handler",
    "RawConsumer",
    "redact",
]
