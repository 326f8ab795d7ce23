"""``mesh manager``'s options come from one table (mesh.cli.manager_options): every setting is
reachable from it or listed as deliberately not, and the table's flags, environment variables
and defaults are what the parser and the settings do."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mesh.cli import build_parser
from mesh.cli.manager_options import (
    FROM_SHARED_OPTIONS,
    MANAGER_OPTIONS,
    NOT_FROM_THE_CLI,
    manager_settings,
)
from mesh.manager.settings import ManagerSettings


def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in MANAGER_OPTIONS:
        if option.env is not None:
            monkeypatch.delenv(option.env, raising=False)
    for name in ("MESH_AMQP_URL", "MESH_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)


def settings_from(argv: list[str]) -> ManagerSettings:
    return manager_settings(build_parser().parse_args(["manager", *argv]))


def covered(path: str, value: Any) -> bool:
    """The setting at ``path`` is set by an option, listed as not, or all its parts are."""
    in_table = {o.setting for o in MANAGER_OPTIONS} | set(FROM_SHARED_OPTIONS)
    parent = path.rpartition(".")[0]
    if path in in_table or path in NOT_FROM_THE_CLI or f"{parent}.*" in NOT_FROM_THE_CLI:
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(
            covered(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return False


def test_every_setting_is_an_option_or_deliberately_not() -> None:
    defaults = ManagerSettings()
    missing = [
        f.name
        for f in dataclasses.fields(ManagerSettings)
        if not covered(f.name, getattr(defaults, f.name))
    ]
    assert missing == []
    assert not {o.setting for o in MANAGER_OPTIONS} & set(NOT_FROM_THE_CLI)


def test_no_flags_give_the_settings_defaults_but_the_status_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean(monkeypatch)
    assert settings_from([]) == ManagerSettings(http_port=8090)


@pytest.mark.parametrize("option", [o for o in MANAGER_OPTIONS if o.env], ids=lambda o: o.flag)
def test_each_environment_variable_is_the_flags_default_and_its_help_says_so(
    option: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean(monkeypatch)
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    manager = commands.choices["manager"]  # type: ignore[attr-defined]
    assert f"env {option.env}" in " ".join(manager.format_help().split())
    without = getattr(parser.parse_args(["manager"]), option.dest)
    values = {
        "--liveness-probe": "7",
        "--shards": "4",
        "--shard-lease": "12",
        "--agent-identity": "on",
        "--http-port": "9000",
        "--shedding": "off",
        "--shed-thresholds": "0.5,0.6,0.7",
        "--shed-queue-age": "9",
        "--shed-hysteresis": "0.2",
        "--shed-min-dwell": "4",
        "--low-priority": "3",
        "--eviction": "off",
        "--lease-ttl": "30",
        "--admission-capacity": "descriptor",
        "--scaler": "local",
    }
    monkeypatch.setenv(option.env, values.get(option.flag, "from-the-environment"))
    assert getattr(build_parser().parse_args(["manager"]), option.dest) != without


def test_flags_reach_nested_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clean(monkeypatch)
    got = settings_from(
        ["--lease-ttl", "30", "--shards", "4", "--http-port", "-1", "--management-url", ""]
    )
    assert got.admission.lease_ttl_s == 30.0
    assert (got.shard_count, got.http_port, got.management_url) == (4, None, None)
    assert settings_from(["--shards", "0"]).shard_count is None
