"""Which grant a full pool's urgent request may take back (mesh.core.policy.victims)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.core.policy.victims import choose_victim, evict_order


@dataclass
class Kind:
    grants: list[str]  # youngest first

    def youngest(self) -> str | None:
        return self.grants[0] if self.grants else None


def test_only_interactive_requests_evict_and_only_lower_ranks() -> None:
    pool = {(0, 1): Kind(["batch-young"]), (0, 2): Kind(["interactive"])}
    assert choose_victim(1, True, pool, {}) is None
    assert choose_victim(2, True, pool, {}) == "batch-young"
    assert choose_victim(2, True, {(0, 2): Kind(["interactive"])}, {}) is None


def test_rebuildable_goes_before_retryable_and_lower_rank_first() -> None:
    rebuildable, retryable = evict_order("rebuildable"), evict_order("retryable")
    assert (rebuildable, retryable) == (0, 1)
    pool = {
        (1, 0): Kind(["retryable-speculative"]),
        (0, 1): Kind(["rebuildable-batch"]),
        (0, 0): Kind([]),
    }
    assert choose_victim(2, True, pool, {}) == "rebuildable-batch"
    assert evict_order("external-side-effects") is None  # never a victim


def test_a_tenant_at_its_share_takes_back_only_its_own_work() -> None:
    pool = {(0, 1): Kind(["someone-elses"])}
    own = {(0, 1): Kind(["mine"])}
    assert choose_victim(2, False, pool, own) == "mine"
    assert choose_victim(2, False, pool, {}) is None
