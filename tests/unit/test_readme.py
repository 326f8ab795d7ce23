"""The README's code is part of the product: its agent example must define a working agent."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def test_the_readme_producer_example_uses_the_real_client_api() -> None:
    from mesh.producer import MeshClient, TaskOutcome

    example = next(block for block in python_blocks() if "MeshClient" in block)
    assert "MeshClient.connect(" in example and hasattr(MeshClient, "connect")
    assert "client.run_task(" in example and hasattr(MeshClient, "run_task")
    assert "outcome.lease.agent_id" in example and "lease" in TaskOutcome.__dataclass_fields__
