"""Redis budgets against the real Redis: all or nothing, retry times, idempotency, TTL expiry,
settlement, two managers sharing one budget exactly, and Redis down or slow.

Redis comes from ``MESH_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). An
unreachable Redis fails these tests with one sentence — never a skip: in CI that must be a red
build (``bash scripts/ensure-redis.sh`` brings it up). Each test keeps its keys under a prefix
of its own and deletes them afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio import Redis

from mesh.checks import CHECK_UNAVAILABLE, CheckOutcome, CheckRequest, Usage
from mesh.checks.redis_budget import BudgetLimit, LimitKind, RedisBudgetCheck
from mesh.checks.runner import CheckRunner
from mesh.wire.reasons import Reason

from .budget_manager import drive, shared_check

DEFAULT_TEST_REDIS_URL = "redis://127.0.0.1:6379/0"
START_REDIS_HINT = "run `bash scripts/ensure-redis.sh`"
OTHER_MANAGER = Path(__file__).with_name("budget_manager.py")

RPM, TPM = LimitKind.RPM, LimitKind.TPM
CONCURRENCY, DAILY = LimitKind.CONCURRENCY, LimitKind.DAILY_TOKENS


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis's URL, once it is known to answer (else the test fails)."""
    url = os.environ.get("MESH_TEST_REDIS_URL", DEFAULT_TEST_REDIS_URL)
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        error = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    else:
        return url
    finally:
        client.close()
    why = "CI=true, so this is a failure, not a skip; " if _in_ci() else ""
    pytest.fail(
        f"No Redis answers at {url} ({error}); "
        f"{why}{START_REDIS_HINT}, or set MESH_TEST_REDIS_URL to a running server.",
        pytrace=False,
    )


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    """A plain client, for looking at the counters."""
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(raw: Redis, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """``mesh:t-<test>-<hex>:budget:``; every key under it is deleted after the test."""
    short = request.node.name.removeprefix("test_")[:30]
    key_prefix = f"mesh:t-{short}-{uuid.uuid4().hex[:6]}:budget:"
    yield key_prefix
    keys = [key async for key in raw.scan_iter(match=f"{key_prefix}*", count=1000)]
    if keys:
        await raw.delete(*keys)


CheckFactory = Callable[..., RedisBudgetCheck]


@pytest.fixture
async def make_check(redis_url: str, prefix: str) -> AsyncIterator[CheckFactory]:
    """``make_check(name, limits, **options)``: a check with a connection pool of its own,
    under the test's prefix, closed after the test."""
    made: list[RedisBudgetCheck] = []

    def make(name: str, limits: list[BudgetLimit], **options: Any) -> RedisBudgetCheck:
        options.setdefault("key_prefix", prefix)
        options.setdefault("timeout_s", 2.0)
        check = RedisBudgetCheck.from_url(name, limits, options.pop("url", redis_url), **options)
        made.append(check)
        return check

    yield make
    for check in reversed(made):
        await check.aclose()


def request_for(
    admission_id: str, tokens: int = 0, *, tenant: str = "t1", ttl_s: float = 30.0
) -> CheckRequest:
    return CheckRequest(admission_id, "pool-a", tenant, "llm.chat", tokens, ttl_s=ttl_s)


def minute_start() -> float:
    """A fixed clock for a test: the current minute's start plus 15 s (windows never roll)."""
    return (time.time() // 60) * 60 + 15.0


async def counter(raw: Redis, key: str) -> int:
    return int(await raw.get(key) or 0)


def window_key(prefix: str, kind: str, scope: str, now: float, tenant: str = "t1") -> str:
    if kind == "daily":
        return f"{prefix}daily:{scope}:{tenant}:{int(now // 86400)}"
    return f"{prefix}{kind}:{scope}:{int(now // 60)}"


async def test_three_checks_second_refusing_leave_no_counter_moved(
    make_check: CheckFactory, raw: Redis, prefix: str
) -> None:
    now = minute_start()
    first = make_check("a-provider", [BudgetLimit(RPM, "openai", 10)], clock=lambda: now)
    second = make_check("b-tokens", [BudgetLimit(TPM, "openai", 1000)], clock=lambda: now)
    third = make_check("c-tool", [BudgetLimit(CONCURRENCY, "browser", 5)], clock=lambda: now)
    assert (await second.reserve(request_for("filler", 900))).ready  # leaves 100 tokens
    rpm_key = window_key(prefix, "rpm", "openai", now)
    tpm_key = window_key(prefix, "tpm", "openai", now)
    browser = f"{prefix}concurrency:browser"

    result = await CheckRunner([third, first, second]).reserve(request_for("adm-1", 300))

    assert result.outcome is CheckOutcome.RETRY
    assert (result.check, result.reason) == ("b-tokens", Reason.CAPACITY)
    assert result.retry_after_ms == 45_000  # the rest of the minute
    assert [answer.check for answer in result.answers] == ["a-provider", "b-tokens"]
    assert await counter(raw, rpm_key) == 0  # taken by the first, given back
    assert await counter(raw, tpm_key) == 900  # the filler's only
    assert await raw.zcard(browser) == 0  # the third was never asked
    assert not await raw.exists(first.record_key("adm-1"), second.record_key("adm-1"))

    # Once the second has room, the same admission takes all three.
    await second.release(request_for("filler", 900))
    assert (await CheckRunner([first, second, third]).reserve(request_for("adm-1", 300))).ready
    assert await counter(raw, rpm_key) == 1
    assert await counter(raw, tpm_key) == 300
    assert await raw.zrange(browser, 0, -1) == ["adm-1"]


async def test_one_check_with_three_limits_takes_all_or_none(
    make_check: CheckFactory, raw: Redis, prefix: str
) -> None:
    now = minute_start()
    check = make_check(
        "provider",
        [
            BudgetLimit(RPM, "openai", 10),
            BudgetLimit(DAILY, "tenants", 500),
            BudgetLimit(CONCURRENCY, "browser", 5),
        ],
        clock=lambda: now,
    )
    assert (await check.reserve(request_for("adm-1", 400))).ready

    refused = await check.reserve(request_for("adm-2", 200))

    assert refused.outcome is CheckOutcome.RETRY
    assert refused.reason == Reason.TENANT_BUDGET
    day_end = (now // 86400 + 1) * 86400
    assert refused.retry_after_ms == int((day_end - now) * 1000)  # until UTC midnight
    assert await counter(raw, window_key(prefix, "rpm", "openai", now)) == 1
    assert await counter(raw, window_key(prefix, "daily", "tenants", now)) == 400
    assert await raw.zrange(f"{prefix}concurrency:browser", 0, -1) == ["adm-1"]
    # Another tenant has a daily budget of its own.
    assert (await check.reserve(request_for("adm-3", 200, tenant="t2"))).ready


async def test_a_request_above_a_whole_limit_is_rejected(make_check: CheckFactory) -> None:
    check = make_check("provider", [BudgetLimit(RPM, "x", 10), BudgetLimit(TPM, "x", 1000)])

    result = await check.reserve(request_for("adm-1", 5000))

    assert (result.outcome, result.reason) == (CheckOutcome.REJECTED, Reason.CAPACITY)
    assert "1000 tokens per minute" in result.detail
    assert result.retry_after_ms is None


async def test_retry_carries_the_rest_of_the_minute_or_the_concurrency_default(
    make_check: CheckFactory,
) -> None:
    now = minute_start() + 20.5  # 35.5 s into the minute
    rpm = make_check("rpm", [BudgetLimit(RPM, "openai", 2)], clock=lambda: now)
    tool = make_check(
        "tool",
        [BudgetLimit(CONCURRENCY, "sandbox", 1)],
        clock=lambda: now,
        concurrency_retry_ms=1500,
    )
    for admission in ("a1", "a2"):
        assert (await rpm.reserve(request_for(admission))).ready
    assert (await tool.reserve(request_for("a1"))).ready

    rate = await rpm.reserve(request_for("a3"))
    held = await tool.reserve(request_for("a3"))

    assert (rate.outcome, rate.reason, rate.retry_after_ms) == (
        CheckOutcome.RETRY,
        Reason.CAPACITY,
        24_500,
    )
    assert (held.outcome, held.retry_after_ms) == (CheckOutcome.RETRY, 1500)


async def test_reserving_twice_takes_once_and_releasing_twice_gives_back_once(
    make_check: CheckFactory, raw: Redis, prefix: str
) -> None:
    now = minute_start()
    check = make_check(
        "provider",
        [
            BudgetLimit(RPM, "openai", 10),
            BudgetLimit(TPM, "openai", 10_000),
            BudgetLimit(CONCURRENCY, "browser", 5),
        ],
        clock=lambda: now,
    )
    first = await check.reserve(request_for("adm-1", 300))
    again = await check.reserve(request_for("adm-1", 300))

    assert first.ready and again.ready
    assert (first.detail, again.detail) == ("taken", "replayed")
    rpm_key, tpm_key = (
        window_key(prefix, "rpm", "openai", now),
        window_key(prefix, "tpm", "openai", now),
    )
    assert await counter(raw, rpm_key) == 1
    assert await counter(raw, tpm_key) == 300
    assert await raw.zcard(f"{prefix}concurrency:browser") == 1

    assert (await check.reserve(request_for("adm-2", 200))).ready
    await check.release(request_for("adm-1", 300))
    await check.release(request_for("adm-1", 300))

    assert await counter(raw, rpm_key) == 1  # adm-2's only
    assert await counter(raw, tpm_key) == 200
    assert await raw.zrange(f"{prefix}concurrency:browser", 0, -1) == ["adm-2"]


async def test_a_held_reservation_expires_after_its_ttl(
    make_check: CheckFactory, raw: Redis
) -> None:
    check = make_check("tool", [BudgetLimit(CONCURRENCY, "sandbox", 1)])  # Redis's own clock
    assert (await check.reserve(request_for("crashed", ttl_s=1.0))).ready
    refused = await check.reserve(request_for("next"))
    assert refused.outcome is CheckOutcome.RETRY

    await asyncio.sleep(1.3)

    assert not await raw.exists(check.record_key("crashed"))
    assert (await check.reserve(request_for("next"))).ready


async def test_release_settles_tokens_with_the_actual_count(
    make_check: CheckFactory, raw: Redis, prefix: str
) -> None:
    now = minute_start()
    check = make_check(
        "provider",
        [
            BudgetLimit(RPM, "openai", 100),
            BudgetLimit(TPM, "openai", 10_000),
            BudgetLimit(DAILY, "tenants", 100_000),
        ],
        clock=lambda: now,
    )
    rpm_key = window_key(prefix, "rpm", "openai", now)
    tpm_key = window_key(prefix, "tpm", "openai", now)
    day_key = window_key(prefix, "daily", "tenants", now)
    for admission, estimate in (("over", 300), ("under", 100), ("unknown", 50), ("never", 70)):
        assert (await check.reserve(request_for(admission, estimate))).ready
    assert await counter(raw, tpm_key) == 520

    await check.release(request_for("over", 300), Usage(tokens=120))  # -180
    await check.release(request_for("under", 100), Usage(tokens=250))  # +150
    await check.release(request_for("unknown", 50), Usage(tokens=None))  # the estimate stays
    await check.release(request_for("never", 70))  # never ran: everything back

    assert await counter(raw, tpm_key) == 120 + 250 + 50
    assert await counter(raw, day_key) == 120 + 250 + 50
    assert await counter(raw, rpm_key) == 3  # the three that ran


async def test_settling_never_goes_below_zero(
    make_check: CheckFactory, raw: Redis, prefix: str
) -> None:
    now = minute_start()
    check = make_check("provider", [BudgetLimit(TPM, "openai", 10_000)], clock=lambda: now)
    tpm_key = window_key(prefix, "tpm", "openai", now)
    assert (await check.reserve(request_for("adm-1", 500))).ready
    await raw.set(tpm_key, 100, keepttl=True)  # an operator reset the window meanwhile

    await check.release(request_for("adm-1", 500), Usage(tokens=0))

    assert await counter(raw, tpm_key) == 0


async def test_a_script_redis_does_not_know_is_loaded_and_run(raw: Redis) -> None:
    """What a restarted Redis looks like to a client: ``NOSCRIPT`` for a script it ran
    before. A script of its own (unique, so never loaded) shows it without flushing the
    scripts of everyone else on the shared server."""
    from mesh.checks.redis_budget import _Script, _text

    script = _Script(f"return ARGV[1] .. '-{uuid.uuid4().hex}'")
    assert not (await raw.script_exists(script.sha))[0]
    answer = await script(raw, [], ["ran"])
    assert _text(answer).startswith("ran-")
    assert (await raw.script_exists(script.sha))[0]


# ---- two managers sharing one budget ----------------------------------------------------------
async def test_two_managers_share_one_budget_exactly_over_10000_admissions(
    raw: Redis, prefix: str, redis_url: str
) -> None:
    limit, each = 2500, 5000
    other = await asyncio.create_subprocess_exec(
        sys.executable,
        str(OTHER_MANAGER),
        redis_url,
        prefix,
        str(limit),
        str(each),
        str(each),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert other.stdin is not None and other.stdout is not None
    mine = shared_check(redis_url, prefix, limit)  # a connection pool of its own
    try:
        assert (await asyncio.wait_for(other.stdout.readline(), 30)).strip() == b"ready"
        other.stdin.write(b"go\n")
        await other.stdin.drain()
        granted_here, outcomes_here = await drive(mine, 0, each)
        theirs = json.loads(await asyncio.wait_for(other.stdout.readline(), 60))
        assert await asyncio.wait_for(other.wait(), 30) == 0
    finally:
        await mine.aclose()
        if other.returncode is None:
            other.kill()
            await other.wait()

    assert granted_here + theirs["granted"] == limit, (outcomes_here, theirs["outcomes"])
    assert granted_here > 0 and theirs["granted"] > 0  # the two really competed
    assert await raw.zcard(f"{prefix}concurrency:tool") == limit
    # Every refusal was the budget's, none a lost call: the total is exact, not merely at most.
    refused = f"RETRY/{Reason.CAPACITY.value}"
    assert outcomes_here.get(refused, 0) + theirs["outcomes"].get(refused, 0) == 2 * each - limit


# ---- Redis down or slow -----------------------------------------------------------------------
@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    yield port


async def test_redis_unreachable_is_retry_check_unavailable_quickly(
    make_check: CheckFactory, closed_port: int
) -> None:
    check = make_check(
        "provider",
        [BudgetLimit(RPM, "x", 10)],
        url=f"redis://127.0.0.1:{closed_port}/0",
        timeout_s=0.5,
    )
    started = time.monotonic()

    result = await check.reserve(request_for("adm-1"))
    await check.release(request_for("adm-1"))

    assert time.monotonic() - started < 1.0
    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert result.retry_after_ms is not None and result.retry_after_ms > 0
    assert (check.unavailable, check.release_failures) == (1, 1)


async def test_redis_that_never_answers_is_retry_after_the_timeout(
    make_check: CheckFactory,
) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        check = make_check(
            "provider",
            [BudgetLimit(RPM, "x", 10)],
            url=f"redis://127.0.0.1:{port}/0",
            timeout_s=0.3,
        )
        started = time.monotonic()
        result = await check.reserve(request_for("adm-1"))
        took = time.monotonic() - started
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()

    assert 0.25 <= took < 1.5
    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
