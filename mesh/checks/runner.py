"""Runs an admission's checks in the one global order, compensating on the first that is not
READY.

Theory of operation
-------------------
A :class:`CheckRunner` holds the checks of one pool, sorted by name: every manager asks them in
the same order, so two admissions never hold one check each while waiting on the other's.
:meth:`CheckRunner.reserve` asks them one after another and stops at the first that is not
READY; the checks already READY are then released newest first (compensation), and the
overall answer is that check's outcome, reason and retry time. Only when every check is READY
is the admission READY, and then the admission holds all of them until
:meth:`CheckRunner.release_all` (released, expired, or compensated by its caller).

Each check gets ``timeout_s`` to answer. A check that does not answer in time (or raises,
which is a bug in it) counts as ``RETRY`` / :data:`~mesh.checks.base.CHECK_UNAVAILABLE` and is
released as well, in case it reserved after all. A check answering ``PENDING`` is not done:
it is treated as ``RETRY`` too. The runner never raises for an expected outcome and keeps no
state per admission: asking again asks every check again, and the checks are idempotent by
admission ID.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mesh.checks.base import (
    CHECK_UNAVAILABLE,
    AdmissionCheck,
    CheckOutcome,
    CheckRequest,
    CheckResult,
    Usage,
)

__all__ = [
    "DEFAULT_CHECK_TIMEOUT_S",
    "DEFAULT_RETRY_MS",
    "CheckRunner",
    "RunResult",
    "runners_by_pool",
]

log = logging.getLogger(__name__)

DEFAULT_CHECK_TIMEOUT_S = 5.0
DEFAULT_RETRY_MS = 1000  # a refusal's retry time when the check gave none


@dataclass(frozen=True, slots=True)
class RunResult:
    """The checks' answers for one admission, in the order they were asked."""

    outcome: CheckOutcome  # READY, RETRY or REJECTED (never PENDING)
    answers: tuple[CheckResult, ...] = ()
    refusal: CheckResult | None = None  # the first answer that was not READY

    @property
    def ready(self) -> bool:
        return self.outcome is CheckOutcome.READY

    @property
    def reason(self) -> str | None:
        return None if self.refusal is None else self.refusal.reason

    @property
    def retry_after_ms(self) -> int | None:
        return None if self.refusal is None else self.refusal.retry_after_ms

    @property
    def check(self) -> str | None:
        """The name of the check that refused."""
        return None if self.refusal is None else self.refusal.check


class CheckRunner:
    """The checks of one pool, asked for each admission in the global order (by name)."""

    def __init__(
        self,
        checks: Iterable[AdmissionCheck],
        *,
        timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
        default_retry_ms: int = DEFAULT_RETRY_MS,
    ) -> None:
        ordered = sorted(checks, key=lambda check: check.name)
        names = [check.name for check in ordered]
        if len(set(names)) != len(names):
            raise ValueError(f"check names must be unique, got {names}")
        self.checks: tuple[AdmissionCheck, ...] = tuple(ordered)
        self.timeout_s = timeout_s
        self.default_retry_ms = default_retry_ms
        self.timeouts = 0  # checks that did not answer within timeout_s
        self.release_failures = 0  # releases that raised or timed out

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(check.name for check in self.checks)

    async def reserve(self, request: CheckRequest) -> RunResult:
        """Ask every check in order; READY only if all are, else the first refusal's answer
        with the checks before it released, newest first."""
        answers: list[CheckResult] = []
        held: list[AdmissionCheck] = []
        for check in self.checks:
            answer = await self._ask(check, request)
            answers.append(answer)
            if answer.ready:
                held.append(check)
                continue
            if answer.reason == CHECK_UNAVAILABLE:
                held.append(check)  # it may have reserved after all: release it too
            await self._release_each(reversed(held), request, None)
            refusal = self._as_refusal(answer)
            return RunResult(refusal.outcome, tuple(answers), refusal)
        return RunResult(CheckOutcome.READY, tuple(answers))

    async def release_all(self, request: CheckRequest, usage: Usage | None = None) -> None:
        """Release every check for this admission, newest first, settled with ``usage``.
        Checks that hold nothing for it do nothing; failures are counted and logged."""
        await self._release_each(reversed(self.checks), request, usage)

    async def _ask(self, check: AdmissionCheck, request: CheckRequest) -> CheckResult:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await check.reserve(request)
        except TimeoutError:
            self.timeouts += 1
            detail = f"no answer within {self.timeout_s} s"
        except Exception as exc:  # a bug in the check: never the admission's failure
            log.exception(
                "check %s raised on reserve",
                check.name,
                extra={"admission_id": request.admission_id, "check": check.name},
            )
            detail = f"raised {type(exc).__name__}"
        return CheckResult(
            check.name,
            CheckOutcome.RETRY,
            CHECK_UNAVAILABLE,
            detail,
            retry_after_ms=self.default_retry_ms,
        )

    def _as_refusal(self, answer: CheckResult) -> CheckResult:
        outcome = answer.outcome
        if outcome is CheckOutcome.PENDING:
            outcome = CheckOutcome.RETRY
        retry_after_ms = answer.retry_after_ms
        if outcome is CheckOutcome.RETRY and retry_after_ms is None:
            retry_after_ms = self.default_retry_ms
        if outcome is answer.outcome and retry_after_ms == answer.retry_after_ms:
            return answer
        return CheckResult(answer.check, outcome, answer.reason, answer.detail, retry_after_ms)

    async def _release_each(
        self, checks: Iterable[AdmissionCheck], request: CheckRequest, usage: Usage | None
    ) -> None:
        for check in checks:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await check.release(request, usage)
            except Exception:
                self.release_failures += 1
                log.warning(
                    "check %s: release failed (its TTL frees it)",
                    check.name,
                    exc_info=True,
                    extra={"admission_id": request.admission_id, "check": check.name},
                )


def runners_by_pool(
    checks: Sequence[AdmissionCheck],
    pools: Mapping[str, Sequence[str]],
    *,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
) -> dict[str, CheckRunner]:
    """One runner per pool, from the checks by name (an unknown name is a ``KeyError``)."""
    by_name = {check.name: check for check in checks}
    return {
        pool: CheckRunner([by_name[name] for name in names], timeout_s=timeout_s)
        for pool, names in pools.items()
    }
