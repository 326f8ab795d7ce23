"""No ``extra=`` field may take a name ``logging.LogRecord`` reserves: ``makeRecord`` raises
``KeyError`` at the call, so a log line on an error path would fail the command it reports on
(``extra={"msg": ...}`` once made the manager skip the replies of a whole command batch)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

import mesh
from mesh.errors import LocalProtocolError
from mesh.logs import RESERVED, checked

SOURCE = Path(mesh.__file__).parent


def reserved_fields_in(source: str) -> list[str]:
    """``line: key`` of every reserved key in an ``extra=`` dict literal, or passed by name to
    a ``_extra(...)`` helper, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        keys: list[str] = []
        for kw in node.keywords:
            if kw.arg == "extra" and isinstance(kw.value, ast.Dict):
                keys += [
                    k.value
                    for k in kw.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                ]
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "_extra":
            keys += [kw.arg for kw in node.keywords if kw.arg]
        found += [f"{node.lineno}: {key}" for key in keys if key in RESERVED]
    return found


def test_no_log_call_in_the_package_uses_a_reserved_field_name() -> None:
    offenders = {
        str(path.relative_to(SOURCE)): hits
        for path in sorted(SOURCE.rglob("*.py"))
        if (hits := reserved_fields_in(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


def test_the_walk_finds_a_reserved_field_where_it_hides() -> None:
    source = (
        'log.info("x", extra={"agent_id": a, "msg": m})\n'
        'log.warning("y", extra=self._extra(queue=q, filename=f))\n'
    )
    assert reserved_fields_in(source) == ["1: msg", "2: filename"]


def test_the_reserved_names_are_exactly_what_logging_refuses() -> None:
    logger = logging.getLogger("test.reserved")
    for name in sorted(RESERVED):
        with pytest.raises(KeyError):
            logger.makeRecord("n", logging.INFO, "f", 1, "m", (), None, extra={name: 1})
    logger.makeRecord("n", logging.INFO, "f", 1, "m", (), None, extra={"message_type": 1})


@pytest.mark.parametrize("name", sorted(RESERVED))
def test_the_fields_helper_refuses_every_reserved_name_at_once(name: str) -> None:
    with pytest.raises(LocalProtocolError, match=name):
        checked({"agent_id": "a-1", name: "x"})


def test_the_fields_helper_passes_ordinary_fields_through() -> None:
    fields = {"agent_id": "a-1", "message_type": "mesh.task.v1"}
    assert checked(fields) is fields


def test_a_malformed_http_request_is_one_warning_line_and_other_errors_stay_errors() -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    from mesh.logs import malformed_http_quietly

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
            ("10.0.0.9",), (type(exc), exc, None),
        )  # fmt: skip

    bad = record(BadHttpMessage("Invalid method"))
    assert malformed_http_quietly(bad)
    assert (bad.levelname, bad.exc_info) == ("WARNING", None)
    assert "10.0.0.9" in bad.getMessage() and "Invalid method" in bad.getMessage()
    other = record(RuntimeError("handler bug"))
    assert malformed_http_quietly(other)
    assert (other.levelname, other.exc_info is not None) == ("ERROR", True)
