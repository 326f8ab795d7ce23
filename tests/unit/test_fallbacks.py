"""Fallbacks never widen: a backup pool stands in for the primary only if it gives the task
nothing the primary would not — rule by rule, in every combination, and in the admitter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.core.eligibility import WIDENING_RULES, widening
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.wire import AdmissionReason, AdmissionRequest, CapabilityDescriptor, TaskRequirements

from .samples import DESCRIPTOR, REQUIREMENTS, T0

PRIMARY = DESCRIPTOR  # rag-eu: eu-west-1 + eu-central-1; public/internal/confidential; shared


def descriptor(**changes: Any) -> CapabilityDescriptor:
    return CapabilityDescriptor.model_validate({**DESCRIPTOR.model_dump(mode="json"), **changes})


def requirements(**changes: Any) -> TaskRequirements:
    return TaskRequirements.model_validate({**REQUIREMENTS.model_dump(mode="json"), **changes})


def backup(**changes: Any) -> CapabilityDescriptor:
    return descriptor(pool_id="rag-eu-2", **changes)


TOOLS = [
    {"name": "web-search", "version": "2.1.0", "permits": 8},
    {"name": "code.exec", "version": "1.0.0", "permits": 2},
]
DEDICATED = {"mode": "dedicated", "tenants": ["acme"]}


# ---- one rule at a time -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("primary", "standby", "task", "rule"),
    [
        pytest.param({}, {}, {}, None, id="the same pool under another name"),
        pytest.param({}, {"result_schema_range": ">=3"}, {}, "result_schema", id="result schema"),
        pytest.param({}, {"regions": ["us-east-1"]}, {}, "regions", id="another region"),
        pytest.param(
            {}, {"regions": ["eu-west-1", "us-east-1"]}, {}, "regions", id="one region more"
        ),
        pytest.param(
            {},
            {"regions": ["us-east-1"]},
            {"regions": ["eu-west-1", "us-east-1"]},
            None,
            id="a region the task allows",
        ),
        pytest.param(
            {}, {"regions": ["eu-central-1"]}, {}, None, id="within the primary's regions"
        ),
        pytest.param(
            {},
            {"regions": ["eu-west-1"]},
            {"regions": []},
            None,
            id="task names no region: the primary's",
        ),
        pytest.param(
            {"data_classifications": ["internal"]},
            {"data_classifications": ["public", "internal"]},
            {},
            "classifications",
            id="one label more",
        ),
        pytest.param(
            {}, {"data_classifications": ["internal"]}, {}, None, id="fewer labels is narrower"
        ),
        pytest.param(
            {"tenant_isolation": DEDICATED},
            {"tenant_isolation": {"mode": "shared", "tenants": []}},
            {},
            "tenants",
            id="dedicated to public",
        ),
        pytest.param(
            {"tenant_isolation": DEDICATED},
            {"tenant_isolation": {"mode": "shared", "tenants": ["acme"]}},
            {},
            "tenants",
            id="dedicated to shared",
        ),
        pytest.param(
            {"tenant_isolation": {"mode": "shared", "tenants": ["acme"]}},
            {"tenant_isolation": {"mode": "shared", "tenants": ["acme", "beta"]}},
            {},
            "tenants",
            id="one tenant more",
        ),
        pytest.param(
            {"tenant_isolation": {"mode": "shared", "tenants": ["acme", "beta"]}},
            {"tenant_isolation": DEDICATED},
            {},
            None,
            id="shared to dedicated is narrower",
        ),
        pytest.param(
            {"tools": TOOLS[:1]}, {"tools": TOOLS}, {}, "tools", id="a tool the primary lacks"
        ),
        pytest.param(
            {},
            {"tools": [{**TOOLS[0], "version": "3.0.0"}, TOOLS[1]]},
            {},
            "tools",
            id="another major version of a tool",
        ),
        pytest.param(
            {}, {"tools": [{**TOOLS[0], "version": "2.9.1"}]}, {}, None, id="same major, fewer"
        ),
        pytest.param(
            {},
            {"sandbox": {"kind": "none", "count": 4}},
            {},
            "sandbox",
            id="another sandbox kind",
        ),
        pytest.param(
            {},
            {"sandbox": {"kind": "none", "count": 4}},
            {"needs_sandbox": False},
            None,
            id="sandbox kind, task needs none",
        ),
    ],
)
def test_each_way_of_widening_is_refused_by_its_rule(
    primary: dict[str, Any], standby: dict[str, Any], task: dict[str, Any], rule: str | None
) -> None:
    found = widening(descriptor(**primary), backup(**standby), requirements(**task))

    assert (found[0] if found else None) == rule, found
    if found:
        assert found[1]  # says what


# ---- every combination, against a model written independently -----------------------------------
REGIONS = ["eu-west-1", "eu-central-1", "us-east-1"]
LABELS = ["public", "internal", "confidential", "restricted"]
TENANTS = ["acme", "beta", "gamma"]
ANYONE = "<any other tenant>"


def subsets(values: list[str], min_size: int = 0) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(values), unique=True, min_size=min_size).map(
        lambda xs: sorted(xs, key=values.index)
    )


isolations = st.one_of(
    st.builds(lambda t: {"mode": "dedicated", "tenants": t}, subsets(TENANTS, 1)),
    st.builds(lambda t: {"mode": "shared", "tenants": t}, subsets(TENANTS)),
)
tools = st.lists(
    st.tuples(st.sampled_from(["web-search", "code.exec"]), st.sampled_from(["1.0.0", "1.5.0"])),
    unique_by=lambda t: t[0],
).map(lambda ts: [{"name": n, "version": v, "permits": 2} for n, v in ts])
pools = st.fixed_dictionaries(
    {
        "regions": subsets(REGIONS, 1),
        "data_classifications": subsets(LABELS),
        "tenant_isolation": isolations,
        "tools": tools,
        "sandbox": st.sampled_from(["gvisor", "firecracker"]).map(
            lambda k: {"kind": k, "count": 2}
        ),
        "result_schema_range": st.sampled_from([">=1,<3", ">=2", "<2"]),
    }
)
tasks = st.fixed_dictionaries(
    {"regions": subsets(REGIONS), "needs_sandbox": st.booleans(), "required_tools": st.just([])}
)


def may_serve(pool: dict[str, Any]) -> set[str]:
    """Who may use the pool, over a finite universe: 'anyone' is a tenant of its own."""
    isolation = pool["tenant_isolation"]
    if isolation["mode"] == "shared" and not isolation["tenants"]:
        return {*TENANTS, ANYONE}
    return set(isolation["tenants"])


def model_widens(
    primary: dict[str, Any], standby: dict[str, Any], task: dict[str, Any]
) -> set[str]:
    """Every dimension in which the backup gives more than the primary (the model)."""
    wider = set()
    produces = {">=1,<3": {"2.0.0"}, ">=2": {"2.0.0"}, "<2": set()}  # the task wants 2.0.0
    if (
        "2.0.0"
        not in produces[primary["result_schema_range"]] & produces[standby["result_schema_range"]]
    ):
        wider.add("result_schema")
    if not set(standby["regions"]) <= set(task["regions"]) | set(primary["regions"]):
        wider.add("regions")
    if not set(standby["data_classifications"]) <= set(primary["data_classifications"]):
        wider.add("classifications")
    stricter = primary["tenant_isolation"]["mode"] == "dedicated"
    if not may_serve(standby) <= may_serve(primary) or (
        stricter and standby["tenant_isolation"]["mode"] == "shared"
    ):
        wider.add("tenants")
    primary_majors = {t["name"]: t["version"].split(".")[0] for t in primary["tools"]}
    if any(primary_majors.get(t["name"]) != t["version"].split(".")[0] for t in standby["tools"]):
        wider.add("tools")
    if task["needs_sandbox"] and standby["sandbox"]["kind"] != primary["sandbox"]["kind"]:
        wider.add("sandbox")
    return wider


@settings(max_examples=400, deadline=None)
@given(primary=pools, standby=pools, task=tasks)
def test_a_fallback_is_accepted_exactly_when_it_widens_nothing(
    primary: dict[str, Any], standby: dict[str, Any], task: dict[str, Any]
) -> None:
    found = widening(descriptor(**primary), backup(**standby), requirements(**task))
    expected = model_widens(primary, standby, task)

    if not expected:
        assert found is None
    else:
        assert found is not None, f"widens {expected} but was accepted"
        # the first rule, in the fixed order, of those that fail
        assert found[0] == min(expected, key=WIDENING_RULES.index)


def test_the_combinations_accept_some_fallbacks_and_hit_every_rule() -> None:
    # Guards the property above against passing vacuously (a fixed, derandomised sample).
    seen: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(primary=pools, standby=pools, task=tasks)
    def tally(primary: dict[str, Any], standby: dict[str, Any], task: dict[str, Any]) -> None:
        found = widening(descriptor(**primary), backup(**standby), requirements(**task))
        seen[found[0] if found else "accepted"] += 1

    tally()

    assert seen["accepted"] >= 20
    assert all(seen[rule] for rule in WIDENING_RULES), seen


# ---- in the admitter --------------------------------------------------------------------------
POLICY = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def admitter(ledger: SqliteLedger, *pools: CapabilityDescriptor, slots: int = 1) -> Admitter:
    a = Admitter(ledger, POLICY)
    for pool in pools:
        limited = pool.model_copy(update={"model_limits": pool.model_limits.model_copy(
            update={"slots": slots})})  # fmt: skip
        assert a.publish_descriptor(limited, T0) is None
    return a


def admit(a: Admitter, admission_id: str, **task: Any) -> Any:
    request = AdmissionRequest(admission_id=admission_id, requirements=requirements(**task))
    return a.admit(request, "acme", T0)


def test_a_fallback_takes_over_only_when_the_primary_is_full_and_says_so(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger, PRIMARY, backup())

    first, second, third = (admit(a, f"adm-{n}") for n in range(3))

    assert first.grant.pool_id == "rag-eu" and first.grant.fallback_for is None
    assert second.grant.pool_id == "rag-eu-2" and second.grant.fallback_for == "rag-eu"
    assert third.outcome == "deferred" and third.reason is AdmissionReason.CAPACITY


def test_a_cross_region_fallback_is_refused_unless_the_task_allows_that_region(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger, PRIMARY, backup(regions=["us-east-1"]))
    assert admit(a, "adm-0").grant.pool_id == "rag-eu"

    pinned = admit(a, "adm-1", regions=["eu-west-1"])  # the backup is not even eligible
    anywhere = admit(a, "adm-2", regions=[])  # eligible, but outside the primary's regions
    allowed = admit(a, "adm-3", regions=["eu-west-1", "us-east-1"])

    assert (pinned.outcome, anywhere.outcome) == ("deferred", "deferred")
    assert allowed.outcome == "admitted" and allowed.grant.pool_id == "rag-eu-2"


@pytest.mark.parametrize(
    "wider",
    [
        {"data_classifications": ["public", "internal", "confidential", "restricted"]},
        {"tools": [*TOOLS, {"name": "shell", "version": "1.0.0", "permits": 1}]},
        {"tenant_isolation": {"mode": "shared", "tenants": ["acme", "beta"]}},
        {"sandbox": {"kind": "none", "count": 4}},
    ],
    ids=["labels", "tools", "tenants", "sandbox"],
)
def test_a_wider_fallback_is_never_granted(ledger: SqliteLedger, wider: dict[str, Any]) -> None:
    primary = descriptor(tenant_isolation={"mode": "shared", "tenants": ["acme"]})
    a = admitter(ledger, primary, backup(**wider))
    assert admit(a, "adm-0").grant.pool_id == "rag-eu"

    refused = admit(a, "adm-1")

    assert refused.outcome == "deferred" and refused.reason is AdmissionReason.CAPACITY
    assert ledger.get("adm-1") is None


def test_a_fallback_alone_stands_in_for_nothing(ledger: SqliteLedger) -> None:
    a = admitter(ledger, backup())  # the only eligible pool is one the task names as fallback

    decision = admit(a, "adm-1")

    assert decision.outcome == "rejected" and decision.reason is AdmissionReason.NO_ELIGIBLE_POOL
    assert "allowed_fallbacks" in decision.detail


def test_fallback_grants_are_counted_for_prometheus(ledger: SqliteLedger) -> None:
    from mesh.manager.metrics import ManagerMetrics, MeshView

    metrics = ManagerMetrics(MeshView(offers=lambda _: True))
    a = admitter(ledger, PRIMARY, backup())
    for n in range(3):
        metrics.admission(requirements(), admit(a, f"adm-{n}"), None)

    labels = {"capability": "rag.search"}
    assert metrics.registry.get_sample_value("mesh_fallback_grants_total", labels) == 1
