"""Pool signals as one manager serves them: its admission decisions counted per pool, and
each pool's figures gathered from the running aggregates the manager already keeps.

:class:`PoolSignalSource` is fed every admission decision (``decided``, from
:meth:`mesh.manager.observe.Observer.admitted`) and answers :meth:`PoolSignalSource.signals`
for the status RPC's ``pool_signals``, ``GET /api/pools`` and ``GET /api/pools/<pool>``. Where
each figure comes from (the arithmetic is :func:`mesh.core.signals.pool_signals`):

* ``queued``: the pool queue's ready tasks, as the admitter last polled them (every
  ``queue_poll_interval_s``, the pressure board's ``queue_depth``); its head's age from the
  management API's queue poll, when configured;
* ``deferred``: the places held in the pool's line (:class:`~mesh.core.line.PoolLine`);
* ``in_flight`` and ``model_slots``: the ledger's model-slot counter as the last tick read it;
* ``live_capacity``: the registry's live tally (free slots of Ready and Busy agents, not held
  by leases), for a described pool only the capabilities and versions its descriptor covers;
* ``agents`` by state: the fleet tally; ``desired_replicas``: the scale planner's target.

Every one is an aggregate: a call costs O(pools + capabilities + waiting requests), never
O(agents).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mesh.core.capacity import LiveCapacity
from mesh.core.eligibility import MODEL_SLOTS
from mesh.core.line import PoolLine
from mesh.core.signals import PoolActivity, PoolFigures, decision_pools, pool_signals
from mesh.manager.metrics import MeshView
from mesh.topology import names
from mesh.wire.admission import AdmissionDecision, CapabilityDescriptor
from mesh.wire.status import PoolSignals


@dataclass
class PoolSignalSource:
    """Each pool's signals for scaling, as this manager knows them."""

    view: MeshView
    namespace: str
    live: Callable[[], LiveCapacity] = LiveCapacity  # the registry's live capacity now
    lines: Callable[[], Mapping[str, PoolLine]] = dict  # the admission core's lines
    desired: Callable[[str], int | None] = lambda _: None  # the scale planner's target
    activity: PoolActivity = field(default_factory=PoolActivity)

    def decided(
        self, at: float, decision: AdmissionDecision, eligibility: Mapping[str, object] | None
    ) -> None:
        """Count one admission decision for the pools it concerns."""
        reason = decision.reason.value if decision.reason else None
        for pool_id in decision_pools(decision, eligibility):
            self.activity.record(pool_id, decision.outcome, reason, at)

    def signals(self) -> dict[str, PoolSignals]:
        """Every known pool's signals now (wall-clock time, as admission decides)."""
        return pool_signals(self.figures(), self.activity, self.view.now())

    def figures(self) -> dict[str, PoolFigures]:
        """Each pool's figures: described pools, pools with agents, pools with a line."""
        view = self.view
        descriptors = view.descriptors()
        pressure = view.pressure()
        states = view.tally().pools()
        lines = dict(self.lines())  # one step: a batch on the ledger thread may add a pool
        heads = {q.name: q.oldest_age_s for q in view.queues}
        free = live_free_by_pool(self.live(), descriptors)
        out = {}
        for pool_id in sorted(set(descriptors) | set(states) | set(lines)):
            descriptor = descriptors.get(pool_id)
            board = pressure.get(pool_id)
            usage = view.usage.get((pool_id, MODEL_SLOTS))
            line = lines.get(pool_id)
            out[pool_id] = PoolFigures(
                queued=board.queue_depth if board is not None and descriptor else None,
                queued_oldest_s=heads.get(names.pool_task_queue(self.namespace, pool_id)),
                waiting=line.places() if line is not None else (),
                in_flight=usage[0] if usage is not None else None,
                model_slots=descriptor.model_limits.slots if descriptor is not None else None,
                live_capacity=free.get(pool_id, 0),
                agents=states.get(pool_id, {}),
                desired_replicas=self.desired(pool_id),
            )
        return out


def live_free_by_pool(
    live: LiveCapacity, descriptors: Mapping[str, CapabilityDescriptor]
) -> dict[str, int]:
    """Per pool, its live agents' free slots for admission: for a described pool those of
    the capabilities and versions its descriptor covers, for any other pool all of them."""
    free: dict[str, int] = {}
    for (pool_id, capability), offers in live.offers.items():
        descriptor = descriptors.get(pool_id)
        if descriptor is None:
            free[pool_id] = free.get(pool_id, 0) + sum(o.free for o in offers)
            continue
        for offered in descriptor.capabilities:
            if offered.name == capability:
                found = live.free(pool_id, capability, offered.version_spec)
                free[pool_id] = free.get(pool_id, 0) + found
    return free
