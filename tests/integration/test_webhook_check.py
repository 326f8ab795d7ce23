"""The HTTP webhook check against a real HTTP server: every answer of the contract maps to its
outcome and retry time, every failure (slow, closed, garbled, flooding, half-answering) is a
counted ``RETRY`` / ``CHECK_UNAVAILABLE`` in about the timeout, and release carries the actual
tokens and never raises.

The service is an aiohttp application on 127.0.0.1 (a random port) in the test's own loop,
answering as each test configures it and recording what it was sent. No broker is needed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import pytest
from aiohttp import web

from mesh.checks import CHECK_UNAVAILABLE, CheckOutcome, CheckRequest, Usage
from mesh.checks.webhook import (
    REASON_THROTTLED,
    WebhookCheck,
)

Answer = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


def answer_json(status: int, body: object, **headers: str) -> Answer:
    async def handler(request: web.Request, received: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(body, status=status, headers=headers)

    return handler


def answer_bytes(status: int, body: bytes) -> Answer:
    async def handler(request: web.Request, received: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="application/json")

    return handler


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Service:
    """A budget service on a random port: answers ``/reserve`` and ``/release`` with the
    configured handlers (ready and 200 by default) and records every request."""

    reserve: Answer = field(default_factory=lambda: answer_json(200, {"outcome": "ready"}))
    release: Answer = field(default_factory=lambda: answer_json(200, {}))
    received: list[Received] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def sent_to(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == f"/budget{path}"]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, dict(request.headers), body))
        handler = self.reserve if request.path.endswith("/reserve") else self.release
        return await handler(request, body)


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    svc = Service()
    app = web.Application()
    app.router.add_post("/budget/reserve", svc.handle)
    app.router.add_post("/budget/release", svc.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    svc.url = f"http://{host}:{port}/budget"
    yield svc
    svc.stopping.set()
    await runner.cleanup()


@pytest.fixture
async def make_check() -> AsyncIterator[Callable[..., WebhookCheck]]:
    """Builds checks the way the checks file does, and closes them after the test."""
    made: list[WebhookCheck] = []

    def build(url: str, **options: Any) -> WebhookCheck:
        options.setdefault("timeout_s", 2.0)
        check = WebhookCheck(
            name="budget", url=url, headers=options.pop("headers", None), **options
        )
        made.append(check)
        return check

    yield build
    for check in reversed(made):
        await check.close()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


def request_for(admission_id: str = "adm-1", **fields: Any) -> CheckRequest:
    return CheckRequest(
        admission_id=admission_id,
        pool_id="pool-a",
        tenant="acme",
        capability="rag.search",
        estimated_tokens=1200,
        run_id="run-7",
        ttl_s=20.0,
        labels={"model": "gpt-x"},
        **fields,
    )


def unavailable_counts(check: WebhookCheck) -> dict[str, int]:
    return {k: v for k, v in check.counters.items() if "failed" in k or "unavailable" in k}


# ---- answers ----------------------------------------------------------------------------------


async def test_a_ready_answer_is_ready_and_the_service_is_sent_the_admission(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    check = make_check(service.url + "/", headers={"Authorization": "Bearer s3cret"})

    result = await check.reserve(request_for())

    assert result.outcome is CheckOutcome.READY and result.check == "budget"
    [sent] = service.received
    assert sent.path == "/budget/reserve"
    assert sent.headers["Idempotency-Key"] == "adm-1"
    assert sent.headers["Authorization"] == "Bearer s3cret"
    assert sent.body == {
        "admission_id": "adm-1",
        "pool_id": "pool-a",
        "tenant": "acme",
        "capability": "rag.search",
        "estimated_tokens": 1200,
        "run_id": "run-7",
        "ttl_s": 20.0,
        "labels": {"model": "gpt-x"},
    }
    assert check.counters == {"reserve_ready": 1}


async def test_a_retry_answer_carries_the_services_retry_time_and_reason(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    service.reserve = answer_json(
        200, {"outcome": "retry", "retry_after_ms": 2500, "reason": "TPM_EXHAUSTED"}
    )
    check = make_check(service.url)

    result = await check.reserve(request_for())

    assert result.outcome is CheckOutcome.RETRY
    assert (result.reason, result.retry_after_ms) == ("TPM_EXHAUSTED", 2500)
    assert check.counters == {"reserve_retry": 1}


async def test_429_with_retry_after_seconds_is_retry_after_that_many_seconds(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    service.reserve = answer_json(429, {"error": "slow down"}, **{"Retry-After": "3"})
    check = make_check(service.url)

    result = await check.reserve(request_for())

    assert result.outcome is CheckOutcome.RETRY
    assert (result.reason, result.retry_after_ms) == (REASON_THROTTLED, 3000)
    assert check.counters == {"reserve_retry": 1, "reserve_throttled": 1}


async def test_503_with_an_http_date_retry_after_is_retry_until_that_date(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    now = 1_800_000_000.0  # the check's wall clock, fixed by the test
    until = format_datetime(datetime.fromtimestamp(now + 7, UTC), usegmt=True)
    service.reserve = answer_json(503, {}, **{"Retry-After": until})
    check = make_check(service.url, clock=lambda: now)

    result = await check.reserve(request_for())

    assert result.outcome is CheckOutcome.RETRY
    assert (result.reason, result.retry_after_ms) == (CHECK_UNAVAILABLE, 7000)
    assert check.counters == {"reserve_retry": 1, "reserve_throttled": 1}


async def test_429_without_retry_after_is_retry_after_the_default(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    service.reserve = answer_bytes(429, b"")
    check = make_check(service.url, default_retry_ms=750)

    result = await check.reserve(request_for())

    assert (result.outcome, result.retry_after_ms) == (CheckOutcome.RETRY, 750)


@pytest.mark.parametrize("status", [403, 422, 200])
async def test_a_rejection_is_rejected_with_the_services_reason(
    service: Service, make_check: Callable[..., WebhookCheck], status: int
) -> None:
    body = {"reason": "TENANT_NOT_APPROVED", "detail": "acme has no contract for gpt-x"}
    service.reserve = answer_json(status, {"outcome": "rejected", **body})
    check = make_check(service.url)

    result = await check.reserve(request_for())

    assert result.outcome is CheckOutcome.REJECTED
    assert (result.reason, result.detail) == (body["reason"], body["detail"])
    assert result.retry_after_ms is None
    assert check.counters == {"reserve_rejected": 1}


# ---- failures ---------------------------------------------------------------------------------


async def test_a_service_slower_than_the_timeout_is_unavailable_after_about_the_timeout(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    async def sleep_past_the_timeout(request: web.Request, _: dict[str, Any]) -> web.Response:
        try:
            await asyncio.wait_for(service.stopping.wait(), 30)
        except TimeoutError:
            pass
        return web.json_response({"outcome": "ready"})

    service.reserve = sleep_past_the_timeout
    check = make_check(service.url, timeout_s=0.5, default_retry_ms=1500)

    started = time.monotonic()
    result = await check.reserve(request_for())
    elapsed = time.monotonic() - started

    assert 0.45 <= elapsed < 1.5
    assert result.outcome is CheckOutcome.RETRY
    assert (result.reason, result.retry_after_ms) == (CHECK_UNAVAILABLE, 1500)
    assert unavailable_counts(check) == {"reserve_failed_timeout": 1, "reserve_unavailable": 1}


async def test_a_closed_port_is_unavailable_at_once(
    make_check: Callable[..., WebhookCheck], closed_port: int
) -> None:
    check = make_check(f"http://127.0.0.1:{closed_port}", timeout_s=5.0)

    started = time.monotonic()
    result = await check.reserve(request_for())

    assert time.monotonic() - started < 1.0
    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert unavailable_counts(check) == {"reserve_failed_connection": 1, "reserve_unavailable": 1}


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (200, b"<html>ok</html>", "body"),
        (200, b'["ready"]', "body"),
        (200, b'{"outcome": "maybe"}', "body"),
        (200, b"", "body"),
        (500, b'{"outcome": "ready"}', "status"),
        (502, b"bad gateway", "status"),
        (404, b"not found", "status"),
    ],
)
async def test_an_unusable_answer_is_unavailable_and_counted_by_kind(
    service: Service,
    make_check: Callable[..., WebhookCheck],
    status: int,
    body: bytes,
    kind: str,
) -> None:
    service.reserve = answer_bytes(status, body)
    check = make_check(service.url)

    result = await check.reserve(request_for())

    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert result.retry_after_ms == check.default_retry_ms
    assert unavailable_counts(check) == {f"reserve_failed_{kind}": 1, "reserve_unavailable": 1}


async def test_a_flooding_service_is_cut_off_at_the_body_cap(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    sent = 0

    async def endless_body(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        try:
            while not service.stopping.is_set() and sent < 64 * 1024 * 1024:
                await response.write(b"x" * 16384)
                sent += 16384
        except (ConnectionError, RuntimeError):
            pass  # the check hung up
        return response

    service.reserve = endless_body
    # Without the cap this would read until the timeout and count a timeout instead.
    check = make_check(service.url, timeout_s=5.0, max_body_bytes=64 * 1024)

    started = time.monotonic()
    result = await check.reserve(request_for())

    assert time.monotonic() - started < 2.0
    assert (result.outcome, result.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert unavailable_counts(check) == {
        "reserve_failed_body_too_large": 1,
        "reserve_unavailable": 1,
    }


async def test_a_declared_huge_body_is_refused_unread_and_one_under_the_cap_is_read(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    check = make_check(service.url, max_body_bytes=64 * 1024)

    service.reserve = answer_bytes(200, b" " * (10 * 1024 * 1024) + b'{"outcome": "ready"}')
    huge = await check.reserve(request_for("adm-huge"))
    padded = b'{"outcome": "ready"}' + b" " * (60 * 1024)
    service.reserve = answer_bytes(200, padded)
    under_the_cap = await check.reserve(request_for("adm-padded"))

    assert (huge.outcome, huge.reason) == (CheckOutcome.RETRY, CHECK_UNAVAILABLE)
    assert under_the_cap.outcome is CheckOutcome.READY
    assert check.counters["reserve_failed_body_too_large"] == 1
    assert check.counters["reserve_ready"] == 1


async def test_a_service_answering_every_other_check_with_503_holds_exactly_the_ready_ones(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    held: set[str] = set()
    asked = 0

    async def half_the_checks(request: web.Request, body: dict[str, Any]) -> web.Response:
        nonlocal asked
        asked += 1
        if asked % 2 == 0:
            return web.Response(status=503, text="overloaded")
        held.add(body["admission_id"])
        return web.json_response({"outcome": "ready"})

    async def give_back(request: web.Request, body: dict[str, Any]) -> web.Response:
        held.discard(body["admission_id"])
        return web.json_response({})

    service.reserve, service.release = half_the_checks, give_back
    check = make_check(service.url, default_retry_ms=400)
    requests = [request_for(f"adm-{i}") for i in range(20)]

    results = await asyncio.gather(*(check.reserve(r) for r in requests))
    ready = [r for r, result in zip(requests, results, strict=True) if result.ready]
    retried = [result for result in results if not result.ready]

    assert len(ready) == 10 and len(retried) == 10
    assert {(r.outcome, r.reason, r.retry_after_ms) for r in retried} == {
        (CheckOutcome.RETRY, CHECK_UNAVAILABLE, 400)
    }
    assert held == {r.admission_id for r in ready}
    assert check.counters == {"reserve_ready": 10, "reserve_retry": 10, "reserve_throttled": 10}

    for r in ready:
        await check.release(r, Usage(tokens=900))

    assert held == set()
    assert check.counters["release_ok"] == 10


# ---- release ----------------------------------------------------------------------------------


async def test_release_posts_the_actual_tokens_with_the_idempotency_key(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    check = make_check(service.url, headers={"Authorization": "Bearer s3cret"})
    ran, never_ran = request_for("adm-ran"), request_for("adm-never-ran")

    await check.release(ran, Usage(tokens=950))
    await check.release(never_ran)

    first, second = service.sent_to("/release")
    assert first.headers["Idempotency-Key"] == "adm-ran"
    assert first.headers["Authorization"] == "Bearer s3cret"
    assert first.body == {
        "admission_id": "adm-ran",
        "pool_id": "pool-a",
        "tenant": "acme",
        "capability": "rag.search",
        "run_id": "run-7",
        "estimated_tokens": 1200,
        "tokens": 950,
    }
    assert (second.headers["Idempotency-Key"], second.body["tokens"]) == ("adm-never-ran", None)
    assert check.counters == {"release_ok": 2}


async def test_release_never_raises_when_the_service_is_down_slow_or_failing(
    service: Service, make_check: Callable[..., WebhookCheck], closed_port: int
) -> None:
    async def never_answers(request: web.Request, _: dict[str, Any]) -> web.Response:
        await service.stopping.wait()
        return web.json_response({})

    down = make_check(f"http://127.0.0.1:{closed_port}")
    await down.release(request_for(), Usage(tokens=10))

    service.release = answer_bytes(500, b"boom")
    failing = make_check(service.url)
    await failing.release(request_for(), Usage(tokens=10))

    service.release = never_answers
    slow = make_check(service.url, timeout_s=0.3)
    started = time.monotonic()
    await slow.release(request_for(), Usage(tokens=10))

    assert time.monotonic() - started < 1.0
    assert down.counters == {"release_failed": 1, "release_failed_connection": 1}
    assert failing.counters == {"release_failed": 1, "release_failed_status": 1}
    assert slow.counters == {"release_failed": 1, "release_failed_timeout": 1}


async def test_a_closed_check_opens_a_new_session_when_asked_again(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    check = make_check(service.url)

    first = await check.reserve(request_for("adm-1"))
    await check.close()
    await check.close()  # closing twice is harmless
    second = await check.reserve(request_for("adm-2"))

    assert first.ready and second.ready
    assert [r.body["admission_id"] for r in service.sent_to("/reserve")] == ["adm-1", "adm-2"]


async def test_the_same_admission_asked_twice_sends_the_same_idempotency_key(
    service: Service, make_check: Callable[..., WebhookCheck]
) -> None:
    check = make_check(service.url)

    await check.reserve(request_for("adm-9"))
    await check.reserve(request_for("adm-9"))

    keys = [r.headers["Idempotency-Key"] for r in service.sent_to("/reserve")]
    assert keys == ["adm-9", "adm-9"]
    assert json.dumps(service.sent_to("/reserve")[0].body) == json.dumps(
        service.sent_to("/reserve")[1].body
    )
