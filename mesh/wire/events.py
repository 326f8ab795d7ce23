"""The orchestration log on the wire: :class:`OrchestrationEvent` and the ``detail`` of each
of its kinds.

An event's ``kind`` says what happened and names the model its ``detail`` follows
(:data:`EVENT_DETAILS`); a kind not listed there is refused, and so is a detail with a key or
a value its kind's model does not allow. Each kind's model is a schema of its own in
``schemas/`` (``mesh.event.<kind>.v1.json``, underscores as hyphens), and the event's schema
ties them to ``kind``. Reading back what a journal stored is the exception
(:meth:`OrchestrationEvent.as_stored`): an older manager's kinds and keys stay readable.

Who emits what: the pool core (:mod:`mesh.core.pool`) the lifecycle transitions and the
registry's events, the manager (:mod:`mesh.manager.service`,
:mod:`mesh.manager.admission_service`) admission and rollout, :mod:`mesh.manager.shards`
the ownership of shards. Most are journaled and published
on ``log.<agent_id>.<kind>``; ``capability_*`` are published on
``capability.<name>.<agent_id>`` only, ``grant_revoked`` and ``descriptor_active`` on
``grant.<pool_id>…`` only (the agents' grant feed).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, ErrorDetails, InitErrorDetails, PydanticCustomError

from mesh import constants as c
from mesh.wire.models import (
    CostClass,
    Count,
    Identifier,
    Message,
    PoolEpoch,
    PoolId,
    PositiveInt,
    SemVer,
    Timestamp,
    WireModel,
)

BrokerUser = Annotated[
    str, Field(min_length=1, max_length=255, description="A broker user (AMQP user_id).")
]
PressureStage = Literal[
    "NORMAL", "SHED_SPECULATIVE", "PAUSE_BATCH", "TIGHTEN", "REJECT_INTERACTIVE"
]
"""The names of :class:`mesh.core.pressure.Stage`, as ``pressure_stage`` carries them."""

# ---- the agent lifecycle (Registry.transition): one kind per trigger ---------------------


class RegisteredDetail(WireModel):
    """``registered``, from the pool core: an agent's registration arrived (Spawning ->
    Registering)."""


class ReadyDetail(WireModel):
    """``ready``, from the pool core: the registration was accepted (Registering -> Ready);
    the agent is handed work from now on."""


class RefusedDetail(WireModel):
    """``refused``, from the pool core: the registration was refused (Registering ->
    Terminated); ``reason`` is the refusal's reason code, ``detail`` its explanation (the
    text the agent is sent)."""

    detail: str = Field(min_length=1)


class AcquiredDetail(WireModel):
    """``acquired``, from the pool core: a lease took one slot of the agent (Ready or Busy ->
    Busy); the event's ``capability`` is the slot's."""

    lease_id: Identifier


class ReleasedDetail(WireModel):
    """``released``, from the pool core: a leased slot was given back (``lease_id``; Busy or
    Draining stay, the last unit of work Busy -> Ready), or the agent's pool work finished
    (no ``lease_id``; Busy -> Ready)."""

    lease_id: Identifier | None = None


class BusyDetail(WireModel):
    """``busy``, from the pool core: the agent reported pool work started (Ready -> Busy)."""


class DrainingDetail(WireModel):
    """``draining``, from the pool core: the agent takes no new work (Ready or Busy ->
    Draining): a drain request, a scale-down, or the agent's own SIGTERM."""


class TerminatedDetail(WireModel):
    """``terminated``, from the pool core: the agent deregistered, was replaced by a new
    incarnation, or finished its drain (-> Terminated); it is forgotten."""


class LostDetail(WireModel):
    """``lost``, from the pool core: no heartbeat for the missed-heartbeat window (->
    Terminated); the agent is fenced off the broker and forgotten."""


# ---- the registry (PoolCore) ----------------------------------------------------------------


class IllegalTransitionDetail(WireModel):
    """``illegal_transition``, from the pool core: a trigger the lifecycle table does not
    allow in the agent's state (``from_state``) was refused; ``reason`` names both."""


class RegistrationRefusedDetail(WireModel):
    """``registration_refused``, from the pool core: a second incarnation of a live agent was
    refused (``AGENT_ID_IN_USE``, broker identities off); it may retry once the live one
    deregisters or is declared lost."""

    incarnation: Identifier = Field(
        description=(
            "The incarnation that was refused, as its fingerprint (sha256- and the first 12 "
            "hex digits of its SHA-256): with identities off an incarnation is what lets a "
            "publisher speak for the agent, so the events feed never carries one."
        )
    )
    live_incarnation: Identifier = Field(
        description="The one that stays registered, as its fingerprint."
    )


class DrainConfirmedDetail(WireModel):
    """``drain_confirmed``, from the pool core: a draining agent's heartbeat says it stopped
    taking pool tasks (once per drain), with what still runs there."""

    pool_in_flight: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="The pool tasks it still runs, per capability."
    )
    leases: Count = Field(description="The leases still held on it.")


class ScaleDetail(WireModel):
    """``scale``, from the pool core: a scaling policy set ``deployment`` to ``replicas``;
    on a scale-down the event's ``agent_id`` is the agent removed first (else empty)."""

    deployment: Identifier
    replicas: Count


class CapabilityAvailableDetail(WireModel):
    """``capability_available``, from the pool core, published (not journaled) when an
    accepted agent offers the event's ``capability``: at this version and cost class."""

    version: SemVer
    cost_class: CostClass


class CapabilityWithdrawnDetail(WireModel):
    """``capability_withdrawn``, from the pool core, published (not journaled) when a removed
    agent no longer offers the event's ``capability`` at this version."""

    version: SemVer


class VersionDriftDetail(WireModel):
    """``version_drift``, from the pool core: the event's ``capability`` is offered at more
    than one version at once."""

    versions: list[SemVer] = Field(min_length=2, description="The versions offered, oldest first.")


# ---- the manager ----------------------------------------------------------------------------


class ManagerStartedDetail(WireModel):
    """``manager_started``, from the manager once started; ``reason`` is its manager ID."""


class ManagerStalledDetail(WireModel):
    """``manager_stalled``, from the pool core: it was not ticked for a while (the manager
    process stalled), so every agent's liveness window restarted instead of evicting them."""


class ConnectionRestoredDetail(WireModel):
    """``connection_restored``, from the pool core: the manager hears the broker again after
    losing it; every agent's liveness window restarted."""


# ---- admission (AdmissionService) -----------------------------------------------------------


class AdmissionDetail(WireModel):
    """``admission``, from the manager: one admission decided for ``tenant`` (``reason`` is
    the refusal's reason, or the outcome); ``pool_id`` and ``fence`` are the grant's, null
    unless admitted. Journaled; published only when not admitted."""

    admission_id: Identifier
    outcome: Literal["admitted", "rejected", "deferred"]
    tenant: BrokerUser
    pool_id: PoolId | None
    fence: PositiveInt | None


class AdmissionEvictedDetail(WireModel):
    """``admission_evicted``, from the manager: admitted work (``admission_id`` at ``fence``,
    held by ``tenant``) was released to make room for the more urgent ``for_admission``; its
    grant is revoked as evicted (``grant_revoked``)."""

    admission_id: Identifier
    pool_id: PoolId
    fence: PositiveInt
    tenant: BrokerUser = Field(description="Its holder ('(unknown)' for a grant adopted bare).")
    for_admission: Identifier


class AdmissionRevokedDetail(WireModel):
    """``admission_revoked``, from the manager: the operator (``by``) revoked an admission
    for a security reason (``reason``); its grant is revoked (``grant_revoked``). Journaled,
    not published."""

    admission_id: Identifier
    pool_id: PoolId
    fence: PositiveInt
    by: BrokerUser


class AdmissionExpiredDetail(WireModel):
    """``admission_expired``, from the manager's expiry sweep: a grant outlived its lease in
    the ledger (``reason`` names the new fence); its grant is revoked (``grant_revoked``)."""

    admission_id: Identifier
    pool_id: PoolId


class PressureStageDetail(WireModel):
    """``pressure_stage``, from the manager: a pool's pressure stage changed (``from`` ->
    ``to``) because of ``cause`` (utilisation, queue age, a broker alarm, ...)."""

    pool_id: PoolId
    from_: PressureStage = Field(alias="from")
    to: PressureStage
    cause: str


# ---- rollout (AdmissionService) -------------------------------------------------------------


class DescriptorDetail(WireModel):
    """``descriptor``, from the manager: it accepted the pool's descriptor at ``epoch``;
    ``draining`` (when the epoch advanced) the admissions that may finish under the older
    one."""

    pool_id: PoolId
    epoch: PositiveInt
    draining: list[Identifier] | None = Field(default=None, max_length=4096)


class DescriptorShadowDetail(WireModel):
    """``descriptor_shadow``, from the manager: the pool's next descriptor (``epoch``) is
    evaluated in shadow — decisions record how its eligibility would differ. Journaled, not
    published."""

    pool_id: PoolId
    epoch: PositiveInt


class GrantRevokedDetail(WireModel):
    """``grant_revoked``, from the manager on ``grant.<pool_id>.<admission_id>`` (not
    journaled): every grant of ``admission_id`` up to ``fence`` is void (the event's
    ``to_state`` says why: ``RELEASED`` or ``EXPIRED``). ``evicted``: taken back for more
    urgent work, so its agent stops it; ``security``: the operator's reason for a security
    revocation, which stops it too (:mod:`mesh.agent.grants`)."""

    admission_id: Identifier
    pool_id: PoolId
    fence: PositiveInt
    evicted: bool = False
    security: str | None = Field(default=None, min_length=1, max_length=500)


# ---- several managers (mesh.manager.shards) -------------------------------------------------


class ShardDetail(WireModel):
    """``shard``, from a manager: who owns a shard of the registry changed. The event's
    ``reason`` says how (``taken``, ``given_back``, ``lost``: a renewal found the lease gone);
    ``fence`` is the lease's fence (none for a loss)."""

    shard: Count
    manager_id: Identifier
    fence: PositiveInt | None = None


EVENT_DETAILS: dict[str, type[WireModel]] = {
    "registered": RegisteredDetail,
    "ready": ReadyDetail,
    "refused": RefusedDetail,
    "acquired": AcquiredDetail,
    "released": ReleasedDetail,
    "busy": BusyDetail,
    "draining": DrainingDetail,
    "terminated": TerminatedDetail,
    "lost": LostDetail,
    "illegal_transition": IllegalTransitionDetail,
    "registration_refused": RegistrationRefusedDetail,
    "drain_confirmed": DrainConfirmedDetail,
    "scale": ScaleDetail,
    "capability_available": CapabilityAvailableDetail,
    "capability_withdrawn": CapabilityWithdrawnDetail,
    "version_drift": VersionDriftDetail,
    "manager_started": ManagerStartedDetail,
    "manager_stalled": ManagerStalledDetail,
    "connection_restored": ConnectionRestoredDetail,
    "admission": AdmissionDetail,
    "admission_evicted": AdmissionEvictedDetail,
    "admission_revoked": AdmissionRevokedDetail,
    "admission_expired": AdmissionExpiredDetail,
    "pressure_stage": PressureStageDetail,
    "descriptor": DescriptorDetail,
    "descriptor_shadow": DescriptorShadowDetail,
    "shard": ShardDetail,
    # The pool's active epoch, on grant.<pool_id> (and, to itself, by an agent whose
    # registration's acceptance carried it).
    c.EVENT_DESCRIPTOR_ACTIVE: PoolEpoch,
    c.EVENT_GRANT_REVOKED: GrantRevokedDetail,
}
"""Every event kind, and the model its ``detail`` follows."""


def detail_schema_name(kind: str) -> str:
    """The schema name of a kind's detail, ``mesh.event.<kind>.v1`` (underscores as hyphens,
    as in every other schema name)."""
    return f"mesh.event.{kind.replace('_', '-')}.v1"


_AS_STORED = "as_stored"  # the validation context key of OrchestrationEvent.as_stored


class OrchestrationEvent(Message):
    """One entry of the append-only orchestration log (also published on the events exchange).
    ``detail`` follows the model of its ``kind`` (:data:`EVENT_DETAILS`)."""

    TYPE = "mesh.orchestration-event.v1"
    type: Literal["mesh.orchestration-event.v1"] = "mesh.orchestration-event.v1"
    seq: int | None = Field(default=None, description="Position in the journal, once stored.")
    at: Timestamp
    kind: str = Field(max_length=64, examples=["registered", "ready", "acquired", "lost"])
    agent_id: str = Field(default="", max_length=63)
    from_state: str | None = None
    to_state: str | None = None
    capability: str | None = None
    reason: str = Field(default="", max_length=1000)
    detail: dict[str, Any] = Field(
        default_factory=dict, description="What happened, as the model of its kind says."
    )

    @classmethod
    def as_stored(cls, fields: dict[str, Any]) -> OrchestrationEvent:
        """An event as a journal stored it: the envelope is validated, its kind and detail
        are taken as written, so an entry an older (or newer) manager wrote stays readable."""
        return cls.model_validate(fields, context={_AS_STORED: True})

    @model_validator(mode="after")
    def _detail_fits_kind(self, info: ValidationInfo) -> Self:
        if info.context is not None and info.context.get(_AS_STORED):
            return self
        model = EVENT_DETAILS.get(self.kind)
        if model is None:
            unknown = PydanticCustomError(
                "unknown_event_kind",
                "unknown event kind '{kind}' (the kinds are in mesh.wire.events.EVENT_DETAILS)",
                {"kind": self.kind},
            )
            raise _errors([InitErrorDetails(type=unknown, loc=("kind",), input=self.kind)])
        try:
            # Strict: exactly the JSON types the kind's schema allows ("3" is no fence).
            model.model_validate(self.detail, strict=True)
        except ValidationError as exc:
            raise _errors([_under("detail", e) for e in exc.errors()]) from None
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The envelope with ``kind`` one of the known kinds, plus one ``if kind is K then
        detail is K's model`` per kind (a kind whose model has required fields requires
        ``detail`` too)."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        target["properties"]["kind"]["enum"] = sorted(EVENT_DETAILS)
        rules = []
        for kind, model in EVENT_DETAILS.items():
            detail = handler(model.__pydantic_core_schema__)
            then: dict[str, Any] = {"properties": {"detail": detail}}
            if any(f.is_required() for f in model.model_fields.values()):
                then["required"] = ["detail"]
            rules.append({"if": {"properties": {"kind": {"const": kind}}}, "then": then})
        target["allOf"] = rules
        return schema


def _under(field: str, error: ErrorDetails) -> InitErrorDetails:
    """A detail model's error, placed under ``field`` of the event."""
    found = InitErrorDetails(type=error["type"], loc=(field, *error["loc"]), input=error["input"])
    if "ctx" in error:
        found["ctx"] = error["ctx"]
    return found


def _errors(errors: list[InitErrorDetails]) -> ValidationError:
    return ValidationError.from_exception_data(OrchestrationEvent.__name__, errors)
