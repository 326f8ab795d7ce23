"""``mesh broker`` and ``mesh agent --shared-topology``: arguments and usage errors, without a
broker (the management API calls are exercised in tests/integration/test_agent_permissions.py).
"""

from __future__ import annotations

import pytest

from mesh.cli import build_parser, main


def test_an_agent_checks_or_declares_the_shared_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_SHARED_TOPOLOGY", raising=False)
    assert build_parser().parse_args(["agent", "calc"]).shared_topology == "declare"
    args = build_parser().parse_args(["agent", "calc", "--shared-topology", "check"])
    assert args.shared_topology == "check"
    monkeypatch.setenv("MESH_SHARED_TOPOLOGY", "check")
    assert build_parser().parse_args(["agent", "calc"]).shared_topology == "check"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "calc", "--shared-topology", "sometimes"])


def test_add_agent_needs_a_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "add-agent", "calc-1"]) == 2
    assert "--pool" in capsys.readouterr().err


def test_add_agent_takes_one_pool_and_add_pool_agents_one_or_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["broker", "add-agent", "calc-1", "--pool", "calc", "--pool", "echo"]) == 2
    assert "one --pool" in capsys.readouterr().err
    assert main(["broker", "add-pool-agents", "mesh-agents-calc"]) == 2
    assert "--pool" in capsys.readouterr().err
    args = build_parser().parse_args(
        ["broker", "add-pool-agents", "mesh-agents", "--pool", "calc", "--pool", "echo"]
    )
    assert (args.action, args.agent_id, args.pool) == (
        "add-pool-agents",
        "mesh-agents",
        ["calc", "echo"],
    )


def test_an_unset_password_variable_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MESH_TEST_NO_SUCH_PASSWORD", raising=False)
    argv = ["broker", "add-agent", "calc-1", "--pool", "calc"]
    assert main([*argv, "--password-env", "MESH_TEST_NO_SUCH_PASSWORD"]) == 2
    assert "MESH_TEST_NO_SUCH_PASSWORD" in capsys.readouterr().err


def test_an_unreachable_management_api_is_one_clear_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "http://guest:guest@127.0.0.1:9"  # discard: nothing answers
    assert main(["broker", "remove-agent", "calc-1", "--management-url", url]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the RabbitMQ management API" in err and "guest:guest" not in err


def test_a_management_url_must_be_http(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "remove-agent", "x", "--management-url", "amqp://h:5672"]) == 1
    assert "not a management API URL" in capsys.readouterr().err
