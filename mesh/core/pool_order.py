"""Which pools an admission tries, and in which order.

Primaries first, in the one preference order (:mod:`mesh.core.ranking`: cost class, then
load); then the task's ``allowed_fallbacks``, each only if it gives the task nothing the
preferred primary would not. Kept apart from the decision so the order can be read (and
tested) on its own: changing it changes which pool a task lands on, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from mesh.core import ranking
from mesh.core.capacity import LiveCapacity
from mesh.core.eligibility import MODEL_SLOTS, EligibilityResult, fallback_pools, widening
from mesh.core.ranking import Rank
from mesh.wire.admission import CapabilityDescriptor, TaskRequirements

__all__ = ["by_preference", "pools_to_try"]


def pools_to_try(
    requirements: TaskRequirements,
    eligibility: EligibilityResult,
    counters: Mapping[tuple[str, str], tuple[int, int]],
    live: LiveCapacity | None,
    descriptors: Mapping[str, CapabilityDescriptor],
) -> Iterator[tuple[str, str | None]]:
    """The pools to try, in order, as ``(pool_id, the primary it stands in for)``; the
    fallbacks are checked only once every primary is full.

    Primaries — eligible pools the task does not name as fallbacks — come first, in the
    one preference order (:func:`by_preference`). Then the task's ``allowed_fallbacks``
    that are eligible, in its order, each only if it gives the task nothing the preferred
    primary would not (:func:`~mesh.core.eligibility.widening`). Without an eligible
    primary, a fallback has nothing to stand in for: nothing is tried.
    """
    named = set(requirements.allowed_fallbacks)
    primaries = by_preference(
        [p for p in eligibility.eligible if p not in named], requirements, counters, live
    )
    if not primaries:
        return
    for pool_id in primaries:
        yield pool_id, None
    primary = descriptors[primaries[0]]
    for pool_id in fallback_pools(requirements, eligibility, descriptors):
        if widening(primary, descriptors[pool_id], requirements) is None:
            yield pool_id, primary.pool_id


def by_preference(
    pools: Sequence[str],
    req: TaskRequirements,
    counters: Mapping[tuple[str, str], tuple[int, int]],
    live: LiveCapacity | None,
) -> list[str]:
    """``pools`` in the one preference order (:func:`mesh.core.ranking.rank`) — the pool's
    cost class for the capability, from its live agents, then its share of model slots in
    use — and then pool ID."""
    if len(pools) < 2:
        return list(pools)
    name, wanted = req.capability.name, req.capability.version_spec

    def key(pool_id: str) -> tuple[Rank, str]:
        used, capacity = counters.get((pool_id, MODEL_SLOTS), (0, 0))
        cost = None if live is None else live.cost_class(pool_id, name, wanted)
        return (ranking.rank(cost, used / capacity if capacity else 1.0), pool_id)

    return sorted(pools, key=key)
