"""Wire models of admission control: descriptors, requirements, decisions and releases.

Theory of operation
-------------------
A **pool** (an agent Deployment) may only do what its :class:`CapabilityDescriptor` says. The
descriptor is published by a trusted control plane (an operator principal), never by agents;
heartbeats carry utilisation only and cannot widen it. Each descriptor carries the pool's
``descriptor_epoch`` (rollouts activate one epoch at a time), the ``policy_generation`` it was
written under, and an ``expires_at``: a stale, superseded or expired descriptor denies.

A producer asks for admission with an :class:`AdmissionRequest` holding the task's
:class:`TaskRequirements`. The requirements carry no tenant: the tenant is the authenticated
producer (the AMQP ``user_id`` RabbitMQ validated), supplied by the shell.
:func:`requirement_digest` hashes the requirements together with that tenant; the reservation
ledger keys every reservation by ``admission_id`` + digest, so the same ID with the same payload
is idempotent and the same ID with another payload is a ``CONFLICT``.

Every request gets exactly one :class:`AdmissionDecision`: ``admitted`` with an
:class:`AdmissionGrant` (pool, epoch, generation, fence, grant IDs, expiry), or ``rejected`` /
``deferred`` with an :class:`AdmissionReason` and, when retrying can help, ``retry_after_ms``.
A holder gives a grant back with :class:`AdmissionRelease`, presenting its fence; the answer is
an :class:`AdmissionReleaseReply`.

Everything here is validated at the edge: unknown fields are errors, version specifiers and
schema ranges must parse as PEP 440 specifier sets, set-like lists must not repeat themselves,
and the model validators enforce the decision invariants (a grant exactly when admitted, a
reason exactly when not). Lists keep the order they were sent in, and that order is part of
the digest: a producer retrying sends the same bytes, and a reordered request is a different
request.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Annotated, Any, Literal, Self

import orjson
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import AfterValidator, Field, field_validator, model_validator

from mesh.wire.models import (
    UNIQUE_ITEMS,
    CapabilityName,
    Count,
    Degradations,
    Identifier,
    Message,
    PoolId,
    PositiveInt,
    Refusal,
    SemVer,
    Timestamp,
    WireModel,
    distinct,
)
from mesh.wire.models import AdmissionGrant as AdmissionGrant  # re-exported: the one grant
from mesh.wire.reasons import Reason

AdmissionReason = Reason
"""The admission decisions' codes are :class:`~mesh.wire.reasons.Reason` members (one enum);
this name is kept for one version."""


# ---- field types --------------------------------------------------------------------------


def _check_specifier(text: str) -> str:
    if not _valid_specifier(text):
        raise ValueError(f"{text!r} is not a valid PEP 440 version specifier set")
    return text


@lru_cache(maxsize=4096)
def _valid_specifier(text: str) -> bool:
    """Parsing a specifier set is the dearest part of validating requirements, and producers
    send the same few ranges over and over: remember the verdict per string."""
    try:
        SpecifierSet(text)
    except InvalidSpecifier:
        return False
    return True


Specifier = Annotated[
    str,
    Field(
        min_length=1,
        max_length=200,
        description="PEP 440 version specifier set, e.g. '>=1,<2'; must parse.",
        examples=[">=1,<2"],
    ),
    AfterValidator(_check_specifier),
]
RuntimeDigest = Annotated[
    str,
    Field(
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="Digest of the pool's runtime image: 'sha256:' and 64 lowercase hex digits.",
    ),
]
ToolName = Annotated[
    str,
    Field(
        pattern=r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*$",
        max_length=128,
        description="Tool name: lowercase words, optionally dotted, e.g. 'web-search'.",
        examples=["web-search"],
    ),
]
Region = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Region name, lowercase, e.g. 'eu-west-1'.",
        examples=["eu-west-1"],
    ),
]
Tenant = Annotated[str, Field(min_length=1, max_length=128, description="A tenant (AMQP user).")]
Classification = Literal["public", "internal", "confidential", "restricted"]
ServiceClass = Literal["interactive", "batch", "speculative"]
Recoverability = Literal[
    "rebuildable", "retryable", "side_effects", "awaiting_approval", "near_commit"
]

Classifications = Annotated[list[Classification], AfterValidator(distinct), UNIQUE_ITEMS]
Regions = Annotated[list[Region], AfterValidator(distinct), UNIQUE_ITEMS]
Tenants = Annotated[list[Tenant], AfterValidator(distinct), UNIQUE_ITEMS]
PoolIds = Annotated[list[PoolId], AfterValidator(distinct), UNIQUE_ITEMS]


# ---- the capability descriptor ------------------------------------------------------------


class CapabilityRange(WireModel):
    """A capability and a range of its versions (served by a pool, or wanted by a task)."""

    name: CapabilityName
    version_spec: Specifier = ">=0"


class PoolTool(WireModel):
    """A tool a pool may use, at one version, with its number of concurrent permits."""

    name: ToolName
    version: SemVer
    permits: Count = Field(description="Concurrent permits of this tool in the pool.")


class TenantIsolation(WireModel):
    """Which tenants a pool may serve.

    ``dedicated``: only ``tenants`` (at least one). ``shared``: ``tenants`` if any, else anyone.
    """

    mode: Literal["shared", "dedicated"]
    tenants: Tenants = Field(default_factory=list)

    @model_validator(mode="after")
    def _dedicated_names_its_tenants(self) -> Self:
        if self.mode == "dedicated" and not self.tenants:
            raise ValueError("a dedicated pool must name at least one tenant")
        return self


class ModelLimits(WireModel):
    """The model behind a pool: its window, its output cap and how many calls run at once."""

    context_tokens: PositiveInt
    max_output_tokens: PositiveInt
    slots: Count = Field(description="Concurrent model calls (the ledger's 'model_slots').")


class Sandbox(WireModel):
    """The pool's code-execution sandboxes."""

    kind: str = Field(min_length=1, max_length=64, examples=["gvisor"])
    count: Count = Field(description="Concurrent sandboxes (the ledger's 'sandboxes').")


class HealthEvidence(WireModel):
    """The control plane's last health verdict on the pool."""

    status: Literal["healthy", "degraded", "unhealthy"]
    checked_at: Timestamp


class CapabilityDescriptor(Message):
    """Control plane -> manager: everything one pool may do, at one epoch. Agents never send it."""

    TYPE = "mesh.capability-descriptor.v1"
    type: Literal["mesh.capability-descriptor.v1"] = "mesh.capability-descriptor.v1"
    pool_id: PoolId
    descriptor_epoch: PositiveInt
    runtime_digest: RuntimeDigest
    capabilities: list[CapabilityRange] = Field(min_length=1, max_length=64)
    task_schema_range: Specifier = Field(description="Task schema versions the pool accepts.")
    result_schema_range: Specifier = Field(description="Result schema versions it can produce.")
    tools: list[PoolTool] = Field(default_factory=list, max_length=64)
    data_classifications: Classifications = Field(description="Labels the pool may receive.")
    tenant_isolation: TenantIsolation
    regions: Regions = Field(min_length=1, description="Where the pool processes data.")
    model_limits: ModelLimits
    sandbox: Sandbox
    policy_generation: PositiveInt
    health: HealthEvidence
    issued_at: Timestamp
    expires_at: Timestamp
    issued_by: Identifier = Field(description="The operator principal that published it.")

    @field_validator("capabilities")
    @classmethod
    def _capability_names_unique(cls, caps: list[CapabilityRange]) -> list[CapabilityRange]:
        distinct([c.name for c in caps])
        return caps

    @field_validator("tools")
    @classmethod
    def _tool_names_unique(cls, tools: list[PoolTool]) -> list[PoolTool]:
        distinct([t.name for t in tools])
        return tools

    @model_validator(mode="after")
    def _expires_after_issue(self) -> Self:
        if self.expires_at <= self.issued_at:
            raise ValueError("expires_at must be later than issued_at")
        return self


# ---- the task's requirements --------------------------------------------------------------


def local_descriptor(
    pool_id: str,
    capability: CapabilityRange,
    *,
    epoch: int,
    issued_by: str,
    now: float,
    policy_generation: int,
    ttl_s: float,
    slots: int = 16,
) -> CapabilityDescriptor:
    """A descriptor for a pool on one machine (the demo's, the conformance kit's, the
    overload bench's): its one capability, public and internal data, shared tenancy, region
    ``local``, ``slots`` model slots (16: more than a few local agents run, so live capacity
    is what binds), no sandbox, healthy now, valid for ``ttl_s``."""
    return CapabilityDescriptor(
        pool_id=pool_id,
        descriptor_epoch=epoch,
        runtime_digest="sha256:" + "0" * 64,
        capabilities=[capability],
        task_schema_range=">=1,<2",
        result_schema_range=">=1,<2",
        data_classifications=["public", "internal"],
        tenant_isolation=TenantIsolation(mode="shared"),
        regions=["local"],
        model_limits=ModelLimits(context_tokens=8192, max_output_tokens=1024, slots=slots),
        sandbox=Sandbox(kind="none", count=0),
        policy_generation=policy_generation,
        health=HealthEvidence(status="healthy", checked_at=now),
        issued_at=now - 1,
        expires_at=now + ttl_s,
        issued_by=issued_by,
    )


class ToolRequirement(WireModel):
    """A tool a task needs: a version range and how many permits it holds at once."""

    name: ToolName
    version_spec: Specifier = ">=0"
    permits: PositiveInt = 1


class TaskRequirements(Message):
    """What one task needs. No tenant field: the tenant is the authenticated producer."""

    TYPE = "mesh.task-requirements.v1"
    type: Literal["mesh.task-requirements.v1"] = "mesh.task-requirements.v1"
    capability: CapabilityRange
    task_schema_version: SemVer
    result_schema_version: SemVer
    input_classifications: Classifications = Field(
        min_length=1, description="Labels of the task's input; unlabelled input is not admitted."
    )
    required_tools: list[ToolRequirement] = Field(default_factory=list, max_length=64)
    estimated_tokens: Count
    needs_sandbox: bool = False
    estimated_duration_s: float = Field(ge=0)
    deadline: Timestamp | None = None
    regions: Regions = Field(
        default_factory=list, description="Where the data may be processed; empty means anywhere."
    )
    priority: int = Field(default=0, ge=0, le=9, description="0 lowest ... 9 highest (AMQP).")
    service_class: ServiceClass = "batch"
    recoverability: Recoverability = Field(
        default="side_effects",
        description=(
            "What losing the task mid-way costs. 'rebuildable' (a cache fill, a speculative "
            "branch) and 'retryable' (no external effects) non-interactive work may be "
            "evicted for interactive work when its pool is full; 'side_effects' (external "
            "effects of unknown outcome), 'awaiting_approval' and 'near_commit' never are."
        ),
    )
    run_id: Identifier | None = Field(
        default=None,
        description="The orchestration run (workflow) the task belongs to, scoped by tenant; "
        "under pressure each run is held to its share of the pool.",
    )
    allowed_degradations: Degradations = Field(default_factory=list)
    allowed_fallbacks: PoolIds = Field(
        default_factory=list,
        description="Pools the task may fall back to, in order; each must still be eligible.",
    )

    @field_validator("required_tools")
    @classmethod
    def _tool_names_unique(cls, tools: list[ToolRequirement]) -> list[ToolRequirement]:
        distinct([t.name for t in tools])
        return tools


def requirement_digest(requirements: TaskRequirements, tenant: str) -> str:
    """``sha256:<hex>`` of the canonical JSON (sorted keys) of the requirements and the tenant.

    Stable across processes and Python versions: it depends only on the field values. That
    JSON is ``{"requirements": requirements.model_dump(mode="json"), "tenant": tenant}``;
    orjson writes it straight from the models' fields (:func:`_fields`), which is the same
    thing for models whose fields are all plain JSON types — as every model inside
    ``TaskRequirements`` is (a test walks them) — without building the dicts first. The
    model must have been validated (as every decoded request is): ``model_copy(update=...)``
    skips validation, so an ``int`` given for a ``float`` field would stay an ``int``.
    """
    canonical = orjson.dumps(
        {"requirements": requirements, "tenant": tenant},
        default=_fields,
        option=orjson.OPT_SORT_KEYS,
    )
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _fields(value: object) -> dict[str, Any]:
    """orjson's ``default`` for :func:`requirement_digest`: a wire model as its fields."""
    if isinstance(value, WireModel):
        return value.__dict__
    raise TypeError(f"not JSON: {type(value).__name__}")


# ---- the admission protocol ---------------------------------------------------------------


class AdmissionRequest(Message):
    """Producer -> manager (with ``reply_to``): admit this task. Answered by a decision."""

    TYPE = "mesh.admission-request.v1"
    type: Literal["mesh.admission-request.v1"] = "mesh.admission-request.v1"
    admission_id: Identifier
    requirements: TaskRequirements


class AdmissionDecision(Message):
    """Manager -> producer: ``admitted`` with a grant, or ``rejected`` / ``deferred`` and why."""

    TYPE = "mesh.admission-decision.v1"
    type: Literal["mesh.admission-decision.v1"] = "mesh.admission-decision.v1"
    admission_id: Identifier
    outcome: Literal["admitted", "rejected", "deferred"]
    grant: AdmissionGrant | None = None
    reason: AdmissionReason | None = None
    detail: str = Field(default="", max_length=2000)
    retry_after_ms: int | None = Field(default=None, ge=0)
    position: int | None = Field(
        default=None,
        ge=1,
        description="A deferral for capacity: this request's place in the pool's line (1: "
        "next). Its place is kept if it retries with the same admission ID within "
        "retry_after_ms and a grace; a request that comes back later joins at the back.",
    )
    allowed_degradations: Degradations = Field(default_factory=list)

    @model_validator(mode="after")
    def _grant_exactly_when_admitted(self) -> Self:
        if self.outcome == "admitted":
            if self.grant is None:
                raise ValueError("an admitted decision carries a grant")
            if (
                self.reason is not None
                or self.retry_after_ms is not None
                or self.position is not None
            ):
                raise ValueError(
                    "an admitted decision has no reason, no retry_after_ms and no position"
                )
            if self.grant.admission_id != self.admission_id:
                raise ValueError("the grant belongs to another admission")
        else:
            if self.grant is not None:
                raise ValueError(f"a {self.outcome} decision carries no grant")
            if self.reason is None:
                raise ValueError(f"a {self.outcome} decision carries a reason")
        return self

    def refusal(self) -> Refusal | None:
        """This decision in the one refusal shape (:func:`mesh.wire.refusal_of`); ``None`` if
        it admits."""
        if self.outcome == "admitted" or self.reason is None:
            return None
        return Refusal(reason=self.reason, detail=self.detail, retry_after_ms=self.retry_after_ms)


class AdmissionRelease(Message):
    """Holder -> manager: give the grant back. Only the current fence may release it.

    Settlement may report what the phase really cost; the manager compares it with the
    requirements' estimates (``mesh_cost_estimate_ratio``) and the deadline
    (``mesh_deadline_misses_total``). A release without them is a cancellation."""

    TYPE = "mesh.admission-release.v1"
    type: Literal["mesh.admission-release.v1"] = "mesh.admission-release.v1"
    admission_id: Identifier
    fence: PositiveInt
    actual_tokens: Count | None = Field(default=None, description="Tokens the phase used.")
    actual_duration_s: float | None = Field(
        default=None, ge=0, description="How long the phase's work took."
    )
    finished_at: Timestamp | None = Field(default=None, description="When the work finished.")


class AdmissionRevoke(Message):
    """Operator -> manager: take an admission's grant back now, for a security reason (a
    leaked credential, a compromised pool). Its attempt is cancelled wherever it runs and its
    result refused; it is not resubmitted. Answered by an ``AdmissionReleaseReply``."""

    TYPE = "mesh.admission-revoke.v1"
    type: Literal["mesh.admission-revoke.v1"] = "mesh.admission-revoke.v1"
    admission_id: Identifier
    reason: str = Field(min_length=1, max_length=500)


class AdmissionReleaseReply(Message):
    """Manager -> holder: released, or not and why (``STALE_FENCE``, ``NOT_FOUND``, ...)."""

    TYPE = "mesh.admission-release-reply.v1"
    type: Literal["mesh.admission-release-reply.v1"] = "mesh.admission-release-reply.v1"
    admission_id: Identifier
    released: bool
    reason: AdmissionReason | None = None
    detail: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _reason_exactly_when_not_released(self) -> Self:
        if self.released and self.reason is not None:
            raise ValueError("a successful release has no reason")
        if not self.released and self.reason is None:
            raise ValueError("a refused release carries a reason")
        return self


class DescriptorShadow(Message):
    """Operator -> manager: evaluate every admission also against ``descriptor``, a candidate
    next epoch of ``pool_id``, and record how its eligibility would differ — deciding nothing
    by it (shadow routing). Without ``descriptor`` the pool's shadow is removed. Answered by a
    ``DescriptorAccepted`` naming the shadow's epoch (or, when removed, the active one)."""

    TYPE = "mesh.descriptor-shadow.v1"
    type: Literal["mesh.descriptor-shadow.v1"] = "mesh.descriptor-shadow.v1"
    pool_id: PoolId
    descriptor: CapabilityDescriptor | None = None

    @model_validator(mode="after")
    def _same_pool(self) -> Self:
        if self.descriptor is not None and self.descriptor.pool_id != self.pool_id:
            raise ValueError(f"the descriptor is for pool {self.descriptor.pool_id!r}")
        return self


class DescriptorAccepted(Message):
    """Manager -> operator: the descriptor is its pool's active one now."""

    TYPE = "mesh.descriptor-accepted.v1"
    type: Literal["mesh.descriptor-accepted.v1"] = "mesh.descriptor-accepted.v1"
    pool_id: PoolId
    descriptor_epoch: int = Field(ge=1)


class ExplainRequest(Message):
    """Client -> manager: why was this admission decided the way it was?"""

    TYPE = "mesh.explain-request.v1"
    type: Literal["mesh.explain-request.v1"] = "mesh.explain-request.v1"
    admission_id: Identifier


class ExplainReply(Message):
    """Manager -> client: the decision, the eligibility record behind it (every pool, the rule
    that filtered it, the epochs and generation seen), and the reservation's state now."""

    TYPE = "mesh.explain-reply.v1"
    type: Literal["mesh.explain-reply.v1"] = "mesh.explain-reply.v1"
    admission_id: Identifier
    found: bool
    decision: AdmissionDecision | None = None
    eligibility: dict[str, Any] | None = None
    reservation: dict[str, Any] | None = None
    tenant: str | None = Field(
        default=None, max_length=255, description="The authenticated producer it was decided for."
    )


ADMISSION_MESSAGE_TYPES: tuple[type[Message], ...] = (
    CapabilityDescriptor,
    TaskRequirements,
    AdmissionRequest,
    AdmissionDecision,
    AdmissionRelease,
    AdmissionRevoke,
    AdmissionReleaseReply,
    DescriptorAccepted,
    DescriptorShadow,
    ExplainRequest,
    ExplainReply,
)
