"""The headers a dead-lettered message carries: why, from where, and where it was going.

Shared by every transport, so a dead letter reads the same whichever one wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mesh import constants as c


def dead_letter_headers(
    original: Mapping[Any, Any],
    *,
    routing_key: str,
    exchange: str,
    reason: str,
    detail: str,
    source_queue: str,
) -> dict[str, Any]:
    """The original headers plus the mesh's reason, detail and provenance headers."""
    return {
        **{k: v for k, v in original.items() if isinstance(k, str)},
        c.H_REASON: reason,
        c.H_DETAIL: detail[:1000],
        c.H_SOURCE_QUEUE: source_queue,
        "x-mesh-original-routing-key": routing_key,
        "x-mesh-original-exchange": exchange,
    }
