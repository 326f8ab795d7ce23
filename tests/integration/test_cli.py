"""The ``mesh`` command as a user runs it: real processes, real broker."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.transport import AmqpTransport

from .harness import live_member, start_manager
from .test_admission import RAG_AGENT, REQUIREMENTS, fresh, settings_for


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
    assert "descriptors published for pools calc, textstats, echo" in out
    drained = re.search(r"draining (\S+) with (\d+) task\(s\) in flight", out)
    assert drained is not None, out[-3000:]
    victim, held = drained.group(1), int(drained.group(2))
    assert held > 0  # drained while it held work, on the admission path
    assert f"{victim} has left; the scaler keeps the replicas" in out
    assert "lost              0" in out
    assert "executed twice    0" in out
    completed = int(out.split("completed once")[1].split()[0])
    assert completed >= 10
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


def test_status_without_a_manager_says_so_and_declares_nothing(
    amqp_url: str, namespace: str, management_api: Any
) -> None:
    run = mesh("--amqp-url", amqp_url, "--namespace", namespace, "status", "--timeout", "2")

    assert run.returncode == 3
    assert "Traceback" not in run.stderr
    assert f"no manager has set up namespace {namespace!r}" in run.stderr, run.stderr
    # Read-only: it left the namespace as it found it (it used to declare its exchanges).
    assert management_api.list_names("exchanges", f"{namespace}.") == []
    explain = mesh("--amqp-url", amqp_url, "--namespace", namespace, "explain", "adm-1")
    assert explain.returncode == 3 and "is `mesh manager` running" in explain.stderr
    assert management_api.list_names("exchanges", f"{namespace}.") == []


def test_schemas_check_passes_on_the_committed_schemas() -> None:
    run = mesh("schemas", "check", cwd=Path(__file__).parents[2])

    assert run.returncode == 0, run.stderr
    assert "match the models" in run.stdout


# ---- mesh log filters, mesh top: against a manager in this process ---------------------------


async def amesh(*args: str, timeout_s: float = 60) -> tuple[int, str, str]:
    """``mesh`` in a subprocess without blocking this loop (the manager under test runs on it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def manager_with_history(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[ManagerService]:
    """A manager (status page on a free port) that accepted two descriptors and decided two
    admissions: one granted, one refused."""
    settings = replace(
        settings_for(amqp_url, namespace, tmp_path), http_port=0, http_host="127.0.0.1"
    )
    service = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="cli-test")
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    try:
        await live_member(service, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
        await client.publish_descriptor(fresh())
        await client.publish_descriptor(fresh(pool_id="rag-us", regions=["us-east-1"]))
        granted = await client.admit(REQUIREMENTS, admission_id="adm-granted")
        elsewhere = REQUIREMENTS.model_copy(update={"regions": ["ap-south-1"]})
        refused = await client.admit(elsewhere, admission_id="adm-refused")
        assert (granted.outcome, refused.outcome) == ("admitted", "rejected")
    finally:
        await client.close()
    yield service
    await transport.close()
    try:
        await asyncio.wait_for(service.stop(), 30)
    except TimeoutError:
        for t in asyncio.all_tasks():
            t.print_stack(limit=12)
        raise


async def test_log_filters_select_from_the_journal_a_real_manager_wrote(
    manager_with_history: ManagerService, tmp_path: Path
) -> None:
    journal = str(tmp_path / "journal.sqlite3")

    code, out, err = await amesh("log", "--journal", journal, "--kind", "admission", "--json")
    assert code == 0, err
    decided = [orjson.loads(line) for line in out.splitlines()]
    assert [(e["detail"]["admission_id"], e["detail"]["outcome"]) for e in decided] == [
        ("adm-granted", "admitted"),
        ("adm-refused", "rejected"),
    ]
    assert decided[1]["reason"] == "NO_ELIGIBLE_POOL"

    code, out, _ = await amesh(
        "log", "--journal", journal, "--kind", "descriptor", "--since", "5m", "--limit", "1"
    )
    assert code == 0
    assert len(out.splitlines()) == 1 and "(rag-us epoch 3)" in out  # the newest one

    code, out, _ = await amesh(
        "log", "--journal", journal, "--agent", "-", "--kind", "manager_started",
        "--kind", "admission", "--until", "1h",
    )  # fmt: skip
    assert (code, out) == (0, "")  # all of it happened in the last hour

    code, out, _ = await amesh("log", "--journal", journal, "--kind", "admission", "-n", "0")
    assert "admission adm-refused" in out.splitlines()[-1]  # the handle for `mesh explain`

    code, out, err = await amesh("log", "--journal", journal, "--since", "ten minutes")
    assert code == 2 and out == ""
    assert err.startswith("mesh log: --since: 'ten minutes' is neither a duration")
    assert "Traceback" not in err


async def test_log_follow_applies_the_same_filters_to_the_live_feed(
    amqp_url: str, namespace: str, manager_with_history: ManagerService
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", "--amqp-url", amqp_url, "--namespace", namespace,
        "log", "-f", "--kind", "admission", "--kind", "lost", "--limit", "1", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        following = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert f"following {namespace}.events (log.*.admission, log.*.lost)" in following
        client = await MeshClient.connect(amqp_url, namespace=namespace, name="cli-test")
        try:
            await client.publish_descriptor(fresh(pool_id="rag-ap", regions=["us-west-2"]))
            elsewhere = REQUIREMENTS.model_copy(update={"regions": ["ap-south-1"]})
            await client.admit(elsewhere, admission_id="adm-live")
        finally:
            await client.close()
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    assert proc.returncode == 0, err
    (line,) = out.decode().splitlines()  # the descriptor event was not bound; --limit 1 ended it
    event = orjson.loads(line)
    assert (event["kind"], event["detail"]["admission_id"]) == ("admission", "adm-live")


async def test_top_once_draws_a_real_managers_status(
    manager_with_history: ManagerService,
) -> None:
    assert manager_with_history.observer.web is not None
    url = manager_with_history.observer.web.url

    code, out, err = await amesh("top", "--once", "--url", url)

    assert code == 0, out + err
    assert f"manager {manager_with_history.settings.manager_id}" in out
    assert "pressure NORMAL" in out and "admitted 1 · rejected 1" in out
    assert [line.split()[:3] for line in out.splitlines() if line.split()[:1] == ["rag-us"]] == [
        ["rag-us", "3", "3"]
    ]
    assert any("adm-refused" in line and "NO_ELIGIBLE_POOL" in line for line in out.splitlines())


def test_top_once_without_a_manager_says_so_and_exits_1() -> None:
    run = mesh("top", "--once", "--url", "http://127.0.0.1:1/", timeout_s=30)

    assert run.returncode == 1
    assert "manager unreachable: cannot reach http://127.0.0.1:1/api/status" in run.stdout
    assert "Traceback" not in run.stderr
