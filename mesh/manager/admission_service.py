"""Admission for one manager: the RPCs that admit, release and explain, the pool task queues,
and the admitter's ticks; the operator's descriptors, epochs and revocations go to its
:class:`~mesh.manager.rollout.RolloutService`.

Theory of operation
-------------------
:class:`AdmissionService` owns the ledger, the :class:`~mesh.manager.admission.Admitter` and
the one thread they run on (``ledger_inline``: the event loop itself for SQLite, else a single
worker thread, so the admitter is only ever touched from one thread). Admission requests are
decided in batches (group commit, :class:`~mesh.manager.batching.GroupCommit`): one ledger
transaction, one thread hand-off and one journal commit per batch. Releases join the same
batches and are settled in the same transaction, after the decisions' writes (one commit for
both: with PostgreSQL one statement, its dearest part a disk flush). Everything else it needs —
the pool core's live capacity and scale planner, the journal and the events exchange (through
the :class:`~mesh.manager.commands.CommandExecutor`), the broker, the status page — it is given
as ports by the manager that wires it (:class:`~mesh.manager.service.ManagerService`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from mesh import constants as c
from mesh.core.capacity import LiveCapacity, live_slots_resource
from mesh.core.demand import admission_demand
from mesh.core.eligibility import MODEL_SLOTS
from mesh.core.events import (
    AppendLog,
    CapacityMissed,
    DemandObserved,
    Instant,
    LogEntry,
)
from mesh.core.pool import PoolCore
from mesh.core.pressure import StageChange
from mesh.errors import (
    LocalProtocolError,
    StoreError,
)
from mesh.leases import LeaseSigner
from mesh.ledger.model import Reservation
from mesh.ledger.sqlite import SqliteLedger
from mesh.ledger.store import LedgerStore, Usage
from mesh.manager.admission import (
    Admitted,
    Admitter,
    DecisionRecord,
    ExternalGrantor,
)
from mesh.manager.admission_records import (
    eviction_entry,
    explain,
    revocation_event,
    stage_change_entry,
)
from mesh.manager.batching import GroupCommit
from mesh.manager.clock import Clock
from mesh.manager.commands import CommandExecutor
from mesh.manager.journal import Journal
from mesh.manager.observe import Observer
from mesh.manager.pool_queues import PoolQueues
from mesh.manager.rollout import RolloutService
from mesh.manager.settings import ManagerSettings, open_ledger
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.delivery import Delivery
from mesh.transport.ports import ManagerTransport
from mesh.wire.admission import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorShadow,
    ExplainRequest,
)
from mesh.wire.models import (
    AgentRegistration,
    Message,
    PoolEpoch,
)
from mesh.wire.status import PoolCapacity

if TYPE_CHECKING:
    from mesh.manager.live_share import SharedLive

log = logging.getLogger(__name__)

T = TypeVar("T")

INLINE_LINGER_QUIET_S = 0.0001
"""The group commit's quiet step when batches are decided on the event loop (see
``ManagerSettings.admission_linger_quiet_s``): a batch leaves as soon as nothing more arrives
within it, instead of waiting out the whole linger; requests that arrive together are still
decided together (bench/admission.py measures both, at 16 and 64 in flight)."""


class AdmissionService:
    """Admission for one manager, on the ports it is given."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        clock: Clock,
        counters: Counter[str],
        topology: Topology,
        core: PoolCore,
        observer: Observer,
        commands: CommandExecutor,
        transport: Callable[[], ManagerTransport],
        journal: Callable[[], Journal | None],
        shared_live: Callable[[], SharedLive | None],
        ledger: LedgerStore | None = None,
        grantors: Sequence[ExternalGrantor] = (),
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.counters = counters
        self.topology = topology
        self._core = core  # its live capacity, and the scale planner's capacity misses
        self._observer = observer
        self._commands = commands
        self._transport = transport
        self._journal = journal
        self._shared_live = shared_live
        self.admitter: Admitter | None = None
        self._ledger = ledger
        self._owns_ledger = ledger is None
        self._grantors = grantors
        # Admissions are decided in batches (group commit: one ledger transaction per batch),
        # serialised in arrival order: on the loop itself for SQLite (``ledger_inline``), else
        # on one worker thread. Housekeeping (open, checkpoint, close) always uses the thread.
        self._ledger_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._ledger_inline = False
        self._pool_queues = PoolQueues(
            topology=topology, transport=transport, observer=observer, counters=counters
        )
        self.rollout = RolloutService(
            settings,
            clock=clock,
            counters=counters,
            commands=commands,
            pool_queues=self._pool_queues,
            on_ledger=self._on_ledger,
            publish_revocation=self._publish_revocation,
        )
        self._pool_queues_polled_at = float("-inf")  # monotonic
        self._usage: Usage | None = None  # the ledger's counters as the last tick read them
        # Admissions and releases, in one queue: each batch is one ledger transaction.
        self._batches: GroupCommit[_LedgerItem, _LedgerResult] = GroupCommit(
            self._ledger_batch,
            max_batch=settings.admission_batch,
            linger_s=settings.admission_linger_s,
        )

    @property
    def ledger_thread(self) -> ThreadPoolExecutor:
        """The one worker thread ledger calls run on (with ``ledger_inline``: housekeeping
        only); benchmarks read its CPU time there."""
        return self._ledger_thread

    @property
    def descriptors(self) -> Mapping[str, CapabilityDescriptor]:
        """The active descriptors (replaced, never changed: safe to read from the loop)."""
        return self.admitter.descriptors if self.admitter is not None else {}

    async def start(self) -> None:
        """Open the ledger, recover its descriptors and grants, bind the pool queues."""
        s = self.settings
        if self._ledger is None:
            self._ledger = await self._in_ledger_thread(open_ledger, s.ledger_url, s.ledger_schema)
        self._ledger_inline = (
            isinstance(self._ledger, SqliteLedger) if s.ledger_inline is None else s.ledger_inline
        )
        self._batches.quiet_s = s.admission_linger_quiet_s
        if self._batches.quiet_s is None and self._ledger_inline:
            self._batches.quiet_s = INLINE_LINGER_QUIET_S
        self.admitter = Admitter(self._ledger, s.admission, self._grantors)
        if s.lease_key_file is not None:
            self.admitter.lease_signer = LeaseSigner.load_or_create(s.lease_key_file)
            log.info(
                "signing invocation leases",
                extra={"key_id": self.admitter.lease_signer.key_id, "file": str(s.lease_key_file)},
            )
        adopted = await self._on_ledger(self.admitter.load_descriptors)
        held = await self._on_ledger(self.admitter.recover_pressure, self.clock.now().wall)
        waiting = await self._on_ledger(self.admitter.recover_lines, self.clock.now().wall)
        self.counters["line_places_recovered"] += waiting
        log.info(
            "descriptors loaded from the ledger",
            extra={"pools": adopted, "grants": held, "places_in_line": waiting},
        )

    async def bind_pool_queues(self) -> None:
        await self._pool_queues.ensure(list(self.descriptors.values()))

    async def close_intake(self) -> None:
        """Decide what is queued, then take no more admissions."""
        await self._batches.close()

    async def barrier(self) -> None:
        """Wait until whatever runs on the ledger thread is done. A tick cancelled mid-way may
        have left a checkpoint running there (a cancelled await does not stop the thread),
        on connections closed next: closing one under it crashed the process (SIGSEGV in
        sqlite3). The thread runs one call at a time, in order, so a call of nothing returns
        once whatever ran before it is done."""
        await self._in_ledger_thread(_nothing)

    async def close(self) -> None:
        """Close the ledger (if this service opened it) and its thread."""
        if self._owns_ledger and self._ledger is not None:
            await self._in_ledger_thread(self._ledger.close)
        self._ledger_thread.shutdown(wait=False)

    async def tick(self) -> None:
        """Expire overdue grants, announce epochs, sync live capacity, feed the pressure board."""
        await self._expire_admissions()
        await self._observe_tick()

    def understands_epochs(self, registration: AgentRegistration) -> bool:
        """A pool with a descriptor hands out grants bound to its active epoch: its agents
        must refuse older ones, and say so (``features``)."""
        described = registration.deployment in self.descriptors
        return not described or c.FEATURE_DESCRIPTOR_EPOCHS in registration.features

    def stage_of(self, pool_id: str) -> str | None:
        """The pool's shedding stage (its name) as the admitter last observed it, or ``None``
        (a trace's admission span says it)."""
        seen = None if self.admitter is None else self.admitter.pools_seen.get(pool_id)
        return None if seen is None else seen.stage.name

    def pool_epoch(self, pool_id: str) -> PoolEpoch | None:
        """The pool's epoch as last announced (what a registration's acceptance carries)."""
        return self.rollout.pool_epoch(pool_id)

    async def reservation(self, admission_id: str) -> Reservation | None:
        """The ledger's reservation of ``admission_id`` (``None``: not held, or no ledger yet)."""
        if self._ledger is None:
            return None
        return await self._on_ledger(self._ledger.get, admission_id)

    async def _in_ledger_thread(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._ledger_thread, partial(fn, *args))

    async def _on_ledger(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an admission-path call where the ledger's calls run (see ``ledger_inline``)."""
        if self._ledger_inline:
            return fn(*args)
        return await self._in_ledger_thread(fn, *args)

    async def handle(
        self,
        message: AdmissionRequest
        | AdmissionRelease
        | AdmissionRevoke
        | CapabilityDescriptor
        | DescriptorShadow
        | ExplainRequest,
        request: Delivery,
    ) -> Message:
        admitter = self.admitter
        if admitter is None:
            raise LocalProtocolError("the manager is not started")
        now = self.clock.now().wall
        if isinstance(message, ExplainRequest):
            return await self._on_ledger(explain, admitter, message.admission_id)
        if isinstance(message, CapabilityDescriptor):
            return await self.rollout.publish(admitter, message, request, now)
        if isinstance(message, AdmissionRevoke):
            return await self.rollout.revoke(admitter, message, request, now)
        if isinstance(message, DescriptorShadow):
            return await self.rollout.shadow(admitter, message, request, now)
        if isinstance(message, AdmissionRelease):
            try:
                return await self._release(admitter, message, request, now)
            except StoreError as exc:  # nothing changed: the holder asks again (idempotent)
                self.counters["release_ledger_unavailable"] += 1
                log.warning("a release found the ledger unavailable", extra={"error": str(exc)})
                return AdmissionReleaseReply(
                    admission_id=message.admission_id,
                    released=False,
                    reason=AdmissionReason.LEDGER_UNAVAILABLE,
                    detail=f"the reservation ledger failed: {exc}"[:1000]
                    + "; release again with the same fence",
                )
        tenant = request.user_id  # validated by RabbitMQ against the connection's user
        if not tenant:
            self.counters["admission_unauthenticated"] += 1
            return AdmissionDecision(
                admission_id=message.admission_id,
                outcome="rejected",
                reason=AdmissionReason.INVALID_REQUEST,
                detail="no authenticated producer: publish with user_id set to your broker user",
            )
        if request.redelivered:
            again = await self._answered_before(admitter, message, tenant)
            if again is not None:
                return again
        decision = await self._batches.submit((message, tenant))
        assert isinstance(decision, AdmissionDecision)
        return decision

    async def _answered_before(
        self, admitter: Admitter, message: AdmissionRequest, tenant: str
    ) -> AdmissionDecision | None:
        """A redelivered request's recorded deferral or refusal, given again
        (:meth:`Admitter.answered_before`) and journaled as the batch journals a decision
        (marked ``answered_again``: the manager that decided it may have died before its
        own journal entry); ``None`` (decide it) if there is none or the ledger cannot say."""
        try:
            again = await self._on_ledger(admitter.answered_before, message, tenant)
        except StoreError:
            return None
        if again is None:
            return None
        self.counters["admission.answered_again"] += 1
        entry = LogEntry(
            at=self.clock.now().wall,
            kind="admission",
            reason=again.reason.value if again.reason else again.outcome,
            detail={
                "admission_id": again.admission_id,
                "outcome": again.outcome,
                "tenant": tenant,
                "pool_id": None,
                "fence": None,
                "answered_again": True,
            },
        )
        await self._commands.publish_events(
            [
                (names.log_key(event.agent_id, event.kind), event)
                for event in self._commands.append([entry])
            ]
        )
        return again

    async def _release(
        self, admitter: Admitter, message: AdmissionRelease, request: Delivery, now: float
    ) -> AdmissionReleaseReply:
        """Settle a grant (fenced) for its tenant or the operator; the ledger's failure is
        the caller's (a :class:`StoreError`)."""
        started = self.clock.now().mono
        record = await self._on_ledger(admitter.recorded, message.admission_id)
        if not self._may_release(record, request.user_id):
            self.counters["not_authorized.admission_release"] += 1
            return AdmissionReleaseReply(
                admission_id=message.admission_id,
                released=False,
                reason=AdmissionReason.NOT_AUTHORIZED,
                detail="an admission is released by the tenant it was granted to (or the "
                f"operator); this came from {request.user_id!r}",
            )
        settled = await self._batches.submit(_Release(message.admission_id, message.fence))
        if isinstance(settled, BaseException):  # the ledger failed (a StoreError)
            raise settled
        assert not isinstance(settled, AdmissionDecision)
        reply, released_now, pool_id = settled
        if released_now:  # a retried release is answered the same, and counted once
            self._observer.metrics.release_latency.observe(self.clock.now().mono - started)
            self._observer.metrics.settled(
                record.estimate if record else None,
                message.actual_tokens,
                message.actual_duration_s,
                message.finished_at,
            )
            if pool_id is not None:
                await self._publish_revocation(
                    pool_id, message.admission_id, message.fence, "RELEASED", now
                )
        return reply

    def _may_release(self, record: DecisionRecord | None, user_id: str | None) -> bool:
        """The tenant an admission was decided for, or the operator, may release it (a
        record the ledger no longer has, or one without a tenant, is left to the fence)."""
        tenant = None if record is None else record.tenant
        return tenant is None or user_id in (tenant, self.settings.operator_user)

    async def _ledger_batch(self, items: list[_LedgerItem]) -> list[_LedgerResult]:
        """Decide every admission and settle every release that queued up meanwhile: one
        ledger transaction, one thread hand-off and one journal commit for the lot."""
        admitter = self.admitter
        if admitter is None:
            raise LocalProtocolError("the manager is not started")
        requests = [item for item in items if not isinstance(item, _Release)]
        releases = [(item.admission_id, item.fence) for item in items if isinstance(item, _Release)]
        at = self.clock.now()
        live = self._live(at) if requests else None  # a batch of releases alone decides nothing
        batch = await self._on_ledger(
            partial(admitter.admit_batch, releases=releases), requests, at.wall, live
        )
        if releases:
            self.counters["release_batches"] += 1
        settled = batch.settled  # each release's outcome, or the one error all of them get
        settles: Iterator[_LedgerResult] = iter(
            [settled] * len(releases) if isinstance(settled, StoreError) else settled
        )
        decisions: Iterator[_LedgerResult] = iter(await self._admitted(requests, batch, at))
        return [next(settles) if isinstance(item, _Release) else next(decisions) for item in items]

    async def _admitted(
        self, requests: list[tuple[AdmissionRequest, str]], batch: Admitted, at: Instant
    ) -> list[AdmissionDecision]:
        """What follows a batch's decisions: scaler misses, counters, metrics, the journal,
        the live feed and the evictions' revocations."""
        now = at.wall
        decisions = batch.decisions
        if requests:
            self.counters["admission_batches"] += 1
        for pool_id, reason in batch.misses:  # capacity misses for the scaler
            await self._commands.execute(self._core.handle(CapacityMissed(pool_id, reason), at))
        entries = []
        for (request, tenant), decision, record in zip(
            requests, decisions, batch.records, strict=True
        ):
            grant = decision.grant
            if decision.admission_id in batch.replayed:
                # The same grant again, for a retried or redelivered request: journaled so
                # (``replayed``), and counted neither as a grant nor in the metrics again.
                self.counters["admission.replayed"] += 1
                reason = "replayed"
            else:
                self.counters[f"admission.{decision.outcome}"] += 1
                self._observer.admitted(
                    now, request.requirements, decision, record.eligibility if record else None
                )
                reason = decision.reason.value if decision.reason else decision.outcome
            entries.append(
                LogEntry(
                    at=now,
                    kind="admission",
                    reason=reason,
                    detail={
                        "admission_id": decision.admission_id,
                        "outcome": decision.outcome,
                        "tenant": tenant,
                        "pool_id": grant.pool_id if grant else None,
                        "fence": grant.fence if grant else None,
                    },
                )
            )
        evictions = batch.evictions
        entries += [eviction_entry(e) for e in evictions]
        # Every decision is journaled (``mesh log``) and recorded in the ledger (``mesh
        # explain``); the live feed carries only the refusals — what someone following it can
        # act on — so a busy mesh does not pay one more broker message per grant.
        if entries:
            await self._commands.publish_events(
                [
                    (names.log_key(event.agent_id, event.kind), event)
                    for event in self._commands.append(entries)
                    if event.detail.get("outcome") != "admitted"
                ]
            )
        for eviction in evictions:  # after the journal: the producer learns of it from here on
            victim = eviction.victim
            self.counters["admissions_evicted"] += 1
            self._observer.metrics.evictions.labels(victim.pool_id, eviction.recoverability).inc()
            await self._publish_revocation(
                victim.pool_id, victim.admission_id, victim.fence, "RELEASED", now, evicted=True
            )
        return decisions

    def _live(self, now: Instant) -> LiveCapacity | None:
        """The registry's live capacity for admission (``None``: the descriptors alone bound
        it, ``admission_capacity="descriptor"``)."""
        if self.settings.admission_capacity != "live":
            return None
        shared = self._shared_live()
        if shared is not None:
            return shared.view()
        return self._core.live_capacity(now)

    def share_live(self) -> None:
        """Several managers share live capacity (mesh.manager.live_share): each pool's owner
        writes its ledger live-slot capacities, fenced by its shard lease; this manager's
        admission batches no longer write them."""
        assert self.admitter is not None, "start the admission service first"
        self.admitter.core.writes_live = False

    async def _observe_tick(self) -> None:
        usage = None
        if self.admitter is not None:
            usage = self._usage = await self._on_ledger(self.admitter.ledger.usage)
        await self._observer.tick(usage)
        if self.admitter is not None:
            await self._observe_pressure(self.admitter)

    async def _observe_pressure(self, admitter: Admitter) -> None:
        """Feed the pressure board what the tick saw — the ledger's counters (other managers'
        grants too), the broker's alarm, and every ``queue_poll_interval_s`` each pool queue's
        depth (passive declare: ready tasks) and head age (the management API, when
        configured) — and journal every stage change with the time it happened. The board is
        the admitter's: fed where the admitter runs."""
        now = self.clock.now()
        queues = None
        if now.mono - self._pool_queues_polled_at >= self.settings.queue_poll_interval_s:
            self._pool_queues_polled_at = now.mono
            queues = await self._pool_queues.depths(admitter.descriptors)
        changes = await self._on_ledger(  # the counters read afresh there: see observe
            partial(
                admitter.observe, now.wall,
                queues=queues, broker_blocked=self._transport().blocked,
            )
        )  # fmt: skip
        await self._journal_stage_changes(changes)
        if self._core.scaling.deployments:  # the pools' demand, for scaling (to zero)
            demand = await self._on_ledger(admission_demand, admitter.core, now.wall)
            await self._commands.execute(self._core.handle(DemandObserved(demand), now))

    async def _journal_stage_changes(self, changes: list[StageChange]) -> None:
        for change in changes:
            self._observer.metrics.stage_changed(change)
            log.info(
                "pressure stage",
                extra={"pool_id": change.pool_id, "stage": change.new.name, "cause": change.cause},
            )
        if changes:
            await self._commands.execute([AppendLog(stage_change_entry(c)) for c in changes])

    async def _expire_admissions(self) -> None:
        if self.admitter is None:
            return
        await self.rollout.tick(self.admitter)
        live = self._live(self.clock.now())
        if live is not None:
            await self._on_ledger(self.admitter.sync_live, live, self.clock.now().wall)
        expired = await self._on_ledger(self.admitter.expire, self.clock.now().wall)
        # WAL checkpoints off the commit path, on the worker thread (own connections).
        await self._in_ledger_thread(self.admitter.ledger.maintain)
        journal = self._journal()
        if journal is not None:
            await self._in_ledger_thread(journal.maintain)
        if expired:
            self.counters["admissions_expired"] += len(expired)
            await self._commands.execute(
                [
                    AppendLog(
                        LogEntry(
                            at=self.clock.now().wall,
                            kind="admission_expired",
                            reason=f"fence {r.fence}",
                            detail={"admission_id": r.admission_id, "pool_id": r.pool_id},
                        )
                    )
                    for r in expired
                ]
            )
            for r in expired:  # the new, higher fence: it covers the one the holder has
                await self._publish_revocation(
                    r.pool_id, r.admission_id, r.fence, "EXPIRED", self.clock.now().wall
                )

    async def _publish_revocation(
        self,
        pool_id: str,
        admission_id: str,
        fence: int,
        state: str,
        now: float,
        *,
        evicted: bool = False,
        security: str | None = None,
    ) -> None:
        """Tell the pool's agents that grants of ``admission_id`` up to ``fence`` are void
        (:func:`revocation_event`); fire-and-forget: the ledger is the truth, and an agent that
        misses it still refuses the grant once it expires."""
        event = revocation_event(pool_id, admission_id, fence, state, now, evicted, security)
        self.counters["grants_revoked"] += 1
        await self._commands.publish_event(names.grant_key(pool_id, admission_id), event)

    def pool_capacities(self, now: Instant) -> list[PoolCapacity]:
        """Per described pool and capability: the registry's live figure and the ledger's
        counts as the last tick read them (how capacity is counted, docs/admission.md)."""
        if self.admitter is None:
            return []
        live = self._core.live_capacity(now)
        usage = self._usage or {}
        out = []
        for pool_id, descriptor in sorted(self.admitter.descriptors.items()):
            model = usage.get((pool_id, MODEL_SLOTS))
            for offered in descriptor.capabilities:
                held = usage.get((pool_id, live_slots_resource(offered.name)))
                out.append(
                    PoolCapacity(
                        pool_id=pool_id,
                        capability=offered.name,
                        live_agents=live.agents(pool_id, offered.name, offered.version_spec),
                        live_slots=live.free(pool_id, offered.name, offered.version_spec),
                        granted=None if held is None else held[0],
                        model_slots=None if model is None else model[1],
                        model_slots_granted=None if model is None else model[0],
                    )
                )
        return out


@dataclass(frozen=True, slots=True)
class _Release:
    """A release waiting in the ledger batches' queue."""

    admission_id: str
    fence: int


_LedgerItem = tuple[AdmissionRequest, str] | _Release  # (request, tenant) or a release
_LedgerResult = AdmissionDecision | tuple[AdmissionReleaseReply, bool, str | None] | StoreError


def _nothing() -> None:
    """A call that waits its turn on the ledger thread (a barrier)."""
