"""Option tables: a command whose options set a settings dataclass declares them as rows of
:class:`Option` — the flag, the environment variable that gives its default, and the setting it
sets — and its parser (:func:`add_options`) and its settings (:func:`settings_from`) are both
built from that one table, so the three cannot drift apart. ``mesh manager``
(:mod:`mesh.cli.manager_options`) and ``mesh agent`` (:mod:`mesh.cli.agent_options`) use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from mesh.cli.common import _env

S = TypeVar("S")

ON = ("1", "on", "true")
"""An environment variable's values that switch a flag (``store_true``) on."""


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Option:
    """One option of a command."""

    flag: str
    env: str | None
    """The environment variable whose value is the default (None: none)."""
    setting: str | None
    """The settings field, or dotted path into one, it sets (None: not a setting — used by
    the command itself)."""
    help: str
    default: str | None = None
    """The default as text, parsed by ``type`` as the environment's value would be."""
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    group: str | None = None
    to_setting: Callable[[Any], Any] = _same
    """The parsed value as the setting wants it."""
    action: Literal["store_true", "append"] | None = None
    """``store_true``: a switch (the environment turns it on with 1, on or true); ``append``:
    repeatable (the environment gives the first value)."""
    name: str | None = None
    """The parsed value's attribute, when not the flag's own name."""

    @property
    def dest(self) -> str:
        return self.name or self.flag.removeprefix("--").replace("-", "_")

    def help_text(self) -> str:
        said = []
        if self.env is not None:
            said.append(f"env {self.env}")
        if self.default not in (None, ""):
            said.append(f"default {self.default}")
        if not said:
            return self.help
        if self.help.endswith(")"):  # "… (0: off)" -> "… (0: off; env X; default 0)"
            return f"{self.help[:-1]}; {'; '.join(said)})"
        return f"{self.help} ({'; '.join(said)})"

    def default_value(self) -> Any:
        """The default as argparse takes it: the environment's value, else the table's."""
        if self.action == "store_true":
            return self.env is not None and _env(self.env, "").lower() in ON
        if self.action == "append":
            given = _env(self.env, "") if self.env else ""
            return [given] if given else []
        default = _env(self.env, self.default or "") if self.env else self.default
        return default if default not in ("", None) else self.default


def add_options(
    parser: argparse.ArgumentParser,
    options: Sequence[Option],
    groups: Mapping[str, str] | None = None,
) -> None:
    """Every row of ``options`` as an option of ``parser``; a row's ``group`` is an argument
    group, described by ``groups``."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        target: Any = parser
        if option.group is not None:
            if option.group not in made:
                made[option.group] = parser.add_argument_group(
                    option.group, (groups or {}).get(option.group)
                )
            target = made[option.group]
        kwargs: dict[str, Any] = {"help": option.help_text(), "default": option.default_value()}
        if option.name is not None:
            kwargs["dest"] = option.name
        for key in ("type", "metavar", "choices", "action"):
            if getattr(option, key) is not None:
                kwargs[key] = getattr(option, key)
        target.add_argument(option.flag, **kwargs)


def settings_from(base: S, options: Sequence[Option], args: argparse.Namespace) -> S:
    """``base`` (a frozen dataclass) with every setting of ``options`` as ``args`` give it."""
    settings: Any = base
    for option in options:
        if option.setting is not None:
            value = option.to_setting(getattr(args, option.dest))
            settings = _with(settings, option.setting.split("."), value)
    return settings  # type: ignore[no-any-return]


def _with(obj: Any, path: list[str], value: Any) -> Any:
    """``obj`` (a frozen dataclass) with the field at ``path`` set to ``value``."""
    head, *rest = path
    inner = value if not rest else _with(getattr(obj, head), rest, value)
    return dataclasses.replace(obj, **{head: inner})
