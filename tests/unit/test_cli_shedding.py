"""``mesh manager``'s load-shedding knobs: flags and environment into the admission policy."""

from __future__ import annotations

import pytest

from mesh.cli import build_parser
from mesh.cli.manager_options import manager_settings
from mesh.core.pressure import PressurePolicy


def policy(argv: list[str]) -> PressurePolicy:
    return manager_settings(build_parser().parse_args(["manager", *argv])).admission.pressure


def test_the_defaults_are_the_documented_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MESH_SHEDDING", "MESH_SHED_THRESHOLDS", "MESH_LOW_PRIORITY", "MESH_EVICTION"):
        monkeypatch.delenv(name, raising=False)
    assert policy([]) == PressurePolicy()


def test_flags_set_every_knob() -> None:
    got = policy(
        [
            "--shedding=off",
            "--shed-thresholds=0.5,0.6,0.9",
            "--shed-queue-age=2.5",
            "--low-priority=3",
            "--eviction=off",
        ]
    )
    assert got == PressurePolicy(
        enabled=False, thresholds=(0.5, 0.6, 0.9), queue_age_s=2.5, low_priority=3, evict=False
    )


def test_the_environment_sets_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_SHED_THRESHOLDS", "0.6,0.8,1")
    monkeypatch.setenv("MESH_LOW_PRIORITY", "2")
    monkeypatch.setenv("MESH_EVICTION", "off")
    got = policy([])
    assert (got.thresholds, got.low_priority, got.evict) == ((0.6, 0.8, 1.0), 2, False)


@pytest.mark.parametrize(
    "argv",
    [
        ["--shed-thresholds=0.9,0.8,0.95"],  # not ascending
        ["--shed-thresholds=0.7,0.85"],  # two
        ["--shed-thresholds=0,0.5,0.9"],  # zero
        ["--shed-thresholds=a,b,c"],
        ["--shedding=maybe"],
        ["--low-priority=10"],
    ],
)
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["manager", *argv])
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["manager"], ["agent", "echo"]])
def test_the_liveness_probe_is_off_by_default_and_set_by_flag_or_environment(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MESH_LIVENESS_PROBE_S", raising=False)
    assert build_parser().parse_args(command).liveness_probe is None
    assert build_parser().parse_args([*command, "--liveness-probe=2.5"]).liveness_probe == 2.5
    assert build_parser().parse_args([*command, "--liveness-probe=0"]).liveness_probe is None
    monkeypatch.setenv("MESH_LIVENESS_PROBE_S", "4")
    assert build_parser().parse_args(command).liveness_probe == 4.0


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_liveness_probe_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["manager", f"--liveness-probe={value}"])
