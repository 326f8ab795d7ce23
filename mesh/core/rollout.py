"""Descriptor rollout: each pool's active descriptor and epoch, a shadow candidate for its
next epoch, and the older-epoch grants still honoured while a pool moves on.

The admission core reads these on every decision; this room only changes them, always by
replacing a mapping rather than changing it in place (readers on other threads see one
version or the next), and bumps ``version`` so the eligibility cache knows. Shadow
descriptors are evaluated and recorded with each decision (:meth:`Rollout.shadow_record`),
never enforced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mesh.core.eligibility import EligibilityResult, check_eligibility
from mesh.wire.admission import CapabilityDescriptor, TaskRequirements

__all__ = ["Rollout"]

_NO_DESCRIPTOR = "no_descriptor"
"""In a shadow record: the pool has no live descriptor (the shadow would create it)."""


@dataclass
class Rollout:
    """The active descriptors and epochs per pool, their shadows and draining allowlists."""

    descriptors: Mapping[str, CapabilityDescriptor] = field(default_factory=dict)
    active_epochs: Mapping[str, int] = field(default_factory=dict)
    # pool -> a candidate next descriptor every admission is also evaluated against (shadow
    # routing: recorded with the decision, never enforced); in memory only
    shadows: Mapping[str, CapabilityDescriptor] = field(default_factory=dict)
    # pool -> {admission_id: grant expiry}: grants of an older epoch still honoured (the
    # admissions ACTIVE when this manager advanced the pool's epoch), until released or expired
    draining: dict[str, dict[str, float]] = field(default_factory=dict)
    version: int = 0  # bumped whenever a descriptor or an active epoch changes

    def activate(self, descriptor: CapabilityDescriptor) -> None:
        """Make ``descriptor`` its pool's active one."""
        self.version += 1
        self.descriptors = {**self.descriptors, descriptor.pool_id: descriptor}
        self.active_epochs = {**self.active_epochs, descriptor.pool_id: descriptor.descriptor_epoch}

    def set_active_epoch(self, pool_id: str, epoch: int) -> None:
        """Make ``epoch`` the pool's active descriptor epoch: descriptors of other epochs are
        no longer eligible."""
        self.version += 1
        self.active_epochs = {**self.active_epochs, pool_id: epoch}

    def set_shadow(self, descriptor: CapabilityDescriptor, now: float) -> str | None:
        """Shadow ``descriptor`` (a newer epoch than the active one); ``None`` or why not."""
        current = self.active_epochs.get(descriptor.pool_id)
        if current is not None and descriptor.descriptor_epoch <= current:
            return (
                f"a shadow is a candidate next epoch: {descriptor.descriptor_epoch} is not "
                f"newer than the active {current}"
            )
        if descriptor.expires_at <= now:
            return "the descriptor has already expired"
        self.shadows = {**self.shadows, descriptor.pool_id: descriptor}
        return None

    def drop_shadow(self, pool_id: str) -> CapabilityDescriptor | None:
        dropped = self.shadows.get(pool_id)
        self.shadows = {p: d for p, d in self.shadows.items() if p != pool_id}
        return dropped

    def draining_allowlist(self, pool_id: str, now: float) -> list[str] | None:
        """The admissions whose older-epoch grants the pool's agents still honour, or ``None``
        if this manager did not advance the pool (it does not know the list: say nothing)."""
        allowlist = self.draining.get(pool_id)
        if allowlist is None:
            return None
        for admission_id in [a for a, expires_at in allowlist.items() if expires_at <= now]:
            del allowlist[admission_id]
        return sorted(allowlist)

    def ended(self, admission_id: str) -> None:
        """A grant is over: no allowlist honours it any more."""
        for allowlist in self.draining.values():
            allowlist.pop(admission_id, None)

    def shadow_record(
        self,
        requirements: TaskRequirements,
        tenant: str,
        live: EligibilityResult,
        now: float,
        active_generation: int,
    ) -> dict[str, Any]:
        """How eligibility would differ with the shadow descriptors active."""
        descriptors = {**self.descriptors, **self.shadows}
        epochs = {**self.active_epochs}
        epochs.update((p, d.descriptor_epoch) for p, d in self.shadows.items())
        shadow = check_eligibility(
            requirements, tenant, descriptors,
            active_epochs=epochs, active_generation=active_generation, now=now,
        )  # fmt: skip
        live_rules = {v.pool_id: v.rule for v in live.verdicts}
        pools = [
            {
                "pool_id": v.pool_id,
                "descriptor_epoch": v.descriptor_epoch,
                "live": live_rules.get(v.pool_id, _NO_DESCRIPTOR),
                "shadow": v.rule,
            }
            for v in shadow.verdicts
            if v.pool_id in self.shadows
        ]
        agree = all((p["live"] is None) == (p["shadow"] is None) for p in pools)
        return {"eligible": list(shadow.eligible), "pools": pools, "agree": agree}
