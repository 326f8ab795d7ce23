"""Admission checks: what a resource outside the ledger answers for one admission.

Theory of operation
-------------------
A pool's admission may need more than the ledger's counters: a model provider's tokens and
requests per minute shared by every manager, a tool's concurrent sessions, a tenant's daily
token budget, an approval service. Each is an :class:`AdmissionCheck`, asked for one
admission at a time and answering as Kueue's AdmissionChecks do:

* ``READY`` — the resource is reserved for this admission (until ``release``);
* ``RETRY`` — not now: nothing is held, ask again after ``retry_after_ms``;
* ``REJECTED`` — never for this request (``reason`` says why);
* ``PENDING`` is not an answer but the state of a check still running: the admission stays
  PREPARING in the ledger meanwhile, and is never consumable before every check is READY.

A check is idempotent by admission ID (asked twice, it answers the same and holds one
reservation), holds what it reserved for at most ``ttl_s`` unless it is released or settled,
and never raises for an expected outcome: a resource that cannot be reached is ``RETRY``
with :data:`CHECK_UNAVAILABLE`. Several checks of one admission are asked in one global
order (by name) and the first that is not READY releases those before it, newest first
(:mod:`mesh.checks.runner`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Protocol

__all__ = [
    "CHECK_UNAVAILABLE",
    "AdmissionCheck",
    "CheckOutcome",
    "CheckRequest",
    "CheckResult",
    "Usage",
]

CHECK_UNAVAILABLE: Final = "CHECK_UNAVAILABLE"
"""The reason of a ``RETRY`` when the check's resource could not be asked (down, slow)."""


class CheckOutcome(StrEnum):
    PENDING = "PENDING"  # still running (a state of the admission, not an answer)
    READY = "READY"
    RETRY = "RETRY"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class CheckRequest:
    """One admission, as a check sees it."""

    admission_id: str
    pool_id: str
    tenant: str
    capability: str
    estimated_tokens: int = 0  # the request's estimate (input plus output tokens)
    run_id: str | None = None
    ttl_s: float = 30.0  # what a READY check holds at most, unless released or settled
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """A check's answer for one admission."""

    check: str  # the check's name
    outcome: CheckOutcome
    reason: str | None = None  # why not READY (a reason code or the resource's own word)
    detail: str = ""
    retry_after_ms: int | None = None  # RETRY: when asking again can succeed

    @property
    def ready(self) -> bool:
        return self.outcome is CheckOutcome.READY


@dataclass(frozen=True, slots=True)
class Usage:
    """What the admission really used, reported at release (settles estimates)."""

    tokens: int | None = None


class AdmissionCheck(Protocol):
    """A resource outside the ledger, asked for each admission of the pools it applies to."""

    @property
    def name(self) -> str:
        """Unique among the checks of a manager; the global order checks are asked in."""
        ...

    async def reserve(self, request: CheckRequest) -> CheckResult:
        """Reserve for ``request`` (idempotent by admission ID). Never raises for an
        expected outcome; an unreachable resource is ``RETRY`` / :data:`CHECK_UNAVAILABLE`."""
        ...

    async def release(self, request: CheckRequest, usage: Usage | None = None) -> None:
        """Give back what ``reserve`` took for this admission (nothing taken: nothing to
        do), settled with ``usage`` when the admission ran. Idempotent."""
        ...
