"""The operator's hand on admission: capability descriptors published and shadowed, each pool's
active epoch announced to its agents, and admissions revoked for security.

Every message here is the operator's alone (``operator_user``); anyone else gets
``NOT_AUTHORIZED`` and is counted. It is a room of its own because it changes what may be
admitted rather than admitting: the admission service hands it the admitter and the ledger
thread, and it reaches the journal and the events exchange through the command executor.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from mesh import constants as c
from mesh.core.events import AppendLog, LogEntry
from mesh.manager.admission import Admitter
from mesh.manager.clock import Clock
from mesh.manager.commands import CommandExecutor
from mesh.manager.pool_queues import PoolQueues
from mesh.manager.settings import ManagerSettings
from mesh.topology import names
from mesh.transport.delivery import Delivery
from mesh.wire.admission import (
    AdmissionReason,
    AdmissionReleaseReply,
    AdmissionRevoke,
    CapabilityDescriptor,
    DescriptorAccepted,
    DescriptorShadow,
)
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import Message, PoolEpoch, Refusal
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_DRAINING_ANNOUNCED = 4096
"""Admission IDs a ``descriptor_active`` event carries at most (~150 KB); past that, the rest
of an epoch's draining attempts are refused by their agents as of an older epoch."""


class OnLedger(Protocol):
    """Runs a call where the admitter's calls run (the ledger thread, or the loop)."""

    def __call__(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...


class Revoker(Protocol):
    """Publishes that grants of an admission up to a fence are void."""

    def __call__(
        self,
        pool_id: str,
        admission_id: str,
        fence: int,
        state: str,
        now: float,
        *,
        security: str | None = None,
    ) -> Awaitable[None]: ...


class RolloutService:
    """Descriptors, epochs and revocations, for the operator: the I/O around the admission
    core's own :class:`~mesh.core.rollout.Rollout`."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        clock: Clock,
        counters: Counter[str],
        commands: CommandExecutor,
        pool_queues: PoolQueues,
        on_ledger: OnLedger,
        publish_revocation: Revoker,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.counters = counters
        self._commands = commands
        self._pool_queues = pool_queues
        self._on_ledger = on_ledger
        self._publish_revocation = publish_revocation
        self._epochs: dict[str, PoolEpoch] = {}  # pool -> its last descriptor_active detail
        self._announced_at = float("-inf")  # monotonic; announced on the first tick

    def pool_epoch(self, pool_id: str) -> PoolEpoch | None:
        """The pool's epoch as last announced (what a registration's acceptance carries)."""
        return self._epochs.get(pool_id)

    def _refused(self, request: Delivery, what: str) -> Refusal | None:
        """``None`` if the operator sent it; else the refusal, counted."""
        if request.user_id == self.settings.operator_user:
            return None
        self.counters["descriptor_not_authorized"] += 1
        return Refusal(
            reason=Reason.NOT_AUTHORIZED,
            detail=f"{what} are accepted only from {self.settings.operator_user!r}",
        )

    async def publish(
        self, admitter: Admitter, descriptor: CapabilityDescriptor, request: Delivery, now: float
    ) -> Message:
        """Make ``descriptor`` its pool's active one (a new epoch: announced at once)."""
        refused = self._refused(request, "descriptors")
        if refused is not None:
            log.warning(
                "descriptor from a non-operator refused",
                extra={"pool_id": descriptor.pool_id, "user_id": request.user_id},
            )
            return refused
        problem = await self._on_ledger(admitter.publish_descriptor, descriptor, now)
        if problem is not None:
            return Refusal(reason=Reason.SCHEMA_VIOLATION, detail=problem)
        self.counters["descriptors_published"] += 1
        announced = await self.announce(admitter, [descriptor])
        detail: dict[str, Any] = {
            "pool_id": descriptor.pool_id,
            "epoch": descriptor.descriptor_epoch,
        }
        if descriptor.pool_id in announced:  # the epoch advanced: what may finish under the old
            detail["draining"] = announced[descriptor.pool_id]
        entry = LogEntry(
            at=now,
            kind="descriptor",
            reason=f"{descriptor.pool_id} epoch {descriptor.descriptor_epoch}",
            detail=detail,
        )
        await self._commands.execute([AppendLog(entry)])
        return DescriptorAccepted(
            pool_id=descriptor.pool_id, descriptor_epoch=descriptor.descriptor_epoch
        )

    async def shadow(
        self, admitter: Admitter, message: DescriptorShadow, request: Delivery, now: float
    ) -> Message:
        """Set (or with no descriptor, remove) a pool's shadow descriptor: decided beside the
        active one and recorded, never enforced."""
        refused = self._refused(request, "shadows")
        if refused is not None:
            return refused
        descriptor, pool_id = message.descriptor, message.pool_id
        if descriptor is None:
            await self._on_ledger(admitter.drop_shadow, pool_id)
            log.info("shadow removed", extra={"pool_id": pool_id})
            active = admitter.active_epochs.get(pool_id, 1)
            return DescriptorAccepted(pool_id=pool_id, descriptor_epoch=active)
        problem = await self._on_ledger(admitter.set_shadow, descriptor, now)
        if problem is not None:
            return Refusal(reason=Reason.SCHEMA_VIOLATION, detail=problem)
        self.counters["shadows_set"] += 1
        self._commands.append(
            [
                LogEntry(
                    at=now,
                    kind="descriptor_shadow",
                    reason=f"{pool_id} epoch {descriptor.descriptor_epoch} in shadow",
                    detail={"pool_id": pool_id, "epoch": descriptor.descriptor_epoch},
                )
            ]
        )
        return DescriptorAccepted(pool_id=pool_id, descriptor_epoch=descriptor.descriptor_epoch)

    async def revoke(
        self, admitter: Admitter, message: AdmissionRevoke, request: Delivery, now: float
    ) -> AdmissionReleaseReply:
        """A security revocation: release whatever holds the admission, at its current fence,
        and tell its pool — the attempt is cancelled where it runs and its result refused."""
        if request.user_id != self.settings.operator_user:
            self.counters["revoke_not_authorized"] += 1
            return AdmissionReleaseReply(
                admission_id=message.admission_id,
                released=False,
                reason=AdmissionReason.NOT_AUTHORIZED,
                detail=f"only the operator user may revoke; this came from {request.user_id!r}",
            )
        held = await self._on_ledger(admitter.ledger.get, message.admission_id)
        if held is None or held.state not in ("PREPARING", "ACTIVE"):
            state = "unknown" if held is None else held.state
            return AdmissionReleaseReply(
                admission_id=message.admission_id,
                released=False,
                reason=AdmissionReason.NOT_FOUND,
                detail=f"nothing to revoke: the admission is {state}",
            )
        reply, released_now = await self._on_ledger(
            admitter.settle, held.admission_id, held.fence, now
        )
        if released_now:
            self.counters["admissions_revoked"] += 1
            self._commands.append(
                [
                    LogEntry(
                        at=now,
                        kind="admission_revoked",
                        reason=message.reason,
                        detail={
                            "admission_id": held.admission_id,
                            "pool_id": held.pool_id,
                            "fence": held.fence,
                            "by": request.user_id,
                        },
                    )
                ]
            )
            log.warning(
                "admission revoked",
                extra={"admission_id": held.admission_id, "reason": message.reason},
            )
            await self._publish_revocation(
                held.pool_id, held.admission_id, held.fence, "RELEASED", now,
                security=message.reason,
            )  # fmt: skip
        return reply

    async def tick(self, admitter: Admitter) -> None:
        """Adopt descriptors other managers stored, and announce every pool's epoch when one
        was adopted or ``epoch_announce_interval_s`` has passed (agents that missed an
        announcement catch up)."""
        adopted = await self._on_ledger(admitter.load_descriptors)
        due = self.clock.now().mono - self._announced_at
        if adopted or due >= self.settings.epoch_announce_interval_s:
            await self.announce(admitter, list(admitter.descriptors.values()))

    async def announce(
        self, admitter: Admitter, descriptors: Sequence[CapabilityDescriptor]
    ) -> dict[str, list[str]]:
        """Tell each pool's agents its active descriptor epoch (``grant.<pool>``), so they
        refuse grants issued under an older one (:mod:`mesh.agent.grants`). Returns the
        draining allowlists announced, by pool (pools this manager did not advance: none)."""
        await self._pool_queues.ensure(descriptors)
        now = self.clock.now()
        self._announced_at = now.mono
        announced: dict[str, list[str]] = {}
        for descriptor in descriptors:
            detail: dict[str, Any] = {
                "pool_id": descriptor.pool_id,
                "descriptor_epoch": descriptor.descriptor_epoch,
                "policy_generation": self.settings.admission.active_generation,
            }
            draining = await self._on_ledger(  # the admitter's state lives on the ledger thread
                admitter.draining_allowlist, descriptor.pool_id, now.wall
            )
            if draining is not None:  # only the manager that advanced the epoch knows it
                detail["draining"] = announced[descriptor.pool_id] = draining[
                    :MAX_DRAINING_ANNOUNCED
                ]
            self._epochs[descriptor.pool_id] = PoolEpoch.model_validate(detail)
            event = OrchestrationEvent(
                at=now.wall,
                kind=c.EVENT_DESCRIPTOR_ACTIVE,
                reason=f"epoch {descriptor.descriptor_epoch}",
                detail=detail,
            )
            await self._commands.publish_event(names.pool_grant_key(descriptor.pool_id), event)
        return announced
