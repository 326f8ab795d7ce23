"""The conformance kit (``mesh conformance``) on the real broker: the Python sample agent
passes every check, and an agent with one defect fails exactly the check for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mesh.conformance import CHECK_KEYS, KitSettings, run

HERE = Path(__file__).parent


@pytest.mark.timeout(240)  # twelve checks, the fence's 15 s freeze among them
async def test_the_python_sample_agent_passes_every_check(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    lines: list[str] = []
    results = await run(
        KitSettings(
            agent_cmd=f"{sys.executable} -m mesh agent echo",
            amqp_url=amqp_url,
            namespace=namespace,
            work_dir=tmp_path,
        ),
        lines.append,
    )
    print("\n".join(lines))
    assert [r.key for r in results] == list(CHECK_KEYS)
    assert [r.key for r in results if not r.passed] == [], "\n".join(lines)
    assert lines[-1] == f"{len(CHECK_KEYS)} of {len(CHECK_KEYS)} checks passed"
    # The kit cleans up after itself: nothing of its namespace is left on the broker.
    assert management_api.list_names("queues", f"{namespace}.") == []
    assert management_api.list_names("exchanges", f"{namespace}.") == []


@pytest.mark.parametrize(
    ("defect", "check"),
    [
        ("revocations", "grants"),
        ("drain", "drain"),
        ("hand-over", "hand-over"),
        ("signed", "signed"),
        ("pool-queue", "pool-queue"),
        ("seq-leap", "forged-heartbeat"),
        ("trace", "trace-context"),
    ],
)
async def test_an_agent_with_a_defect_fails_its_check(
    amqp_url: str, namespace: str, tmp_path: Path, defect: str, check: str
) -> None:
    lines: list[str] = []
    results = await run(
        KitSettings(
            agent_cmd=f"{sys.executable} {HERE / 'broken_agent.py'} {defect}",
            amqp_url=amqp_url,
            namespace=namespace,
            work_dir=tmp_path,
            only=(check,),
        ),
        lines.append,
    )
    print("\n".join(lines))
    assert [(r.key, r.passed) for r in results] == [("register", True), (check, False)]


def test_the_command_fails_an_agent_whose_heartbeats_do_not_count_up(
    amqp_url: str, namespace: str
) -> None:
    """Through the CLI, as a user runs it: a line per check, a summary, exit code 1."""
    done = subprocess.run(
        [
            sys.executable, "-m", "mesh", "--amqp-url", amqp_url, "--namespace", namespace,
            "conformance", "--check", "heartbeats",
            "--agent-cmd", f"{sys.executable} {HERE / 'broken_agent.py'} seq",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert any(line.startswith("PASS  [register]") for line in lines), done.stdout
    assert any(
        line.startswith("FAIL  [heartbeats]") and "seq not increasing: [0, 0, 0]" in line
        for line in lines
    ), done.stdout
    assert lines[-1] == "1 of 2 checks passed"
