"""The ``mesh`` command as a user runs it: real processes, real broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def mesh(
    *args: str, timeout_s: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesh", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd,
    )


def test_the_demo_runs_manager_agents_and_producer_and_loses_nothing(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    run = mesh(
        "--amqp-url", amqp_url, "--namespace", namespace,
        "demo", "--duration", "8", "--work-dir", str(tmp_path / "demo"),
    )  # fmt: skip

    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "every agent is Ready" in out
    assert "lost              0" in out
    assert "draining calc-1" in out
    assert "calc-1 has left; the scaler keeps the replicas" in out
    succeeded = int(out.split("succeeded")[1].split()[0])
    assert succeeded >= 10
    assert (tmp_path / "demo" / "orchestration.sqlite3").exists()

    log = mesh("log", "--journal", str(tmp_path / "demo" / "orchestration.sqlite3"), "-n", "500")
    assert log.returncode == 0
    assert "lost" not in log.stdout.split()  # nobody was lost: drains are graceful
    assert log.stdout.count("terminated") >= 4


def test_an_unreachable_broker_is_one_clear_sentence_not_a_traceback() -> None:
    run = mesh("--amqp-url", "amqp://guest:guest@127.0.0.1:1/", "status", timeout_s=30)

    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/" in run.stderr
    assert "rabbitmq-server -detached" in run.stderr


def test_status_without_a_manager_says_so(amqp_url: str, namespace: str) -> None:
    run = mesh("--amqp-url", amqp_url, "--namespace", namespace, "status", "--timeout", "2")

    assert run.returncode == 3
    assert "Traceback" not in run.stderr
    assert "mesh manager" in run.stderr or "is it running" in run.stderr


def test_schemas_check_passes_on_the_committed_schemas() -> None:
    run = mesh("schemas", "check", cwd=Path(__file__).parents[2])

    assert run.returncode == 0, run.stderr
    assert "match the models" in run.stdout
