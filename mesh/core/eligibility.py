"""Eligibility: which pools may take a task, and what a reservation on one of them takes.

Theory of operation
-------------------
Eligibility is a conjunction of hard predicates over one pool's
:class:`~mesh.wire.admission.CapabilityDescriptor`, evaluated in the fixed order of
:data:`RULES`. The first predicate that fails filters the pool out, and the verdict records that
rule's name, a short detail, and the descriptor epoch, active epoch and policy generation seen.
Matching uses versions, labels and policies only — no scoring. The rules, in order:

``capability_offered``
    The pool serves the capability by name, and its ``version_spec`` and the request's admit a
    common version (see :func:`specs_overlap`).
``schema_compatible``
    ``task_schema_version`` is in ``task_schema_range`` and ``result_schema_version`` is in
    ``result_schema_range``.
``tools_allowed``
    Every required tool is among the pool's tools, at a version the required ``version_spec``
    admits, and asks for no more permits than the pool has in all.
``classification_allowed``
    Every input label is among the pool's ``data_classifications``.
``tenant_isolation``
    A dedicated pool admits only its tenants; a shared pool with a tenant list admits only
    those, and a shared pool with an empty list admits any tenant.
``region_allowed``
    The request names no region, or at least one of its regions is one of the pool's. (A
    descriptor always names at least one region, so "no region" still means "somewhere".)
``epoch_current``
    ``descriptor_epoch`` equals the pool's active epoch; a pool without one is stale.
``generation_current``
    ``policy_generation`` equals the active policy generation.
``not_expired``
    ``now < expires_at``.
``healthy``
    The health evidence is not ``unhealthy`` (``degraded`` pools stay eligible).

Policy rules come first and freshness rules after, so the pool that got furthest says the most
about a denial: if it only failed on freshness, a retry against a current descriptor may succeed
(:meth:`EligibilityResult.denial_reason` maps that to ``STALE_EPOCH`` and friends).

Everything here is pure and deterministic: no clock (``now`` is a parameter), no I/O, pools
evaluated in ``pool_id`` order, details built from sorted values. Re-running
:func:`check_eligibility` on recorded inputs gives an equal result; ``mesh explain`` relies on
that, together with :meth:`EligibilityResult.to_record`, a JSON-ready dict.

``allowed_fallbacks`` never widens anything: a fallback is just another pool that must pass
every rule (:func:`fallback_pools`), and it may stand in for the pool the task would have had
(its *primary*) only if it gives the task nothing that pool would not (:func:`widening`, in
the fixed order of :data:`WIDENING_RULES`):

``result_schema``
    It produces the task's result schema version, as the primary does.
``regions``
    It processes data only where the primary does or the task explicitly allows (its
    ``regions``): no cross-region move that was not allowed. A task that names no region
    allows no move: its fallbacks stay in the primary's regions.
``classifications``
    It may receive no label the primary may not.
``tenants``
    It is shared with no tenant the primary is not: a dedicated pool is never swapped for a
    shared one, and a shared pool with a tenant list never for one open to anyone.
``tools``
    It has no tool the primary lacks, and each shared tool at the same major version (the
    same semantics).
``sandbox``
    A task that needs a sandbox gets the primary's kind of sandbox.

Finally, :func:`reservation_items` and :func:`capacities` name the ledger's counters for a
reservation: ``model_slots``, ``sandboxes`` and ``tool:<name>`` per pool, and
``tenant_tokens:<tenant>`` per tenant across pools. Items are sorted by resource name (code-point
order): one total order shared by every admission, so every transaction takes its counters in
the same order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mesh.core.index import parse_spec, parse_version
from mesh.errors import LocalProtocolError
from mesh.wire.admission import AdmissionReason, CapabilityDescriptor, TaskRequirements

MODEL_SLOTS = "model_slots"
SANDBOXES = "sandboxes"
TOOL_PREFIX = "tool:"
TENANT_TOKENS_PREFIX = "tenant_tokens:"


def tool_resource(name: str) -> str:
    """The ledger resource counting a tool's permits in a pool."""
    return TOOL_PREFIX + name


def tenant_tokens_resource(tenant: str) -> str:
    """The ledger resource counting a tenant's token budget (across pools)."""
    return TENANT_TOKENS_PREFIX + tenant


# ---- version ranges -----------------------------------------------------------------------


def _candidate_versions(specs: Iterable[SpecifierSet]) -> list[Version]:
    named = [Version("0")]
    for spec in specs:
        for specifier in spec:
            try:
                named.append(Version(specifier.version.removesuffix(".*")))
            except InvalidVersion:  # '===' compares arbitrary strings
                continue
    # Measured before equal versions collapse: 0 == 0.0.0, but ~=0.0.0 needs three places.
    width = max(len(v.release) for v in named)
    found = set(named)
    for version in named:
        release = version.release + (0,) * (width - len(version.release))
        # The next version at each position (1.4.0 -> 2, 1.5, 1.4.1), and one just above the
        # version itself (1.4.0.1), below every version of the same width that is greater.
        found.update(Version(_dotted((*release[:i], release[i] + 1))) for i in range(width))
        found.add(Version(_dotted((*release, 1))))
    return sorted(found)


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


@lru_cache(maxsize=4096)
def common_version(served: str, wanted: str) -> Version | None:
    """A version both PEP 440 specifier sets admit, or ``None`` if none was found.

    The search is over a finite set of candidates: 0, every version either set names (``1.*``
    names 1), and for each of those its successors — the next version at each release position
    and one just above it (for 1.4 among three-part versions: 2, 1.5, 1.4.1 and 1.4.0.1). That
    steps over exclusive lower bounds and over the holes ``!=`` punches. The answer is sound —
    a version found is one both sets really admit — but completeness is only tested (against a
    brute-force search), not proven: a miss reports the ranges as disjoint, which denies
    admission, the safe side. Pre-releases count as versions, as in the capability index.
    """
    a, b = parse_spec(served), parse_spec(wanted)
    for version in _candidate_versions((a, b)):
        if a.contains(version, prereleases=True) and b.contains(version, prereleases=True):
            return version
    return None


def specs_overlap(served: str, wanted: str) -> bool:
    """Whether two specifier sets admit a common version (see :func:`common_version`)."""
    return common_version(served, wanted) is not None


# ---- the rules ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolCheck:
    """Everything one rule looks at for one pool."""

    requirements: TaskRequirements
    tenant: str
    descriptor: CapabilityDescriptor
    active_epoch: int | None
    active_generation: int
    now: float


Predicate = Callable[[PoolCheck], str | None]
"""A rule's test: ``None`` when the pool passes, else a short detail of why not."""


def _capability_offered(c: PoolCheck) -> str | None:
    wanted = c.requirements.capability
    served = next((s for s in c.descriptor.capabilities if s.name == wanted.name), None)
    if served is None:
        return f"capability {wanted.name!r} is not offered"
    if not specs_overlap(served.version_spec, wanted.version_spec):
        return (
            f"{wanted.name} served at {served.version_spec!r}, "
            f"requested {wanted.version_spec!r}: no common version"
        )
    return None


def _schema_compatible(c: PoolCheck) -> str | None:
    req, d = c.requirements, c.descriptor
    for what, version, spec in (
        ("task", req.task_schema_version, d.task_schema_range),
        ("result", req.result_schema_version, d.result_schema_range),
    ):
        if not parse_spec(spec).contains(parse_version(version), prereleases=True):
            return f"{what} schema {version} is outside {spec!r}"
    return None


def _tools_allowed(c: PoolCheck) -> str | None:
    offered = {t.name: t for t in c.descriptor.tools}
    for need in c.requirements.required_tools:
        tool = offered.get(need.name)
        if tool is None:
            return f"tool {need.name!r} is not allowed"
        if not parse_spec(need.version_spec).contains(
            parse_version(tool.version), prereleases=True
        ):
            return f"tool {need.name} {tool.version} does not match {need.version_spec!r}"
        if need.permits > tool.permits:
            return f"tool {need.name}: {need.permits} permits wanted, the pool has {tool.permits}"
    return None


def _classification_allowed(c: PoolCheck) -> str | None:
    refused = sorted(
        set(c.requirements.input_classifications) - set(c.descriptor.data_classifications)
    )
    return f"labels not allowed: {', '.join(refused)}" if refused else None


def _tenant_isolation(c: PoolCheck) -> str | None:
    isolation = c.descriptor.tenant_isolation
    if isolation.mode == "shared" and not isolation.tenants:
        return None
    if c.tenant in isolation.tenants:
        return None
    return f"tenant {c.tenant!r} is not admitted by this {isolation.mode} pool"


def _region_allowed(c: PoolCheck) -> str | None:
    wanted = c.requirements.regions
    if not wanted or set(wanted) & set(c.descriptor.regions):
        return None
    served = ", ".join(sorted(c.descriptor.regions))
    return f"regions {', '.join(sorted(wanted))} not served (pool: {served})"


def _epoch_current(c: PoolCheck) -> str | None:
    epoch = c.descriptor.descriptor_epoch
    if c.active_epoch is None:
        return f"descriptor epoch {epoch}, but the pool has no active epoch"
    if epoch != c.active_epoch:
        return f"descriptor epoch {epoch}, active epoch {c.active_epoch}"
    return None


def _generation_current(c: PoolCheck) -> str | None:
    generation = c.descriptor.policy_generation
    if generation != c.active_generation:
        return f"policy generation {generation}, active generation {c.active_generation}"
    return None


def _not_expired(c: PoolCheck) -> str | None:
    expires_at = c.descriptor.expires_at
    # No time in the detail: the record keeps when it was evaluated, and a verdict that does
    # not change with the clock can be shared (the cache, content-addressed snapshots).
    return None if c.now < expires_at else f"expired at {expires_at!r}"


def _healthy(c: PoolCheck) -> str | None:
    health = c.descriptor.health
    if health.status == "unhealthy":
        return f"unhealthy (checked at {health.checked_at!r})"
    return None


@dataclass(frozen=True, slots=True)
class Rule:
    """One hard predicate, by name."""

    name: str
    check: Predicate


RULES: tuple[Rule, ...] = (
    Rule("capability_offered", _capability_offered),
    Rule("schema_compatible", _schema_compatible),
    Rule("tools_allowed", _tools_allowed),
    Rule("classification_allowed", _classification_allowed),
    Rule("tenant_isolation", _tenant_isolation),
    Rule("region_allowed", _region_allowed),
    Rule("epoch_current", _epoch_current),
    Rule("generation_current", _generation_current),
    Rule("not_expired", _not_expired),
    Rule("healthy", _healthy),
)
RULE_NAMES: tuple[str, ...] = tuple(rule.name for rule in RULES)

_FRESHNESS_REASONS = {
    "epoch_current": AdmissionReason.STALE_EPOCH,
    "generation_current": AdmissionReason.STALE_GENERATION,
    "not_expired": AdmissionReason.DESCRIPTOR_EXPIRED,
}


def first_failure(check: PoolCheck) -> tuple[str, str] | None:
    """The first rule (name, detail) the pool fails, or ``None`` if it passes them all."""
    for rule in RULES:
        detail = rule.check(check)
        if detail is not None:
            return rule.name, detail
    return None


# ---- results ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolVerdict:
    """One pool's outcome: eligible (``rule`` is ``None``) or the first rule that filtered it."""

    pool_id: str
    descriptor_epoch: int
    active_epoch: int | None
    policy_generation: int
    rule: str | None = None
    detail: str = ""

    @property
    def eligible(self) -> bool:
        return self.rule is None


@dataclass(frozen=True, slots=True)
class EligibilitySnapshot:
    """An eligibility record without its time (:meth:`EligibilityResult.snapshot`): the same
    for every request that got the same verdicts, so a decision stores its ``ref`` and the
    ledger stores the ``body`` once (content-addressed)."""

    ref: str  # "sha256:" and the hex SHA-256 of ``body``
    body: str  # canonical JSON: sorted keys, no whitespace
    record: Mapping[str, Any]  # ``body`` parsed; shared, never change it

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> EligibilitySnapshot:
        body = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        return cls("sha256:" + hashlib.sha256(body).hexdigest(), body.decode(), record)

    @classmethod
    def parse(cls, ref: str, body: str) -> EligibilitySnapshot:
        """A stored snapshot; ``ValueError`` if ``body`` is not what ``ref`` addresses."""
        record = orjson.loads(body)
        if not isinstance(record, dict) or cls.of(record).ref != ref:
            raise ValueError(f"the stored eligibility snapshot {ref} does not match its body")
        return cls(ref, body, record)


class _Derived:
    """What a result's verdicts imply, worked out once and shared by the copies
    :class:`EligibilityCache` hands out (they differ only in ``now``)."""

    __slots__ = ("eligible", "snapshot")

    def __init__(self) -> None:
        self.eligible: tuple[str, ...] | None = None
        self.snapshot: EligibilitySnapshot | None = None


@dataclass(frozen=True, slots=True)
class EligibilityResult:
    """Every pool's verdict (in ``pool_id`` order), and the generation and time they saw."""

    verdicts: tuple[PoolVerdict, ...]
    active_generation: int
    now: float
    _derived: _Derived = field(default_factory=_Derived, compare=False, repr=False)

    def at(self, now: float) -> EligibilityResult:
        """The same verdicts, seen at ``now`` (sharing what was worked out from them)."""
        return EligibilityResult(self.verdicts, self.active_generation, now, self._derived)

    @property
    def eligible(self) -> tuple[str, ...]:
        """The pools that passed every rule, in ``pool_id`` order."""
        derived = self._derived
        if derived.eligible is None:
            derived.eligible = tuple(v.pool_id for v in self.verdicts if v.eligible)
        return derived.eligible

    def snapshot(self) -> EligibilitySnapshot:
        """:meth:`to_record` without ``now``, content-addressed (worked out once)."""
        derived = self._derived
        if derived.snapshot is None:
            record = self.to_record()
            del record["now"]
            derived.snapshot = EligibilitySnapshot.of(record)
        return derived.snapshot

    @property
    def filtered(self) -> tuple[PoolVerdict, ...]:
        return tuple(v for v in self.verdicts if not v.eligible)

    def by_rule(self) -> dict[str, tuple[str, ...]]:
        """Rule name -> the pools it filtered out, in rule order (only rules that filtered some)."""
        out = {
            name: tuple(v.pool_id for v in self.verdicts if v.rule == name) for name in RULE_NAMES
        }
        return {name: pools for name, pools in out.items() if pools}

    def denial_reason(self) -> AdmissionReason | None:
        """``None`` if some pool is eligible; else the reason code of the pool that got furthest.

        A pool that passed every policy rule and failed only on freshness means the request
        would be eligible on a current descriptor: ``STALE_EPOCH``, ``STALE_GENERATION`` or
        ``DESCRIPTOR_EXPIRED``. Anything else is ``NO_ELIGIBLE_POOL``.
        """
        if self.eligible:
            return None
        reached = [RULE_NAMES.index(v.rule) for v in self.verdicts if v.rule is not None]
        if not reached:
            return AdmissionReason.NO_ELIGIBLE_POOL
        furthest = RULE_NAMES[max(reached)]
        return _FRESHNESS_REASONS.get(furthest, AdmissionReason.NO_ELIGIBLE_POOL)

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole result (what ``mesh explain`` shows and replays)."""
        return {
            "rules": list(RULE_NAMES),
            "active_generation": self.active_generation,
            "now": self.now,
            "eligible": list(self.eligible),
            "pools": [
                {
                    "pool_id": v.pool_id,
                    "descriptor_epoch": v.descriptor_epoch,
                    "active_epoch": v.active_epoch,
                    "policy_generation": v.policy_generation,
                    "rule": v.rule,
                    "detail": v.detail,
                }
                for v in self.verdicts
            ],
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> EligibilityResult:
        """The inverse of :meth:`to_record`."""
        return cls(
            verdicts=tuple(PoolVerdict(**pool) for pool in record["pools"]),
            active_generation=record["active_generation"],
            now=record["now"],
        )


def check_eligibility(
    requirements: TaskRequirements,
    tenant: str,
    descriptors: Mapping[str, CapabilityDescriptor],
    *,
    active_epochs: Mapping[str, int],
    active_generation: int,
    now: float,
) -> EligibilityResult:
    """Evaluate every pool's descriptor against the requirements, in ``pool_id`` order.

    ``tenant`` is the authenticated producer; ``descriptors`` maps each pool ID to its latest
    known descriptor; ``active_epochs`` maps pool IDs to their active descriptor epoch.
    """
    if not tenant:
        raise LocalProtocolError("the tenant must be the authenticated producer, not empty")
    verdicts = []
    for pool_id in sorted(descriptors):
        descriptor = descriptors[pool_id]
        if descriptor.pool_id != pool_id:
            raise LocalProtocolError(
                f"descriptor of pool {descriptor.pool_id!r} filed under {pool_id!r}"
            )
        active_epoch = active_epochs.get(pool_id)
        failure = first_failure(
            PoolCheck(requirements, tenant, descriptor, active_epoch, active_generation, now)
        )
        rule, detail = failure if failure is not None else (None, "")
        verdicts.append(
            PoolVerdict(
                pool_id=pool_id,
                descriptor_epoch=descriptor.descriptor_epoch,
                active_epoch=active_epoch,
                policy_generation=descriptor.policy_generation,
                rule=rule,
                detail=detail,
            )
        )
    return EligibilityResult(tuple(verdicts), active_generation, now)


def eligibility_key(requirements: TaskRequirements, tenant: str) -> tuple[object, ...]:
    """Everything of a request that a rule reads — and nothing else — as a hashable value:
    two requests with the same key get the same verdicts from the same descriptors at the same
    time. (A test changes each requirement field in turn and checks that any field a rule
    reads is in here.)"""
    return (
        tenant,
        requirements.capability.name,
        requirements.capability.version_spec,
        requirements.task_schema_version,
        requirements.result_schema_version,
        tuple((t.name, t.version_spec, t.permits) for t in requirements.required_tools),
        tuple(requirements.input_classifications),
        tuple(requirements.regions),
    )


class EligibilityCache:
    """Recent eligibility results by :func:`eligibility_key`, for one state of the
    descriptors (the caller passes a ``state`` token that changes whenever a descriptor, an
    active epoch or the generation does, and clears nothing by hand).

    An entry holds while ``now`` is before the earliest ``expires_at`` of the descriptors that
    had not expired when it was computed — the only way time changes a verdict (an expired
    descriptor stays expired, and no verdict's detail quotes the time). The
    result handed out carries the caller's ``now``. Bounded: the oldest entry goes first.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._state: object = None
        self._entries: dict[tuple[object, ...], tuple[EligibilityResult, float]] = {}
        self.hits = 0
        self.misses = 0

    def get(
        self,
        requirements: TaskRequirements,
        tenant: str,
        descriptors: Mapping[str, CapabilityDescriptor],
        *,
        state: object,
        active_epochs: Mapping[str, int],
        active_generation: int,
        now: float,
    ) -> EligibilityResult:
        found = self.lookup(
            requirements, tenant, descriptors,
            state=state, active_epochs=active_epochs, active_generation=active_generation,
            now=now,
        )  # fmt: skip
        return found if found.now == now else found.at(now)

    def lookup(
        self,
        requirements: TaskRequirements,
        tenant: str,
        descriptors: Mapping[str, CapabilityDescriptor],
        *,
        state: object,
        active_epochs: Mapping[str, int],
        active_generation: int,
        now: float,
    ) -> EligibilityResult:
        """As :meth:`get`, but a cached result is handed out as it was computed: its ``now``
        is the time it was computed at (for a caller that reads only the verdicts)."""
        if state != self._state:
            self._entries.clear()
            self._state = state
        key = eligibility_key(requirements, tenant)
        found = self._entries.get(key)
        if found is not None and now < found[1]:
            self.hits += 1
            return found[0]
        self.misses += 1
        result = check_eligibility(
            requirements, tenant, descriptors,
            active_epochs=active_epochs, active_generation=active_generation, now=now,
        )  # fmt: skip
        live = (d.expires_at for d in descriptors.values() if d.expires_at > now)
        until = min(live, default=math.inf)  # the already expired stay expired
        if len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (result, until)
        return result


def fallback_pools(
    requirements: TaskRequirements,
    eligible: EligibilityResult,
    descriptors: Mapping[str, CapabilityDescriptor],
) -> tuple[str, ...]:
    """The task's ``allowed_fallbacks`` that passed every rule, in the task's order.

    A fallback gets no exemption: a pool is returned only if its verdict in ``eligible`` is
    eligible and the descriptor in ``descriptors`` is still the one that verdict saw (same
    epoch and generation). Naming a pool as a fallback never makes it eligible.
    """
    passed = {v.pool_id: v for v in eligible.verdicts if v.eligible}
    out: list[str] = []
    for pool_id in requirements.allowed_fallbacks:
        verdict = passed.get(pool_id)
        descriptor = descriptors.get(pool_id)
        if (
            verdict is not None
            and descriptor is not None
            and descriptor.descriptor_epoch == verdict.descriptor_epoch
            and descriptor.policy_generation == verdict.policy_generation
        ):
            out.append(pool_id)
    return tuple(out)


WIDENING_RULES = ("result_schema", "regions", "classifications", "tenants", "tools", "sandbox")


def widening(
    primary: CapabilityDescriptor, backup: CapabilityDescriptor, requirements: TaskRequirements
) -> tuple[str, str] | None:
    """The first rule by which ``backup`` would give the task more than ``primary`` does, as
    ``(rule, detail)``; ``None`` if it may stand in (module docstring, :data:`WIDENING_RULES`)."""
    result = parse_version(requirements.result_schema_version)
    if not all(
        parse_spec(d.result_schema_range).contains(result, prereleases=True)
        for d in (primary, backup)
    ):
        return "result_schema", (
            f"result schema {requirements.result_schema_version} is not produced by both "
            f"{primary.pool_id} ({primary.result_schema_range}) and {backup.pool_id} "
            f"({backup.result_schema_range})"
        )
    allowed_regions = {*requirements.regions, *primary.regions}
    if extra := sorted(set(backup.regions) - allowed_regions):
        return "regions", f"{backup.pool_id} processes data in {extra}, not allowed"
    if extra := sorted(set(backup.data_classifications) - set(primary.data_classifications)):
        return "classifications", f"{backup.pool_id} may receive {extra}; {primary.pool_id} not"
    if (why := _tenants_wider(primary, backup)) is not None:
        return "tenants", why
    primary_tools = {t.name: t.version for t in primary.tools}
    for tool in sorted(backup.tools, key=lambda t: t.name):
        if tool.name not in primary_tools:
            return "tools", f"{backup.pool_id} has tool {tool.name}; {primary.pool_id} has not"
        if parse_version(tool.version).major != parse_version(primary_tools[tool.name]).major:
            return "tools", (
                f"{tool.name} is {tool.version} on {backup.pool_id} but "
                f"{primary_tools[tool.name]} on {primary.pool_id} (another major version)"
            )
    if requirements.needs_sandbox and backup.sandbox.kind != primary.sandbox.kind:
        return "sandbox", (
            f"{backup.pool_id} runs {backup.sandbox.kind} sandboxes, "
            f"{primary.pool_id} {primary.sandbox.kind}"
        )
    return None


def _tenants_wider(primary: CapabilityDescriptor, backup: CapabilityDescriptor) -> str | None:
    """Why ``backup`` is open to a tenant ``primary`` is not; ``None`` if it is no wider."""
    p, b = primary.tenant_isolation, backup.tenant_isolation
    if p.mode == "shared" and not p.tenants:
        return None  # the primary is open to anyone: nothing is wider
    if b.mode == "shared" and not b.tenants:
        return f"{backup.pool_id} is shared with any tenant; {primary.pool_id} is not"
    if p.mode == "dedicated" and b.mode == "shared":
        return f"{backup.pool_id} is shared; {primary.pool_id} is dedicated"
    if extra := sorted(set(b.tenants) - set(p.tenants)):
        return f"{backup.pool_id} serves tenants {extra}; {primary.pool_id} does not"
    return None


# ---- what a reservation takes -------------------------------------------------------------


def reservation_items(requirements: TaskRequirements, tenant: str) -> tuple[tuple[str, int], ...]:
    """The ledger counters one admission takes, as (resource, amount), sorted by resource name.

    One model slot; one sandbox if the task needs one; each required tool's permits; and the
    estimated tokens from the tenant's budget. Every amount is positive (the ledger counts
    nothing else), so a task estimated at 0 tokens takes nothing from the budget.
    """
    if not tenant:
        raise LocalProtocolError("the tenant must be the authenticated producer, not empty")
    items = [(MODEL_SLOTS, 1)]
    if requirements.estimated_tokens > 0:
        items.append((tenant_tokens_resource(tenant), requirements.estimated_tokens))
    if requirements.needs_sandbox:
        items.append((SANDBOXES, 1))
    items.extend((tool_resource(t.name), t.permits) for t in requirements.required_tools)
    return tuple(sorted(items))


def capacities(descriptor: CapabilityDescriptor) -> dict[str, int]:
    """The per-pool ledger capacities a descriptor grants, sorted by resource name."""
    out = {
        MODEL_SLOTS: descriptor.model_limits.slots,
        SANDBOXES: descriptor.sandbox.count,
        **{tool_resource(t.name): t.permits for t in descriptor.tools},
    }
    return dict(sorted(out.items()))
