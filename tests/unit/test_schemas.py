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
    EVENT_DETAILS,
    MESSAGE_TYPES,
    AgentRegistration,
    FindReply,
    Heartbeat,
    LeaseGranted,
    Message,
    OrchestrationEvent,
    Refusal,
    StatusRequest,
    TaskResult,
    decode,
    encode,
)
from mesh.wire.events import detail_schema_name
from mesh.wire.schemas import drift

from .samples import EVENT_DETAIL_SAMPLES, SAMPLES, sample_json

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
        "schemas/ is out of date with the models in mesh/wire/: run `mesh schemas export` "
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

    assert committed == (
        {cls.TYPE for cls in MESSAGE_TYPES}
        | {"mesh.capability.v1"}
        | {detail_schema_name(kind) for kind in EVENT_DETAILS}
    )


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


# ---- orchestration events: the detail follows the kind ----------------------------------


def event_json(kind: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {**sample_json(OrchestrationEvent), "kind": kind, "detail": detail}


def test_every_event_kind_has_a_sample_detail() -> None:
    assert set(EVENT_DETAIL_SAMPLES) == set(EVENT_DETAILS)


def test_a_detail_schema_is_named_after_its_kind_with_hyphens() -> None:
    assert detail_schema_name("grant_revoked") == "mesh.event.grant-revoked.v1"
    assert detail_schema_name("lost") == "mesh.event.lost.v1"


@pytest.mark.parametrize("kind", sorted(EVENT_DETAILS))
def test_every_kinds_sample_detail_validates_against_its_committed_schemas(kind: str) -> None:
    detail = EVENT_DETAIL_SAMPLES[kind]

    assert schema_errors(detail_schema_name(kind), detail) == []
    assert schema_errors(OrchestrationEvent.TYPE, event_json(kind, detail)) == []


def test_the_event_schema_lists_the_kinds_and_holds_each_kinds_detail_schema() -> None:
    schema = committed_schema(OrchestrationEvent.TYPE)
    rules = {
        rule["if"]["properties"]["kind"]["const"]: rule["then"]["properties"]["detail"]
        for rule in schema["allOf"]
    }

    assert schema["properties"]["kind"]["enum"] == sorted(EVENT_DETAILS)
    assert sorted(rules) == sorted(EVENT_DETAILS)
    for kind, detail in rules.items():
        own = committed_schema(detail_schema_name(kind))
        assert detail == {k: v for k, v in own.items() if k not in ("$schema", "$id")}, kind


def _revoked(**changes: Any) -> dict[str, Any]:
    return {**EVENT_DETAIL_SAMPLES["grant_revoked"], **changes}


# (kind, a detail that kind does not allow)
BAD_EVENT_DETAILS: list[tuple[str, dict[str, Any]]] = [
    ("acquired", {}),
    ("acquired", {"lease_id": ""}),
    ("acquired", EVENT_DETAIL_SAMPLES["grant_revoked"]),  # another kind's detail
    ("grant_revoked", _revoked(fence="41")),
    ("grant_revoked", _revoked(fence=0)),
    ("grant_revoked", _revoked(evicted="yes")),
    ("grant_revoked", _revoked(security="")),
    ("grant_revoked", _revoked(pool_id="has.dots")),
    ("pressure_stage", {**EVENT_DETAIL_SAMPLES["pressure_stage"], "to": "PANIC"}),
    ("version_drift", {"versions": ["1.2.0"]}),
    ("version_drift", {"versions": ["1.2", "1.3"]}),
    ("drain_confirmed", {"pool_in_flight": {"calc.add": -1}, "leases": 0}),
    ("scale", {"deployment": "calc", "replicas": True}),
    ("capability_available", {"version": "1.2.0", "cost_class": "D"}),
    ("admission", {**EVENT_DETAIL_SAMPLES["admission"], "outcome": "maybe"}),
    ("admission", {k: v for k, v in EVENT_DETAIL_SAMPLES["admission"].items() if k != "fence"}),
    ("descriptor_active", {**EVENT_DETAIL_SAMPLES["descriptor_active"], "descriptor_epoch": 0}),
    ("descriptor", {"pool_id": "rag-eu", "epoch": 3, "draining": "adm-1"}),
]


@pytest.mark.parametrize(
    ("kind", "detail"),
    BAD_EVENT_DETAILS,
    ids=[f"{kind}:{json.dumps(detail, sort_keys=True)}" for kind, detail in BAD_EVENT_DETAILS],
)
def test_a_detail_its_kind_does_not_allow_fails_the_committed_schemas_and_the_codec(
    kind: str, detail: dict[str, Any]
) -> None:
    event = event_json(kind, detail)

    assert schema_errors(detail_schema_name(kind), detail), f"{kind} accepted {detail}"
    assert schema_errors(OrchestrationEvent.TYPE, event), f"the event accepted {detail}"
    with pytest.raises(MessageRejected):
        decode(json.dumps(event).encode())


@pytest.mark.parametrize("kind", sorted(EVENT_DETAILS))
def test_an_unknown_detail_key_fails_every_kind(kind: str) -> None:
    detail = {**EVENT_DETAIL_SAMPLES[kind], "x_privileged": True}

    assert schema_errors(detail_schema_name(kind), detail)
    assert schema_errors(OrchestrationEvent.TYPE, event_json(kind, detail))
    with pytest.raises(MessageRejected):
        decode(json.dumps(event_json(kind, detail)).encode())


@pytest.mark.parametrize(
    "kind",
    sorted(k for k, model in EVENT_DETAILS.items() if model.model_json_schema().get("required")),
)
def test_an_event_without_the_detail_its_kind_requires_fails(kind: str) -> None:
    event = event_json(kind, {})
    del event["detail"]

    assert schema_errors(OrchestrationEvent.TYPE, event)
    with pytest.raises(MessageRejected):
        decode(json.dumps(event).encode())


def test_an_event_of_an_unknown_kind_fails_the_committed_schema_and_the_codec() -> None:
    event = event_json("teleported", {})

    assert any("teleported" in e for e in schema_errors(OrchestrationEvent.TYPE, event))
    with pytest.raises(MessageRejected, match="unknown event kind 'teleported'"):
        decode(json.dumps(event).encode())
