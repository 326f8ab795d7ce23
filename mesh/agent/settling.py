"""Settling a delivery (ack, requeue, reject, dead-letter) and other small waits, as every room
of the agent runtime does them: a failure is logged, never raised — the channel is gone and
the broker redelivers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mesh.errors import MeshError, MessageRejected
from mesh.topology import Topology
from mesh.transport import Delivery
from mesh.transport.ports import Subscription
from mesh.transport.ports import Transport as AgentTransport

log = logging.getLogger(__name__)


async def ack(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.ack()
    except Exception as exc:  # the channel is gone: the broker redelivers
        log.warning(
            "ack failed; the message will be redelivered", extra={**extra, "error": str(exc)}
        )


async def requeue(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.reject(requeue=True)
    except Exception as exc:
        log.warning("requeue failed", extra={**extra, "error": str(exc)})


async def reject(delivery: Delivery, extra: dict[str, Any]) -> None:
    try:
        await delivery.reject(requeue=False)
    except Exception as exc:
        log.warning("reject failed", extra={**extra, "error": str(exc)})


async def dead_letter(
    transport: AgentTransport,
    topology: Topology,
    delivery: Delivery,
    queue: str,
    exc: MessageRejected,
    extra: dict[str, Any],
) -> None:
    """Republish ``delivery`` to the dead-letter exchange with its reason, then ack it; if
    that fails, reject it (the queue's own dead-lettering, if any, takes it)."""
    extra = {**extra, "queue": queue, "reason": exc.reason, "detail": exc.detail[:200]}
    log.warning("message dead-lettered", extra=extra)
    try:
        await transport.dead_letter(
            delivery,
            dead_letter_exchange=topology.dead_letter_exchange,
            source_queue=queue,
            reason=exc.reason,
            detail=exc.detail,
        )
    except MeshError as err:
        log.error("dead-lettering failed; rejecting", extra={**extra, "error": str(err)})
        await reject(delivery, extra)
        return
    await ack(delivery, extra)


async def cancel_quietly(consumer: Subscription | None) -> None:
    if consumer is None:
        return
    try:
        await consumer.cancel()
    except Exception as exc:
        log.debug("consumer cancel failed", extra={"error": str(exc)})


async def wait_until(event: asyncio.Event, deadline: float) -> bool:
    """Wait for ``event`` until the loop-time ``deadline``; ``True`` if it was set."""
    if event.is_set():
        return True
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return False
    try:
        async with asyncio.timeout(remaining):
            await event.wait()
    except TimeoutError:
        return False
    return True
