"""Live capacity: what each pool can do *now*, as the registry knows it.

Theory of operation
-------------------
A descriptor says what a pool *may* do; the registry says what it *can* do. For every pool
(deployment) and capability, :class:`~mesh.core.pool.PoolCore` keeps a running aggregate,
per version, of its Ready and Busy agents offering it and their **free concurrency for
admission**: ``max_concurrency`` minus the slots held by leases. Pool tasks an agent runs are
not subtracted — each is covered by an ACTIVE grant, which the ledger already counts against
this figure. The aggregate changes only when an agent registers, is accepted, drains, is lost
or leaves, or when a lease is taken or given back, so keeping it costs nothing per heartbeat
and nothing per agent on a query.

Admission reads it through :class:`LiveCapacity`, an immutable snapshot (the decision may run
on the ledger's thread while the loop changes the registry): a pool with no live agent whose
version matches both the task's range and the descriptor's is not admissible
(``NO_LIVE_AGENT``), and the ledger's ``live_slots:<capability>`` counter of the pool is kept at
the free figure of the agents the descriptor's range covers, so grants never pass it.
``retry_s`` says when capacity may arrive for pools with a scaling policy (the scale planner's
estimate), the retry hint of a refusal for want of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mesh.core.index import parse_spec, parse_version
from mesh.core.ranking import cheapest

LIVE_SLOTS_PREFIX = "live_slots:"


def live_slots_resource(capability: str) -> str:
    """The ledger resource counting a pool's live agents' free concurrency for a capability."""
    return LIVE_SLOTS_PREFIX + capability


@dataclass(frozen=True, slots=True)
class LiveOffer:
    """One version of a capability at one cost class in one pool: how many live agents offer
    it, and their concurrency not held by leases."""

    version: str
    agents: int
    free: int
    cost_class: str


@dataclass(frozen=True, slots=True)
class LiveCapacity:
    """A snapshot of every pool's live offers; ``version`` changes whenever they do."""

    offers: Mapping[tuple[str, str], tuple[LiveOffer, ...]] = field(default_factory=dict)
    retry_s: Mapping[str, float] = field(default_factory=dict)
    version: int = 0
    # (pool, capability, specs) -> matching offers: every admission asks the same few
    # questions of one snapshot, and a version range check costs more than the rest.
    _matching: dict[tuple[str, str, tuple[str, ...]], tuple[LiveOffer, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def matching(self, pool_id: str, capability: str, *specs: str) -> tuple[LiveOffer, ...]:
        """The pool's offers of ``capability`` whose version is in every one of ``specs``."""
        key = (pool_id, capability, specs)
        found = self._matching.get(key)
        if found is None:
            parsed = [parse_spec(s) for s in specs]
            found = self._matching[key] = tuple(
                offer
                for offer in self.offers.get((pool_id, capability), ())
                if all(p.contains(parse_version(offer.version), prereleases=True) for p in parsed)
            )
        return found

    def free(self, pool_id: str, capability: str, *specs: str) -> int:
        """Free concurrency for admission of the matching versions."""
        return sum(offer.free for offer in self.matching(pool_id, capability, *specs))

    def agents(self, pool_id: str, capability: str, *specs: str) -> int:
        """Live agents offering a matching version."""
        return sum(offer.agents for offer in self.matching(pool_id, capability, *specs))

    def cost_class(self, pool_id: str, capability: str, *specs: str) -> str | None:
        """The pool's cost class for the capability: the cheapest its live agents offer at a
        matching version (``None``: none does) — what pool choice ranks it by."""
        return cheapest([offer.cost_class for offer in self.matching(pool_id, capability, *specs)])
