"""What a webhook service's answer means, decided without any HTTP: ``Retry-After`` in seconds
or as an HTTP date, and each status and body of the ``/reserve`` contract."""

from __future__ import annotations

import pytest

from mesh.checks import CHECK_UNAVAILABLE, CheckOutcome, CheckResult
from mesh.checks.webhook import (
    REASON_REJECTED,
    REASON_RETRY,
    REASON_THROTTLED,
    parse_retry_after,
    reserve_result,
)

NOW = 1_784_000_000.0  # 2026-07-14 03:33:20 UTC


@pytest.mark.parametrize(
    ("header", "ms"),
    [
        ("3", 3000),
        (" 0 ", 0),
        ("1.5", 1500),
        ("Tue, 14 Jul 2026 03:33:30 GMT", 10_000),  # ten seconds after NOW
        ("Tue, 14 Jul 2026 03:33:00 GMT", 0),  # in the past: now
        (None, None),
        ("", None),
        ("soon", None),
        ("-4", 0),
        ("nan", None),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(header: str | None, ms: int | None) -> None:
    assert parse_retry_after(header, NOW) == ms


def answer(status: int, body: bytes, retry_after: str | None = None) -> CheckResult | str:
    return reserve_result(
        "budget", status, body, retry_after, now=NOW, default_retry_ms=1000, max_retry_ms=60_000
    )


def test_the_contracts_answers_map_to_outcomes_reasons_and_retry_times() -> None:
    def summary(status: int, body: bytes, retry_after: str | None = None) -> tuple[object, ...]:
        result = answer(status, body, retry_after)
        assert not isinstance(result, str)
        return (result.outcome, result.reason, result.retry_after_ms)

    assert summary(200, b'{"outcome": "ready"}') == (CheckOutcome.READY, None, None)
    assert summary(204, b'{"outcome": "READY"}') == (CheckOutcome.READY, None, None)
    assert summary(200, b'{"outcome": "retry"}') == (CheckOutcome.RETRY, REASON_RETRY, 1000)
    assert summary(200, b'{"outcome": "retry", "retry_after_ms": 99, "reason": "TPM"}') == (
        CheckOutcome.RETRY,
        "TPM",
        99,
    )
    assert summary(200, b'{"outcome": "retry", "retry_after_ms": 9e9}')[2] == 60_000  # capped
    assert summary(200, b'{"outcome": "rejected"}') == (
        CheckOutcome.REJECTED,
        REASON_REJECTED,
        None,
    )
    assert summary(403, b"forbidden") == (CheckOutcome.REJECTED, REASON_REJECTED, None)
    assert summary(422, b'{"reason": "NO_CONTRACT"}') == (
        CheckOutcome.REJECTED,
        "NO_CONTRACT",
        None,
    )
    assert summary(429, b"", "2") == (CheckOutcome.RETRY, REASON_THROTTLED, 2000)
    assert summary(429, b"", "86400") == (CheckOutcome.RETRY, REASON_THROTTLED, 60_000)
    assert summary(503, b"") == (CheckOutcome.RETRY, CHECK_UNAVAILABLE, 1000)
    assert summary(503, b'{"reason": "MAINTENANCE"}', "1") == (
        CheckOutcome.RETRY,
        "MAINTENANCE",
        1000,
    )


@pytest.mark.parametrize(
    ("status", "body", "failure"),
    [
        (200, b"", "body"),
        (200, b"ready", "body"),
        (200, b'{"outcome": 1}', "body"),
        (200, b'{"outcome": "pending"}', "body"),
        (200, b"\xff\xfe", "body"),
        (500, b'{"outcome": "ready"}', "status"),
        (301, b"", "status"),
        (400, b"", "status"),
    ],
)
def test_an_answer_outside_the_contract_is_a_failure(
    status: int, body: bytes, failure: str
) -> None:
    assert answer(status, body) == failure
