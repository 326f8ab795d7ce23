"""The grants the admission core holds on the pressure board: counted when made, adopted
from the ledger after a restart, forgotten when they end, and evicted to make room.

The board's fair shares and stages need to know who holds what, and an eviction needs the
victim's fence and items to release it; :class:`HeldGrants` keeps both in step, and puts
the board back when a batch is abandoned. Which grant is a victim is the board's policy
(:mod:`mesh.core.policy.victims`); this room carries it out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mesh.core.batch import Batch, Eviction, Held
from mesh.core.capacity import LIVE_SLOTS_PREFIX
from mesh.core.decision_memory import DECISION_CACHE_SIZE
from mesh.core.eligibility import MODEL_SLOTS, TENANT_TOKENS_PREFIX
from mesh.core.pressure import Holding, PressureBoard, evict_order, shed_rank
from mesh.core.records import DecisionRecord
from mesh.ledger.model import TENANT_POOL, Refused, Release, Reservation, ReservationState
from mesh.wire.admission import AdmissionRequest, TaskRequirements

__all__ = ["HeldGrants", "run_of", "short_of_slots"]


@dataclass
class HeldGrants:
    """Grants made or adopted, by admission ID, and the recent ones taken back."""

    pressure: PressureBoard
    held: dict[str, Held] = field(default_factory=dict)
    # Grants this core took back (evicted), recent ones: their holder's release is refused
    # as such, not answered as a retried release (bounded; not kept across a restart).
    evicted: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def count(
        self,
        batch: Batch,
        reservation: Reservation,
        req: TaskRequirements,
        tenant: str,
        now: float,
    ) -> None:
        """Count a grant ``batch`` makes (or finds made) on the board."""
        self.pressure.granted(
            reservation.admission_id, reservation.pool_id, tenant, now,
            rank=shed_rank(req.service_class, req.priority, self.pressure.policy),
            evict_order=evict_order(req.recoverability),
            run=run_of(req.run_id, tenant),
        )  # fmt: skip
        batch.granted.append(reservation.admission_id)
        batch.held[reservation.admission_id] = Held(
            reservation.fence, reservation.items, reservation.expires_at
        )

    def adopt(self, reservation: Reservation, decided: DecisionRecord | None) -> None:
        """Count a grant the ledger holds (after a restart) on the pressure board: the fair
        shares need to know who holds what, and an eviction its fence."""
        estimate = (decided.estimate if decided else None) or {}
        tenant = _tenant_of(reservation) or (decided.tenant if decided else None)
        rank = shed_rank(
            estimate.get("service_class", "batch"),
            estimate.get("priority", 0),
            self.pressure.policy,
        )
        self.pressure.adopt(
            reservation.admission_id,
            Holding(
                reservation.pool_id,
                tenant or "(unknown)",
                reservation.updated_at or reservation.created_at,
                rank,
                evict_order(estimate.get("recoverability")),  # unknown: never evicted
                run_of(estimate.get("run_id"), tenant or "(unknown)"),
            ),
        )
        self.held[reservation.admission_id] = Held(
            reservation.fence, reservation.items, reservation.expires_at
        )

    def ended(self, admission_id: str, now: float, *, completed: bool) -> None:
        """A grant is over (released by its holder, expired, or found gone)."""
        self.pressure.ended(admission_id, now, completed=completed)
        self.held.pop(admission_id, None)

    def evict_for(
        self, batch: Batch, request: AdmissionRequest, tenant: str, pool_id: str, now: float
    ) -> bool:
        """Release one recoverable, lower-ranked grant of the full ``pool_id`` to make room
        for ``request``; ``True`` if one was released (in the batch's counters and ops)."""
        req = request.requirements
        rank = shed_rank(req.service_class, req.priority, self.pressure.policy)
        victim_id = self.pressure.victim(pool_id, tenant, rank, now)
        if victim_id is None:
            return False
        held = batch.held.get(victim_id) or self.held.get(victim_id)
        if held is None or held.expires_at <= now:  # not a grant this core knows, or overdue
            self.pressure.ended(victim_id, now, completed=False)
            return False
        batch.ops.append(Release(victim_id, held.fence, now))
        batch.give_back(held.items)
        holding = self.pressure.ended(victim_id, now, completed=False)
        assert holding is not None  # the board named it
        victim = Reservation(
            victim_id, "", pool_id, ReservationState.RELEASED, held.fence, held.items,
            held.expires_at, now, now,
        )  # fmt: skip
        batch.evicted.append(Eviction(victim, holding, request.admission_id, now))
        batch.held.pop(victim_id, None)
        return True

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: its grants are held, its victims are not."""
        for eviction in batch.evicted:
            self.held.pop(eviction.victim.admission_id, None)
            self.evicted[eviction.victim.admission_id] = eviction.at
            while len(self.evicted) > DECISION_CACHE_SIZE:
                self.evicted.popitem(last=False)
        self.held.update(batch.held)

    def abandoned(self, batch: Batch, now: float) -> None:
        """Nothing of ``batch`` was kept: the board as it was before it."""
        for admission_id in batch.granted:
            self.pressure.ended(admission_id, now, completed=False)
        for eviction in batch.evicted:  # the victims' releases rolled back with it
            self.pressure.restore(eviction.victim.admission_id, eviction.holding, now)


def short_of_slots(refused: Refused | None) -> bool:
    """Short of a model slot or a live agent's slot: what evicting a grant of the pool frees."""
    return refused is not None and (
        refused.resource == MODEL_SLOTS or (refused.resource or "").startswith(LIVE_SLOTS_PREFIX)
    )


def run_of(run_id: str | None, tenant: str) -> str | None:
    """A run's key on the pressure board: run IDs are scoped by tenant."""
    return None if run_id is None else f"{tenant}/{run_id}"


def _tenant_of(reservation: Reservation) -> str | None:
    """The tenant whose token budget a reservation draws on (None if it takes no tokens)."""
    for item in reservation.items:
        if item.pool_id == TENANT_POOL and item.resource.startswith(TENANT_TOKENS_PREFIX):
            return item.resource[len(TENANT_TOKENS_PREFIX) :]
    return None
