"""``mesh demo``'s options come from one table (mesh.cli.demo_options): every DemoSettings
field is reachable from it or listed as deliberately not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mesh.cli import build_parser
from mesh.cli.demo_options import DEMO_OPTIONS, FROM_SHARED_OPTIONS, NOT_FROM_THE_CLI, demo_settings
from mesh.demo import DemoSettings


def settings_from(argv: list[str]) -> DemoSettings:
    return demo_settings(build_parser().parse_args(["demo", *argv]))


def test_every_setting_is_an_option_or_deliberately_not() -> None:
    in_table = {o.setting for o in DEMO_OPTIONS} | set(FROM_SHARED_OPTIONS)
    fields = {f.name for f in dataclasses.fields(DemoSettings)}
    assert sorted(fields - in_table - set(NOT_FROM_THE_CLI)) == []
    assert not in_table & set(NOT_FROM_THE_CLI)
    assert set(NOT_FROM_THE_CLI) <= fields


def test_no_flags_give_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MESH_AMQP_URL", "MESH_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    assert settings_from([]) == DemoSettings()


def test_flags_reach_the_settings() -> None:
    got = settings_from(
        ["--duration", "0", "--concurrency", "9", "--producer-only", "--work-dir", "/tmp/d"]
    )
    assert (got.duration_s, got.concurrency, got.producer_only) == (0.0, 9, True)
    assert got.work_dir == Path("/tmp/d")
