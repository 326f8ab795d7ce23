"""Shared budgets in Redis: provider rpm/tpm, tool concurrency and tenants' daily tokens, taken
all or nothing by one Lua script.

Theory of operation
-------------------
Every manager of a namespace points its :class:`RedisBudgetCheck` at one Redis, so a limit is
shared exactly, whichever manager admits. A check holds one or more :class:`BudgetLimit`:

* ``rpm`` / ``tpm`` — requests and tokens per minute of a model provider, counted in **fixed**
  60 s windows (key ``<prefix>rpm:<scope>:<minute>``, the minute since the epoch): exact, and
  a refusal's retry time is the rest of the minute;
* ``concurrency`` — sessions of a tool held at once: a sorted set ``<prefix>concurrency:<scope>``
  of admission IDs scored by when their hold expires (now + the request's ``ttl_s``), so a
  crashed manager's holds lapse by themselves; a refusal retries after ``concurrency_retry_ms``;
* ``daily_tokens`` — a tenant's tokens per UTC day (``<prefix>daily:<scope>:<tenant>:<day>``).

Windows are read from Redis's own clock (``TIME``), so managers with skewed clocks agree; a
test may pass a clock instead. The reserve script checks every limit first and moves counters
only when all fit, so a refusal leaves nothing half-taken; what it took is recorded under the
admission's key (``<prefix>admission:<check>:<admission id>``, expiring after ``ttl_s``). A
second reserve for the same admission finds the record and takes nothing more. The release
script gives back the concurrency, and settles the windows by how the admission ended:

* it never ran (``usage=None``: compensated, refused, expired before ACTIVE): the request and
  its estimate are given back too;
* it ran (``Usage(tokens=n)``): the request stays counted and the actual tokens replace the
  estimate; ``Usage(tokens=None)`` (ran, tokens unknown) leaves the estimate charged.

A surplus is charged to the current window; a saving is given back only to the window that
was charged, while it is still current (a past minute no longer limits anyone), and never
below zero. A record that expires leaves its windows charged at the estimate (nothing said
otherwise) and its concurrency lapses with it.

Redis down or slow is ``RETRY`` / :data:`~mesh.checks.base.CHECK_UNAVAILABLE`; release
failures are counted and logged (the TTLs clean up). One standalone Redis (the script
derives window keys, which Redis Cluster forbids).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from mesh.checks.base import CHECK_UNAVAILABLE, CheckOutcome, CheckRequest, CheckResult, Usage
from mesh.wire.reasons import Reason

__all__ = ["BudgetLimit", "LimitKind", "RedisBudgetCheck", "default_key_prefix"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.5
DEFAULT_CONCURRENCY_RETRY_MS = 1000


class LimitKind(StrEnum):
    RPM = "rpm"  # requests per minute of a provider
    TPM = "tpm"  # tokens per minute of a provider
    CONCURRENCY = "concurrency"  # sessions of a tool held at once
    DAILY_TOKENS = "daily_tokens"  # a tenant's tokens per UTC day


_TOKEN_KINDS = frozenset({LimitKind.TPM, LimitKind.DAILY_TOKENS})


@dataclass(frozen=True, slots=True)
class BudgetLimit:
    """One limit: ``limit`` of ``kind`` for ``scope`` (a provider, a tool or a budget name)."""

    kind: LimitKind
    scope: str
    limit: int

    def base_key(self, prefix: str, tenant: str) -> str:
        if self.kind is LimitKind.DAILY_TOKENS:
            return f"{prefix}daily:{self.scope}:{tenant}"
        return f"{prefix}{self.kind.value}:{self.scope}"

    def cost(self, request: CheckRequest) -> int:
        return max(0, request.estimated_tokens) if self.kind in _TOKEN_KINDS else 1

    @property
    def reason(self) -> Reason:
        return Reason.TENANT_BUDGET if self.kind is LimitKind.DAILY_TOKENS else Reason.CAPACITY

    def describe(self) -> str:
        unit = {
            LimitKind.RPM: "requests per minute",
            LimitKind.TPM: "tokens per minute",
            LimitKind.CONCURRENCY: "concurrent sessions",
            LimitKind.DAILY_TOKENS: "tokens per day and tenant",
        }[self.kind]
        return f"{self.scope}: {self.limit} {unit}"


def default_key_prefix(namespace: str) -> str:
    """``mesh:<namespace>:budget:``, the prefix of every key a namespace's budgets use."""
    return f"mesh:{namespace}:budget:"


# KEYS[1]: the admission's record; KEYS[1 + i]: limit i's base key.
# ARGV: admission ID, now in ms (0: Redis's clock), ttl ms, concurrency retry ms, then per
# limit i: kind, limit, cost. Returns {outcome, limit index, retry ms, current count}.
_RESERVE = """
local record = KEYS[1]
if redis.call('EXISTS', record) == 1 then
  return {'READY', 0, 0, 0}
end
local id = ARGV[1]
local now = tonumber(ARGV[2])
if now <= 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local ttl = tonumber(ARGV[3])
local conc_retry = tonumber(ARGV[4])
local n = #KEYS - 1
local keys, costs, kinds, ends = {}, {}, {}, {}
local refusal = nil
for i = 1, n do
  local kind = ARGV[2 + 3 * i]
  local limit = tonumber(ARGV[3 + 3 * i])
  local cost = tonumber(ARGV[4 + 3 * i])
  local key, current
  if kind == 'concurrency' then
    key = KEYS[1 + i]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    current = redis.call('ZCARD', key)
    ends[i] = now + conc_retry
  else
    local width = 60000
    if kind == 'daily_tokens' then width = 86400000 end
    local window = math.floor(now / width)
    key = KEYS[1 + i] .. ':' .. string.format('%d', window)
    current = tonumber(redis.call('GET', key) or '0')
    ends[i] = (window + 1) * width
  end
  keys[i], costs[i], kinds[i] = key, cost, kind
  if cost > limit then
    return {'REJECTED', i, 0, current}
  end
  if cost > 0 and current + cost > limit then
    local wait = ends[i] - now
    if refusal == nil or wait > refusal[3] then refusal = {'RETRY', i, wait, current} end
  end
end
if refusal ~= nil then return refusal end
redis.call('HSET', record, 'n', n, 'id', id)
for i = 1, n do
  if kinds[i] == 'concurrency' then
    redis.call('ZADD', keys[i], now + ttl, id)
    local last = redis.call('ZRANGE', keys[i], -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', keys[i], math.max(1, tonumber(last[2]) - now + 1000))
  elseif costs[i] > 0 then
    redis.call('INCRBY', keys[i], costs[i])
    redis.call('PEXPIRE', keys[i], ends[i] - now + 60000)
  end
  redis.call('HSET', record, 't' .. i, kinds[i], 'b' .. i, KEYS[1 + i], 'k' .. i, keys[i],
             'c' .. i, costs[i])
end
redis.call('PEXPIRE', record, ttl)
return {'READY', 0, 0, 1}
"""

# KEYS[1]: the admission's record. ARGV: actual tokens (-2: it never ran, give everything back;
# -1: it ran, tokens not reported), now in ms (0: Redis's clock). Returns 1 when it released
# something, 0 when there was nothing to release.
_RELEASE = """
local record = KEYS[1]
local fields = redis.call('HGETALL', record)
if #fields == 0 then return 0 end
local h = {}
for j = 1, #fields, 2 do h[fields[j]] = fields[j + 1] end
local actual = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
if now <= 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
for i = 1, tonumber(h['n']) do
  local kind, key, cost = h['t' .. i], h['k' .. i], tonumber(h['c' .. i])
  if kind == 'concurrency' then
    redis.call('ZREM', key, h['id'])
  else
    local delta = 0
    if actual == -2 then
      delta = -cost
    elseif actual >= 0 and kind ~= 'rpm' then
      delta = actual - cost
    end
    local width = 60000
    if kind == 'daily_tokens' then width = 86400000 end
    local window = math.floor(now / width)
    local current = h['b' .. i] .. ':' .. string.format('%d', window)
    if delta > 0 then
      redis.call('INCRBY', current, delta)
      redis.call('PEXPIRE', current, (window + 1) * width - now + 60000)
    elseif delta < 0 and current == key then
      local held = tonumber(redis.call('GET', key) or '0')
      local give = math.min(-delta, held)
      if give > 0 then redis.call('DECRBY', key, give) end
    end
  end
end
redis.call('DEL', record)
return 1
"""


class _Script:
    """A Lua script run by ``EVALSHA``, loaded once (and again after ``NOSCRIPT``: a restarted
    or flushed Redis)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    async def __call__(self, client: Redis, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


_RESERVE_SCRIPT = _Script(_RESERVE)
_RELEASE_SCRIPT = _Script(_RELEASE)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBudgetCheck:
    """An :class:`~mesh.checks.base.AdmissionCheck` taking ``limits`` in one Redis, all or none.

    ``clock`` (epoch seconds) replaces Redis's clock for the windows, for tests. ``timeout_s``
    bounds each call (Redis down or slow: ``RETRY`` / ``CHECK_UNAVAILABLE``)."""

    def __init__(
        self,
        name: str,
        limits: Sequence[BudgetLimit],
        client: Redis,
        *,
        key_prefix: str = "mesh:budget:",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        concurrency_retry_ms: int = DEFAULT_CONCURRENCY_RETRY_MS,
        clock: Callable[[], float] | None = None,
        owns_client: bool = False,
    ) -> None:
        if not limits:
            raise ValueError(f"budget check {name!r} has no limits")
        self._name = name
        self.limits = tuple(limits)
        self._client = client
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._concurrency_retry_ms = concurrency_retry_ms
        self._clock = clock
        self._owns_client = owns_client
        self.unavailable = 0  # reserves answered CHECK_UNAVAILABLE
        self.release_failures = 0  # releases that could not reach Redis (the TTLs clean up)

    @classmethod
    def from_url(
        cls,
        name: str,
        limits: Sequence[BudgetLimit],
        url: str,
        *,
        key_prefix: str = "mesh:budget:",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        concurrency_retry_ms: int = DEFAULT_CONCURRENCY_RETRY_MS,
        clock: Callable[[], float] | None = None,
    ) -> RedisBudgetCheck:
        """A check with a connection pool of its own to ``url`` (closed by :meth:`aclose`).
        No client-side retries: a failed call is a RETRY answer, retried by the producer."""
        client = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        return cls(
            name,
            limits,
            client,
            key_prefix=key_prefix,
            timeout_s=timeout_s,
            concurrency_retry_ms=concurrency_retry_ms,
            clock=clock,
            owns_client=True,
        )

    @property
    def name(self) -> str:
        return self._name

    def record_key(self, admission_id: str) -> str:
        return f"{self._prefix}admission:{self._name}:{admission_id}"

    def _now_ms(self) -> int:
        return 0 if self._clock is None else int(self._clock() * 1000)

    async def reserve(self, request: CheckRequest) -> CheckResult:
        keys = [self.record_key(request.admission_id)]
        args: list[str | int] = [
            request.admission_id,
            self._now_ms(),
            max(1, int(request.ttl_s * 1000)),
            self._concurrency_retry_ms,
        ]
        for limit in self.limits:
            keys.append(limit.base_key(self._prefix, request.tenant))
            args += [limit.kind.value, limit.limit, limit.cost(request)]
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await _RESERVE_SCRIPT(self._client, keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.unavailable += 1
            log.warning(
                "budget check %s: Redis unavailable: %r",
                self._name,
                exc,
                extra={"admission_id": request.admission_id, "check": self._name},
            )
            return CheckResult(
                self._name,
                CheckOutcome.RETRY,
                CHECK_UNAVAILABLE,
                f"Redis did not answer: {type(exc).__name__}",
                retry_after_ms=self._concurrency_retry_ms,
            )
        return self._result(request, answer)

    def _result(self, request: CheckRequest, answer: Sequence[Any]) -> CheckResult:
        outcome = CheckOutcome(_text(answer[0]))
        if outcome is CheckOutcome.READY:
            replayed = int(answer[3]) == 0
            return CheckResult(self._name, outcome, detail="replayed" if replayed else "taken")
        limit = self.limits[int(answer[1]) - 1]
        asks, current = limit.cost(request), int(answer[3])
        if outcome is CheckOutcome.REJECTED:
            return CheckResult(
                self._name,
                outcome,
                limit.reason,
                f"asks {asks}, above the whole limit of {limit.describe()}",
            )
        return CheckResult(
            self._name,
            outcome,
            limit.reason,
            f"asks {asks} with {current} taken of {limit.describe()}",
            retry_after_ms=max(1, int(answer[2])),
        )

    async def release(self, request: CheckRequest, usage: Usage | None = None) -> None:
        if usage is None:
            actual = -2  # it never ran: everything it took goes back
        else:
            actual = -1 if usage.tokens is None else max(0, usage.tokens)
        keys = [self.record_key(request.admission_id)]
        try:
            async with asyncio.timeout(self._timeout_s):
                await _RELEASE_SCRIPT(self._client, keys, [actual, self._now_ms()])
        except (RedisError, OSError, TimeoutError) as exc:
            self.release_failures += 1
            log.warning(
                "budget check %s: release failed (its TTL will free it): %r",
                self._name,
                exc,
                extra={"admission_id": request.admission_id, "check": self._name},
            )

    async def aclose(self) -> None:
        """Close the connection pool, if this check opened it (:meth:`from_url`)."""
        if self._owns_client:
            await self._client.aclose()
