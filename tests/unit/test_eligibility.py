"""Eligibility: hard predicates in a fixed order, replayable verdicts, fallbacks never widen."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mesh.core.eligibility import (
    RULE_NAMES,
    RULES,
    EligibilityResult,
    PoolCheck,
    PoolVerdict,
    capacities,
    check_eligibility,
    common_version,
    fallback_pools,
    first_failure,
    reservation_items,
    specs_overlap,
)
from mesh.errors import LocalProtocolError
from mesh.wire import (
    AdmissionReason,
    CapabilityDescriptor,
    TaskRequirements,
)

from .samples import DESCRIPTOR, REQUIREMENTS, T0

# Scenarios take ~100 choices each; these budgets keep the module within a few seconds.
SCENARIOS = settings(max_examples=100, deadline=None)
FAST = settings(max_examples=200, deadline=None)

NOW = T0
TENANT = "acme"
POOL = DESCRIPTOR.pool_id
EPOCHS = {POOL: DESCRIPTOR.descriptor_epoch}
GENERATION = DESCRIPTOR.policy_generation


def descriptor(**changes: Any) -> CapabilityDescriptor:
    return CapabilityDescriptor.model_validate({**DESCRIPTOR.model_dump(mode="json"), **changes})


def requirements(**changes: Any) -> TaskRequirements:
    return TaskRequirements.model_validate({**REQUIREMENTS.model_dump(mode="json"), **changes})


@dataclass
class Case:
    """A change to the baseline (sample requirements, sample descriptor, current context)."""

    req: dict[str, Any] = field(default_factory=dict)
    desc: dict[str, Any] = field(default_factory=dict)
    tenant: str = TENANT
    epochs: dict[str, int] | None = None
    generation: int = GENERATION
    now: float = NOW

    def merged(self, other: Case) -> Case:
        return Case(
            req={**self.req, **other.req},
            desc={**self.desc, **other.desc},
            tenant=other.tenant if other.tenant != TENANT else self.tenant,
            epochs=other.epochs if other.epochs is not None else self.epochs,
            generation=other.generation if other.generation != GENERATION else self.generation,
            now=other.now if other.now != NOW else self.now,
        )

    def run(self) -> EligibilityResult:
        d = descriptor(**self.desc)
        return check_eligibility(
            requirements(**self.req),
            self.tenant,
            {d.pool_id: d},
            active_epochs=EPOCHS if self.epochs is None else self.epochs,
            active_generation=self.generation,
            now=self.now,
        )

    def failing_rules(self) -> list[str]:
        """Every rule the pool fails (not only the first)."""
        check = PoolCheck(
            requirements(**self.req),
            self.tenant,
            descriptor(**self.desc),
            (EPOCHS if self.epochs is None else self.epochs).get(POOL),
            self.generation,
            self.now,
        )
        return [rule.name for rule in RULES if rule.check(check) is not None]


def only_verdict(result: EligibilityResult) -> PoolVerdict:
    (verdict,) = result.verdicts
    return verdict


# ---- the baseline -------------------------------------------------------------------------------


def test_the_sample_requirements_are_eligible_on_the_sample_descriptor() -> None:
    result = Case().run()

    assert result.eligible == (POOL,)
    assert only_verdict(result) == PoolVerdict(
        pool_id=POOL, descriptor_epoch=3, active_epoch=3, policy_generation=7, rule=None, detail=""
    )
    assert result.denial_reason() is None
    assert Case().failing_rules() == []


def test_the_rules_run_in_the_documented_order() -> None:
    assert RULE_NAMES == (
        "capability_offered",
        "schema_compatible",
        "tools_allowed",
        "classification_allowed",
        "tenant_isolation",
        "region_allowed",
        "epoch_current",
        "generation_current",
        "not_expired",
        "healthy",
    )


# ---- each rule denies on its own ----------------------------------------------------------------


def cap(name: str, spec: str = ">=0") -> dict[str, Any]:
    return {"capability": {"name": name, "version_spec": spec}}


def tool(spec: str = ">=0", permits: int = 1) -> dict[str, Any]:
    return {"required_tools": [{"name": "web-search", "version_spec": spec, "permits": permits}]}


def isolation(mode: str, *tenants: str) -> dict[str, Any]:
    return {"tenant_isolation": {"mode": mode, "tenants": list(tenants)}}


ONLY_CODE_EXEC = [{"name": "code.exec", "version": "1.0.0", "permits": 2}]
UNHEALTHY = {"status": "unhealthy", "checked_at": T0 - 1}

DENIALS: list[tuple[str, str, Case, str]] = [
    ("capability_offered", "not served", Case(req=cap("rag.rerank")), "'rag.rerank' is not"),
    ("capability_offered", "no common version", Case(req=cap("rag.search", ">=3")), "no common"),
    ("capability_offered", "past the range", Case(req=cap("rag.answer", ">=2")), "no common"),
    ("schema_compatible", "task too new", Case(req={"task_schema_version": "2.0.0"}), "task"),
    ("schema_compatible", "task too old", Case(desc={"task_schema_range": ">=1.5"}), "1.4.0"),
    ("schema_compatible", "result", Case(req={"result_schema_version": "3.0.0"}), "result"),
    ("tools_allowed", "tool not allowed", Case(desc={"tools": ONLY_CODE_EXEC}), "not allowed"),
    ("tools_allowed", "tool too old", Case(req=tool(">=3")), "2.1.0 does not match '>=3'"),
    ("tools_allowed", "too many permits", Case(req=tool(permits=9)), "9 permits wanted"),
    ("classification_allowed", "restricted input",
     Case(req={"input_classifications": ["internal", "restricted"]}), "not allowed: restricted"),
    ("classification_allowed", "public pool",
     Case(desc={"data_classifications": ["public"]}), "labels not allowed: internal"),
    ("tenant_isolation", "dedicated to another", Case(desc=isolation("dedicated", "globex")),
     "'acme' is not admitted by this dedicated pool"),
    ("tenant_isolation", "shared among others", Case(desc=isolation("shared", "globex", "initech")),
     "'acme' is not admitted by this shared pool"),
    ("tenant_isolation", "a foreign tenant",
     Case(tenant="mallory", desc=isolation("dedicated", TENANT)), "'mallory'"),
    ("region_allowed", "pool elsewhere", Case(desc={"regions": ["us-east-1"]}),
     "regions eu-west-1 not served (pool: us-east-1)"),
    ("region_allowed", "data pinned elsewhere", Case(req={"regions": ["us-west-2", "ap-south-1"]}),
     "regions ap-south-1, us-west-2 not served"),
    ("epoch_current", "older epoch", Case(epochs={POOL: 4}), "descriptor epoch 3, active epoch 4"),
    ("epoch_current", "epoch not yet active", Case(epochs={POOL: 2}), "active epoch 2"),
    ("epoch_current", "unknown to the rollout", Case(epochs={}), "no active epoch"),
    ("generation_current", "older", Case(generation=8), "generation 7, active generation 8"),
    ("generation_current", "newer", Case(generation=6), "generation 7, active generation 6"),
    ("not_expired", "at the expiry instant", Case(now=DESCRIPTOR.expires_at), "expired at"),
    ("not_expired", "a day later", Case(now=DESCRIPTOR.expires_at + 86_400), "expired at"),
    ("healthy", "unhealthy", Case(desc={"health": UNHEALTHY}), "unhealthy"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "case", "detail"),
    [(rule, case, detail) for rule, _, case, detail in DENIALS],
    ids=[f"{rule}:{name}" for rule, name, _, _ in DENIALS],
)
def test_each_rule_denies_on_its_own_under_its_own_name(rule: str, case: Case, detail: str) -> None:
    result = case.run()

    verdict = only_verdict(result)
    assert result.eligible == ()
    assert verdict.rule == rule
    assert detail in verdict.detail
    assert case.failing_rules() == [rule]  # on its own: every other rule passes


def test_every_rule_has_a_denial_case() -> None:
    assert {rule for rule, _, _, _ in DENIALS} == set(RULE_NAMES)


STILL_ELIGIBLE: list[tuple[str, Case]] = [
    ("a degraded pool", Case(desc={"health": {"status": "degraded", "checked_at": T0}})),
    ("a dedicated pool of this tenant", Case(desc=isolation("dedicated", "globex", TENANT))),
    ("a shared pool listing this tenant", Case(desc=isolation("shared", TENANT))),
    ("no region asked for", Case(req={"regions": []})),
    ("one of several regions served", Case(req={"regions": ["us-east-1", "eu-central-1"]})),
    ("no tools needed", Case(req={"required_tools": []})),
    ("every permit the pool has", Case(req=tool(permits=8))),
    ("a wildcard version", Case(req=cap("rag.answer", "==1.3.*"))),
    ("an exclusive lower bound", Case(req=cap("rag.search", ">2.99"))),
    ("just before expiry", Case(now=DESCRIPTOR.expires_at - 0.001)),
]


@pytest.mark.parametrize("case", [c for _, c in STILL_ELIGIBLE], ids=[n for n, _ in STILL_ELIGIBLE])
def test_what_the_rules_allow_stays_eligible(case: Case) -> None:
    assert case.run().eligible == (POOL,)


# ---- the order of the rules ---------------------------------------------------------------------

# One breakage per rule, each touching its own input, so any combination can be applied at once.
BREAKS: dict[str, Case] = {
    "capability_offered": Case(req=cap("rag.rerank")),
    "schema_compatible": Case(desc={"task_schema_range": ">=5"}),
    "tools_allowed": Case(desc={"tools": ONLY_CODE_EXEC}),
    "classification_allowed": Case(desc={"data_classifications": ["public"]}),
    "tenant_isolation": Case(desc=isolation("dedicated", "globex")),
    "region_allowed": Case(desc={"regions": ["us-east-1"]}),
    "epoch_current": Case(epochs={POOL: 4}),
    "generation_current": Case(generation=8),
    "not_expired": Case(now=DESCRIPTOR.expires_at),
    "healthy": Case(desc={"health": UNHEALTHY}),
}


def test_a_pool_failing_several_rules_is_filtered_by_the_first_in_rule_order() -> None:
    assert list(BREAKS) == list(RULE_NAMES)
    for size in range(1, len(BREAKS) + 1):
        for broken in itertools.combinations(RULE_NAMES, size):
            case = Case()
            for name in broken:
                case = case.merged(BREAKS[name])

            assert case.failing_rules() == list(broken)
            assert only_verdict(case.run()).rule == broken[0]


# ---- misuse, unknown and several pools ----------------------------------------------------------


def test_an_empty_tenant_is_a_bug_in_the_caller() -> None:
    with pytest.raises(LocalProtocolError):
        Case(tenant="").run()
    with pytest.raises(LocalProtocolError):
        reservation_items(REQUIREMENTS, "")


def test_a_descriptor_filed_under_another_pool_is_a_bug_in_the_caller() -> None:
    with pytest.raises(LocalProtocolError, match="filed under"):
        check_eligibility(
            REQUIREMENTS,
            TENANT,
            {"rag-us": DESCRIPTOR},
            active_epochs={"rag-us": 3},
            active_generation=GENERATION,
            now=NOW,
        )


def pools(**changes_by_pool: dict[str, Any]) -> dict[str, CapabilityDescriptor]:
    return {pool: descriptor(pool_id=pool, **changes) for pool, changes in changes_by_pool.items()}


def run(
    descriptors: dict[str, CapabilityDescriptor],
    *,
    req: TaskRequirements = REQUIREMENTS,
    epochs: dict[str, int] | None = None,
) -> EligibilityResult:
    return check_eligibility(
        req,
        TENANT,
        descriptors,
        active_epochs={p: 3 for p in descriptors} if epochs is None else epochs,
        active_generation=GENERATION,
        now=NOW,
    )


MIXED = pools(
    zeta={},
    alpha={"regions": ["us-east-1"]},
    mid={"descriptor_epoch": 2},
    beta={},
    gamma={"expires_at": NOW - 1},
)


def test_verdicts_come_in_pool_id_order_whatever_the_mapping_order() -> None:
    result = run(MIXED)

    assert [v.pool_id for v in result.verdicts] == ["alpha", "beta", "gamma", "mid", "zeta"]
    assert result.eligible == ("beta", "zeta")
    assert run(dict(reversed(MIXED.items()))) == result


def test_the_result_says_which_pools_each_rule_filtered_at_which_epoch() -> None:
    result = run(MIXED)

    assert result.by_rule() == {
        "region_allowed": ("alpha",),
        "epoch_current": ("mid",),
        "not_expired": ("gamma",),
    }
    (mid,) = (v for v in result.filtered if v.pool_id == "mid")
    assert (mid.descriptor_epoch, mid.active_epoch, mid.policy_generation) == (2, 3, 7)
    assert result.active_generation == GENERATION


def test_no_descriptors_means_no_eligible_pool() -> None:
    result = run({})

    assert result.verdicts == ()
    assert result.denial_reason() == AdmissionReason.NO_ELIGIBLE_POOL


DENIAL_REASONS: list[tuple[str, dict[str, dict[str, Any]], AdmissionReason]] = [
    ("only a policy rule", {"a": {"regions": ["us-east-1"]}}, AdmissionReason.NO_ELIGIBLE_POOL),
    ("only a stale epoch", {"a": {"descriptor_epoch": 2}}, AdmissionReason.STALE_EPOCH),
    ("only a stale generation", {"a": {"policy_generation": 6}}, AdmissionReason.STALE_GENERATION),
    ("only an expired descriptor", {"a": {"expires_at": NOW}}, AdmissionReason.DESCRIPTOR_EXPIRED),
    ("only unhealthy", {"a": {"health": UNHEALTHY}}, AdmissionReason.NO_ELIGIBLE_POOL),
    ("the furthest pool decides", {"a": {"regions": ["us-east-1"]}, "b": {"expires_at": NOW}},
     AdmissionReason.DESCRIPTOR_EXPIRED),
    ("an earlier freshness rule", {"a": {"descriptor_epoch": 2}, "b": {"regions": ["us-east-1"]}},
     AdmissionReason.STALE_EPOCH),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "reason"),
    [(c, r) for _, c, r in DENIAL_REASONS],
    ids=[n for n, _, _ in DENIAL_REASONS],
)
def test_a_denial_reason_comes_from_the_pool_that_got_furthest(
    changes: dict[str, dict[str, Any]], reason: AdmissionReason
) -> None:
    assert run(pools(**changes)).denial_reason() == reason


# ---- records and replay -------------------------------------------------------------------------


def test_the_record_is_plain_json_and_round_trips() -> None:
    result = run(MIXED)

    record = result.to_record()
    text = json.dumps(record)

    assert EligibilityResult.from_record(json.loads(text)) == result
    assert record["rules"] == list(RULE_NAMES)
    assert record["eligible"] == ["beta", "zeta"]
    assert record["pools"][0] == {
        "pool_id": "alpha",
        "descriptor_epoch": 3,
        "active_epoch": 3,
        "policy_generation": 7,
        "rule": "region_allowed",
        "detail": "regions eu-west-1 not served (pool: us-east-1)",
    }


def test_rerunning_on_the_recorded_inputs_reproduces_the_record_exactly() -> None:
    first = run(MIXED)
    # The inputs as `mesh explain` would load them back: decoded from JSON, in another order.
    reloaded = {
        pool: CapabilityDescriptor.model_validate_json(d.model_dump_json())
        for pool, d in sorted(MIXED.items(), reverse=True)
    }
    req = TaskRequirements.model_validate_json(REQUIREMENTS.model_dump_json())

    again = run(reloaded, req=req)

    assert again == first
    assert json.dumps(again.to_record()) == json.dumps(first.to_record())


# ---- fallbacks never widen ----------------------------------------------------------------------


def test_a_fallback_outside_the_allowed_regions_or_labels_is_never_returned() -> None:
    changes: dict[str, dict[str, Any]] = {
        "rag-eu": {},
        "rag-us": {"regions": ["us-east-1"]},
        "rag-public": {"data_classifications": ["public"]},
        "rag-old": {"descriptor_epoch": 2},
    }
    descriptors = pools(**changes)
    req = requirements(allowed_fallbacks=["rag-us", "rag-public", "rag-old", "rag-ghost"])

    result = run(descriptors, req=req)

    assert fallback_pools(req, result, descriptors) == ()
    assert result.eligible == ("rag-eu",)


def test_eligible_fallbacks_come_back_in_the_order_the_task_gave() -> None:
    descriptors = pools(**{"a": {}, "b": {}, "c": {}})
    req = requirements(allowed_fallbacks=["c", "a"])

    assert fallback_pools(req, run(descriptors, req=req), descriptors) == ("c", "a")


def test_a_fallback_whose_descriptor_changed_since_the_check_is_not_returned() -> None:
    descriptors = pools(**{"a": {}, "b": {}})
    req = requirements(allowed_fallbacks=["a", "b"])
    result = run(descriptors, req=req)
    moved_on = {**descriptors, "a": descriptor(pool_id="a", descriptor_epoch=4)}

    assert fallback_pools(req, result, moved_on) == ("b",)
    assert fallback_pools(req, result, {"b": descriptors["b"]}) == ("b",)


CAPS = ["rag.search", "rag.answer"]
SPECS = [">=0", ">=1,<2", ">=2", "==1.*", "<1", "~=1.2", ">1.2.3"]
SEMVERS = ["0.9.0", "1.0.0", "1.2.3", "1.2.4", "2.0.0"]
TOOLS = ["web-search", "code.exec"]
LABELS = ["public", "internal", "confidential", "restricted"]
REGIONS = ["eu-west-1", "eu-central-1", "us-east-1"]
TENANTS = ["acme", "globex"]
POOL_IDS = ["p1", "p2", "p3", "p4"]


def subsets(values: list[str], *, min_size: int = 0) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(values), unique=True, min_size=min_size)


# Strategies are built once, at import: building them inside every draw is what costs time.
SPEC = st.sampled_from(SPECS)
SEMVER = st.sampled_from(SEMVERS)
ISOLATIONS = st.one_of(
    st.fixed_dictionaries({"mode": st.just("shared"), "tenants": subsets(TENANTS)}),
    st.fixed_dictionaries({"mode": st.just("dedicated"), "tenants": subsets(TENANTS, min_size=1)}),
)
SERVED_CAPABILITIES = subsets(CAPS, min_size=1).flatmap(
    lambda names: st.tuples(
        *(st.fixed_dictionaries({"name": st.just(n), "version_spec": SPEC}) for n in names)
    ).map(list)
)
POOL_TOOLS = subsets(TOOLS).flatmap(
    lambda names: st.tuples(
        *(
            st.fixed_dictionaries(
                {"name": st.just(n), "version": SEMVER, "permits": st.integers(0, 3)}
            )
            for n in names
        )
    ).map(list)
)
NEEDED_TOOLS = subsets(TOOLS).flatmap(
    lambda names: st.tuples(
        *(
            st.fixed_dictionaries(
                {"name": st.just(n), "version_spec": SPEC, "permits": st.integers(1, 3)}
            )
            for n in names
        )
    ).map(list)
)
DESCRIPTOR_FIELDS = st.fixed_dictionaries(
    {
        "descriptor_epoch": st.integers(1, 2),
        "runtime_digest": st.just("sha256:" + "0" * 64),
        "capabilities": SERVED_CAPABILITIES,
        "task_schema_range": SPEC,
        "result_schema_range": SPEC,
        "tools": POOL_TOOLS,
        "data_classifications": subsets(LABELS),
        "tenant_isolation": ISOLATIONS,
        "regions": subsets(REGIONS, min_size=1),
        "model_limits": st.just({"context_tokens": 8192, "max_output_tokens": 1024, "slots": 2}),
        "sandbox": st.fixed_dictionaries({"kind": st.just("gvisor"), "count": st.integers(0, 2)}),
        "policy_generation": st.integers(1, 2),
        "health": st.fixed_dictionaries(
            {
                "status": st.sampled_from(["healthy", "degraded", "unhealthy"]),
                "checked_at": st.just(NOW),
            }
        ),
        "issued_at": st.just(NOW - 100),
        "expires_at": st.sampled_from([NOW - 1, NOW, NOW + 1]),
        "issued_by": st.just("operator"),
    }
)
random_requirements = st.fixed_dictionaries(
    {
        "capability": st.fixed_dictionaries({"name": st.sampled_from(CAPS), "version_spec": SPEC}),
        "task_schema_version": SEMVER,
        "result_schema_version": SEMVER,
        "input_classifications": subsets(LABELS, min_size=1),
        "required_tools": NEEDED_TOOLS,
        "estimated_tokens": st.integers(0, 100),
        "needs_sandbox": st.booleans(),
        "estimated_duration_s": st.just(1.0),
        "regions": subsets(REGIONS),
        "allowed_fallbacks": subsets([*POOL_IDS, "ghost"]),
    }
).map(TaskRequirements.model_validate)


@dataclass(frozen=True)
class Scenario:
    requirements: TaskRequirements
    tenant: str
    descriptors: dict[str, CapabilityDescriptor]
    epochs: dict[str, int]
    generation: int

    def check(self, req: TaskRequirements | None = None) -> EligibilityResult:
        return check_eligibility(
            self.requirements if req is None else req,
            self.tenant,
            self.descriptors,
            active_epochs=self.epochs,
            active_generation=self.generation,
            now=NOW,
        )


EPOCH_MAPS = st.dictionaries(st.sampled_from(POOL_IDS), st.integers(1, 2))
POOL_SETS = subsets(POOL_IDS, min_size=1)


def first_version_in(spec: str) -> str:
    return next(v for v in SEMVERS if Version(v) in SpecifierSet(spec))


# How to make each descriptor field fit a request. Random fields almost never all fit at once,
# which would leave the fallback property vacuous; so each field is made to fit nine times in
# ten and left random otherwise (a random value may still fit, or break the pool).
FITTING: dict[str, Callable[[TaskRequirements, str, int], Any]] = {
    "capabilities": lambda req, _, __: [req.capability.model_dump(mode="json")],
    "task_schema_range": lambda req, _, __: f"=={req.task_schema_version}",
    "result_schema_range": lambda _, __, ___: ">=0",
    "tools": lambda req, _, __: [
        {"name": t.name, "version": first_version_in(t.version_spec), "permits": t.permits}
        for t in req.required_tools
    ],
    "data_classifications": lambda req, _, __: list(req.input_classifications),
    "tenant_isolation": lambda _, tenant, __: {"mode": "dedicated", "tenants": [tenant]},
    "regions": lambda req, _, __: list(req.regions) or ["eu-west-1"],
    "policy_generation": lambda _, __, generation: generation,
    "expires_at": lambda _, __, ___: NOW + 1,
    "health": lambda _, __, ___: {"status": "healthy", "checked_at": NOW},
}
ONE_IN_TEN = st.integers(0, 9).map(lambda n: n == 0)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    req = draw(random_requirements)
    tenant = draw(st.sampled_from(TENANTS))
    generation = draw(st.integers(1, 2))
    epochs = draw(EPOCH_MAPS)
    descriptors = {}
    for pool in draw(POOL_SETS):
        fields: dict[str, Any] = draw(DESCRIPTOR_FIELDS)
        for name, fit in FITTING.items():
            if not draw(ONE_IN_TEN):
                fields[name] = fit(req, tenant, generation)
        if not draw(ONE_IN_TEN):
            epochs[pool] = int(fields["descriptor_epoch"])
        descriptors[pool] = CapabilityDescriptor.model_validate({"pool_id": pool, **fields})
    return Scenario(req, tenant, descriptors, epochs, generation)


def satisfies_every_requirement(s: Scenario, pool: str) -> None:
    """An oracle written apart from the rules: what 'eligible' means, in plain set logic."""
    req, d = s.requirements, s.descriptors[pool]
    served = {c.name: c.version_spec for c in d.capabilities}
    witness = common_version(served[req.capability.name], req.capability.version_spec)
    assert witness is not None
    assert witness in SpecifierSet(served[req.capability.name], prereleases=True)
    assert witness in SpecifierSet(req.capability.version_spec, prereleases=True)
    assert Version(req.task_schema_version) in SpecifierSet(d.task_schema_range)
    assert Version(req.result_schema_version) in SpecifierSet(d.result_schema_range)
    tools = {t.name: t for t in d.tools}
    for need in req.required_tools:
        assert need.name in tools
        assert Version(tools[need.name].version) in SpecifierSet(need.version_spec)
        assert need.permits <= tools[need.name].permits
    assert set(req.input_classifications) <= set(d.data_classifications)
    isolation = d.tenant_isolation
    assert s.tenant in isolation.tenants or (isolation.mode == "shared" and not isolation.tenants)
    assert not req.regions or set(req.regions) & set(d.regions)
    assert d.descriptor_epoch == s.epochs.get(pool)
    assert d.policy_generation == s.generation
    assert NOW < d.expires_at
    assert d.health.status != "unhealthy"


@SCENARIOS
@given(scenarios())
def test_fallbacks_never_widen_what_a_task_may_use(s: Scenario) -> None:
    result = s.check()

    fallbacks = fallback_pools(s.requirements, result, s.descriptors)

    assert set(fallbacks) <= set(s.requirements.allowed_fallbacks) & set(result.eligible)
    for pool in fallbacks:
        satisfies_every_requirement(s, pool)
        check = PoolCheck(
            s.requirements, s.tenant, s.descriptors[pool], s.epochs.get(pool), s.generation, NOW
        )
        assert [rule.name for rule in RULES if rule.check(check) is not None] == []
    # Naming pools as fallbacks changes no pool's verdict.
    unnamed = s.requirements.model_copy(update={"allowed_fallbacks": []})
    assert s.check(unnamed).verdicts == result.verdicts


def test_the_scenarios_return_some_fallbacks_and_refuse_others() -> None:
    # Guards the property above against passing vacuously. Derandomised: a fixed sample, so
    # the guard cannot flake (at 60 random examples it fell short about one run in six).
    seen: Counter[str] = Counter()

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(scenarios())
    def tally(s: Scenario) -> None:
        result = s.check()
        returned = fallback_pools(s.requirements, result, s.descriptors)
        seen["returned"] += bool(returned)
        seen["refused"] += any(
            p in s.descriptors and p not in returned for p in s.requirements.allowed_fallbacks
        )

    tally()

    print(dict(seen))
    assert seen["returned"] >= 10
    assert seen["refused"] >= 10


@SCENARIOS
@given(scenarios())
def test_every_eligible_pool_meets_every_requirement_and_every_verdict_is_its_first_failure(
    s: Scenario,
) -> None:
    result = s.check()

    for verdict in result.verdicts:
        check = PoolCheck(
            s.requirements,
            s.tenant,
            s.descriptors[verdict.pool_id],
            s.epochs.get(verdict.pool_id),
            s.generation,
            NOW,
        )
        failure = first_failure(check)
        assert (verdict.rule, verdict.detail) == (failure or (None, ""))
        if verdict.eligible:
            satisfies_every_requirement(s, verdict.pool_id)
    assert EligibilityResult.from_record(json.loads(json.dumps(result.to_record()))) == result
    assert s.check() == result


# ---- version ranges -----------------------------------------------------------------------------

OVERLAPS: list[tuple[str, str, bool]] = [
    (">=2.0,<3", ">=2.1", True),
    (">=1,<2", ">1.9", True),
    (">1,<1.0.2", ">=0", True),
    ("==1.*", ">=1.5,<1.6", True),
    ("~=1.4.2", ">=1.4.5", True),
    (">=0", "==3.2.1", True),
    ("!=1.5", ">=1.5,<1.6", True),
    ("<=2", ">2", False),
    ("!=1.5", "==1.5", False),
    (">=2.0,<3", ">=3", False),
    ("==1.*", "==2.*", False),
    (">1.0,<1.1", "!=1.0.*", False),
    ("!=0", "~=0.0.0", True),  # 0.0.1: a short version must not hide a longer one's places
]


@pytest.mark.parametrize(("served", "wanted", "overlap"), OVERLAPS)
def test_version_ranges_overlap_when_they_admit_a_common_version(
    served: str, wanted: str, overlap: bool
) -> None:
    assert specs_overlap(served, wanted) is overlap
    assert specs_overlap(wanted, served) is overlap


def dotted(parts: list[int]) -> str:
    return ".".join(map(str, parts))


releases = st.lists(st.integers(0, 3), min_size=1, max_size=3).map(dotted)
specifiers = st.one_of(
    st.tuples(st.sampled_from(["==", "!=", ">=", ">", "<=", "<"]), releases).map("".join),
    st.tuples(st.sampled_from(["==", "!="]), releases).map(lambda t: f"{t[0]}{t[1]}.*"),
    st.lists(st.integers(0, 3), min_size=2, max_size=3).map(lambda r: "~=" + dotted(r)),
)
spec_sets = st.lists(specifiers, min_size=1, max_size=3).map(",".join)
GRID = [Version(f"{a}.{b}.{c}") for a in range(5) for b in range(5) for c in range(5)]


@settings(max_examples=300, deadline=None)
@given(spec_sets, spec_sets)
def test_a_common_version_is_real_and_found_whenever_a_brute_force_search_finds_one(
    served: str, wanted: str
) -> None:
    a, b = SpecifierSet(served), SpecifierSet(wanted)

    found = common_version(served, wanted)

    if found is not None:  # sound
        assert a.contains(found, prereleases=True)
        assert b.contains(found, prereleases=True)
    if any(a.contains(v) and b.contains(v) for v in GRID):  # complete on the grid
        assert found is not None


# ---- what a reservation takes -------------------------------------------------------------------


def test_the_sample_reserves_a_slot_a_sandbox_tool_permits_and_tenant_tokens_in_name_order() -> (
    None
):
    assert reservation_items(REQUIREMENTS, TENANT) == (
        ("model_slots", 1),
        ("sandboxes", 1),
        ("tenant_tokens:acme", 12_000),
        ("tool:web-search", 2),
    )


def test_no_sandbox_and_no_tokens_reserve_neither() -> None:
    req = requirements(needs_sandbox=False, estimated_tokens=0, required_tools=[])

    assert reservation_items(req, TENANT) == (("model_slots", 1),)


@FAST
@given(random_requirements, st.sampled_from(TENANTS))
def test_reservation_items_are_sorted_distinct_and_positive(
    req: TaskRequirements, tenant: str
) -> None:
    items = reservation_items(req, tenant)
    names = [name for name, _ in items]

    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert all(amount > 0 for _, amount in items)
    assert ("model_slots", 1) in items
    assert {n for n in names if n.startswith("tool:")} == {
        f"tool:{t.name}" for t in req.required_tools
    }


def test_a_descriptor_grants_slots_sandboxes_and_tool_permits() -> None:
    assert capacities(DESCRIPTOR) == {
        "model_slots": 16,
        "sandboxes": 4,
        "tool:code.exec": 2,
        "tool:web-search": 8,
    }
    assert list(capacities(DESCRIPTOR)) == sorted(capacities(DESCRIPTOR))


def test_every_pool_resource_a_task_reserves_has_a_capacity_on_a_pool_it_is_eligible_for() -> None:
    pool_resources = {name for name, _ in reservation_items(REQUIREMENTS, TENANT)} - {
        "tenant_tokens:acme"
    }

    assert pool_resources <= set(capacities(DESCRIPTOR))


# ---- purity -------------------------------------------------------------------------------------


def test_the_eligibility_module_loads_no_event_loop_broker_client_or_store() -> None:
    script = (
        "import json, sys\nimport mesh.core.eligibility\nprint(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(done.stdout)

    assert "mesh.core.eligibility" in loaded
    forbidden = ("asyncio", "aio_pika", "aiormq", "kubernetes", "sqlite3", "mesh.transport")
    assert [m for m in loaded if m.split(".")[0] in forbidden or m in forbidden] == []
