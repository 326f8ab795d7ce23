"""The sample agents compute right answers, refuse what they must, and honour their schemas."""

from __future__ import annotations

import math
from typing import Any

import pytest
from jsonschema.validators import validator_for

from mesh.agent import Agent
from mesh.samples import SAMPLES, CalcAgent, CalcError, EchoAgent, TextStatsAgent, evaluate
from mesh.samples.calc import MAX_EXPRESSION_LENGTH
from mesh.samples.textstats import text_stats


def validate(schema: dict[str, Any], instance: Any) -> None:
    validator_for(schema)(schema).validate(instance)


def is_valid(schema: dict[str, Any], instance: Any) -> bool:
    return bool(validator_for(schema)(schema).is_valid(instance))


# ---- calc -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 * (3 + 4) ** 2", 98),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("-(3)", -3),
        ("+4", 4),
        ("--4", 4),
        ("1.5e3 + 0.5", 1500.5),
        ("sqrt(16)", 4.0),
        ("abs(-3.5)", 3.5),
        ("round(2.567, 2)", 2.57),
        ("round(2.5)", 2),
        ("min(3, 1, 2)", 1),
        ("max(3, 1, 2)", 3),
        ("floor(2.7) + ceil(2.1)", 5),
        ("log(e)", 1.0),
        ("log(8, 2)", 3.0),
        ("exp(0)", 1.0),
        ("2 * pi", 2 * math.pi),
        ("  1 + 1  ", 2),
    ],
)
def test_calc_evaluates_arithmetic(expression: str, expected: float) -> None:
    assert evaluate(expression) == pytest.approx(expected)


def test_calc_keeps_integers_exact_within_64_bits_and_returns_floats_beyond() -> None:
    assert evaluate("2 ** 62") == 2**62
    assert isinstance(evaluate("2 ** 62"), int)
    big = evaluate("2 ** 100")
    assert isinstance(big, float)
    assert big == float(2**100)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "x + 1",
        "math.sqrt(4)",
        "(1).__class__",
        "eval('1')",
        "sqrt(x=4)",
        "max(*[1, 2])",
        "[1, 2][0]",
        "'a' * 3",
        "True + 1",
        "1 if 1 else 2",
        "1 < 2",
        "lambda: 1",
        "(lambda: 1)()",
        "abs",
        "1; 2",
        "",
        "1 +",
        "1 & 3",
        "1 << 4",
        "~1",
        "not 1",
        "1j",
    ],
)
def test_calc_refuses_everything_outside_its_allowlist(expression: str) -> None:
    with pytest.raises(CalcError):
        evaluate(expression)


@pytest.mark.parametrize(
    "expression",
    ["9 ** 9 ** 9", "2 ** 100000", "10 ** 1000", "(10 ** 200) ** 20", "2 ** 1001", "1.5 ** -5000"],
)
def test_calc_refuses_huge_exponents_and_results(expression: str) -> None:
    with pytest.raises(CalcError):
        evaluate(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("(-8) ** 0.5", "not a real number"),
        ("10.0 ** 400", "too large"),
        ("exp(1000)", "too large"),
        ("1e308 * 10", "not a finite number"),
        ("round(1.5, 99)", "digits"),
        ("sqrt(1, 2)", "arguments"),
    ],
)
def test_calc_explains_values_it_cannot_compute(expression: str, message: str) -> None:
    with pytest.raises(CalcError, match=message):
        evaluate(expression)


def test_calc_refuses_overlong_and_deeply_nested_expressions() -> None:
    with pytest.raises(CalcError, match="longer than"):
        evaluate("1+" * 300 + "1")
    with pytest.raises(CalcError):
        evaluate("(" * 240 + "1" + ")" * 240)
    assert evaluate("-" * 499 + "1") == -1  # deep but legal: no crash


async def test_calc_handler_returns_the_value_and_the_expression() -> None:
    agent = CalcAgent("calc-test")
    assert await agent.evaluate({"expression": "6 * 7"}) == {"value": 42, "expression": "6 * 7"}


# ---- textstats ------------------------------------------------------------------------------


def test_textstats_counts_words_sentences_and_characters() -> None:
    stats = text_stats("The cat sat. The cat ran! Did the dog? the end")
    assert stats["characters"] == 46
    assert stats["words"] == 11
    assert stats["sentences"] == 4
    assert stats["top_words"] == [
        {"word": "the", "count": 4},
        {"word": "cat", "count": 2},
        {"word": "did", "count": 1},
        {"word": "dog", "count": 1},
        {"word": "end", "count": 1},
    ]
    assert stats["longest_word"] == "The"
    assert stats["average_word_length"] == 3.0


def test_textstats_keeps_contractions_hyphens_and_unicode_words_whole() -> None:
    stats = text_stats("Don't stop the well-known Größe… l\u2019été!")
    assert stats["words"] == 6
    assert stats["longest_word"] == "well-known"
    assert {"word": "grösse", "count": 1} in stats["top_words"]  # case folding: ß -> ss
    assert stats["sentences"] == 1


def test_textstats_of_empty_or_wordless_text_is_all_zero() -> None:
    for text in ("", "   ", "... !!! ???"):
        stats = text_stats(text)
        assert stats["words"] == 0
        assert stats["sentences"] == 0
        assert stats["average_word_length"] == 0.0
        assert stats["top_words"] == []
        assert stats["longest_word"] == ""


def test_textstats_case_folds_top_words() -> None:
    stats = text_stats("Apple apple APPLE banana Banana cherry")
    assert stats["top_words"][:2] == [{"word": "apple", "count": 3}, {"word": "banana", "count": 2}]


# ---- echo -----------------------------------------------------------------------------------


async def test_echo_returns_the_message_and_the_time_it_slept() -> None:
    agent = EchoAgent("echo-test")
    assert await agent.echo({"message": "hi"}) == {"message": "hi", "slept_ms": 0}
    assert await agent.echo({"message": "zzz", "sleep_ms": 20}) == {
        "message": "zzz",
        "slept_ms": 20,
    }


# ---- schemas --------------------------------------------------------------------------------


def test_samples_are_registered_under_their_keys_with_distinct_capabilities_and_costs() -> None:
    assert set(SAMPLES) == {"calc", "textstats", "echo"}
    assert SAMPLES["calc"] is CalcAgent
    assert SAMPLES["textstats"] is TextStatsAgent
    assert SAMPLES["echo"] is EchoAgent
    caps = [spec.capability for cls in SAMPLES.values() for spec in cls.capabilities.values()]
    assert sorted((c.name, c.version, c.cost_class, c.max_concurrency) for c in caps) == [
        ("math.evaluate", "1.0.0", "A", 4),
        ("test.echo", "1.0.0", "C", 8),
        ("text.stats", "1.2.0", "B", 2),
    ]


def _all_object_schemas(schema: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append(schema)
        for value in schema.values():
            found += _all_object_schemas(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _all_object_schemas(value)
    return found


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_sample_schemas_are_valid_and_strict(key: str) -> None:
    cls: type[Agent] = SAMPLES[key]
    for spec in cls.capabilities.values():
        for schema in (spec.capability.input_schema, spec.capability.output_schema):
            validator_for(schema).check_schema(schema)
            objects = _all_object_schemas(schema)
            assert objects, "the schema describes an object"
            for obj in objects:
                assert obj["additionalProperties"] is False
                assert obj["required"], "every object schema names its required fields"


@pytest.mark.parametrize(
    ("key", "payload"),
    [
        ("calc", {"expression": "2 ** 0.5 * (3 - 1)"}),
        ("calc", {"expression": "7 // 2"}),
        ("textstats", {"text": "One two three. Four five!"}),
        ("textstats", {"text": ""}),
        ("echo", {"message": "hello", "sleep_ms": 1}),
    ],
)
async def test_sample_inputs_and_outputs_validate_against_their_schemas(
    key: str, payload: dict[str, Any]
) -> None:
    agent = SAMPLES[key]()
    [bound] = agent.bind().values()
    validate(bound.spec.capability.input_schema, payload)
    output = await bound.handler(payload)
    validate(bound.spec.capability.output_schema, output)


@pytest.mark.parametrize(
    ("key", "payload"),
    [
        ("calc", {}),
        ("calc", {"expression": "1", "extra": True}),
        ("calc", {"expression": "1" * (MAX_EXPRESSION_LENGTH + 1)}),
        ("calc", {"expression": 12}),
        ("textstats", {"text": "x" * 100_001}),
        ("echo", {"message": "m", "sleep_ms": 60_001}),
        ("echo", {"message": "m", "sleep_ms": -1}),
        ("echo", {"message": "m", "sleep_ms": 1.5}),
        ("echo", {"sleep_ms": 1}),
    ],
)
def test_sample_input_schemas_refuse_bad_payloads(key: str, payload: dict[str, Any]) -> None:
    [spec] = SAMPLES[key].capabilities.values()
    assert not is_valid(spec.capability.input_schema, payload)
