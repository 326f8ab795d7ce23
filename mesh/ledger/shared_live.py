"""What managers share through the shard lease store: pools' live offers and the shard count.

Pure values, no I/O. The core computes with them (:mod:`mesh.core.capacity`,
:mod:`mesh.core.shards`) and the store reads and writes them
(:mod:`mesh.ledger.shard_leases`), so they live here, below both: the store never imports
the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.errors import LocalProtocolError

MAX_SHARDS = 4_096


def check_shard_count(shard_count: int) -> int:
    """``shard_count`` if it is usable (1 to :data:`MAX_SHARDS`), else a clear error."""
    if not 1 <= shard_count <= MAX_SHARDS:
        raise LocalProtocolError(f"shard_count must be 1..{MAX_SHARDS}, got {shard_count}")
    return shard_count


@dataclass(frozen=True, slots=True)
class LiveOffer:
    """One version of a capability at one cost class in one pool: how many live agents offer
    it, and their concurrency not held by leases."""

    version: str
    agents: int
    free: int
    cost_class: str


@dataclass(frozen=True, slots=True)
class PoolLive:
    """One pool's live offers as its shard's owner last wrote them for the other managers
    (several managers, :mod:`mesh.manager.live_share`): ``(capability, offer)`` pairs, the
    scale planner's retry hint, and the shard and fence they were written under."""

    shard: int
    fence: int
    offers: tuple[tuple[str, LiveOffer], ...]
    retry_s: float | None = None

    def agents(self) -> int:
        return sum(offer.agents for _, offer in self.offers)
