"""The manager's Prometheus metrics (``prometheus-client``), served on ``/metrics``.

Theory of operation
-------------------
Two kinds of series, one registry per manager (tests run several managers in one process):

* **Counters and histograms of events**, incremented where the event happens: admissions by
  decision and reason, the eligibility rule that filtered each pool out, dead-lettered
  messages by reason, heartbeat lag, the latency of a release, and at settlement the
  estimated-to-actual cost ratio and deadline misses (from what the holder reports when it
  releases: the manager does not see task results).
* **Gauges of state**, computed at scrape time by :class:`_StateCollector` from a
  :class:`MeshView` (the pool core's running tally of agents by state and load by capability,
  the admitter's descriptors, the last ledger-usage and queue snapshots the manager's tick
  took). A scrape costs O(capabilities + pools + queues), never O(agents): the tally is moved
  as agents change (:mod:`mesh.core.tally`). When the last agent of a capability terminates,
  its series simply stop being reported.

Label cardinality stays bounded: capabilities, pools, lifecycle states, reason codes, rule
names, resources, tenants and queue names — never agent IDs or admission IDs. Capability labels
come from what agents registered and descriptors declared; a request naming a capability
nobody offers is counted under ``capability="(unknown)"``, so a producer cannot mint series.

prometheus-client is the well-kept reference implementation of the exposition format
(including the OpenMetrics variant and histogram buckets); writing that by hand would only be
a way to get it subtly wrong.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mesh.core.eligibility import RULE_NAMES
from mesh.core.pressure import PoolPressure, StageChange
from mesh.core.tally import FleetTally
from mesh.wire.admission import AdmissionDecision, CapabilityDescriptor, TaskRequirements
from mesh.wire.status import AgentStatus

UNKNOWN = "(unknown)"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class QueueStat:
    """One queue as the broker's management API reported it."""

    name: str
    messages: int
    oldest_age_s: float | None  # None: the broker did not report the head message's age


@dataclass(slots=True)
class MeshView:
    """What the state gauges are computed from; the manager fills it in."""

    # Agents by pool and state, load by capability: the pool core's running tally.
    tally: Callable[[], FleetTally] = FleetTally
    # One page of agent rows in agent-ID order, (offset, limit): only the status page asks.
    agent_rows: Callable[[int, int], list[AgentStatus]] = lambda _offset, _limit: []
    # Whether a registered agent offers this capability (the pool core's index: O(1)).
    offers: Callable[[str], bool] = lambda _: False
    descriptors: Callable[[], Mapping[str, CapabilityDescriptor]] = dict
    active_epochs: Callable[[], Mapping[str, int]] = dict
    active_generation: Callable[[], int] = lambda: 1
    now: Callable[[], float] = lambda: 0.0
    usage: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    queues: list[QueueStat] = field(default_factory=list)
    pressure: Callable[[], Mapping[str, PoolPressure]] = dict  # the admitter's board
    # Several managers: this manager's ID, the shards it holds (shard -> fence) and its
    # counts of shard transfers ("taken", "given_back", "lost").
    manager_id: str = ""
    shards: Callable[[], Mapping[int, int]] = dict
    shard_transfers: Callable[[], Mapping[str, int]] = dict
    # Live capacity written for the shards it holds (mesh.manager.live_share): "written", or
    # "fenced" (refused: its lease was no longer its own).
    live_writes: Callable[[], Mapping[str, int]] = dict


class ManagerMetrics:
    """Every metric of one manager, on its own registry."""

    def __init__(self, view: MeshView) -> None:
        self.view = view
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.admissions = Counter(
            "mesh_admissions",
            "Admission decisions, by outcome and reason code.",
            ["capability", "service_class", "decision", "reason"],
            registry=r,
        )
        self.match_failures = Counter(
            "mesh_match_failures",
            "Pools filtered out of an admission, by the eligibility rule that filtered them.",
            ["capability", "rule"],
            registry=r,
        )
        self.fallbacks = Counter(
            "mesh_fallback_grants",
            "Grants on a fallback pool standing in for a full primary (rate against admissions).",
            ["capability"],
            registry=r,
        )
        self.shadow_verdicts = Counter(
            "mesh_shadow_verdicts",
            "Admissions evaluated against a shadow descriptor, by pool and whether the pool's "
            "eligibility agreed with the live one (shadow routing: recorded, never enforced).",
            ["pool", "agreement"],
            registry=r,
        )
        self.evictions = Counter(
            "mesh_evictions",
            "Admitted recoverable work evicted from a full pool for interactive work.",
            ["pool", "recoverability"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "mesh_dead_lettered_messages",
            "Messages the manager dead-lettered, by reason code.",
            ["reason"],
            registry=r,
        )
        self.heartbeats_rejected = Counter(
            "mesh_heartbeats_rejected",
            "Heartbeats the manager could not decode (counted and dropped), by reason code.",
            ["reason"],
            registry=r,
        )
        self.heartbeat_lag = BatchHistogram(
            "mesh_heartbeat_lag_seconds",
            "Delay between an agent sending a heartbeat and the manager handling it.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.release_latency = Histogram(
            "mesh_admission_release_seconds",
            "Time from a release (or cancellation) arriving to its reservation being released.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.cost_ratio = Histogram(
            "mesh_cost_estimate_ratio",
            "Estimated / actual cost of settled admissions, as the holder reported it at "
            "release (measure: tokens or duration); above 1 over-estimates.",
            ["capability", "service_class", "measure"],
            buckets=(0.125, 0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 8.0),
            registry=r,
        )
        self.deadline_misses = Counter(
            "mesh_deadline_misses",
            "Settled admissions whose work finished after the requirements' deadline.",
            ["capability", "service_class"],
            registry=r,
        )
        self.settlements = Counter(
            "mesh_settlements",
            "Admissions given back: completed (actual cost reported) or cancelled.",
            ["capability", "service_class", "how"],
            registry=r,
        )
        self.stage_changes = Counter(
            "mesh_pressure_stage_changes",
            "Shedding-stage changes of a pool, by the stage entered.",
            ["pool", "stage"],
            registry=r,
        )
        self.registry.register(_StateCollector(view))

    def stage_changed(self, change: StageChange) -> None:
        self.stage_changes.labels(change.pool_id, change.new.name).inc()

    def capability_label(self, capability: str) -> str:
        """``capability`` if an agent or a descriptor offers it, else ``(unknown)``. On the
        admission path: the index lookup is O(1), and pools are few."""
        if self.view.offers(capability):
            return capability
        for descriptor in self.view.descriptors().values():
            if any(c.name == capability for c in descriptor.capabilities):
                return capability
        return UNKNOWN

    def admission(
        self,
        requirements: TaskRequirements | None,
        decision: AdmissionDecision,
        eligibility: Mapping[str, object] | None,
    ) -> None:
        """Count one decision and, from its eligibility record, every pool it filtered out."""
        capability = (
            self.capability_label(requirements.capability.name) if requirements else UNKNOWN
        )
        service_class = requirements.service_class if requirements else UNKNOWN
        reason = decision.reason.value if decision.reason else "none"
        self.admissions.labels(capability, service_class, decision.outcome, reason).inc()
        if decision.grant is not None and decision.grant.fallback_for is not None:
            self.fallbacks.labels(capability).inc()
        shadow = eligibility.get("shadow") if eligibility else None
        if isinstance(shadow, dict) and isinstance(shadow.get("pools"), list):
            for pool in shadow["pools"]:
                if isinstance(pool, dict):
                    same = (pool.get("live") is None) == (pool.get("shadow") is None)
                    agreement = "agree" if same else "differ"
                    self.shadow_verdicts.labels(str(pool.get("pool_id")), agreement).inc()
        pools = eligibility.get("pools") if eligibility else None
        if isinstance(pools, list):
            for pool in pools:
                rule = pool.get("rule") if isinstance(pool, dict) else None
                if rule in RULE_NAMES:
                    self.match_failures.labels(capability, rule).inc()

    def settled(
        self,
        estimate: Mapping[str, Any] | None,
        actual_tokens: int | None,
        actual_duration_s: float | None,
        finished_at: float | None,
    ) -> None:
        """One release: completed (with actuals) or cancelled; ratios and deadline misses."""
        estimate = estimate or {}
        capability = self.capability_label(str(estimate.get("capability", "")))
        service_class = str(estimate.get("service_class") or UNKNOWN)
        completed = actual_tokens is not None or actual_duration_s is not None
        self.settlements.labels(
            capability, service_class, "completed" if completed else "cancelled"
        ).inc()
        pairs = (
            ("tokens", estimate.get("estimated_tokens"), actual_tokens),
            ("duration", estimate.get("estimated_duration_s"), actual_duration_s),
        )
        for measure, estimated, actual in pairs:
            if isinstance(estimated, int | float) and actual:
                ratio = estimated / actual
                self.cost_ratio.labels(capability, service_class, measure).observe(ratio)
        deadline = estimate.get("deadline")
        if isinstance(deadline, int | float) and finished_at is not None and finished_at > deadline:
            self.deadline_misses.labels(capability, service_class).inc()

    def render(self) -> bytes:
        """The exposition text of every metric."""
        text: bytes = generate_latest(self.registry)
        return text


class BatchHistogram(Collector):
    """A histogram for the hottest path, observed a batch at a time: what arrived in one read
    is counted into plain lists with one ``bisect`` each, no lock (the manager observes on
    its event loop; a scrape copies the counts). prometheus-client's ``Histogram`` takes a
    lock and walks its buckets per observation, ~1 µs: a third of what the rest of a
    heartbeat costs the manager. Exposed through prometheus-client's own
    ``HistogramMetricFamily``, so the format is still the library's."""

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = [*sorted(float(b) for b in buckets), math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self._counts, self._bounds
        total = 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # the first bucket whose bound >= value
            total += value
        self._sum += total

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        cumulative = list(accumulate(counts))
        yield HistogramMetricFamily(
            self.name,
            self.documentation,
            buckets=[
                # the library's own "le" formatting ("0.005", "1.0", "+Inf"); it is untyped
                (floatToGoString(bound), count)  # type: ignore[no-untyped-call]
                for bound, count in zip(self._bounds, cumulative, strict=True)
            ],
            sum_value=total,
        )


class _StateCollector(Collector):
    """Gauges computed at scrape time from the manager's live state."""

    def __init__(self, view: MeshView) -> None:
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []  # computed per scrape: nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        view = self.view
        yield from _agent_gauges(view.tally())
        yield from _shard_series(view)
        yield _eligible_pools(
            view.descriptors(), view.active_epochs(), view.active_generation(), view.now()
        )
        utilisation = GaugeMetricFamily(
            "mesh_reservation_utilisation",
            "Reserved share of each ledger counter of a pool (used / capacity).",
            labels=["pool", "resource"],
        )
        tenant = GaugeMetricFamily(
            "mesh_tenant_budget_utilisation",
            "Reserved share of each tenant's token budget.",
            labels=["tenant"],
        )
        for (pool, resource), (used, capacity) in sorted(view.usage.items()):
            share = used / capacity if capacity else 0.0
            if resource.startswith("tenant_tokens:"):
                tenant.add_metric([resource.removeprefix("tenant_tokens:")], share)
            else:
                utilisation.add_metric([pool, resource], share)
        yield utilisation
        yield tenant
        depth = GaugeMetricFamily(
            "mesh_queue_messages", "Messages ready or unacked in each mesh queue.", labels=["queue"]
        )
        age = GaugeMetricFamily(
            "mesh_queue_oldest_message_age_seconds",
            "Age of the message at the head of each mesh queue (where the broker reports it).",
            labels=["queue"],
        )
        for queue in view.queues:
            depth.add_metric([queue.name], queue.messages)
            if queue.oldest_age_s is not None:
                age.add_metric([queue.name], queue.oldest_age_s)
        yield depth
        yield age
        yield from _pressure_gauges(view.pressure())


def _pressure_gauges(pools: Mapping[str, PoolPressure]) -> Iterator[Metric]:
    stage = GaugeMetricFamily(
        "mesh_pressure_stage",
        "Shedding stage of each pool: 0 normal, 1 speculative shed, 2 batch paused, "
        "3 tenants held to fair shares, 4 interactive refused.",
        labels=["pool"],
    )
    since = GaugeMetricFamily(
        "mesh_pressure_stage_since_timestamp_seconds",
        "When each pool entered its current shedding stage (Unix time).",
        labels=["pool"],
    )
    service = GaugeMetricFamily(
        "mesh_service_time_seconds",
        "Mean time grants of each pool were held (admission to release), recent releases.",
        labels=["pool"],
    )
    for pool_id, p in sorted(pools.items()):
        stage.add_metric([pool_id], int(p.stage))
        since.add_metric([pool_id], p.since)
        mean = p.mean_service_s()
        if mean is not None:
            service.add_metric([pool_id], mean)
    yield stage
    yield since
    yield service


def _agent_gauges(tally: FleetTally) -> Iterator[Metric]:
    states = GaugeMetricFamily(
        "mesh_agents", "Agents by capability and lifecycle state.", labels=["capability", "state"]
    )
    for (capability, state), n in sorted(tally.by_capability_state.items()):
        states.add_metric([capability, state], n)
    yield states
    busy = GaugeMetricFamily(
        "mesh_in_flight", "Tasks in flight on Ready and Busy agents.", labels=["capability"]
    )
    room = GaugeMetricFamily(
        "mesh_capacity", "Concurrency of Ready and Busy agents.", labels=["capability"]
    )
    for capability, load in sorted(tally.loads.items()):
        if load.taking_work:
            busy.add_metric([capability], load.in_flight)
            room.add_metric([capability], load.capacity)
    yield busy
    yield room


def _eligible_pools(
    descriptors: Mapping[str, CapabilityDescriptor],
    epochs: Mapping[str, int],
    generation: int,
    now: float,
) -> Metric:
    """Pools whose descriptor is current (epoch, generation, not expired), per capability."""
    counts: dict[str, int] = {}
    for pool_id, descriptor in descriptors.items():
        current = (
            descriptor.descriptor_epoch == epochs.get(pool_id)
            and descriptor.policy_generation == generation
            and descriptor.expires_at > now
        )
        for capability in {c.name for c in descriptor.capabilities}:
            counts.setdefault(capability, 0)
            if current:
                counts[capability] += 1
    family = GaugeMetricFamily(
        "mesh_eligible_pools",
        "Pools with a current descriptor offering each capability.",
        labels=["capability"],
    )
    for capability, n in sorted(counts.items()):
        family.add_metric([capability], n)
    return family


def _shard_series(view: MeshView) -> Iterator[Metric]:
    """Several managers: which shards this manager holds (one series per held shard, its
    fence as the value) and how many changed hands here, by how."""
    held = GaugeMetricFamily(
        "mesh_shard_fence",
        "The fence under which this manager holds a shard of the registry (held shards only).",
        labels=["manager", "shard"],
    )
    shards = view.shards()
    for shard, fence in sorted(shards.items()):
        held.add_metric([view.manager_id, str(shard)], fence)
    count = GaugeMetricFamily(
        "mesh_shards_held", "Shards of the registry this manager holds.", labels=["manager"]
    )
    count.add_metric([view.manager_id], len(shards))
    transfers = CounterMetricFamily(
        "mesh_shard_transfers",
        "Shards that changed hands at this manager: taken, given back, or lost (a renewal "
        "found the lease gone).",
        labels=["manager", "change"],
    )
    for change, n in sorted(view.shard_transfers().items()):
        transfers.add_metric([view.manager_id, change], n)
    live = CounterMetricFamily(
        "mesh_live_writes",
        "Writes of its shards' live capacity to the ledger by this manager: written, or "
        "fenced (refused by the store: the shard's lease was no longer this manager's).",
        labels=["manager", "outcome"],
    )
    for outcome, n in sorted(view.live_writes().items()):
        live.add_metric([view.manager_id, outcome], n)
    yield held
    yield count
    yield transfers
    yield live
