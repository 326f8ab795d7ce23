"""The wire codec: every message round-trips, and bad bytes only ever become MessageRejected."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mesh.constants import MAX_MESSAGE_BYTES
from mesh.errors import MessageRejected, RemoteProtocolError
from mesh.wire import (
    MESSAGE_TYPES,
    REGISTRY,
    AgentRegistration,
    Capability,
    Heartbeat,
    Message,
    PoolEpoch,
    Reason,
    RegistrationAccepted,
    Task,
    decode,
    decode_as,
    encode,
    models,
)

from .samples import ADD_INPUT_SCHEMA, CALC_ADD, SAMPLES, sample_json

FAST = settings(max_examples=200, deadline=None)


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def rejection(raw: bytes, **kwargs: Any) -> MessageRejected:
    with pytest.raises(MessageRejected) as caught:
        decode(raw, **kwargs)
    return caught.value


def capability_json(**changes: Any) -> dict[str, Any]:
    return {**CALC_ADD.model_dump(mode="json"), **changes}


# ---- round trips ---------------------------------------------------------------------------


def test_there_is_one_sample_for_every_message_type() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES)


def test_every_message_type_has_a_unique_versioned_name() -> None:
    names = [cls.TYPE for cls in MESSAGE_TYPES]

    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"mesh\.[a-z]+(-[a-z]+)*\.v[1-9][0-9]*", n) for n in names), names
    assert REGISTRY == {cls.TYPE: cls for cls in MESSAGE_TYPES}


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TYPE)
def test_every_message_round_trips_through_the_codec(cls: type[Message]) -> None:
    message = SAMPLES[cls]

    raw = encode(message)
    back = decode(raw)

    assert type(back) is cls
    assert back == message
    assert orjson.loads(raw)["type"] == cls.TYPE
    assert encode(back) == raw


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TYPE)
def test_every_message_decodes_from_plain_json_written_by_another_language(
    cls: type[Message],
) -> None:
    # Key order, whitespace and the json module's own number formatting must not matter.
    obj = sample_json(cls)
    raw = json.dumps(dict(reversed(list(obj.items()))), indent=2).encode()

    assert decode(raw) == SAMPLES[cls]


def test_decode_as_insists_on_the_expected_types() -> None:
    raw = encode(SAMPLES[Heartbeat])

    assert decode_as(raw, Task, Heartbeat) == SAMPLES[Heartbeat]
    with pytest.raises(MessageRejected) as caught:
        decode_as(raw, Task)
    assert caught.value.reason == Reason.UNEXPECTED_MESSAGE_TYPE
    assert "mesh.heartbeat.v1" in caught.value.detail


def test_a_registration_defaults_to_a_ten_second_heartbeat() -> None:
    obj = sample_json(AgentRegistration)
    del obj["heartbeat_interval_s"]

    decoded = decode(body(obj))

    assert isinstance(decoded, AgentRegistration)
    assert decoded.heartbeat_interval_s == 10.0


# ---- decode errors map to reason codes -------------------------------------------------------


def test_a_rejection_is_a_remote_protocol_error_with_its_reason() -> None:
    exc = rejection(b"{")

    assert isinstance(exc, RemoteProtocolError)
    assert exc.reason == Reason.MALFORMED_JSON
    assert str(exc).startswith("MALFORMED_JSON: ")


def test_an_oversized_body_is_refused_before_it_is_parsed() -> None:
    garbage = b"{" * (MAX_MESSAGE_BYTES + 1)  # would be MALFORMED_JSON if it were parsed

    exc = rejection(garbage)

    assert exc.reason == Reason.MESSAGE_TOO_LARGE
    assert str(MAX_MESSAGE_BYTES) in exc.detail


def test_the_size_limit_is_inclusive_and_configurable() -> None:
    raw = encode(SAMPLES[Heartbeat])

    assert decode(raw, max_bytes=len(raw)) == SAMPLES[Heartbeat]
    assert rejection(raw, max_bytes=len(raw) - 1).reason == Reason.MESSAGE_TOO_LARGE


@pytest.mark.parametrize(
    "raw",
    [b"", b"{not json", b'{"type": "mesh.heartbeat.v1"', b"\xff\xfe\x00", b"NaN", b"[1, 2]", b"3"],
)
def test_bytes_that_are_not_a_json_object_are_malformed(raw: bytes) -> None:
    assert rejection(raw).reason == Reason.MALFORMED_JSON


@pytest.mark.parametrize("obj", [{}, {"agent_id": "a"}, {"type": 1}, {"type": None}])
def test_an_object_without_a_string_type_is_missing_its_type(obj: dict[str, Any]) -> None:
    assert rejection(body(obj)).reason == Reason.MISSING_TYPE


@pytest.mark.parametrize(
    "type_name", ["mesh.nope.v1", "mesh.heartbeat.v2", "", "MESH.HEARTBEAT.V1"]
)
def test_an_unknown_type_is_refused_by_name(type_name: str) -> None:
    exc = rejection(body({**sample_json(Heartbeat), "type": type_name}))

    assert exc.reason == Reason.UNKNOWN_MESSAGE_TYPE
    assert repr(type_name) in exc.detail


def test_an_extra_top_level_field_is_an_unknown_field() -> None:
    exc = rejection(body({**sample_json(Heartbeat), "priority": "high"}))

    assert exc.reason == Reason.UNKNOWN_FIELD
    assert "priority" in exc.detail


def test_an_extra_nested_field_is_an_unknown_field() -> None:
    obj = sample_json(AgentRegistration)
    obj["capabilities"][0]["privileged"] = True

    exc = rejection(body(obj))

    assert exc.reason == Reason.UNKNOWN_FIELD
    assert "capabilities.0.privileged" in exc.detail


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", -1),
        ("seq", "seven"),
        ("agent_id", "has.dots"),
        ("agent_id", ""),
        ("in_flight", {"calc.add": -1}),
        ("sent_at", -5),
        ("draining", "maybe"),
    ],
)
def test_a_wrong_value_is_a_schema_violation(field: str, value: Any) -> None:
    exc = rejection(body({**sample_json(Heartbeat), field: value}))

    assert exc.reason == Reason.SCHEMA_VIOLATION
    assert exc.detail.startswith("mesh.heartbeat.v1: ")
    assert field in exc.detail


def test_a_missing_required_field_is_a_schema_violation() -> None:
    obj = sample_json(Heartbeat)
    del obj["incarnation"]

    exc = rejection(body(obj))

    assert exc.reason == Reason.SCHEMA_VIOLATION
    assert "incarnation" in exc.detail


# ---- capabilities ------------------------------------------------------------------------------


def test_a_valid_capability_keeps_its_schemas() -> None:
    cap = Capability.model_validate(capability_json())

    assert cap.input_schema == ADD_INPUT_SCHEMA
    assert cap.max_concurrency == 4


@pytest.mark.parametrize(
    "schema",
    [
        {"type": 12},
        {"type": "integr"},
        {"required": "a"},
        {"properties": []},
        {"minimum": "zero"},
        {"pattern": "["},
    ],
)
@pytest.mark.parametrize("which", ["input_schema", "output_schema"])
def test_a_capability_with_an_invalid_json_schema_is_refused(
    which: str, schema: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        Capability.model_validate(capability_json(**{which: schema}))


def test_a_schema_sent_again_is_checked_against_its_metaschema_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[dict[str, Any]] = []
    check = models._schema_problem_of
    monkeypatch.setattr(models, "_schema_problem_of", lambda s: checked.append(s) or check(s))
    models._schema_problem.cache_clear()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reordered = {"required": ["n"], "properties": {"n": {"type": "integer"}}, "type": "object"}
    bad = {"type": "object", "required": "n"}

    for _ in range(3):
        Capability.model_validate(capability_json(input_schema=schema, output_schema=reordered))
        with pytest.raises(ValidationError, match="not a valid JSON Schema"):
            Capability.model_validate(capability_json(input_schema=bad, output_schema=schema))

    assert checked == [schema, bad]


@pytest.mark.parametrize(
    "version", ["1.0", "1", "v1.0.0", "01.0.0", "1.0.0-beta", "1.0.0+build", "1.0.x", ""]
)
def test_a_capability_with_a_version_that_is_not_semver_is_refused(version: str) -> None:
    with pytest.raises(ValidationError, match="version"):
        Capability.model_validate(capability_json(version=version))


@pytest.mark.parametrize(
    "name", ["search", "Rag.search", "rag..search", "rag.search.", ".rag", "rag.1search", "r ag.x"]
)
def test_a_capability_name_must_be_dotted_lowercase_words(name: str) -> None:
    with pytest.raises(ValidationError, match="name"):
        Capability.model_validate(capability_json(name=name))


@pytest.mark.parametrize("name", ["rag.search", "calc.add", "a.b.c", "img-gen.sd_xl"])
def test_a_dotted_capability_name_is_accepted(name: str) -> None:
    assert Capability.model_validate(capability_json(name=name)).name == name


@pytest.mark.parametrize("max_concurrency", [0, -1, 10_001])
def test_a_capability_needs_a_sane_max_concurrency(max_concurrency: int) -> None:
    with pytest.raises(ValidationError, match="max_concurrency"):
        Capability.model_validate(capability_json(max_concurrency=max_concurrency))


def test_a_capability_cost_class_is_a_b_or_c() -> None:
    with pytest.raises(ValidationError, match="cost_class"):
        Capability.model_validate(capability_json(cost_class="D"))


def test_a_registration_with_duplicate_capability_names_is_refused() -> None:
    obj = sample_json(AgentRegistration)
    obj["capabilities"] = [capability_json(), capability_json(version="2.0.0")]

    with pytest.raises(ValidationError, match="capability names must be unique"):
        AgentRegistration.model_validate(obj)
    exc = rejection(body(obj))
    assert exc.reason == Reason.SCHEMA_VIOLATION
    assert "unique" in exc.detail


def test_a_registration_with_no_capability_is_refused() -> None:
    obj = {**sample_json(AgentRegistration), "capabilities": []}

    assert rejection(body(obj)).reason == Reason.SCHEMA_VIOLATION


def test_a_bad_capability_inside_a_registration_is_a_schema_violation() -> None:
    obj = sample_json(AgentRegistration)
    obj["capabilities"][0]["input_schema"] = {"type": 12}

    exc = rejection(body(obj))

    assert exc.reason == Reason.SCHEMA_VIOLATION
    assert "capabilities.0.input_schema" in exc.detail


@pytest.mark.parametrize("dollar_schema", [5, True, [], {}], ids=["int", "bool", "list", "dict"])
def test_a_capability_schema_with_a_non_string_dollar_schema_is_rejected(
    dollar_schema: Any,
) -> None:
    obj = sample_json(AgentRegistration)
    obj["capabilities"][0]["input_schema"] = {"$schema": dollar_schema, "type": "object"}

    assert rejection(body(obj)).reason == Reason.SCHEMA_VIOLATION


# ---- property tests: bad input only ever becomes MessageRejected ---------------------------

# An explicit alphabet: hypothesis' default one costs seconds to build on first use.
SURROGATES: list[Literal["Cs"]] = ["Cs"]
characters = st.characters(exclude_categories=SURROGATES)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(characters, max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(characters, max_size=10), children, max_size=4)
    ),
    max_leaves=8,
)
message_classes = st.sampled_from(MESSAGE_TYPES)


def decodes_or_is_rejected(raw: bytes) -> Message | None:
    """Decode; a MessageRejected is fine, anything else escapes and fails the test.

    Whatever does decode must survive a round trip unchanged."""
    try:
        message = decode(raw)
    except MessageRejected as exc:
        assert isinstance(exc.reason, Reason)
        return None
    assert decode(encode(message)) == message
    return message


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_are_only_ever_rejected(raw: bytes) -> None:
    decodes_or_is_rejected(raw)


@FAST
@given(json_values)
def test_arbitrary_json_values_are_only_ever_rejected(value: Any) -> None:
    assert decodes_or_is_rejected(json.dumps(value).encode()) is None


FIELD_NAMES = sorted({name for cls in MESSAGE_TYPES for name in cls.model_fields} - {"type"})


@FAST
@given(
    message_classes,
    st.dictionaries(
        st.sampled_from(FIELD_NAMES) | st.text(characters, max_size=8), json_values, max_size=5
    ),
)
def test_a_known_type_with_random_fields_is_rejected_or_decoded(
    cls: type[Message], fields: dict[str, Any]
) -> None:
    result = decodes_or_is_rejected(body({**fields, "type": cls.TYPE}))

    assert result is None or type(result) is cls


@st.composite
def mutated_samples(draw: st.DrawFn) -> tuple[type[Message], dict[str, Any]]:
    """A valid sample with a few fields replaced, deleted or added, at any depth."""
    cls = draw(message_classes)
    obj = sample_json(cls)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        containers: list[dict[str, Any]] = []
        stack: list[Any] = [obj]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                containers.append(node)
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        target = draw(st.sampled_from(containers))
        keys = sorted(k for k in target if k != "type" or target is not obj)
        action = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
        if action == "add":
            target[draw(st.text(characters, max_size=12))] = draw(json_values)
        elif action == "delete":
            del target[draw(st.sampled_from(keys))]
        else:
            target[draw(st.sampled_from(keys))] = draw(json_values)
    return cls, obj


@FAST
@given(mutated_samples())
def test_a_mutated_sample_is_rejected_or_decoded_as_its_own_type(
    case: tuple[type[Message], dict[str, Any]],
) -> None:
    cls, obj = case

    result = decodes_or_is_rejected(body(obj))

    assert result is None or type(result) is cls


def test_a_message_with_an_integer_beyond_64_bits_still_round_trips() -> None:
    # Found by the mutation property above: JSON allows it, orjson cannot write it.
    message = decode(
        b'{"type": "mesh.task.v1", "task_id": "t-1", "capability": "calc.add",'
        b' "payload": {"n": -9223372036854775809}, "submitted_at": 1.0}'
    )

    assert decode(encode(message)) == message


def test_a_field_added_to_a_released_message_is_left_out_while_unset() -> None:
    """``pool_epoch`` came to ``mesh.registration-accepted.v1`` after its release: unset, it
    is not in the body, so an agent that predates it (and refuses unknown fields) reads the
    acceptance; set (only for agents listing ``pool-epoch``), it is there."""
    bare = orjson.loads(encode(RegistrationAccepted(agent_id="a-1", incarnation="i-1")))
    assert "pool_epoch" not in bare
    told = RegistrationAccepted(
        agent_id="a-1",
        incarnation="i-1",
        pool_epoch=PoolEpoch(pool_id="p", descriptor_epoch=2, policy_generation=1),
    )
    body = orjson.loads(encode(told))
    assert body["pool_epoch"]["descriptor_epoch"] == 2
    assert decode(encode(told)) == told
