"""The checks file: its model, its mistakes, and the checks and runners built from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mesh.checks.config import (
    ChecksFile,
    RedisBudgetSpec,
    WebhookSpec,
    build_checks,
    load_checks_file,
)
from mesh.checks.redis_budget import BudgetLimit, LimitKind, RedisBudgetCheck
from mesh.errors import LocalProtocolError

EXAMPLE: dict[str, Any] = {
    "checks": {
        "openai": {
            "type": "redis_budget",
            "redis_url": "redis://127.0.0.1:6379/3",
            "limits": [
                {"kind": "rpm", "scope": "openai", "limit": 500},
                {"kind": "tpm", "scope": "openai", "limit": 90000},
                {"kind": "daily_tokens", "scope": "tenants", "limit": 2000000},
            ],
        },
        "browser": {
            "type": "redis_budget",
            "key_prefix": "custom:",
            "limits": [{"kind": "concurrency", "scope": "browser", "limit": 20}],
        },
        "approval": {
            "type": "webhook",
            "url": "http://127.0.0.1:9/check",
            "timeout_s": 1.5,
            "headers": {"Authorization": "Bearer x"},
        },
    },
    "pools": {"research": ["openai", "approval", "browser"], "cheap": ["browser"]},
}


def write(tmp_path: Path, content: dict[str, Any] | str) -> Path:
    path = tmp_path / "checks.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_checks_file_loads_into_typed_specs(tmp_path: Path) -> None:
    config = load_checks_file(write(tmp_path, EXAMPLE))

    openai = config.checks["openai"]
    assert isinstance(openai, RedisBudgetSpec)
    assert [(lim.kind, lim.scope, lim.limit) for lim in openai.limits] == [
        (LimitKind.RPM, "openai", 500),
        (LimitKind.TPM, "openai", 90000),
        (LimitKind.DAILY_TOKENS, "tenants", 2000000),
    ]
    approval = config.checks["approval"]
    assert isinstance(approval, WebhookSpec)
    assert (approval.url, approval.timeout_s, approval.headers) == (
        "http://127.0.0.1:9/check",
        1.5,
        {"Authorization": "Bearer x"},
    )
    assert config.pools["research"] == ("openai", "approval", "browser")


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda c: c["checks"]["openai"].update(ttl=3), "checks.openai.redis_budget.ttl"),
        (lambda c: c["checks"]["openai"]["limits"][0].update(kind="rph"), "kind"),
        (lambda c: c["checks"]["openai"]["limits"][0].update(limit=-1), "limit"),
        (lambda c: c["checks"]["openai"].update(limits=[]), "limits"),
        (lambda c: c["checks"]["approval"].update(type="grpc"), "checks.approval"),
        (lambda c: c["checks"]["approval"].update(timeout_s=0), "timeout_s"),
        (lambda c: c["pools"].update(other=["nope"]), "unknown checks ['nope']"),
        (lambda c: c["pools"].update(other=["browser", "browser"]), "lists a check twice"),
        (lambda c: c.update(extra=1), "extra"),
    ],
)
def test_a_mistake_is_an_error_naming_the_file_and_where(
    tmp_path: Path, mutate: Any, where: str
) -> None:
    content = json.loads(json.dumps(EXAMPLE))
    mutate(content)
    path = write(tmp_path, content)

    with pytest.raises(LocalProtocolError, match="bad checks file") as caught:
        load_checks_file(path)

    assert str(path) in str(caught.value)
    assert where in str(caught.value)


def test_a_missing_or_unreadable_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError, match="bad checks file"):
        load_checks_file(tmp_path / "missing.json")
    with pytest.raises(LocalProtocolError, match="bad checks file"):
        load_checks_file(write(tmp_path, "{not json"))


async def test_build_checks_makes_each_check_and_a_runner_per_pool_in_name_order() -> None:
    from mesh.checks.webhook import WebhookCheck

    built = build_checks(ChecksFile.model_validate(EXAMPLE), namespace="ns1")
    try:
        by_name = {check.name: check for check in built.checks}
        openai, browser = by_name["openai"], by_name["browser"]
        assert isinstance(openai, RedisBudgetCheck) and isinstance(browser, RedisBudgetCheck)
        assert openai.limits == (
            BudgetLimit(LimitKind.RPM, "openai", 500),
            BudgetLimit(LimitKind.TPM, "openai", 90000),
            BudgetLimit(LimitKind.DAILY_TOKENS, "tenants", 2000000),
        )
        assert openai.record_key("a1") == "mesh:ns1:budget:admission:openai:a1"
        assert browser.record_key("a1") == "custom:admission:browser:a1"
        approval = by_name["approval"]
        assert isinstance(approval, WebhookCheck)
        assert (approval.url, approval.timeout_s) == ("http://127.0.0.1:9/check", 1.5)
        research = built.runner_for("research")
        assert research is not None and research.names == ("approval", "browser", "openai")
        assert built.runner_for("unlisted") is None
    finally:
        await built.aclose()


def test_limit_keys_are_per_scope_and_the_daily_budget_per_tenant() -> None:
    prefix = "mesh:ns:budget:"
    assert BudgetLimit(LimitKind.RPM, "openai", 1).base_key(prefix, "t1") == (
        "mesh:ns:budget:rpm:openai"
    )
    assert BudgetLimit(LimitKind.CONCURRENCY, "browser", 1).base_key(prefix, "t1") == (
        "mesh:ns:budget:concurrency:browser"
    )
    assert BudgetLimit(LimitKind.DAILY_TOKENS, "all", 1).base_key(prefix, "t1") == (
        "mesh:ns:budget:daily:all:t1"
    )
