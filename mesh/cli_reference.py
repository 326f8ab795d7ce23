"""The CLI reference (docs/cli-reference.md), generated from the parser: every command's usage,
description and options as ``mesh <command> --help`` prints them, so the page cannot drift from
the code. ``python -m mesh.cli_reference > docs/cli-reference.md`` writes it; a unit test
regenerates it and diffs."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from unittest import mock

from mesh.cli import build_parser

WIDTH = 100


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every command's parser, depth first, in the order the CLI adds them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases: once
                yield sub
                yield from _subcommands(sub)


def render() -> str:
    """The reference as Markdown, with the defaults a clean environment gives (no ``MESH_*``
    variables) and a fixed width, so it is the same on every machine."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    clean["COLUMNS"] = str(WIDTH)
    with mock.patch.dict(os.environ, clean, clear=True):
        parser = build_parser()
        parts = [
            "# CLI reference",
            "",
            "Generated from the parser by `python -m mesh.cli_reference > docs/cli-reference.md`"
            " (a test keeps it in step); what each command is for is in [cli.md](cli.md).",
            "",
            "## mesh",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for sub in _subcommands(parser):
            parts += ["", f"## {sub.prog}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
