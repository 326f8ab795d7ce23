"""The check runner: the global order, compensation newest first, timeouts, the overall answer."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mesh.checks import CHECK_UNAVAILABLE, CheckOutcome, CheckRequest, CheckResult, Usage
from mesh.checks.runner import CheckRunner, runners_by_pool

REQUEST = CheckRequest("adm-1", "pool-a", "tenant-a", "rag.search", estimated_tokens=100)


class FakeCheck:
    """Answers ``outcome`` (after ``delay_s``), and logs every call in a shared journal."""

    def __init__(
        self,
        name: str,
        journal: list[tuple[str, str]],
        outcome: CheckOutcome = CheckOutcome.READY,
        *,
        reason: str | None = None,
        retry_after_ms: int | None = None,
        delay_s: float = 0.0,
        fail_release: bool = False,
    ) -> None:
        self._name = name
        self.journal = journal
        self.outcome = outcome
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.delay_s = delay_s
        self.fail_release = fail_release
        self.held: set[str] = set()
        self.usages: list[Usage | None] = []

    @property
    def name(self) -> str:
        return self._name

    async def reserve(self, request: CheckRequest) -> CheckResult:
        self.journal.append(("reserve", self._name))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.outcome is CheckOutcome.READY:
            self.held.add(request.admission_id)
        return CheckResult(self._name, self.outcome, self.reason, "", self.retry_after_ms)

    async def release(self, request: CheckRequest, usage: Usage | None = None) -> None:
        self.journal.append(("release", self._name))
        self.usages.append(usage)
        if self.fail_release:
            raise ConnectionError("down")
        self.held.discard(request.admission_id)


class RaisingCheck(FakeCheck):
    async def reserve(self, request: CheckRequest) -> CheckResult:
        self.journal.append(("reserve", self.name))
        raise RuntimeError("a bug in the check")


async def test_checks_are_asked_in_name_order_whatever_order_they_are_given() -> None:
    journal: list[tuple[str, str]] = []
    checks = [FakeCheck(name, journal) for name in ("c", "a", "b")]

    result = await CheckRunner(checks).reserve(REQUEST)

    assert result.ready and result.outcome is CheckOutcome.READY
    assert journal == [("reserve", "a"), ("reserve", "b"), ("reserve", "c")]
    assert [answer.check for answer in result.answers] == ["a", "b", "c"]
    assert result.refusal is None and result.reason is None and result.retry_after_ms is None
    assert all(REQUEST.admission_id in check.held for check in checks)


async def test_a_refusal_stops_the_run_and_releases_the_ready_checks_newest_first() -> None:
    journal: list[tuple[str, str]] = []
    a, b, d = FakeCheck("a", journal), FakeCheck("b", journal), FakeCheck("d", journal)
    c = FakeCheck("c", journal, CheckOutcome.RETRY, reason="CAPACITY", retry_after_ms=4200)

    result = await CheckRunner([d, c, b, a]).reserve(REQUEST)

    assert result.outcome is CheckOutcome.RETRY
    assert (result.check, result.reason, result.retry_after_ms) == ("c", "CAPACITY", 4200)
    assert journal == [
        ("reserve", "a"),
        ("reserve", "b"),
        ("reserve", "c"),
        ("release", "b"),
        ("release", "a"),
    ]
    assert not a.held and not b.held and not d.held  # d was never asked


async def test_rejected_is_the_overall_outcome_with_its_reason() -> None:
    journal: list[tuple[str, str]] = []
    a = FakeCheck("a", journal)
    b = FakeCheck("b", journal, CheckOutcome.REJECTED, reason="TENANT_BUDGET")

    result = await CheckRunner([a, b]).reserve(REQUEST)

    assert result.outcome is CheckOutcome.REJECTED
    assert (result.check, result.reason, result.retry_after_ms) == ("b", "TENANT_BUDGET", None)
    assert not a.held


async def test_a_retry_without_a_time_gets_the_runners_default() -> None:
    journal: list[tuple[str, str]] = []
    check = FakeCheck("a", journal, CheckOutcome.RETRY, reason="CAPACITY")

    result = await CheckRunner([check], default_retry_ms=750).reserve(REQUEST)

    assert (result.outcome, result.retry_after_ms) == (CheckOutcome.RETRY, 750)


async def test_a_pending_answer_is_not_ready_and_counts_as_retry() -> None:
    journal: list[tuple[str, str]] = []
    a, b = FakeCheck("a", journal), FakeCheck("b", journal, CheckOutcome.PENDING)

    result = await CheckRunner([a, b], default_retry_ms=300).reserve(REQUEST)

    assert (result.outcome, result.retry_after_ms) == (CheckOutcome.RETRY, 300)
    assert not a.held


async def test_a_check_that_does_not_answer_in_time_is_unavailable_and_released() -> None:
    journal: list[tuple[str, str]] = []
    a = FakeCheck("a", journal)
    slow = FakeCheck("b", journal, delay_s=5.0)
    c = FakeCheck("c", journal)
    runner = CheckRunner([a, slow, c], timeout_s=0.05, default_retry_ms=900)

    started = asyncio.get_running_loop().time()
    result = await runner.reserve(REQUEST)

    assert asyncio.get_running_loop().time() - started < 1.0
    assert result.outcome is CheckOutcome.RETRY
    assert (result.check, result.reason, result.retry_after_ms) == ("b", CHECK_UNAVAILABLE, 900)
    assert journal == [("reserve", "a"), ("reserve", "b"), ("release", "b"), ("release", "a")]
    assert runner.timeouts == 1
    assert not a.held and not c.held


async def test_a_check_that_raises_is_unavailable_not_an_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    journal: list[tuple[str, str]] = []
    a, broken = FakeCheck("a", journal), RaisingCheck("b", journal)

    with caplog.at_level(logging.ERROR, logger="mesh.checks.runner"):
        result = await CheckRunner([a, broken]).reserve(REQUEST)

    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert "RuntimeError" in (result.refusal.detail if result.refusal else "")
    assert journal[-2:] == [("release", "b"), ("release", "a")]
    assert "check b raised on reserve" in caplog.text


async def test_reserving_twice_asks_every_check_again() -> None:
    journal: list[tuple[str, str]] = []
    runner = CheckRunner([FakeCheck("a", journal), FakeCheck("b", journal)])

    first, second = await runner.reserve(REQUEST), await runner.reserve(REQUEST)

    assert first.ready and second.ready
    assert [call for call in journal if call[0] == "reserve"] == [
        ("reserve", "a"),
        ("reserve", "b"),
        ("reserve", "a"),
        ("reserve", "b"),
    ]


async def test_release_all_releases_newest_first_with_the_usage() -> None:
    journal: list[tuple[str, str]] = []
    checks = [FakeCheck(name, journal) for name in ("a", "b", "c")]
    runner = CheckRunner(checks)
    await runner.reserve(REQUEST)
    journal.clear()

    await runner.release_all(REQUEST, Usage(tokens=42))

    assert journal == [("release", "c"), ("release", "b"), ("release", "a")]
    assert all(check.usages == [Usage(tokens=42)] and not check.held for check in checks)


async def test_a_failing_release_is_counted_and_the_others_still_released() -> None:
    journal: list[tuple[str, str]] = []
    a, b = FakeCheck("a", journal), FakeCheck("b", journal, fail_release=True)
    c = FakeCheck("c", journal)
    runner = CheckRunner([a, b, c])
    await runner.reserve(REQUEST)

    await runner.release_all(REQUEST)

    assert runner.release_failures == 1
    assert not a.held and not c.held


async def test_a_release_that_hangs_is_cut_by_the_timeout() -> None:
    journal: list[tuple[str, str]] = []

    class HangingRelease(FakeCheck):
        async def release(self, request: CheckRequest, usage: Usage | None = None) -> None:
            await asyncio.sleep(5.0)

    a, hanging = FakeCheck("a", journal), HangingRelease("b", journal)
    runner = CheckRunner([a, hanging], timeout_s=0.05)
    await runner.reserve(REQUEST)

    await runner.release_all(REQUEST)

    assert runner.release_failures == 1
    assert not a.held


def test_check_names_must_be_unique() -> None:
    journal: list[tuple[str, str]] = []
    with pytest.raises(ValueError, match="unique"):
        CheckRunner([FakeCheck("a", journal), FakeCheck("a", journal)])


def test_runners_by_pool_picks_each_pools_checks_in_order() -> None:
    journal: list[tuple[str, str]] = []
    checks = [FakeCheck(name, journal) for name in ("a", "b", "c")]

    runners = runners_by_pool(checks, {"p1": ["c", "a"], "p2": ["b"]})

    assert runners["p1"].names == ("a", "c")
    assert runners["p2"].names == ("b",)
    with pytest.raises(KeyError):
        runners_by_pool(checks, {"p3": ["nope"]})
