"""The admission wire models: strict at the edge, invariants enforced, a digest that is stable."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import types
import typing
from typing import Any, Literal

import orjson
import pytest
from pydantic import ValidationError

from mesh.errors import MessageRejected
from mesh.ledger.model import LEDGER_REASONS, LedgerReason
from mesh.wire import (
    ADMISSION_MESSAGE_TYPES,
    MESSAGE_TYPES,
    AdmissionDecision,
    AdmissionReason,
    AdmissionReleaseReply,
    AdmissionRequest,
    CapabilityDescriptor,
    Message,
    Reason,
    TaskRequirements,
    decode,
    encode,
    requirement_digest,
)
from mesh.wire.models import WireModel
from mesh.wire.reasons import ADMISSION_REASONS

from .samples import DESCRIPTOR, GRANT, REQUIREMENTS, SAMPLES, sample_json

TENANT = "acme"


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def rejection(obj: Any) -> MessageRejected:
    with pytest.raises(MessageRejected) as caught:
        decode(body(obj))
    return caught.value


def with_change(obj: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(obj))
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def descriptor_json(**changes: Any) -> dict[str, Any]:
    return {**sample_json(CapabilityDescriptor), **changes}


def requirements_json(**changes: Any) -> dict[str, Any]:
    return {**sample_json(TaskRequirements), **changes}


def decision_json(**changes: Any) -> dict[str, Any]:
    return {**sample_json(AdmissionDecision), **changes}


# ---- registration --------------------------------------------------------------------------


def test_every_admission_message_is_a_registered_wire_message() -> None:
    assert set(ADMISSION_MESSAGE_TYPES) <= set(MESSAGE_TYPES)
    assert {cls.TYPE for cls in ADMISSION_MESSAGE_TYPES} == {
        "mesh.capability-descriptor.v1",
        "mesh.task-requirements.v1",
        "mesh.admission-request.v1",
        "mesh.descriptor-accepted.v1",
        "mesh.descriptor-shadow.v1",
        "mesh.explain-request.v1",
        "mesh.explain-reply.v1",
        "mesh.admission-decision.v1",
        "mesh.admission-release.v1",
        "mesh.admission-revoke.v1",
        "mesh.admission-release-reply.v1",
    }


@pytest.mark.parametrize("first", ["mesh.wire.admission", "mesh.wire.models", "mesh.wire.codec"])
def test_the_admission_messages_are_registered_whichever_module_is_imported_first(
    first: str,
) -> None:
    script = (
        f"import {first}\n"
        "from mesh.wire.codec import REGISTRY\n"
        "print('mesh.admission-request.v1' in REGISTRY)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )

    assert done.stdout.strip() == "True"


def test_the_admission_reasons_are_the_documented_stable_strings() -> None:
    assert {r.value for r in ADMISSION_REASONS} == {
        "NO_ELIGIBLE_POOL",
        "NO_LIVE_AGENT",
        "CAPACITY",
        "TENANT_BUDGET",
        "STALE_EPOCH",
        "STALE_GENERATION",
        "DESCRIPTOR_EXPIRED",
        "CONFLICT",
        "INVALID_REQUEST",
        "STALE_FENCE",
        "NOT_FOUND",
        "EXTERNAL_GRANT_FAILED",
        "LEDGER_UNAVAILABLE",
        "SHED",
        "TENANT_FAIR_SHARE",
        "DEADLINE_UNREACHABLE",
        "QUEUE_FULL",
        "EVICTED",
        "NOT_AUTHORIZED",
        "RUN_CONCURRENCY",
    }


def test_there_is_one_reason_enum_and_its_strings_are_its_names() -> None:
    """Decisions, refusals, task errors, dead letters and the ledger say why in one
    vocabulary; the old names are the same enum, kept for one version."""
    assert AdmissionReason is Reason and LedgerReason is Reason
    assert [r.value for r in Reason] == [r.name for r in Reason]
    assert LEDGER_REASONS <= ADMISSION_REASONS <= set(Reason)


# ---- unknown fields deny, at any depth --------------------------------------------------------

UNKNOWN_FIELD_PATHS: list[tuple[type[Message], tuple[str | int, ...]]] = [
    (CapabilityDescriptor, ("agent_claims",)),
    (CapabilityDescriptor, ("tools", 0, "privileged")),
    (CapabilityDescriptor, ("capabilities", 0, "weight")),
    (CapabilityDescriptor, ("tenant_isolation", "override")),
    (CapabilityDescriptor, ("model_limits", "burst")),
    (CapabilityDescriptor, ("sandbox", "network")),
    (CapabilityDescriptor, ("health", "score")),
    (TaskRequirements, ("tenant",)),
    (TaskRequirements, ("capability", "score")),
    (TaskRequirements, ("required_tools", 0, "unlimited")),
    (AdmissionRequest, ("tenant",)),
    (AdmissionRequest, ("requirements", "tenant")),
    (AdmissionDecision, ("grant", "scope")),
]


@pytest.mark.parametrize(
    ("cls", "path"),
    UNKNOWN_FIELD_PATHS,
    ids=[f"{cls.TYPE}:{'.'.join(map(str, path))}" for cls, path in UNKNOWN_FIELD_PATHS],
)
def test_an_unknown_field_anywhere_is_refused_as_an_unknown_field(
    cls: type[Message], path: tuple[str | int, ...]
) -> None:
    exc = rejection(with_change(sample_json(cls), path, "x"))

    assert exc.reason == Reason.UNKNOWN_FIELD
    assert ".".join(map(str, path)) in exc.detail


def test_requirements_carry_no_tenant_the_tenant_is_the_authenticated_producer() -> None:
    assert "tenant" not in TaskRequirements.model_fields
    assert "tenant" not in AdmissionRequest.model_fields


# ---- the capability descriptor -----------------------------------------------------------------

BAD_DESCRIPTORS: list[tuple[str, tuple[str | int, ...], Any]] = [
    ("pool id with a dot", ("pool_id",), "rag.eu"),
    ("pool id empty", ("pool_id",), ""),
    ("epoch zero", ("descriptor_epoch",), 0),
    ("epoch past 2**53 - 1", ("descriptor_epoch",), 2**53),
    ("digest not sha256", ("runtime_digest",), "md5:" + "ab" * 16),
    ("digest too short", ("runtime_digest",), "sha256:abc"),
    ("digest upper case", ("runtime_digest",), "sha256:" + "AB" * 32),
    ("no capabilities", ("capabilities",), []),
    ("capability spec invalid", ("capabilities", 0, "version_spec"), ">=>2"),
    ("capability spec empty", ("capabilities", 0, "version_spec"), ""),
    ("task schema range invalid", ("task_schema_range",), "one to two"),
    ("result schema range invalid", ("result_schema_range",), "~=1"),
    ("tool version not semver", ("tools", 0, "version"), "2.1"),
    ("tool permits negative", ("tools", 0, "permits"), -1),
    ("tool name upper case", ("tools", 0, "name"), "WebSearch"),
    ("unknown label", ("data_classifications",), ["public", "secret"]),
    ("repeated label", ("data_classifications",), ["public", "public"]),
    ("unknown isolation mode", ("tenant_isolation", "mode"), "pooled"),
    ("dedicated without tenants", ("tenant_isolation",), {"mode": "dedicated", "tenants": []}),
    ("repeated tenant", ("tenant_isolation", "tenants"), ["a", "a"]),
    ("no regions", ("regions",), []),
    ("region upper case", ("regions",), ["EU-West-1"]),
    ("repeated region", ("regions",), ["eu-west-1", "eu-west-1"]),
    ("zero context", ("model_limits", "context_tokens"), 0),
    ("negative slots", ("model_limits", "slots"), -1),
    ("negative sandboxes", ("sandbox", "count"), -1),
    ("generation zero", ("policy_generation",), 0),
    ("unknown health", ("health", "status"), "fine"),
    ("expires at issue", ("expires_at",), sample_json(CapabilityDescriptor)["issued_at"]),
    ("expires before issue", ("expires_at",), 1.0),
    ("no issuer", ("issued_by",), ""),
]


@pytest.mark.parametrize(
    ("path", "value"),
    [(path, value) for _, path, value in BAD_DESCRIPTORS],
    ids=[name for name, _, _ in BAD_DESCRIPTORS],
)
def test_a_bad_descriptor_is_refused(path: tuple[str | int, ...], value: Any) -> None:
    bad = with_change(descriptor_json(), path, value)

    with pytest.raises(ValidationError):
        CapabilityDescriptor.model_validate(bad)
    assert rejection(bad).reason == Reason.SCHEMA_VIOLATION


def test_a_descriptor_names_each_capability_and_tool_once() -> None:
    obj = descriptor_json()
    obj["capabilities"] = [obj["capabilities"][0], obj["capabilities"][0]]
    with pytest.raises(ValidationError, match="distinct"):
        CapabilityDescriptor.model_validate(obj)

    obj = descriptor_json()
    obj["tools"] = [obj["tools"][0], {**obj["tools"][0], "version": "3.0.0"}]
    with pytest.raises(ValidationError, match="distinct"):
        CapabilityDescriptor.model_validate(obj)


def test_a_dedicated_pool_with_tenants_and_a_shared_pool_without_are_both_valid() -> None:
    dedicated = {"mode": "dedicated", "tenants": ["acme"]}

    assert CapabilityDescriptor.model_validate(descriptor_json(tenant_isolation=dedicated))
    assert DESCRIPTOR.tenant_isolation.mode == "shared"
    assert DESCRIPTOR.tenant_isolation.tenants == []


# ---- task requirements ---------------------------------------------------------------------------

BAD_REQUIREMENTS: list[tuple[str, tuple[str | int, ...], Any]] = [
    ("capability not dotted", ("capability", "name"), "search"),
    ("capability spec invalid", ("capability", "version_spec"), "2.x"),
    ("task schema not semver", ("task_schema_version",), "1.4"),
    ("result schema not semver", ("result_schema_version",), "v2.0.0"),
    ("no input label", ("input_classifications",), []),
    ("unknown input label", ("input_classifications",), ["top-secret"]),
    ("repeated input label", ("input_classifications",), ["internal", "internal"]),
    ("tool permits zero", ("required_tools", 0, "permits"), 0),
    ("tool spec invalid", ("required_tools", 0, "version_spec"), "=>2"),
    ("negative tokens", ("estimated_tokens",), -1),
    # Past what JSON readers keep exactly: refused here, not as a failure deep in a batch.
    ("tokens past 2**53 - 1", ("estimated_tokens",), 2**53),
    ("tokens past 64 bits", ("estimated_tokens",), 2**70),
    ("tool permits past 64 bits", ("required_tools", 0, "permits"), 2**70),
    ("negative duration", ("estimated_duration_s",), -0.5),
    ("negative deadline", ("deadline",), -1),
    ("priority ten", ("priority",), 10),
    ("priority negative", ("priority",), -1),
    ("unknown service class", ("service_class",), "urgent"),
    ("unknown degradation", ("allowed_degradations",), ["skip_safety_checks"]),
    ("repeated degradation", ("allowed_degradations",), ["partial_results"] * 2),
    ("fallback not a pool id", ("allowed_fallbacks",), ["rag.eu"]),
    ("repeated fallback", ("allowed_fallbacks",), ["rag-eu-2", "rag-eu-2"]),
    ("repeated region", ("regions",), ["eu-west-1", "eu-west-1"]),
]


@pytest.mark.parametrize(
    ("path", "value"),
    [(path, value) for _, path, value in BAD_REQUIREMENTS],
    ids=[name for name, _, _ in BAD_REQUIREMENTS],
)
def test_bad_requirements_are_refused(path: tuple[str | int, ...], value: Any) -> None:
    bad = with_change(requirements_json(), path, value)

    with pytest.raises(ValidationError):
        TaskRequirements.model_validate(bad)
    request = {**sample_json(AdmissionRequest), "requirements": bad}
    assert rejection(request).reason == Reason.SCHEMA_VIOLATION


def test_requirements_name_each_required_tool_once() -> None:
    obj = requirements_json()
    obj["required_tools"] = [obj["required_tools"][0], {**obj["required_tools"][0], "permits": 1}]

    with pytest.raises(ValidationError, match="distinct"):
        TaskRequirements.model_validate(obj)


def test_minimal_requirements_take_the_conservative_defaults() -> None:
    minimal = TaskRequirements.model_validate(
        {
            "capability": {"name": "rag.search"},
            "task_schema_version": "1.0.0",
            "result_schema_version": "1.0.0",
            "input_classifications": ["public"],
            "estimated_tokens": 0,
            "estimated_duration_s": 1.0,
        }
    )

    assert minimal.capability.version_spec == ">=0"
    assert minimal.required_tools == []
    assert minimal.needs_sandbox is False
    assert minimal.regions == []
    assert (minimal.priority, minimal.service_class) == (0, "batch")
    assert minimal.allowed_degradations == []
    assert minimal.allowed_fallbacks == []


# ---- decisions and release replies ---------------------------------------------------------------

GRANT_JSON = GRANT.model_dump(mode="json")

BAD_DECISIONS: list[tuple[str, dict[str, Any]]] = [
    ("admitted without a grant", {"outcome": "admitted", "grant": None}),
    ("admitted with a reason", {"outcome": "admitted", "reason": "CAPACITY"}),
    ("admitted with a retry time", {"outcome": "admitted", "retry_after_ms": 100}),
    ("a grant for another admission", {"grant": {**GRANT_JSON, "admission_id": "adm-2"}}),
    ("rejected with a grant", {"outcome": "rejected", "reason": "CAPACITY"}),
    ("rejected without a reason", {"outcome": "rejected", "grant": None}),
    ("deferred without a reason", {"outcome": "deferred", "grant": None}),
    ("unknown outcome", {"outcome": "maybe"}),
    ("unknown reason", {"outcome": "rejected", "grant": None, "reason": "BECAUSE"}),
    ("negative retry", {"outcome": "deferred", "grant": None, "reason": "CAPACITY",
                        "retry_after_ms": -1}),
    ("grant fence zero", {"grant": {**GRANT_JSON, "fence": 0}}),
]  # fmt: skip


@pytest.mark.parametrize(
    "changes", [c for _, c in BAD_DECISIONS], ids=[name for name, _ in BAD_DECISIONS]
)
def test_a_decision_breaking_its_invariants_is_refused(changes: dict[str, Any]) -> None:
    bad = decision_json(**changes)

    with pytest.raises(ValidationError):
        AdmissionDecision.model_validate(bad)
    assert rejection(bad).reason == Reason.SCHEMA_VIOLATION


@pytest.mark.parametrize("outcome", ["rejected", "deferred"])
def test_a_refusal_carries_a_reason_a_retry_time_and_the_permitted_degradations(
    outcome: Literal["rejected", "deferred"],
) -> None:
    decision = AdmissionDecision(
        admission_id="adm-1",
        outcome=outcome,
        reason=AdmissionReason.CAPACITY,
        detail="model_slots: 16 of 16 in use",
        retry_after_ms=250,
        allowed_degradations=["partial_results"],
    )

    assert decode(encode(decision)) == decision
    assert decision.grant is None


def test_an_admitted_decision_carries_the_grant_for_its_own_admission() -> None:
    decision = SAMPLES[AdmissionDecision]

    assert isinstance(decision, AdmissionDecision)
    assert decision.grant == GRANT
    assert decision.reason is None


@pytest.mark.parametrize(
    ("released", "reason"), [(True, "STALE_FENCE"), (False, None)], ids=["ok+reason", "no+none"]
)
def test_a_release_reply_has_a_reason_exactly_when_it_released_nothing(
    released: bool, reason: str | None
) -> None:
    bad = {**sample_json(AdmissionReleaseReply), "released": released, "reason": reason}

    with pytest.raises(ValidationError):
        AdmissionReleaseReply.model_validate(bad)
    assert AdmissionReleaseReply(admission_id="adm-1", released=True).reason is None


# ---- the requirement digest ----------------------------------------------------------------------


def _reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed_keys(v) for k, v in reversed(list(value.items()))}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


def test_the_digest_is_sha256_hex() -> None:
    digest = requirement_digest(REQUIREMENTS, TENANT)

    # The documented canonical form, written by hand with the standard library: sorted keys,
    # no spaces, the requirements as their JSON dump, and the tenant.
    canonical = json.dumps(
        {"requirements": REQUIREMENTS.model_dump(mode="json"), "tenant": TENANT},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert digest == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.parametrize(
    "requirements",
    [
        REQUIREMENTS,
        TaskRequirements.model_validate(  # the fewest fields, every default taken
            {
                "capability": {"name": "math.add"},
                "task_schema_version": "1.0.0",
                "result_schema_version": "1.0.0",
                "input_classifications": ["public"],
                "estimated_tokens": 0,
                "estimated_duration_s": 0,  # an int on the wire: a float in the model
            }
        ),
        REQUIREMENTS.model_copy(
            update={"run_id": "run-é-1", "deadline": 1e-7, "recoverability": "rebuildable"}
        ),
    ],
    ids=["sample", "defaults", "unicode-and-small-float"],
)
def test_the_digest_is_the_sha256_of_the_sorted_json_of_requirements_and_tenant(
    requirements: TaskRequirements,
) -> None:
    # The definition, spelled out the slow way: stored digests depend on it never changing.
    canonical = orjson.dumps(
        {"requirements": requirements.model_dump(mode="json"), "tenant": TENANT},
        option=orjson.OPT_SORT_KEYS,
    )

    assert requirement_digest(requirements, TENANT) == (
        "sha256:" + hashlib.sha256(canonical).hexdigest()
    )


def _plain_json_types(annotation: object, where: str) -> list[str]:
    """What in ``annotation`` is not plain JSON (str, int, float, bool, None, list, a str
    Literal) or a wire model made only of those: the digest writes models' fields as they
    are, which equals ``model_dump(mode="json")`` only for such types."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _plain_json_types(args[0], where)
    if origin is typing.Literal:
        return [] if all(isinstance(a, str) for a in args) else [f"{where}: {annotation}"]
    if origin in (list, types.UnionType, typing.Union):
        return [bad for arg in args for bad in _plain_json_types(arg, where)]
    if isinstance(annotation, type) and issubclass(annotation, WireModel):
        return [
            bad
            for name, info in annotation.model_fields.items()
            for bad in _plain_json_types(info.annotation, f"{annotation.__name__}.{name}")
        ] + [f"{annotation.__name__}: computed fields" for _ in annotation.model_computed_fields]
    if annotation in (str, int, float, bool, type(None)):
        return []
    return [f"{where}: {annotation}"]


def test_every_field_under_task_requirements_is_a_plain_json_type() -> None:
    assert _plain_json_types(TaskRequirements, "TaskRequirements") == []
    # The walk itself notices what it must: a set, a datetime, a computed field.
    assert _plain_json_types(set[str], "x") == ["x: set[str]"]
    assert _plain_json_types(list[datetime.datetime] | None, "x") == [
        "x: <class 'datetime.datetime'>"
    ]


def test_the_digest_ignores_key_order_and_formatting_of_the_input_json() -> None:
    raw = json.dumps(_reversed_keys(requirements_json()), indent=3).encode()

    again = TaskRequirements.model_validate_json(raw)

    assert requirement_digest(again, TENANT) == requirement_digest(REQUIREMENTS, TENANT)


def test_the_digest_survives_a_trip_over_the_wire_inside_a_request() -> None:
    request = decode(encode(SAMPLES[AdmissionRequest]))

    assert isinstance(request, AdmissionRequest)
    assert requirement_digest(request.requirements, TENANT) == requirement_digest(
        REQUIREMENTS, TENANT
    )


def test_the_digest_is_the_same_in_another_process() -> None:
    raw = encode(REQUIREMENTS).decode()
    script = (
        "import sys\n"
        "from mesh.wire import TaskRequirements, requirement_digest\n"
        "r = TaskRequirements.model_validate_json(sys.stdin.read())\n"
        f"print(requirement_digest(r, {TENANT!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=raw,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},  # not the parent's seed
    )

    assert done.stdout.strip() == requirement_digest(REQUIREMENTS, TENANT)


# One change to every field (and to some nested ones); each must change the digest.
FIELD_CHANGES: list[tuple[tuple[str | int, ...], Any]] = [
    (("capability", "name"), "rag.answer"),
    (("capability", "version_spec"), ">=2.2"),
    (("task_schema_version",), "1.4.1"),
    (("result_schema_version",), "2.0.1"),
    (("input_classifications",), ["internal", "confidential"]),
    (("required_tools",), []),
    (("required_tools", 0, "permits"), 3),
    (("required_tools", 0, "version_spec"), ">=2.1"),
    (("estimated_tokens",), 12_001),
    (("needs_sandbox",), False),
    (("estimated_duration_s",), 30.5),
    (("deadline",), None),
    (("regions",), ["eu-central-1"]),
    (("priority",), 6),
    (("service_class",), "batch"),
    (("recoverability",), "retryable"),
    (("run_id",), "run-7"),
    (("allowed_degradations",), ["less_retrieval"]),
    (("allowed_fallbacks",), []),
]


def test_the_field_changes_cover_every_requirement_field() -> None:
    changed = {path[0] for path, _ in FIELD_CHANGES}

    assert changed == set(TaskRequirements.model_fields) - {"type"}


@pytest.mark.parametrize(
    ("path", "value"), FIELD_CHANGES, ids=[".".join(map(str, p)) for p, _ in FIELD_CHANGES]
)
def test_any_field_change_changes_the_digest(path: tuple[str | int, ...], value: Any) -> None:
    changed = TaskRequirements.model_validate(with_change(requirements_json(), path, value))

    assert changed != REQUIREMENTS
    assert requirement_digest(changed, TENANT) != requirement_digest(REQUIREMENTS, TENANT)


def test_the_tenant_is_part_of_the_digest() -> None:
    assert requirement_digest(REQUIREMENTS, "acme") != requirement_digest(REQUIREMENTS, "globex")


def test_list_order_is_part_of_the_request_and_so_of_the_digest() -> None:
    reordered = REQUIREMENTS.model_copy(
        update={"allowed_degradations": ["partial_results", "less_retrieval"]}
    )

    assert requirement_digest(reordered, TENANT) != requirement_digest(REQUIREMENTS, TENANT)
