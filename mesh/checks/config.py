"""The checks file (``--checks FILE``, JSON): which admission checks exist and which pools use
them, and the check objects built from it.

An example::

    {"checks": {
       "openai": {"type": "redis_budget", "redis_url": "redis://127.0.0.1:6379/0",
                  "limits": [{"kind": "rpm", "scope": "openai", "limit": 500},
                             {"kind": "tpm", "scope": "openai", "limit": 90000},
                             {"kind": "daily_tokens", "scope": "tenants", "limit": 2000000}]},
       "browser": {"type": "redis_budget",
                   "limits": [{"kind": "concurrency", "scope": "browser", "limit": 20}]},
       "approval": {"type": "webhook", "url": "https://approve.example/check",
                    "timeout_s": 2, "headers": {"Authorization": "Bearer ..."}}},
     "pools": {"research": ["approval", "browser", "openai"]}}

Check names are the keys of ``checks`` (they are also the global order checks are asked in);
every name a pool lists must exist. Unknown fields are errors, so a typo cannot pass for a
default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mesh.checks.base import AdmissionCheck
from mesh.checks.redis_budget import (
    DEFAULT_CONCURRENCY_RETRY_MS,
    DEFAULT_TIMEOUT_S,
    BudgetLimit,
    LimitKind,
    RedisBudgetCheck,
    default_key_prefix,
)
from mesh.checks.runner import DEFAULT_CHECK_TIMEOUT_S, CheckRunner, runners_by_pool
from mesh.errors import LocalProtocolError

__all__ = [
    "BudgetLimitSpec",
    "BuiltChecks",
    "ChecksFile",
    "RedisBudgetSpec",
    "WebhookSpec",
    "build_checks",
    "load_checks_file",
]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class BudgetLimitSpec(BaseModel):
    """One limit of a Redis budget (:class:`~mesh.checks.redis_budget.BudgetLimit`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: LimitKind
    scope: str = Field(min_length=1)  # the provider, the tool or the budget's name
    limit: int = Field(ge=0)

    def limit_object(self) -> BudgetLimit:
        return BudgetLimit(self.kind, self.scope, self.limit)


class RedisBudgetSpec(BaseModel):
    """Shared limits in Redis, taken all or nothing for each admission."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["redis_budget"]
    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str | None = None  # default: mesh:<namespace>:budget:
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    concurrency_retry_ms: int = Field(default=DEFAULT_CONCURRENCY_RETRY_MS, ge=1)
    limits: tuple[BudgetLimitSpec, ...] = Field(min_length=1)


class WebhookSpec(BaseModel):
    """An external service asked over HTTP (:class:`mesh.checks.webhook.WebhookCheck`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["webhook"]
    url: str = Field(min_length=1)
    timeout_s: float = Field(default=2.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)


CheckSpec = Annotated[RedisBudgetSpec | WebhookSpec, Field(discriminator="type")]


class ChecksFile(BaseModel):
    """The checks file: the checks by name, and the pools' lists of check names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checks: dict[str, CheckSpec]
    pools: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    check_timeout_s: float = Field(default=DEFAULT_CHECK_TIMEOUT_S, gt=0)  # per check, per call

    @model_validator(mode="after")
    def _pools_name_known_checks(self) -> ChecksFile:
        for pool, names in self.pools.items():
            unknown = sorted(set(names) - set(self.checks))
            if unknown:
                raise ValueError(f"pool {pool!r} uses unknown checks {unknown}")
            if len(set(names)) != len(names):
                raise ValueError(f"pool {pool!r} lists a check twice: {list(names)}")
        if "" in self.checks:
            raise ValueError("a check needs a name")
        return self


def load_checks_file(path: Path) -> ChecksFile:
    """Read a checks file (JSON). Raises :class:`LocalProtocolError` naming the file and, for
    each mistake, where it is (``checks.openai.limits.0.limit``) and why."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LocalProtocolError(f"bad checks file {path}: {exc}") from None
    try:
        return ChecksFile.model_validate_json(raw)
    except ValidationError as exc:
        mistakes = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in exc.errors()
        )
        raise LocalProtocolError(f"bad checks file {path}: {mistakes}") from None


@dataclass(frozen=True, slots=True)
class BuiltChecks:
    """The check objects of a checks file and each pool's runner; :meth:`aclose` closes the
    checks' connections."""

    checks: tuple[AdmissionCheck, ...]
    runners: Mapping[str, CheckRunner]

    def runner_for(self, pool_id: str) -> CheckRunner | None:
        """The pool's runner, or ``None`` when the pool has no checks."""
        return self.runners.get(pool_id)

    async def aclose(self) -> None:
        for check in self.checks:
            if isinstance(check, RedisBudgetCheck):
                await check.aclose()
            else:
                close = getattr(check, "close", None)
                if close is not None:
                    await close()


def _build_one(name: str, spec: RedisBudgetSpec | WebhookSpec, namespace: str) -> AdmissionCheck:
    if isinstance(spec, RedisBudgetSpec):
        return RedisBudgetCheck.from_url(
            name,
            [limit.limit_object() for limit in spec.limits],
            spec.redis_url,
            key_prefix=spec.key_prefix or default_key_prefix(namespace),
            timeout_s=spec.timeout_s,
            concurrency_retry_ms=spec.concurrency_retry_ms,
        )
    # Imported here: the webhook check brings aiohttp, only needed when one is configured.
    from mesh.checks.webhook import WebhookCheck

    return WebhookCheck(name=name, url=spec.url, timeout_s=spec.timeout_s, headers=spec.headers)


def build_checks(config: ChecksFile, namespace: str) -> BuiltChecks:
    """The check objects of ``config`` (Redis keys under ``mesh:<namespace>:budget:`` unless
    a check names its own prefix) and one runner per pool. Connects lazily: nothing is asked
    until the first admission."""
    checks = tuple(_build_one(name, spec, namespace) for name, spec in config.checks.items())
    runners = runners_by_pool(checks, config.pools, timeout_s=config.check_timeout_s)
    return BuiltChecks(checks, runners)
