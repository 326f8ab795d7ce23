"""Sample agent ``calc``: safe arithmetic (``math.evaluate@1.0.0``, cost class A).

The expression is parsed with :mod:`ast` and walked by a small evaluator that
knows only numbers, ``+ - * / // % **``, unary ``+``/``-``, parentheses, the
constants ``pi`` and ``e`` and a few functions (``sqrt abs round min max floor
ceil log exp``). Everything else - names, attributes, subscripts, keyword
arguments, comparisons, strings - is refused with :class:`CalcError`. Nothing
is ever passed to ``eval``.

Sizes are bounded so one task cannot eat the process: at most 500 characters,
exponents of at most 1000 in magnitude, integers of at most 1024 bits along the
way. Integer results beyond 64 bits are returned as floats (JSON numbers);
non-finite results are refused.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from mesh.agent import Agent, capability

MAX_EXPRESSION_LENGTH = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 1024
_INT64 = 2**63

Number = int | float


class CalcError(ValueError):
    """The expression is not allowed, or its value cannot be computed."""


def _pow(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent {exponent} is larger than {MAX_EXPONENT} in magnitude")
    # base ** exponent >= 2 ** ((bits(base) - 1) * exponent): refuse before computing it.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise CalcError(f"{base} ** {exponent} is larger than {MAX_INT_BITS} bits")
    result = base**exponent
    if isinstance(result, complex):
        raise CalcError(f"{base} ** {exponent} is not a real number")
    return result


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _round(x: Number, ndigits: Number = 0) -> Number:
    if not isinstance(ndigits, int) or abs(ndigits) > 15:
        raise CalcError("round() takes an integer number of digits between -15 and 15")
    return round(x, ndigits) if ndigits else round(x)


def _log(x: Number, base: Number = math.e) -> float:
    return math.log(x, base)


# name -> (function, minimum arity, maximum arity or None)
_FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int | None]] = {
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, None),
    "max": (max, 1, None),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "log": (_log, 1, 2),
    "exp": (math.exp, 1, 1),
}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; raise :class:`CalcError` if it is not allowed."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise CalcError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalcError(f"not an arithmetic expression: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalcError("the expression is too deeply nested") from None
    try:
        value = _eval(tree.body)
    except CalcError:
        raise
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("the result is too large") from None
    except RecursionError:
        raise CalcError("the expression is too deeply nested") from None
    except (ValueError, TypeError) as exc:
        raise CalcError(str(exc)) from None
    return _as_json_number(value)


def _eval(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        return _check(_literal(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _check(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise CalcError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call):
        return _check(_call(node))
    raise CalcError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def _literal(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalcError(f"only numbers are allowed, not {type(value).__name__}")
    return value


def _call(node: ast.Call) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
        what = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
        raise CalcError(f"calling {what!r} is not allowed")
    name = node.func.id
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise CalcError(f"{name}() takes positional numbers only")
    function, least, most = _FUNCTIONS[name]
    if len(node.args) < least or (most is not None and len(node.args) > most):
        raise CalcError(f"{name}() takes {least} to {most or 'any number of'} arguments")
    return function(*(_eval(arg) for arg in node.args))


def _check(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalcError(f"an intermediate result is larger than {MAX_INT_BITS} bits")
    return value


def _as_json_number(value: Number) -> Number:
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    return value


class CalcAgent(Agent):
    """Evaluates arithmetic expressions. Cheap (cost class A), four at a time."""

    deployment = "calc"

    @capability(
        "math.evaluate",
        version="1.0.0",
        description="Evaluate an arithmetic expression safely (no names, no calls but a few).",
        input_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_EXPRESSION_LENGTH,
                    "examples": ["2 * (3 + 4) ** 2", "sqrt(2) / 2"],
                },
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        output_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "expression": {"type": "string"},
            },
            "required": ["value", "expression"],
            "additionalProperties": False,
        },
        max_concurrency=4,
        cost_class="A",
    )
    async def evaluate(self, payload: dict[str, Any]) -> dict[str, Any]:
        expression: str = payload["expression"]
        return {"value": evaluate(expression), "expression": expression}
