"""The committed JSON Schemas in schemas/: in step with the models, and usable without Python.

Samples are checked with the ``jsonschema`` library against the committed files, not with
pydantic, because that is all an agent written in another language would have.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from mesh.errors import MessageRejected
from mesh.wire import (
    MESSAGE_TYPES,
    AgentRegistration,
    FindReply,
    Heartbeat,
    LeaseGranted,
    Message,
    Refusal,
    StatusRequest,
    TaskResult,
    decode,
    encode,
)
from mesh.wire.schemas import drift

from .samples import SAMPLES, sample_json

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


@cache
def committed_schema(type_name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / f"{type_name}.json").read_text("utf-8"))
    return schema


@cache
def validator(type_name: str) -> Draft202012Validator:
    return Draft202012Validator(
        committed_schema(type_name), format_checker=Draft202012Validator.FORMAT_CHECKER
    )


def schema_errors(type_name: str, instance: Any) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator(type_name).iter_errors(instance)]


def test_the_committed_schemas_match_the_models() -> None:
    problems = drift(SCHEMAS)

    assert problems == [], (
        "schemas/ is out of date with mesh/wire/models.py: run `mesh schemas export` "
        f"and commit the result ({', '.join(problems)})"
    )


def test_the_drift_check_notices_changed_missing_and_stale_files(tmp_path: Path) -> None:
    for path in SCHEMAS.glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert drift(tmp_path) == []

    heartbeat = tmp_path / "mesh.heartbeat.v1.json"
    heartbeat.write_text(heartbeat.read_text().replace('"minimum": 0', '"minimum": 1', 1))
    (tmp_path / "mesh.task.v1.json").unlink()
    (tmp_path / "mesh.retired.v1.json").write_text("{}")

    assert drift(tmp_path) == [
        "differs: mesh.heartbeat.v1.json",
        "missing: mesh.task.v1.json",
        "stale: mesh.retired.v1.json",
    ]


def test_there_is_a_committed_schema_for_every_message_and_nothing_else() -> None:
    committed = {p.stem for p in SCHEMAS.glob("*.json")}

    assert committed == {cls.TYPE for cls in MESSAGE_TYPES} | {"mesh.capability.v1"}


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.json")), ids=lambda p: p.stem)
def test_every_committed_schema_is_a_valid_draft_2020_12_schema(path: Path) -> None:
    schema = json.loads(path.read_text(encoding="utf-8"))

    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"urn:agent-mesh:schema:{path.stem}"
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TYPE)
def test_every_message_schema_pins_and_requires_its_type(cls: type[Message]) -> None:
    schema = committed_schema(cls.TYPE)

    assert schema["properties"]["type"]["const"] == cls.TYPE
    assert "type" in schema["required"]
    without_type = sample_json(cls)
    del without_type["type"]
    assert schema_errors(cls.TYPE, without_type)
    assert schema_errors(cls.TYPE, {**sample_json(cls), "type": "mesh.something-else.v1"})


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TYPE)
def test_every_sample_as_encoded_validates_against_its_committed_schema(
    cls: type[Message],
) -> None:
    on_the_wire = json.loads(encode(SAMPLES[cls]))

    assert schema_errors(cls.TYPE, on_the_wire) == []


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TYPE)
def test_an_unknown_top_level_field_fails_the_committed_schema(cls: type[Message]) -> None:
    errors = schema_errors(cls.TYPE, {**sample_json(cls), "x_privileged": True})

    assert errors
    assert any("x_privileged" in e for e in errors)


def _set(obj: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


# (message, path to a field, a value the schema must refuse there)
BAD_VALUES: list[tuple[type[Message], tuple[str | int, ...], Any]] = [
    (Heartbeat, ("seq",), "seven"),
    (Heartbeat, ("seq",), -1),
    (Heartbeat, ("agent_id",), "has.dots"),
    (Heartbeat, ("in_flight", "calc.add"), -1),
    (Heartbeat, ("draining",), "perhaps"),
    (AgentRegistration, ("capabilities",), []),
    (AgentRegistration, ("capabilities", 0, "max_concurrency"), 0),
    (AgentRegistration, ("capabilities", 0, "cost_class"), "D"),
    (AgentRegistration, ("capabilities", 0, "version"), "1.0"),
    (AgentRegistration, ("capabilities", 0, "name"), "search"),
    (AgentRegistration, ("capabilities", 0, "input_schema"), "not an object"),
    (AgentRegistration, ("capabilities", 0, "smuggled"), "field"),
    (AgentRegistration, ("heartbeat_interval_s",), 0),
    (Refusal, ("reason",), "BECAUSE"),
    (TaskResult, ("status",), "maybe"),
    (TaskResult, ("error", "code"), "OOPS"),
    (LeaseGranted, ("lease", "extra"), 1),
    (FindReply, ("agents", 0, "cost_class"), "Z"),
]


@pytest.mark.parametrize(
    ("cls", "path", "value"),
    BAD_VALUES,
    ids=[f"{cls.TYPE}:{'.'.join(map(str, path))}={value!r}" for cls, path, value in BAD_VALUES],
)
def test_a_wrong_or_unknown_nested_value_fails_the_committed_schema(
    cls: type[Message], path: tuple[str | int, ...], value: Any
) -> None:
    bad = _set(sample_json(cls), path, value)

    assert schema_errors(cls.TYPE, bad), f"the schema accepted {path}={value!r}"
    with pytest.raises(MessageRejected):  # and the Python codec agrees
        decode(json.dumps(bad).encode())


def test_a_message_without_fields_is_still_an_object_with_only_its_type() -> None:
    assert schema_errors(StatusRequest.TYPE, {"type": StatusRequest.TYPE}) == []
    assert schema_errors(StatusRequest.TYPE, [StatusRequest.TYPE])


LAX_VALUES: list[tuple[type[Message], str, Any]] = [
    (Heartbeat, "seq", "42"),
    (Heartbeat, "seq", True),
    (Heartbeat, "draining", "true"),
    (Heartbeat, "draining", "no"),
    (Heartbeat, "sent_at", "1700000000"),
]


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    LAX_VALUES,
    ids=[f"{field}={value!r}" for _, field, value in LAX_VALUES],
)
def test_the_codec_refuses_what_the_committed_schema_refuses(
    cls: type[Message], field: str, value: Any
) -> None:
    bad = {**sample_json(cls), field: value}
    assert schema_errors(cls.TYPE, bad)

    with pytest.raises(MessageRejected):
        decode(json.dumps(bad).encode())
