"""Live capacity as admission applies it: no grant without a live agent, and never more
grants than the live agents can take.

A pool with no live agent for the task is refused before its counters are asked
(:func:`no_live_agent`); the ledger's ``live_slots:<capability>`` counters are brought up to
the registry's free concurrency before a batch decides (:class:`LiveSlots`); and the
pressure stages measure a pool against the smaller of its described and its live slots
(:func:`staged_slots`). The figures themselves are the registry's (:mod:`mesh.core.capacity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mesh.core.batch import Batch
from mesh.core.capacity import LIVE_SLOTS_PREFIX, LiveCapacity, described_free
from mesh.core.eligibility import MODEL_SLOTS
from mesh.core.pressure import Shed
from mesh.ledger.model import SetCapacity, Usage
from mesh.wire.admission import AdmissionReason, CapabilityDescriptor, TaskRequirements

__all__ = ["LiveSlots", "no_live_agent", "staged_slots"]


@dataclass
class LiveSlots:
    """What this core last wrote of the ledger's live-slot capacities."""

    # (pool, live_slots resource) -> the capacity last committed to the ledger
    written: dict[tuple[str, str], int] = field(default_factory=dict)
    checked: tuple[int, int] | None = None  # what ``written`` is known to match

    def unchanged(self, live: LiveCapacity, descriptors_version: int) -> bool:
        """True if the ledger's live-slot capacities already match ``live``."""
        return (live.version, descriptors_version) == self.checked

    def write(
        self,
        batch: Batch,
        live: LiveCapacity,
        descriptors: Mapping[str, CapabilityDescriptor],
        descriptors_version: int,
    ) -> None:
        """The ledger's live-slot capacities as the registry says: per described pool and
        capability, the free concurrency of the live agents whose version the descriptor's
        range covers (only those that changed since the last committed write)."""
        checked = (live.version, descriptors_version)
        if checked == self.checked:
            return  # neither the registry nor the descriptors changed since the last write
        targets = {
            key: free
            for key, free in described_free(descriptors, live, descriptors).items()
            if self.written.get(key) != free
        }
        for (pool_id, resource), capacity in sorted(targets.items()):
            batch.ops.append(SetCapacity(pool_id, resource, capacity))
            used = batch.counters.get((pool_id, resource), (0, 0))[0]
            batch.counters[(pool_id, resource)] = (used, capacity)
            batch.live_written[(pool_id, resource)] = capacity
        batch.live_checked = checked

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: what it wrote is what the ledger holds."""
        self.written.update(batch.live_written)
        if batch.live_checked is not None:
            self.checked = batch.live_checked


def no_live_agent(
    pool_id: str,
    req: TaskRequirements,
    live: LiveCapacity | None,
    descriptors: Mapping[str, CapabilityDescriptor],
) -> Shed | None:
    """``NO_LIVE_AGENT`` if no live agent of the pool offers the capability at a version in
    both the task's range and the descriptor's (``None``: one does, or no live view)."""
    if live is None:
        return None
    name = req.capability.name
    described = next(
        (c.version_spec for c in descriptors[pool_id].capabilities if c.name == name), ">=0"
    )
    if live.agents(pool_id, name, req.capability.version_spec, described) > 0:
        return None
    return Shed(
        AdmissionReason.NO_LIVE_AGENT.value,
        f"{pool_id} has no live agent offering {name} {req.capability.version_spec} "
        f"(its descriptor allows {described}): none registered, or all draining or lost",
        None,
    )


def staged_slots(usage: Usage) -> dict[str, tuple[int, int]]:
    """Per pool, its model slots in use and the capacity its stages measure against: the
    described slots, or what its live agents can run over its capabilities if that is less."""
    slots = {pool: held for (pool, resource), held in usage.items() if resource == MODEL_SLOTS}
    live: dict[str, int] = {}  # what the pool's live agents can run, over its capabilities
    for (pool, resource), (_, capacity) in usage.items():
        if resource.startswith(LIVE_SLOTS_PREFIX):
            live[pool] = live.get(pool, 0) + capacity
    for pool, capacity in live.items():  # stages measure against the smaller capacity
        if pool in slots:
            used, described = slots[pool]
            slots[pool] = (used, min(described, capacity))
    return slots
