"""Every option and argument of every ``mesh`` command says what it is for in ``--help``."""

from __future__ import annotations

import argparse

from mesh.cli import build_parser


def _parsers(
    parser: argparse.ArgumentParser, path: str = "mesh"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_option_and_argument_has_help_text() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 10  # the walk reached the subcommands

    silent = [
        f"{path} {action.option_strings[0] if action.option_strings else action.dest}"
        for path, parser in parsers
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not action.help
    ]
    assert silent == []


def test_the_log_level_is_checked_and_case_blind() -> None:
    assert build_parser().parse_args(["--log-level", "debug", "status"]).log_level == "DEBUG"


def test_the_broker_url_may_come_before_or_after_the_command() -> None:
    parse = build_parser().parse_args
    after = parse(["status", "--amqp-url", "amqp://u:p@elsewhere:5672/", "--namespace", "x"])
    assert (after.amqp_url, after.namespace) == ("amqp://u:p@elsewhere:5672/", "x")
    before = parse(["--amqp-url", "amqp://u:p@elsewhere:5672/", "status"])
    assert before.amqp_url == "amqp://u:p@elsewhere:5672/"
    neither = parse(["status"])
    assert neither.amqp_url == parse(["drain", "a-1"]).amqp_url  # the default, unchanged


def test_the_conformance_help_names_every_check_of_the_kit_in_order() -> None:
    from mesh.conformance import CHECK_KEYS

    [(_, conformance)] = [(p, c) for p, c in _parsers(build_parser()) if p == "mesh conformance"]
    [check] = [a for a in conformance._actions if "--check" in a.option_strings]
    assert check.help is not None
    named = check.help.split(": ", 1)[1].replace(" ", "").split(",")
    assert named == list(CHECK_KEYS)
