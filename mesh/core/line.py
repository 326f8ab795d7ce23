"""The line of deferred requests: a request refused for want of capacity keeps its place.

Without a line every freed slot goes to whoever asks first, and a deferred request is asleep
when one frees: under overload the oldest requests starve while newcomers are admitted on
their first try. :class:`PoolLine` keeps, per pool, the admission IDs deferred for capacity in
order — per service class (interactive before batch before speculative), and within a class
per tenant in arrival order, the tenants taken in turn (round robin), so a tenant with a
crowd waiting does not push back one that asks now and then.

The rule (applied by :class:`~mesh.core.admission.AdmissionCore` before it asks the counters):
a request may take a free slot only when fewer requests are ahead of it in line than there are
free slots. Everyone else — a newcomer included — is deferred with its position and a retry
time from that position and the pool's drain rate; its place is kept until ``due_by`` (the
retry time plus a grace), after which it is dropped and counts for nobody. A freed slot is so
held for the head of the line for as long as the head is due back, and no longer.

Pure and in memory. What makes a place outlive its manager is the decision record: each
deferral the ledger keeps names the places its request holds (pool, class, joined at, due
by), and a restarted manager takes them again (``AdmissionCore.rejoin_lines``) before it
decides anything, with the times they were first taken. Several managers on one ledger each
keep their own line (a restarted one starts from every manager's deferrals). Mutations made
while deciding a batch are undone if the batch is abandoned (:meth:`undo`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

CLASS_RANK = {"interactive": 0, "batch": 1, "speculative": 2}


@dataclass(slots=True)
class Waiter:
    admission_id: str
    tenant: str
    service_class: str
    joined_at: float  # its place: the time of its first deferral
    due_by: float  # it must come back by then, or it loses its place


@dataclass(slots=True)
class PoolLine:
    """One pool's waiting requests. Every query first drops the waiters overdue at ``now``."""

    max_waiting: int = 10_000
    # class -> tenant -> admission ID -> waiter, each tenant's in arrival order
    _classes: dict[str, dict[str, OrderedDict[str, Waiter]]] = field(default_factory=dict)
    _waiters: dict[str, Waiter] = field(default_factory=dict)
    _undo: list[tuple[str, Waiter]] = field(default_factory=list)  # ("join" | "leave", w)

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, admission_id: object) -> bool:
        return admission_id in self._waiters

    def get(self, admission_id: str) -> Waiter | None:
        return self._waiters.get(admission_id)

    def places(self) -> list[tuple[float, float]]:
        """``(joined_at, due_by)`` of every waiter, overdue ones included (a copy made in one
        step: the pool signals read it from the event loop while a batch may change it)."""
        return [(w.joined_at, w.due_by) for w in list(self._waiters.values())]

    def waiting(self, now: float) -> int:
        """How many places are held at ``now`` (overdue ones not counted; nothing changes)."""
        return sum(1 for w in self._waiters.values() if w.due_by >= now)

    def ahead(self, admission_id: str, tenant: str, service_class: str, now: float) -> int:
        """How many live waiters come before this request: everyone waiting in a class ranked
        above its own, and in its own class the round-robin order — each other tenant's first
        ``k`` waiters (``k``: this request's rank among its tenant's), and its ``k``-th too if
        that one joined earlier. A request not in line is placed where it would join."""
        self.expire(now)
        rank = CLASS_RANK.get(service_class, len(CLASS_RANK))
        count = 0
        for other, tenants in self._classes.items():
            if CLASS_RANK.get(other, len(CLASS_RANK)) < rank:
                count += sum(len(queue) for queue in tenants.values())
        tenants = self._classes.get(service_class, {})
        own = tenants.get(tenant, OrderedDict())
        me = self._waiters.get(admission_id)
        if me is not None and me.service_class == service_class:
            k = list(own).index(admission_id)
            joined = me.joined_at
        else:
            k, joined = len(own), now
        for name, queue in tenants.items():
            if name == tenant:
                count += k
            elif len(queue) > k:
                count += k + (1 if _nth(queue, k).joined_at < joined else 0)
            else:
                count += len(queue)
        return count

    def join(
        self, admission_id: str, tenant: str, service_class: str, now: float, due_by: float
    ) -> bool:
        """Keep (or extend) this request's place until ``due_by``. A request already in line
        keeps its place; a new one joins at the back of its tenant's queue. ``False`` when the
        line is full (it is deferred all the same, without a place)."""
        self.expire(now)
        found = self._waiters.get(admission_id)
        if found is not None and found.service_class == service_class:
            found.due_by = max(found.due_by, due_by)
            return True
        if found is not None:  # the same ID in another class: a new request, a new place
            self.leave(admission_id)
        if len(self._waiters) >= self.max_waiting:
            return False
        waiter = Waiter(admission_id, tenant, service_class, now, due_by)
        self._classes.setdefault(service_class, {}).setdefault(tenant, OrderedDict())[
            admission_id
        ] = waiter
        self._waiters[admission_id] = waiter
        self._undo.append(("join", waiter))
        return True

    def leave(self, admission_id: str) -> Waiter | None:
        """Out of line (admitted, rejected, or overdue); the waiter, if it was there."""
        waiter = self._waiters.pop(admission_id, None)
        if waiter is None:
            return None
        tenants = self._classes[waiter.service_class]
        queue = tenants[waiter.tenant]
        del queue[admission_id]
        if not queue:
            del tenants[waiter.tenant]
            if not tenants:
                del self._classes[waiter.service_class]
        self._undo.append(("leave", waiter))
        return waiter

    def expire(self, now: float) -> int:
        """Drop every waiter overdue at ``now`` (it did not come back in time); how many."""
        overdue = [w.admission_id for w in self._waiters.values() if w.due_by < now]
        for admission_id in overdue:
            self.leave(admission_id)
        return len(overdue)

    # ---- a batch's changes ----------------------------------------------------------------
    def mark(self) -> int:
        """A point to undo back to (the start of a batch)."""
        return len(self._undo)

    def undo(self, mark: int) -> None:
        """Revert every join and leave since ``mark`` (the batch was not kept)."""
        while len(self._undo) > mark:
            action, waiter = self._undo.pop()
            if action == "join":
                self.leave(waiter.admission_id)
                self._undo.pop()  # that leave is part of the undo, not a change to keep
            else:
                self._restore(waiter)

    def forget_undo(self) -> None:
        """The batch was kept: nothing to undo any more."""
        self._undo.clear()

    def _restore(self, waiter: Waiter) -> None:
        queue = self._classes.setdefault(waiter.service_class, {}).setdefault(
            waiter.tenant, OrderedDict()
        )
        queue[waiter.admission_id] = waiter
        # Back in arrival order: its tenant's queue is ordered by joined_at.
        for admission_id in sorted(queue, key=lambda i: queue[i].joined_at):
            queue.move_to_end(admission_id)
        self._waiters[waiter.admission_id] = waiter


def _nth(queue: OrderedDict[str, Waiter], k: int) -> Waiter:
    for i, waiter in enumerate(queue.values()):
        if i == k:
            return waiter
    raise IndexError(k)
