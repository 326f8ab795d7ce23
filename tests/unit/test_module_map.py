"""docs/modules.md is generated from the modules: regenerated here, it must be the same."""

from __future__ import annotations

from pathlib import Path

from mesh.module_map import render, summary

MAP = Path(__file__).parents[2] / "docs" / "modules.md"


def test_the_module_map_is_what_the_modules_say() -> None:
    assert MAP.read_text() == render(), (
        "docs/modules.md is out of date: python -m mesh.module_map > docs/modules.md"
    )


def test_every_module_is_on_the_map_with_a_summary() -> None:
    text = render()
    root = Path(__file__).parents[2] / "mesh"
    for path in root.rglob("*.py"):
        if path.stem != "__init__":
            assert f"| `{path.stem}` |" in text, path


def test_a_summary_is_the_first_sentence_on_one_line() -> None:
    source = '"""Leaving: the drain protocol,\nseen from the agent. More here.\n\nAnd more."""\n'
    assert summary(source) == "Leaving: the drain protocol, seen from the agent."
    assert summary("x = 1\n") == ""
