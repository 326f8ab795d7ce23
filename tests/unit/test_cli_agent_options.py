"""``mesh agent``'s options come from one table (mesh.cli.agent_options): every AgentSettings
field is reachable from it or listed as deliberately not, and each environment variable is
its flag's default."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from mesh.agent.settings import AgentSettings
from mesh.cli import build_parser
from mesh.cli.agent_options import (
    AGENT_OPTIONS,
    FROM_SHARED_OPTIONS,
    NOT_FROM_THE_CLI,
    agent_settings,
)


def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in AGENT_OPTIONS:
        if option.env is not None:
            monkeypatch.delenv(option.env, raising=False)
    for name in ("MESH_AMQP_URL", "MESH_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)


def settings_from(argv: list[str]) -> AgentSettings:
    return agent_settings(build_parser().parse_args(["agent", "echo", *argv]))


def test_every_setting_is_an_option_or_deliberately_not() -> None:
    in_table = {o.setting for o in AGENT_OPTIONS} | set(FROM_SHARED_OPTIONS)
    fields = {f.name for f in dataclasses.fields(AgentSettings)}
    assert sorted(fields - in_table - set(NOT_FROM_THE_CLI)) == []
    assert not in_table & set(NOT_FROM_THE_CLI)
    assert set(NOT_FROM_THE_CLI) <= fields  # no reason kept for a setting that is gone


def test_no_flags_give_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    clean(monkeypatch)
    assert settings_from([]) == AgentSettings()


@pytest.mark.parametrize("option", [o for o in AGENT_OPTIONS if o.env], ids=lambda o: o.flag)
def test_each_environment_variable_is_the_flags_default_and_its_help_says_so(
    option: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean(monkeypatch)
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    agent = commands.choices["agent"]  # type: ignore[attr-defined]
    assert f"env {option.env}" in " ".join(agent.format_help().split())
    without = getattr(parser.parse_args(["agent", "echo"]), option.dest)
    values = {
        "--heartbeat-interval": "7",
        "--shared-topology": "check",
        "--open-tasks": "on",
        "--liveness-probe": "7",
        "--http-port": "9000",
    }
    monkeypatch.setenv(option.env, values.get(option.flag, "from-the-environment"))
    assert getattr(build_parser().parse_args(["agent", "echo"]), option.dest) != without


def test_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clean(monkeypatch)
    got = settings_from(
        [
            "--drain-timeout", "12", "--lease-public-key", "a.pub", "--lease-public-key",
            "b.pub", "--open-tasks", "--manager-user", "boss", "--liveness-probe", "3",
            "--http-port", "0", "--shared-topology", "check",
        ]
    )  # fmt: skip
    assert got.drain_timeout_s == 12.0
    assert got.lease_public_keys == (Path("a.pub"), Path("b.pub"))
    assert (got.open_tasks, got.manager_user, got.liveness_probe_s) == (True, "boss", 3.0)
    assert (got.http_port, got.shared_topology) == (0, "check")
