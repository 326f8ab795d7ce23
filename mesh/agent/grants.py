"""Grant enforcement on the agent: a task's admission grant is revalidated where it is used.

Theory of operation
-------------------
A :class:`~mesh.wire.models.Task` may carry a ``grant`` (a
:class:`~mesh.wire.models.AdmissionGrant`, the admission decision's own). Tasks
without one take the lease path (their lease is checked by the runtime: no credentials,
no work) and are not affected by anything here.

The agent checks a grant twice: when it **claims** the task (before the handler runs) and again
at the **consumption point**, right before it publishes the result. :func:`check_grant` is the
whole check, pure and in this order:

1. *foreign*: ``grant.pool_id`` is not this agent's pool (its ``deployment``);
2. *expired*: ``now >= grant.expires_at``;
3. *revoked*: the agent has seen a revocation of this admission at a fence ``>=``
   ``grant.fence``;
4. *stale epoch*: the grant was issued under a descriptor epoch older than the pool's active
   one, as the manager last announced it.

A failed check is a ``TaskResult`` with status ``error`` and
:attr:`~mesh.wire.reasons.Reason.GRANT_INVALID`; the runtime logs it, counts it in
``counters["grants_refused"]`` and acks the task (it is never run, or its output is never
delivered).

Revocations. When the manager releases a grant, or its expiry sweep moves reservations to
EXPIRED, it publishes an :class:`~mesh.wire.events.OrchestrationEvent` of kind
``grant_revoked`` on the events exchange, routing key ``grant.<pool_id>.<admission_id>``, with
``detail = {admission_id, pool_id, fence}``: every grant of that admission with a fence up to
``fence`` is no longer valid (a release names the released fence; an expiry names the new,
higher fence the ledger gave the reservation, which covers the old one). RELEASED and EXPIRED
are final and a new phase is a new admission ID, so nothing valid is ever lost this way.

Eviction. When an interactive request evicts recoverable work from a full pool
(:mod:`mesh.core.pressure`), the victim's revocation carries ``detail["evicted"] = true``. Its
agent refuses the task at claim (or its result at the consumption point) with
:attr:`~mesh.wire.reasons.Reason.EVICTED` instead of ``GRANT_INVALID``, and stops the handler
if it is running — the task declared itself rebuildable or retryable — so the slot really is
free; the producer resubmits.

Each agent binds its control queue to ``grant.<its pool>.#`` and keeps the highest revoked
fence per admission in :class:`RevokedGrants`, bounded (oldest forgotten first). The feed is
fire-and-forget and the ledger is the truth: a revocation that is lost or forgotten leaves a
stale grant usable on this agent at most until its ``expires_at``, which the TTL check still
enforces.

Epochs. The manager announces each pool's active descriptor epoch on the same feed
(``grant.<pool_id>``, kind ``descriptor_active``, ``detail = {pool_id, descriptor_epoch,
policy_generation}``) when a descriptor is accepted or adopted, and again every
``epoch_announce_interval_s``; an agent that joins later gets the last announcement in its
``RegistrationAccepted`` (``pool_epoch``), so it judges epochs from its first task. Epochs only
grow, so the agent keeps the highest it has heard; a grant issued under an older epoch was
admitted against a descriptor that no longer holds, and is refused — unless its admission is on
the pool's *draining allowlist*: when the manager advances a pool's epoch, the admissions ACTIVE
at that moment may finish under the old one (``detail["draining"]``, announced with the epoch
until each is released or expires; nothing new is admitted under the old epoch). An announcement
without the key leaves the agent's list as it was (another manager, which did not advance the
epoch, does not know it). Before the first announcement the agent cannot judge epochs and checks
the rest (the manager checked epoch and generation at admission).

Security revocations. An operator's revocation (``mesh admission revoke``) carries
``detail["security"]`` (the reason): the agent stops the attempt if it runs — whatever it
declared about recoverability — and refuses it with ``GRANT_INVALID``, naming the reason.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Any

from mesh import constants as c
from mesh.wire.models import AdmissionGrant

GRANT_REVOKED = c.EVENT_GRANT_REVOKED
"""The ``kind`` of the orchestration event that revokes a grant."""
DESCRIPTOR_ACTIVE = c.EVENT_DESCRIPTOR_ACTIVE
"""The ``kind`` of the orchestration event that announces a pool's active epoch."""

DEFAULT_MAX_REVOKED = 10_000


def check_grant(
    grant: AdmissionGrant,
    *,
    pool_id: str,
    now: float,
    revoked_fence: int | None,
    active_epoch: int | None = None,
    draining: Collection[str] = (),
) -> str | None:
    """``None`` if ``grant`` may be used by an agent of ``pool_id`` at ``now``; else why not.

    ``revoked_fence`` is the highest fence this agent has seen revoked for the grant's
    admission (``None``: none seen); ``active_epoch`` the highest descriptor epoch announced
    for the pool (``None``: none heard yet).
    """
    if grant.pool_id != pool_id:
        return (
            f"grant {grant.admission_id} is for pool {grant.pool_id!r}, "
            f"not this agent's pool {pool_id!r}"
        )
    if now >= grant.expires_at:
        return (
            f"grant {grant.admission_id} (fence {grant.fence}) expired "
            f"{now - grant.expires_at:.3f} s ago"
        )
    if revoked_fence is not None and grant.fence <= revoked_fence:
        return (
            f"grant {grant.admission_id} (fence {grant.fence}) was revoked "
            f"(released or expired at fence {revoked_fence})"
        )
    stale = active_epoch is not None and grant.descriptor_epoch < active_epoch
    if stale and grant.admission_id not in draining:
        return (
            f"grant {grant.admission_id} was issued under descriptor epoch "
            f"{grant.descriptor_epoch}; pool {pool_id!r} is at epoch {active_epoch} and it is "
            "not on the pool's draining allowlist"
        )
    return None


class RevokedGrants:
    """admission_id -> the highest revoked fence (and whether that revocation was an
    eviction), for at most ``max_entries`` admissions."""

    def __init__(self, max_entries: int = DEFAULT_MAX_REVOKED) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._fences: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self._security: OrderedDict[str, str] = OrderedDict()  # admission -> operator's reason

    def revoke(
        self, admission_id: str, fence: int, *, evicted: bool = False, security: str | None = None
    ) -> None:
        """Remember that every grant of ``admission_id`` up to ``fence`` is revoked
        (``security``: by an operator, for this reason)."""
        known = self._fences.pop(admission_id, None)
        if known is not None and known[0] >= fence:
            self._fences[admission_id] = known
        else:
            self._fences[admission_id] = (fence, evicted)
        if security is not None:
            self._security[admission_id] = security
            while len(self._security) > self.max_entries:
                self._security.popitem(last=False)
        while len(self._fences) > self.max_entries:
            self._fences.popitem(last=False)

    def fence(self, admission_id: str) -> int | None:
        """The highest fence revoked for ``admission_id``, or ``None``."""
        known = self._fences.get(admission_id)
        return None if known is None else known[0]

    def security_reason(self, admission_id: str) -> str | None:
        """The operator's reason, if ``admission_id`` was revoked for security."""
        return self._security.get(admission_id)

    def evicted(self, grant: AdmissionGrant) -> bool:
        """Was ``grant`` revoked by an eviction (rather than a release or an expiry)?"""
        known = self._fences.get(grant.admission_id)
        return known is not None and known[1] and grant.fence <= known[0]

    def __len__(self) -> int:
        return len(self._fences)

    def __contains__(self, admission_id: object) -> bool:
        return admission_id in self._fences


def parse_draining(detail: dict[str, Any]) -> frozenset[str] | None:
    """The draining allowlist of a ``descriptor_active`` event, or ``None`` if it carries none
    (a manager that did not advance the epoch does not know it: keep what you have)."""
    draining = detail.get("draining")
    if not isinstance(draining, list):
        return None
    return frozenset(a for a in draining if isinstance(a, str) and a)


def parse_epoch(detail: dict[str, Any]) -> tuple[str, int] | None:
    """``(pool_id, descriptor_epoch)`` from a ``descriptor_active`` event's detail, or
    ``None`` if it does not hold them with the right types."""
    pool_id = detail.get("pool_id")
    epoch = detail.get("descriptor_epoch")
    if not isinstance(pool_id, str) or not pool_id:
        return None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
        return None
    return pool_id, epoch


def parse_revocation(detail: dict[str, Any]) -> tuple[str, str, int] | None:
    """``(admission_id, pool_id, fence)`` from a ``grant_revoked`` event's detail, or ``None``
    if it does not hold them with the right types. (``detail["evicted"] is True`` marks an
    eviction.)"""
    admission_id = detail.get("admission_id")
    pool_id = detail.get("pool_id")
    fence = detail.get("fence")
    if not isinstance(admission_id, str) or not admission_id or not isinstance(pool_id, str):
        return None
    if not isinstance(fence, int) or isinstance(fence, bool) or fence < 1:
        return None
    return admission_id, pool_id, fence
