"""docs/cli-reference.md is generated from the parser: regenerated here, it must be the same."""

from __future__ import annotations

from pathlib import Path

from mesh.cli import build_parser
from mesh.cli_reference import render

REFERENCE = Path(__file__).parents[2] / "docs" / "cli-reference.md"


def test_the_cli_reference_is_what_the_parser_says() -> None:
    assert REFERENCE.read_text() == render(), (
        "docs/cli-reference.md is out of date: python -m mesh.cli_reference > docs/cli-reference.md"
    )


def test_the_reference_has_every_command_and_every_option() -> None:
    text = render()
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    for name, sub in commands.choices.items():  # type: ignore[attr-defined]
        assert f"## mesh {name}\n" in text
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in text, f"mesh {name} {flag}"
