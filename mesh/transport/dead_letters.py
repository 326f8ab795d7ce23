"""The headers a dead-lettered message carries: why, from where, and where it was going.

Shared by every transport, so a dead letter reads the same whichever one wrote it. A refused
body larger than :data:`~mesh.constants.DEAD_LETTER_KEEP_BYTES` keeps only its prefix (enough
to see what it was), with its original size and ``x-mesh-truncated`` in the headers: a flood
of oversized messages must not fill the dead-letter queue with copies of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from mesh import constants as c

if TYPE_CHECKING:
    from mesh.transport.delivery import Delivery


class _Publisher(Protocol):
    async def publish(
        self,
        exchange: str,
        routing_key: str,
        message: bytes,
        *,
        correlation_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        persistent: bool = False,
    ) -> None: ...


def dead_letter_headers(
    original: Mapping[Any, Any],
    *,
    routing_key: str,
    exchange: str,
    reason: str,
    detail: str,
    source_queue: str,
    size: int,
    truncated: bool = False,
) -> dict[str, Any]:
    """The original headers plus the mesh's reason, detail, size and provenance headers."""
    return {
        **{k: v for k, v in original.items() if isinstance(k, str)},
        c.H_REASON: reason,
        c.H_DETAIL: detail[:1000],
        c.H_SOURCE_QUEUE: source_queue,
        c.H_ORIGINAL_SIZE: size,
        c.H_TRUNCATED: truncated,
        "x-mesh-original-routing-key": routing_key,
        "x-mesh-original-exchange": exchange,
    }


async def republish(
    transport: _Publisher,
    delivery: Delivery,
    *,
    dead_letter_exchange: str,
    source_queue: str,
    reason: str,
    detail: str,
) -> None:
    """Republish a refused message to the dead-letter exchange with its reason, confirmed
    (``transport.publish``). The caller acks the original afterwards. Routing key: the
    source queue's name."""
    body = delivery.body
    kept = body[: c.DEAD_LETTER_KEEP_BYTES]
    headers = dead_letter_headers(
        delivery.headers,
        routing_key=delivery.routing_key,
        exchange=delivery.exchange,
        reason=reason,
        detail=detail,
        source_queue=source_queue,
        size=len(body),
        truncated=len(kept) < len(body),
    )
    await transport.publish(
        dead_letter_exchange,
        source_queue,
        kept,
        headers=headers,
        correlation_id=delivery.correlation_id,
        persistent=True,
    )
