"""Live capacity: what each pool can do *now*, as the registry knows it.

Theory of operation
-------------------
A descriptor says what a pool *may* do; the registry says what it *can* do. For every pool
(deployment) and capability, the pool core's :class:`~mesh.core.registry.Registry` keeps a
running aggregate (:class:`LiveTally`), per version, of its Ready and Busy agents offering it
and their **free concurrency for admission**: ``max_concurrency`` minus the slots held by
leases. Pool tasks an agent runs are not subtracted — each is covered by an ACTIVE grant,
which the ledger already counts against this figure. The aggregate changes only when an agent
registers, is accepted, drains, is lost or leaves, or when a lease is taken or given back, so
keeping it costs nothing per heartbeat and nothing per agent on a query.

Admission reads it through :class:`LiveCapacity`, an immutable snapshot (the decision may run
on the ledger's thread while the loop changes the registry): a pool with no live agent whose
version matches both the task's range and the descriptor's is not admissible
(``NO_LIVE_AGENT``), and the ledger's ``live_slots:<capability>`` counter of the pool is kept at
the free figure of the agents the descriptor's range covers, so grants never pass it.
``retry_s`` says when capacity may arrive for pools with a scaling policy (the scale planner's
estimate), the retry hint of a refusal for want of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh.core.index import Slot, parse_spec, parse_version
from mesh.core.ranking import cheapest
from mesh.ledger.shared_live import LiveOffer as LiveOffer  # the row managers share
from mesh.ledger.shared_live import PoolLive as PoolLive

if TYPE_CHECKING:
    from mesh.wire.admission import CapabilityDescriptor

LIVE_SLOTS_PREFIX = "live_slots:"


def live_slots_resource(capability: str) -> str:
    """The ledger resource counting a pool's live agents' free concurrency for a capability."""
    return LIVE_SLOTS_PREFIX + capability


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


class LiveTally:
    """Per pool and capability, per (version, cost class): the live agents and their free
    concurrency, moved one slot at a time; :meth:`snapshot` turns it into a
    :class:`LiveCapacity`, rebuilt only when the figures or the retry hints changed."""

    __slots__ = ("_live", "_snapshot", "_version")

    def __init__(self) -> None:
        # (pool, capability) -> (version, cost class) -> [live agents, free concurrency]
        self._live: dict[tuple[str, str], dict[tuple[str, str], list[int]]] = {}
        self._version = 0
        self._snapshot = LiveCapacity()

    def count_slot(self, pool_id: str, slot: Slot, taking_work: bool) -> None:
        """Bring ``slot``'s share up to date: one agent and its concurrency not held by
        leases while its agent takes work, else nothing. O(1); a no-op if nothing changed."""
        share = max(0, slot.max_concurrency - slot.leased) if taking_work else None
        if share != slot.live:
            key = (pool_id, slot.capability)
            versions = self._live.setdefault(key, {})
            offer = (slot.version, slot.cost_class)
            entry = versions.setdefault(offer, [0, 0])
            if slot.live is not None:
                entry[0] -= 1
                entry[1] -= slot.live
            if share is not None:
                entry[0] += 1
                entry[1] += share
            slot.live = share
            if entry[0] == 0:
                del versions[offer]
                if not versions:
                    del self._live[key]
            self._version += 1

    def snapshot(self, retry: Mapping[str, float]) -> LiveCapacity:
        """The figures as an immutable :class:`LiveCapacity` with ``retry`` as its hints: the
        same object as last time while neither changed (with what it has worked out so far)."""
        snapshot = self._snapshot
        if snapshot.version == self._version and snapshot.retry_s == retry:
            return snapshot
        offers = snapshot.offers
        if snapshot.version != self._version:
            offers = {
                key: tuple(
                    LiveOffer(version, agents, free, cost)
                    for (version, cost), (agents, free) in versions.items()
                )
                for key, versions in self._live.items()
            }
        self._snapshot = LiveCapacity(offers, retry, self._version)
        return self._snapshot


def pool_lives(live: LiveCapacity, pools: set[str], shard: int, fence: int) -> dict[str, PoolLive]:
    """``live``'s figures for ``pools`` as rows for the shared table: only pools with an offer
    or a retry hint (a pool with neither has no row)."""
    offers: dict[str, list[tuple[str, LiveOffer]]] = {}
    for (pool_id, capability), versions in live.offers.items():
        if pool_id in pools:
            offers.setdefault(pool_id, []).extend((capability, o) for o in versions)
    rows = {}
    for pool_id in pools:
        found = tuple(sorted(offers.get(pool_id, ()), key=lambda pair: (pair[0], pair[1].version)))
        retry = live.retry_s.get(pool_id)
        if found or retry is not None:
            rows[pool_id] = PoolLive(shard, fence, found, retry)
    return rows


def merged_live(
    own: LiveCapacity, shared: Mapping[str, PoolLive], from_own: Callable[[str], bool], version: int
) -> LiveCapacity:
    """One snapshot for admission with several managers: a pool this manager answers for
    (``from_own``) from its own registry, every other pool from its owner's shared row."""
    offers: dict[tuple[str, str], tuple[LiveOffer, ...]] = {
        key: versions for key, versions in own.offers.items() if from_own(key[0])
    }
    retry = {pool_id: eta for pool_id, eta in own.retry_s.items() if from_own(pool_id)}
    for pool_id, row in shared.items():
        if from_own(pool_id):
            continue
        for capability, offer in row.offers:
            offers[(pool_id, capability)] = (*offers.get((pool_id, capability), ()), offer)
        if row.retry_s is not None:
            retry[pool_id] = row.retry_s
    return LiveCapacity(offers, retry, version)


def described_free(
    descriptors: Mapping[str, CapabilityDescriptor], live: LiveCapacity, pools: Iterable[str]
) -> dict[tuple[str, str], int]:
    """The ledger's live-slot capacity of each described pool in ``pools`` and capability:
    the free concurrency of the live agents whose version the descriptor's range covers."""
    out = {}
    for pool_id in pools:
        descriptor = descriptors.get(pool_id)
        for offered in descriptor.capabilities if descriptor is not None else ():
            key = (pool_id, live_slots_resource(offered.name))
            out[key] = live.free(pool_id, offered.name, offered.version_spec)
    return out
