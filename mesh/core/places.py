"""The places deferred requests hold in the pools' lines, as the admission core keeps them.

:class:`~mesh.core.line.PoolLine` is one pool's line as a data structure; :class:`Places`
applies it to admission: whether a request must wait behind the line for the room it sees
(:meth:`Places.behind_the_line`), a deferral with a place and a retry time from it
(:meth:`Places.in_line`), the places a decision record keeps, and the lines rebuilt from
those records after a restart (:meth:`Places.rejoin`). Every change made while deciding a
batch is undone if the batch is abandoned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mesh.core.answers import deferred, past_deadline
from mesh.core.batch import Batch, grant_items
from mesh.core.capacity import LiveCapacity
from mesh.core.line import PoolLine
from mesh.core.pressure import PressureBoard, Shed
from mesh.core.records import DecisionRecord
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRequest,
    TaskRequirements,
)

__all__ = ["LINE_REASONS", "Places"]

LINE_REASONS = frozenset({AdmissionReason.CAPACITY.value, AdmissionReason.SHED.value})
"""Deferrals that give a place in the pool's line: want of room, the counters' or the stage's."""


@dataclass
class Places:
    """Every pool's line of requests deferred for capacity, and the room they wait for."""

    pressure: PressureBoard  # the stages that limit a class's room; the pools' drain rates
    rand: Callable[[], float]  # retry-time jitter in [0, 1)
    lines: dict[str, PoolLine] = field(default_factory=dict)  # per pool

    def on(self) -> bool:
        """Lines are part of pressure handling: off with it (``enabled=False``) or alone."""
        return self.pressure.policy.enabled and self.pressure.policy.line

    def line(self, batch: Batch, pool_id: str) -> PoolLine:
        """The pool's line, marked so that ``batch``'s changes to it can be undone."""
        line = self.lines.get(pool_id)
        if line is None:
            line = self.lines[pool_id] = PoolLine(max_waiting=self.pressure.policy.line_max)
        batch.line_marks.setdefault(pool_id, line.mark())
        return line

    def room(
        self,
        batch: Batch,
        pool_id: str,
        req: TaskRequirements,
        tenant: str,
        live: LiveCapacity | None,
    ) -> int:
        """How many grants shaped like ``req`` the pool's counters hold room for now: the
        binding counter decides (slots, sandboxes, a tool…); the tenant's budget is its own."""
        room: int | None = None
        for item_pool, resource, amount in grant_items(req, tenant, pool_id, live):
            if item_pool != pool_id:
                continue
            used, capacity = batch.counters.get((item_pool, resource), (0, 0))
            fits = max(0, capacity - used) // amount
            room = fits if room is None else min(room, fits)
        return room or 0

    def class_room(
        self,
        batch: Batch,
        pool_id: str,
        req: TaskRequirements,
        tenant: str,
        live: LiveCapacity | None,
    ) -> int:
        """The room for ``req``: its counters', within what the pool's stage leaves its class
        (batch and speculative work stop short of full)."""
        free = self.room(batch, pool_id, req, tenant, live)
        staged = self.pressure.class_room(pool_id, req.service_class, req.priority)
        return free if staged is None else min(free, staged)

    def behind_the_line(
        self,
        batch: Batch,
        pool_id: str,
        request: AdmissionRequest,
        tenant: str,
        now: float,
        live: LiveCapacity | None,
    ) -> Shed | None:
        """``CAPACITY`` when at least as many requests wait ahead of this one in the pool's
        line as there is room for: that room is theirs while they are due back."""
        if not self.on() or pool_id not in self.lines:
            return None
        line = self.line(batch, pool_id)
        if not line:
            return None
        req = request.requirements
        cls = req.service_class
        ahead = line.ahead(request.admission_id, tenant, cls, now)
        free = self.class_room(batch, pool_id, req, tenant, live)
        if ahead == 0 or ahead < free:
            return None
        return Shed(
            AdmissionReason.CAPACITY.value,
            f"{ahead} request(s) wait ahead of this one in {pool_id}'s line for {cls} work and "
            f"there is room for {free}: room goes to the head of the line first",
            1,
        )

    def in_line(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        pool_id: str,
        why: Shed,
        now: float,
        live: LiveCapacity | None,
    ) -> AdmissionDecision:
        """A deferral for capacity with a place in ``pool_id``'s line: its position, and a
        retry time from that position and the pool's drain rate; the place is kept until
        then plus ``line_grace_s``. A retry that would miss the deadline: rejected."""
        req = request.requirements
        line = self.line(batch, pool_id)
        ahead = line.ahead(request.admission_id, tenant, req.service_class, now)
        free = self.class_room(batch, pool_id, req, tenant, live)
        joining = request.admission_id not in line
        retry_ms = self.pressure.line_retry_ms(
            pool_id, ahead + 1, free, req.estimated_duration_s, req.deadline, now, self.rand,
            joining=joining,
        )  # fmt: skip
        if retry_ms is None:
            return past_deadline(request, f"{why.detail}; its turn would come after the deadline")
        due_by = now + retry_ms / 1000.0 + self.pressure.policy.line_grace_s
        placed = line.join(request.admission_id, tenant, req.service_class, now, due_by)
        detail = why.detail
        if placed:
            detail = f"{detail}; place {ahead + 1} in {pool_id}'s line, kept until {due_by:.1f}"
        position = ahead + 1 if placed else None
        return deferred(request, AdmissionReason(why.reason), detail, retry_ms, position)

    def keep_places(
        self,
        batch: Batch,
        request: AdmissionRequest,
        tenant: str,
        retry_after_ms: int | None,
        now: float,
    ) -> None:
        """A request in a line deferred for another reason (its class shed for a while, its
        tenant at its share) keeps its place for its retry time and the grace: a younger
        request of its class and tenant must not overtake it meanwhile."""
        due_by = now + (retry_after_ms or 0) / 1000.0 + self.pressure.policy.line_grace_s
        cls = request.requirements.service_class
        for pool_id, line in self.lines.items():
            if request.admission_id in line:
                batch.line_marks.setdefault(pool_id, line.mark())
                line.join(request.admission_id, tenant, cls, now, due_by)

    def leave(self, batch: Batch, admission_id: str) -> None:
        """Out of every line (admitted or rejected)."""
        for pool_id, line in self.lines.items():
            if admission_id in line:
                batch.line_marks.setdefault(pool_id, line.mark())
                line.leave(admission_id)

    def held_by(self, request: AdmissionRequest) -> list[list[Any]] | None:
        """The places ``request`` holds in the lines, as its decision record keeps them: pool,
        class, when it joined, until when it is kept, and the request's deadline."""
        deadline = request.requirements.deadline
        places = [
            [pool_id, w.service_class, w.joined_at, w.due_by, deadline]
            for pool_id, line in self.lines.items()
            if (w := line.get(request.admission_id)) is not None
        ]
        return places or None

    def rejoin(self, waiting: Iterable[tuple[str, DecisionRecord]], now: float) -> int:
        """Rebuild the lines from the records of deferred requests (after a restart): each
        place is taken again with the time it was first taken, so a request deferred before
        the restart stays ahead of one that first asks after it. A holder could not come back
        while no manager was there to hear it (its retry waits in the queue): a place is kept
        at least ``line_grace_s`` from ``now`` — unless its request's deadline has passed.
        Returns how many places were taken."""
        if not self.on():
            return 0
        grace = self.pressure.policy.line_grace_s
        places = sorted(
            (float(joined_at), admission_id, decided.tenant or "", pool_id, cls, float(due_by))
            for admission_id, decided in waiting
            for pool_id, cls, joined_at, due_by, *more in decided.line or ()
            if not more or more[0] is None or float(more[0]) > now
        )
        for joined_at, admission_id, tenant, pool_id, cls, due_by in places:
            line = self.lines.get(pool_id)
            if line is None:
                line = self.lines[pool_id] = PoolLine(max_waiting=self.pressure.policy.line_max)
            line.join(admission_id, tenant, cls, joined_at, max(due_by, now + grace))
        for line in self.lines.values():
            line.forget_undo()
        return len(places)

    def committed(self, batch: Batch) -> None:
        """The shell committed ``batch``: its changes to the lines stay."""
        for pool_id in batch.line_marks:
            self.lines[pool_id].forget_undo()

    def abandoned(self, batch: Batch) -> None:
        """Nothing of ``batch`` was kept: the lines as they were before it."""
        for pool_id, mark in batch.line_marks.items():
            self.lines[pool_id].undo(mark)
