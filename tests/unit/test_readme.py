"""The README's code is part of the product: its agent example must define a working agent."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

README = Path(__file__).parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_agent_example_defines_an_agent_that_would_register() -> None:
    example = next(block for block in python_blocks() if "class Summariser" in block)
    scope: dict[str, Any] = {}
    exec(compile(example, "README.md", "exec"), scope)

    agent = scope["Summariser"]("summariser-1")
    registration = agent.registration("incarnation-1")

    assert [c.name for c in registration.capabilities] == ["text.summarise"]
    assert registration.capabilities[0].cost_class == "B"


def test_the_readme_submit_example_runs_against_the_client_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run the example with a stand-in client: its requirements must validate and its calls
    must fit the real ``MeshClient`` signatures."""
    import mesh.producer
    from mesh.producer import MeshClient
    from mesh.wire import TaskRequirements

    example = next(block for block in python_blocks() if "client.submit(" in block)
    calls: list[tuple[Any, Any, dict[str, Any]]] = []

    class Client:
        @classmethod
        async def connect(cls, url: str) -> Client:
            inspect.signature(MeshClient.connect).bind(url)
            return cls()

        async def __aenter__(self) -> Client:
            return self

        async def __aexit__(self, *_: object) -> None:
            return None

        async def submit(self, requirements: Any, payload: Any, **kw: Any) -> Any:
            inspect.signature(MeshClient.submit).bind(self, requirements, payload, **kw)
            calls.append((requirements, payload, kw))
            grant = SimpleNamespace(pool_id="echo")
            return SimpleNamespace(output={}, decision=SimpleNamespace(grant=grant))

    monkeypatch.setattr(mesh.producer, "MeshClient", Client)
    code = compile(example, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    asyncio.run(eval(code, {}))

    [(requirements, payload, kw)] = calls
    assert isinstance(requirements, TaskRequirements) and payload == {"message": "hi"}
    assert kw == {"timeout_s": 10}
