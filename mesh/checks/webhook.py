"""An admission check that asks an external service over HTTP (a budget or an approval service).

Theory of operation
-------------------
:class:`WebhookCheck` speaks a small JSON-over-HTTP contract with one service at ``url``:

``POST {url}/reserve`` with headers ``Content-Type: application/json`` and
``Idempotency-Key: <admission_id>`` (plus the configured ``headers``, an ``Authorization``
for instance) and the body::

    {"admission_id": "...", "pool_id": "...", "tenant": "...", "capability": "...",
     "estimated_tokens": 1200, "run_id": "..." | null, "ttl_s": 30.0, "labels": {...}}

is answered

* ``200 {"outcome": "ready"}`` — ``READY``: the service holds a reservation for this
  admission until ``/release`` or until ``ttl_s`` has passed;
* ``200 {"outcome": "retry", "retry_after_ms": N, "reason": "..."}`` — ``RETRY`` after ``N``
  ms (``default_retry_ms`` when absent; reason ``WEBHOOK_RETRY`` when absent);
* ``200 {"outcome": "rejected", "reason": "...", "detail": "..."}``, or ``403`` / ``422``
  (with such a body, or none) — ``REJECTED`` with that reason (``WEBHOOK_REJECTED`` when
  absent);
* ``429`` or ``503`` — ``RETRY`` after the ``Retry-After`` header (seconds, or an HTTP date),
  ``default_retry_ms`` when it is absent or unreadable; the reason is the body's ``reason``,
  else ``WEBHOOK_THROTTLED`` (429) or :data:`~mesh.checks.base.CHECK_UNAVAILABLE` (503).

Anything else — no answer within ``timeout_s`` (connecting, sending and reading together), a
refused connection, another status (a 5xx other than 503, a redirect, a 404), a 2xx body that
is not such a JSON object, or a body over ``max_body_bytes`` (read no further) — is ``RETRY``
with :data:`~mesh.checks.base.CHECK_UNAVAILABLE` after ``default_retry_ms``, counted by kind.
Every retry time is capped at ``max_retry_ms``. Any 2xx status counts as 200.

``POST {url}/release`` with ``Idempotency-Key: <admission_id>`` and the body::

    {"admission_id": "...", "pool_id": "...", "tenant": "...", "capability": "...",
     "run_id": "..." | null, "estimated_tokens": 1200, "tokens": 950 | null}

(``tokens``: what the admission really used, ``null`` when it never ran or nobody reported)
is answered with any 2xx. A failure is counted and logged, never raised: the service's own
TTL returns what it holds. Idempotency by admission ID is the service's duty — a reserve
asked twice holds one reservation, a release of nothing or released twice is a 2xx.

A reserve whose answer was lost (a timeout, a 5xx, an unreadable body) may have left a
reservation at the service; the check does not guess, and that reservation lives until a
``release`` for the admission or the service's TTL.

The meaning of an answer is decided by the pure :func:`reserve_result` and
:func:`parse_retry_after`; :class:`WebhookCheck` only moves the bytes, with one
``aiohttp.ClientSession`` created on first use and closed by :meth:`WebhookCheck.close`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any, Final, Literal

import aiohttp

from mesh.checks.base import CHECK_UNAVAILABLE, CheckOutcome, CheckRequest, CheckResult, Usage

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "REASON_REJECTED",
    "REASON_RETRY",
    "REASON_THROTTLED",
    "Failure",
    "WebhookCheck",
    "parse_retry_after",
    "reserve_result",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024
"""The longest answer body read from a service; a longer one is a failure, read no further."""
REASON_RETRY: Final = "WEBHOOK_RETRY"
"""The reason of a ``retry`` answer that gives none."""
REASON_REJECTED: Final = "WEBHOOK_REJECTED"
"""The reason of a rejection (a ``rejected`` answer, a 403 or a 422) that gives none."""
REASON_THROTTLED: Final = "WEBHOOK_THROTTLED"
"""The reason of a 429 that gives none."""
_REASON_CHARS: Final = 200
_DETAIL_CHARS: Final = 500

Failure = Literal["timeout", "connection", "status", "body", "body_too_large"]
"""Why a service could not be asked: each is ``RETRY`` / ``CHECK_UNAVAILABLE``, counted."""


class _Failed(Exception):
    """A service that could not be asked (raised and caught inside this module)."""

    def __init__(self, kind: Failure, detail: str) -> None:
        super().__init__(kind, detail)
        self.kind: Failure = kind
        self.detail = detail


def parse_retry_after(value: str | None, now: float) -> int | None:
    """A ``Retry-After`` header in milliseconds from ``now`` (wall-clock seconds): delay
    seconds or an HTTP date (a date in the past is 0). ``None`` when absent or unreadable."""
    if value is None or not (text := value.strip()):
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # HTTP dates are GMT
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0, math.ceil(seconds * 1000))


def reserve_result(
    check: str,
    status: int,
    body: bytes,
    retry_after: str | None,
    *,
    now: float,
    default_retry_ms: int,
    max_retry_ms: int,
) -> CheckResult | Failure:
    """What a service's answer to ``/reserve`` means (the contract in this module's header):
    the check's result, or the :data:`Failure` that makes it ``RETRY`` / unavailable."""

    def retry(reason: str, after_ms: int | None, detail: str = "") -> CheckResult:
        after = default_retry_ms if after_ms is None else after_ms
        return CheckResult(
            check, CheckOutcome.RETRY, reason, detail, retry_after_ms=min(after, max_retry_ms)
        )

    def rejected(fields: Mapping[str, Any], detail: str = "") -> CheckResult:
        reason = _text(fields.get("reason"), _REASON_CHARS) or REASON_REJECTED
        detail = _text(fields.get("detail"), _DETAIL_CHARS) or detail
        return CheckResult(check, CheckOutcome.REJECTED, reason, detail)

    fields = _json_object(body)
    if 200 <= status < 300:
        outcome = fields.get("outcome") if fields is not None else None
        if fields is None or not isinstance(outcome, str):
            return "body"
        match outcome.lower():
            case "ready":
                return CheckResult(check, CheckOutcome.READY)
            case "retry":
                reason = _text(fields.get("reason"), _REASON_CHARS) or REASON_RETRY
                detail = _text(fields.get("detail"), _DETAIL_CHARS)
                return retry(reason, _milliseconds(fields.get("retry_after_ms")), detail)
            case "rejected":
                return rejected(fields)
        return "body"
    if status in (403, 422):
        return rejected(fields or {}, f"HTTP {status}")
    if status in (429, 503):
        reason = _text((fields or {}).get("reason"), _REASON_CHARS)
        reason = reason or (REASON_THROTTLED if status == 429 else CHECK_UNAVAILABLE)
        return retry(reason, parse_retry_after(retry_after, now), f"HTTP {status}")
    return "status"


class WebhookCheck:
    """An :class:`~mesh.checks.base.AdmissionCheck` answered by the service at ``url`` (the
    contract is this module's header). ``counters`` counts answers (``reserve_ready``,
    ``reserve_retry``, ``reserve_rejected``, ``release_ok``), the 429/503 among them
    (``reserve_throttled``) and failures (``reserve_unavailable``, ``release_failed``, and
    ``<reserve|release>_failed_<kind>`` per :data:`Failure` kind)."""

    def __init__(
        self,
        *,
        name: str,
        url: str,
        timeout_s: float = 2.0,
        headers: Mapping[str, str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        default_retry_ms: int = 1000,
        max_retry_ms: int = 300_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.name = name
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.max_body_bytes = max_body_bytes
        self.default_retry_ms = default_retry_ms
        self.max_retry_ms = max_retry_ms
        self.counters: Counter[str] = Counter()
        self._clock = clock  # wall clock: an HTTP-date Retry-After is read against it
        self._session: aiohttp.ClientSession | None = None
        self._failing = False

    def __repr__(self) -> str:
        return f"WebhookCheck(name={self.name!r}, url={self.url!r})"

    async def reserve(self, request: CheckRequest) -> CheckResult:
        body = {
            "admission_id": request.admission_id,
            "pool_id": request.pool_id,
            "tenant": request.tenant,
            "capability": request.capability,
            "estimated_tokens": request.estimated_tokens,
            "run_id": request.run_id,
            "ttl_s": request.ttl_s,
            "labels": dict(request.labels),
        }
        try:
            status, answer, retry_after = await self._post("reserve", request, body)
            result = reserve_result(
                self.name,
                status,
                answer,
                retry_after,
                now=self._clock(),
                default_retry_ms=self.default_retry_ms,
                max_retry_ms=self.max_retry_ms,
            )
            if isinstance(result, str):
                raise _Failed(result, f"HTTP {status}: {_snippet(answer)}")
        except _Failed as failure:
            self._failed("reserve", request, failure)
            return CheckResult(
                self.name,
                CheckOutcome.RETRY,
                CHECK_UNAVAILABLE,
                f"{self.url}/reserve: {failure.kind}: {failure.detail}"[:_DETAIL_CHARS],
                retry_after_ms=min(self.default_retry_ms, self.max_retry_ms),
            )
        self._answered()
        self.counters[f"reserve_{result.outcome.value.lower()}"] += 1
        if status in (429, 503):
            self.counters["reserve_throttled"] += 1
        return result

    async def release(self, request: CheckRequest, usage: Usage | None = None) -> None:
        body = {
            "admission_id": request.admission_id,
            "pool_id": request.pool_id,
            "tenant": request.tenant,
            "capability": request.capability,
            "run_id": request.run_id,
            "estimated_tokens": request.estimated_tokens,
            "tokens": usage.tokens if usage is not None else None,
        }
        try:
            status, answer, _ = await self._post("release", request, body)
            if not 200 <= status < 300:
                raise _Failed("status", f"HTTP {status}: {_snippet(answer)}")
        except _Failed as failure:
            self._failed("release", request, failure)
            return
        self._answered()
        self.counters["release_ok"] += 1

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # ---- the exchange -----------------------------------------------------------------------
    async def _post(
        self, operation: str, request: CheckRequest, body: Mapping[str, object]
    ) -> tuple[int, bytes, str | None]:
        """POST ``body`` to ``{url}/{operation}``: the status, the body (at most
        ``max_body_bytes``) and the ``Retry-After`` header; raises :class:`_Failed`."""
        headers = {**self.headers, "Idempotency-Key": request.admission_id}
        try:
            async with self._client_session().post(
                f"{self.url}/{operation}", json=body, headers=headers, allow_redirects=False
            ) as response:
                answer = await self._read_capped(response)
                return response.status, answer, response.headers.get("Retry-After")
        except TimeoutError as exc:  # aiohttp's own timeouts are TimeoutErrors too
            raise _Failed("timeout", f"no answer within {self.timeout_s} s") from exc
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise _Failed("connection", f"{type(exc).__name__}: {exc}") from exc

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        limit = self.max_body_bytes
        if response.content_length is not None and response.content_length > limit:
            response.close()  # never read, never reused
            raise _Failed("body_too_large", f"{response.content_length} bytes (over {limit})")
        chunks: list[bytes] = []
        size = 0
        while chunk := await response.content.read(limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                response.close()
                raise _Failed("body_too_large", f"over {limit} bytes")
        return b"".join(chunks)

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"Accept": "application/json"},
            )
        return self._session

    # ---- counting and logging ---------------------------------------------------------------
    def _failed(self, operation: str, request: CheckRequest, failure: _Failed) -> None:
        self.counters[f"{operation}_failed_{failure.kind}"] += 1
        self.counters["reserve_unavailable" if operation == "reserve" else "release_failed"] += 1
        if operation == "reserve":
            self.counters["reserve_retry"] += 1
        # One warning when the service starts failing, not one per admission while it is down.
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(
            level,
            "admission check %s: %s failed (%s)",
            self.name,
            operation,
            failure.kind,
            extra={
                "check": self.name,
                "admission_id": request.admission_id,
                "pool_id": request.pool_id,
                "error": failure.detail,
            },
        )

    def _answered(self) -> None:
        if self._failing:
            self._failing = False
            log.info("admission check %s: the service answers again", self.name)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body) if body.strip() else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _text(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _milliseconds(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return max(0, math.ceil(value))


def _snippet(body: bytes) -> str:
    return body[:200].decode("utf-8", "replace")
