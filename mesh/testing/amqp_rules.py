"""RabbitMQ's rules the in-memory broker follows, as pure functions of their inputs.

Topic and direct matching, the ``x-death`` headers of a dead-lettered message, what any
queue declaration must satisfy, and the texts of a 406. They hold no state, so each can be
read (and tested) without the broker that applies them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any, Literal

from mesh.testing.broker_errors import AccessRefused, PreconditionFailed
from mesh.topology.specs import BindingSpec, ExchangeSpec, ExchangeType, QueueSpec

__all__ = [
    "DeadLetterReason",
    "Spec",
    "binding_matches",
    "check_queue",
    "declaration_order",
    "describe",
    "topic_matches",
    "with_death",
]

DeadLetterReason = Literal["rejected", "expired", "maxlen", "delivery_limit"]
Spec = ExchangeSpec | QueueSpec | BindingSpec


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """RabbitMQ's topic rule: words split on ``.``; ``*`` is exactly one word, ``#`` zero or
    more. An empty key has no words."""
    pattern = binding_key.split(".") if binding_key else []
    words = routing_key.split(".") if routing_key else []
    # reach[j]: the pattern so far matches the first j words.
    reach = [True] + [False] * len(words)
    for token in pattern:
        if token == "#":
            reach = list(itertools.accumulate(reach, lambda seen, here: seen or here))
        else:
            reach = [False] + [
                reach[j] and (token == "*" or token == word) for j, word in enumerate(words)
            ]
    return reach[-1]


def binding_matches(kind: ExchangeType, binding_key: str, routing_key: str) -> bool:
    """Whether a binding with ``binding_key`` on an exchange of type ``kind`` takes
    ``routing_key``."""
    if kind == "topic":
        return topic_matches(binding_key, routing_key)
    if kind == "direct":
        return binding_key == routing_key
    return kind == "fanout"


def check_queue(spec: QueueSpec) -> None:
    """What RabbitMQ refuses whatever else exists."""
    if spec.name.startswith("amq."):
        raise AccessRefused(f"queue name {spec.name!r} is reserved")
    if spec.arguments.queue_type == "quorum":
        if not spec.durable or spec.exclusive or spec.auto_delete:
            raise PreconditionFailed(
                f"quorum queue {spec.name!r} must be durable, neither exclusive nor auto-delete"
            )
        if spec.arguments.overflow == "reject-publish-dlx":
            raise PreconditionFailed(f"quorum queue {spec.name!r}: no reject-publish-dlx")


def describe(spec: ExchangeSpec | QueueSpec) -> str:
    """A declaration's properties, as a 406's text names them."""
    if isinstance(spec, ExchangeSpec):
        return f"type={spec.type} durable={spec.durable}"
    return (
        f"durable={spec.durable} exclusive={spec.exclusive} auto_delete={spec.auto_delete} "
        f"arguments={spec.arguments.to_amqp()}"
    )


def declaration_order(spec: Spec) -> int:
    """Exchanges first, then queues, then the bindings between them."""
    return 0 if isinstance(spec, ExchangeSpec) else 1 if isinstance(spec, QueueSpec) else 2


def with_death(
    headers: Mapping[str, Any],
    *,
    exchange: str,
    routing_key: str,
    queue: str,
    reason: DeadLetterReason,
) -> dict[str, Any]:
    """``headers`` (of a message published to ``exchange`` under ``routing_key``) with
    RabbitMQ's ``x-death`` record of its dead-lettering from ``queue``."""
    updated: dict[str, Any] = copy.deepcopy(dict(headers))
    deaths: list[dict[str, Any]] = list(updated.get("x-death") or [])
    entry: dict[str, Any] = {
        "count": 1,
        "reason": reason,
        "queue": queue,
        "exchange": exchange,
        "routing-keys": [routing_key],
    }
    for index, death in enumerate(deaths):
        if death.get("queue") == queue and death.get("reason") == reason:
            entry = {**death, "count": int(death.get("count", 0)) + 1}
            del deaths[index]
            break
    updated["x-death"] = [entry, *deaths]
    updated.setdefault("x-first-death-reason", reason)
    updated.setdefault("x-first-death-queue", queue)
    updated.setdefault("x-first-death-exchange", exchange)
    return updated
