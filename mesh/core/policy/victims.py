"""Eviction: which admitted grant a full pool's urgent request may take back. Only work that
declared itself recoverable is ever a victim, cheapest to lose first: rebuildable before
retryable, lower rank first, and among those the most recently granted (the least likely to
have started, the least work thrown away)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["EVICTION_ORDER", "Youngest", "choose_victim", "evict_order"]

EVICTION_ORDER = ("rebuildable", "retryable")
"""The recoverabilities whose admitted work may be evicted, first to go first."""


def evict_order(recoverability: str | None) -> int | None:
    """A recoverability's place in :data:`EVICTION_ORDER`; ``None``: never evicted."""
    return EVICTION_ORDER.index(recoverability) if recoverability in EVICTION_ORDER else None


class Youngest(Protocol):
    """Evictable grants of one kind, the most recently granted found without a walk."""

    def youngest(self) -> str | None: ...


def choose_victim(
    rank: int,
    below_share: bool,
    pool_kinds: Mapping[tuple[int, int], Youngest],
    own_kinds: Mapping[tuple[int, int], Youngest],
) -> str | None:
    """The admission ID a request of ``rank`` may evict, or ``None``. Only interactive
    requests (rank 2) evict, and only work of a lower rank; a tenant below its fair share may
    take from anyone's (``pool_kinds``), one at or over it only from its own (``own_kinds``).
    Kinds are ``(evict order, rank)``: the first non-empty kind in that order gives up its
    youngest grant. O(kinds), a handful, whatever the number of grants."""
    if rank < 2:
        return None
    kinds = pool_kinds if below_share else own_kinds
    for kind in sorted(kinds):
        if kind[1] < rank and (chosen := kinds[kind].youngest()) is not None:
            return chosen
    return None
