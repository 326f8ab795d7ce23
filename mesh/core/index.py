"""The capability index: name -> versions -> cost class -> load level -> agents.

Theory of operation
-------------------
``find_by_capability`` must stay cheap at tens of thousands of agents, so the
index never scans agents. For each capability name it keeps one
:class:`VersionGroup` per distinct version (parsed once, when the first agent
with it registers). Each group keeps only the agents that can take work *now*,
bucketed by their rank (:func:`mesh.core.ranking.rank` of their cost class and
load level — the agent's in-flight count) in insertion-ordered dicts. A query:

1. resolves the version spec to the matching groups — parsed once and cached
   per spec string, the cache dropped whenever the set of versions changes;
2. walks the buckets in rank order (cheapest cost class, then least loaded, as
   :mod:`mesh.core.ranking` defines it), copying each bucket's candidates out in
   one slice;
3. stops as soon as ``limit`` agents are found.

Its cost grows with the number of distinct versions and load levels, not with
the number of agents. An agent enters the available buckets when it is
acquirable and has a free slot for that capability, and leaves them when it is
full, draining or removed; every removal path prunes empty groups and names so
no ghost is ever returned.

A bucket holds each available slot's :class:`Candidate`, the answer itself, so a
query copies buckets rather than building one object per agent. The snapshot is
taken when the slot enters its bucket: a slot's in-flight count changes only
together with its agent's load level, and every change of level moves the slot
to another bucket (or puts it back into the same one), which takes a fresh
snapshot. Each slot keeps the :class:`Candidate` it last made and rebuilds it
only when its in-flight count has changed. Candidates are immutable, so handing
the same one out twice is safe.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import islice

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from mesh.core import ranking
from mesh.core.ranking import Rank
from mesh.errors import LocalProtocolError

_SPEC_CACHE_MAX = 1024


class InvalidVersionSpec(LocalProtocolError):
    """The version spec is not a valid PEP 440 specifier set."""


@lru_cache(maxsize=4096)
def parse_version(text: str) -> Version:
    return Version(text)


@lru_cache(maxsize=4096)
def parse_spec(text: str) -> SpecifierSet:
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise InvalidVersionSpec(f"{text!r} is not a valid version specifier") from None


@dataclass(frozen=True, slots=True)
class Candidate:
    """An agent that can take one more task of a capability now."""

    agent_id: str
    capability: str
    version: str
    cost_class: str
    in_flight: int
    max_concurrency: int


@dataclass(slots=True)
class Slot:
    """One agent's offer of one capability, with its live in-flight counter.

    ``in_flight`` is the one count of work (leased slots plus the pool tasks the agent
    reported running), ``leased`` the lease path's share of it, ``live`` what the slot adds to
    its pool's live capacity (``None``: nothing, the agent is not taking work). Only these
    change during a slot's life; a new registration makes new slots.
    """

    agent_id: str
    capability: str
    version: str
    cost_class: str
    max_concurrency: int
    in_flight: int = 0
    leased: int = 0
    live: int | None = None
    _snapshot: Candidate | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.max_concurrency

    def candidate(self) -> Candidate:
        """This slot as a :class:`Candidate`, rebuilt only when ``in_flight`` has changed."""
        snapshot = self._snapshot
        if snapshot is None or snapshot.in_flight != self.in_flight:
            snapshot = self._snapshot = Candidate(
                self.agent_id,
                self.capability,
                self.version,
                self.cost_class,
                self.in_flight,
                self.max_concurrency,
            )
        return snapshot


@dataclass(slots=True)
class VersionGroup:
    version: Version
    text: str
    members: int = 0
    # rank (cost class, load level) -> agent_id -> the slot's Candidate (insertion-ordered)
    available: dict[Rank, dict[str, Candidate]] = field(default_factory=dict)
    ranks: list[Rank] = field(default_factory=list)  # the keys of ``available``, sorted
    ranks_changed: int = 0  # bumped whenever a rank appears or goes

    def add_available(self, slot: Slot, level: int) -> None:
        key = ranking.rank(slot.cost_class, level)
        bucket = self.available.get(key)
        if bucket is None:
            bucket = self.available[key] = {}
            bisect.insort(self.ranks, key)
            self.ranks_changed += 1
        bucket[slot.agent_id] = slot.candidate()

    def discard_available(self, slot: Slot, level: int) -> None:
        key = ranking.rank(slot.cost_class, level)
        bucket = self.available.get(key)
        if bucket is not None and bucket.pop(slot.agent_id, None) is not None and not bucket:
            del self.available[key]
            del self.ranks[bisect.bisect_left(self.ranks, key)]
            self.ranks_changed += 1


@dataclass(slots=True)
class CapabilityEntry:
    """Everything indexed under one capability name."""

    groups: dict[str, VersionGroup] = field(default_factory=dict)
    spec_cache: dict[str, tuple[VersionGroup, ...]] = field(default_factory=dict)
    # spec -> (the matching groups' ``ranks_changed``, their ranks merged): a query over
    # several versions walks one sorted list, rebuilt only when a rank came or went
    merged: dict[str, tuple[tuple[int, ...], list[Rank]]] = field(default_factory=dict)

    def ranks(self, spec_text: str, groups: tuple[VersionGroup, ...]) -> list[Rank]:
        """Every rank with an available agent in ``groups`` (those ``spec_text`` matches),
        sorted."""
        if len(groups) == 1:
            return groups[0].ranks
        stamp = tuple(g.ranks_changed for g in groups)
        cached = self.merged.get(spec_text)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        merged = sorted(set().union(*(g.ranks for g in groups)))
        if len(self.merged) >= _SPEC_CACHE_MAX:  # clients choose the spec strings
            self.merged.clear()
        self.merged[spec_text] = (stamp, merged)
        return merged

    def matching(self, spec_text: str) -> tuple[VersionGroup, ...]:
        cached = self.spec_cache.get(spec_text)
        if cached is None:
            spec = parse_spec(spec_text)
            cached = tuple(
                g for g in self.groups.values() if spec.contains(g.version, prereleases=True)
            )
            if len(self.spec_cache) >= _SPEC_CACHE_MAX:  # clients choose the spec strings
                self.spec_cache.clear()
            self.spec_cache[spec_text] = cached
        return cached


class CapabilityIndex:
    """Multimap capability name -> slots, ordered for ``find``. Not thread-safe by design:
    only the core's single caller touches it."""

    def __init__(self) -> None:
        self._entries: dict[str, CapabilityEntry] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def has_version_matching(self, name: str, spec_text: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and bool(entry.matching(spec_text))

    def versions(self, name: str) -> list[str]:
        entry = self._entries.get(name)
        if entry is None:
            return []
        return [g.text for g in sorted(entry.groups.values(), key=lambda g: g.version)]

    # -- membership -----------------------------------------------------------------------
    def add(self, slot: Slot) -> bool:
        """Index a slot (not yet available). True if its version is new for this name."""
        entry = self._entries.setdefault(slot.capability, CapabilityEntry())
        group = entry.groups.get(slot.version)
        is_new = group is None
        if group is None:
            group = VersionGroup(parse_version(slot.version), slot.version)
            entry.groups[slot.version] = group
            entry.spec_cache.clear()
            entry.merged.clear()
        group.members += 1
        return is_new

    def remove(self, slot: Slot, level: int) -> None:
        """Forget a slot entirely, pruning empty versions and names."""
        entry = self._entries[slot.capability]
        group = entry.groups[slot.version]
        group.discard_available(slot, level)
        group.members -= 1
        if group.members == 0:
            del entry.groups[slot.version]
            entry.spec_cache.clear()
            entry.merged.clear()
            if not entry.groups:
                del self._entries[slot.capability]

    # -- availability ---------------------------------------------------------------------
    def make_available(self, slot: Slot, level: int) -> None:
        self._group(slot).add_available(slot, level)

    def make_unavailable(self, slot: Slot, level: int) -> None:
        self._group(slot).discard_available(slot, level)

    def _group(self, slot: Slot) -> VersionGroup:
        return self._entries[slot.capability].groups[slot.version]

    # -- queries --------------------------------------------------------------------------
    def find(self, name: str, spec_text: str = ">=0", limit: int | None = None) -> list[Candidate]:
        """Agents that can take one more task now: cheapest cost class, then least loaded."""
        entry = self._entries.get(name)
        if entry is None:
            parse_spec(spec_text)  # an invalid spec is an error even for an unknown name
            return []
        groups = entry.matching(spec_text)
        out: list[Candidate] = []
        # Ranks in order (kept sorted, merged across versions only when one came or went),
        # stopping as soon as ``limit`` agents are found.
        for key in entry.ranks(spec_text, groups):
            for group in groups:
                bucket = group.available.get(key)
                if bucket is None:
                    continue
                missing = -1 if limit is None else limit - len(out)
                if missing < 0 or len(bucket) < missing:
                    out += bucket.values()
                    continue
                if missing == 1:
                    out.append(next(iter(bucket.values())))
                else:
                    out += islice(bucket.values(), missing)
                return out
        return out
