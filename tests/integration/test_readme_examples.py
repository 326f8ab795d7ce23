"""The README's producer examples, run for real: a manager, sample agents and the real
``MeshClient`` on the real broker. Only the connection is pointed at this test's namespace
(the examples use the default one, where another mesh may be running)."""

from __future__ import annotations

import ast
import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import mesh.producer
from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES

from .harness import eventually, start_manager
from .test_admission import settings_for
from .test_backpressure import echo_descriptor

README = Path(__file__).parents[2] / "README.md"


def example(containing: str) -> str:
    blocks = README.read_text().split("```python\n")[1:]
    return next(b.split("```", 1)[0] for b in blocks if containing in b)


@pytest.fixture
async def mesh_with_agents(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[ManagerService]:
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    runtimes = [
        AgentRuntime(
            SAMPLES[name](f"{name}-1"), AgentSettings(amqp_url=amqp_url, namespace=namespace)
        )
        for name in ("calc", "echo")
    ]
    operator = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    try:
        for runtime in runtimes:
            await runtime.start()
        assert (await operator.publish_descriptor(echo_descriptor(4))).type.endswith("accepted.v1")
        await eventually(lambda: len(manager.core.agents) == 2, what="both agents Ready")
        yield manager
    finally:
        await operator.close()
        for runtime in runtimes:
            await runtime.stop()
        await manager.stop()


async def run_example(
    code: str, amqp_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run ``code`` as the README shows it (top-level await), its MeshClient connected to
    this test's broker and namespace; returns what it printed."""
    real_connect = MeshClient.connect

    async def connect(url: str, **kwargs: Any) -> MeshClient:
        assert url.startswith("amqp://guest:guest@")  # the README's URL, as written
        return await real_connect(amqp_url, namespace=namespace, **kwargs)

    monkeypatch.setattr(mesh.producer.MeshClient, "connect", staticmethod(connect))
    compiled = compile(code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    printed = io.StringIO()
    scope: dict[str, Any] = {}
    with contextlib.redirect_stdout(printed):
        await eval(compiled, scope)
    client = scope.get("client")
    if isinstance(client, MeshClient):  # the run_task example leaves its client open
        await client.close()
    return printed.getvalue()


async def test_the_readme_run_task_example_runs(
    mesh_with_agents: ManagerService,
    amqp_url: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = await run_example(example("client.run_task("), amqp_url, namespace, monkeypatch)
    assert out.strip() == "{'value': 42, 'expression': '6 * 7'} from calc-1"


async def test_the_readme_submit_example_runs(
    mesh_with_agents: ManagerService,
    amqp_url: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = await run_example(example("client.submit("), amqp_url, namespace, monkeypatch)
    assert out.strip().endswith(" echo")  # the output, then the pool that ran it
    assert "'message': 'hi'" in out
