"""Pydantic v2 models of every message on the wire.

Every message is a flat JSON object whose ``type`` field names its schema and
version (``mesh.heartbeat.v1``). Unknown fields are an error (``extra="forbid"``):
the admission rules depend on nobody sneaking in fields we do not understand.
The JSON Schemas in ``schemas/`` are generated from these classes.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from mesh.constants import AGENT_ID_WORD, DEFAULT_HEARTBEAT_INTERVAL_S
from mesh.wire.reasons import Reason

_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")

CapabilityName = Annotated[
    str,
    Field(
        pattern=r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)+$",
        max_length=128,
        description="Dotted capability name, e.g. 'rag.search'.",
        examples=["rag.search"],
    ),
]
AgentId = Annotated[
    str,
    Field(
        pattern=f"^{AGENT_ID_WORD}$",
        description="Agent identifier; usable as a routing-key word (no dots).",
        examples=["calc-7f9c"],
    ),
]
SemVer = Annotated[
    str,
    Field(
        pattern=_SEMVER.pattern,
        description="Semantic version MAJOR.MINOR.PATCH.",
        examples=["2.1.0"],
    ),
]
VersionSpec = Annotated[
    str,
    Field(
        max_length=200,
        description="PEP 440 version specifier set, e.g. '>=2.0,<3'.",
        examples=[">=2.0,<3"],
    ),
]
Identifier = Annotated[str, Field(min_length=1, max_length=128)]
Timestamp = Annotated[float, Field(ge=0, description="Seconds since the Unix epoch.")]
CostClass = Literal["A", "B", "C"]

T = TypeVar("T")


def distinct(items: list[T]) -> list[T]:
    """A list validator: every item at most once."""
    if len(set(items)) != len(items):
        raise ValueError("items must be distinct")
    return items


UNIQUE_ITEMS = Field(json_schema_extra={"uniqueItems": True})
Degradation = Literal["less_retrieval", "fewer_review_passes", "partial_results"]
"""What a task may give up to finish in time (less retrieval fan-out, fewer review passes,
partial results), only as its requirements allow."""
Degradations = Annotated[list[Degradation], AfterValidator(distinct), UNIQUE_ITEMS]


def _check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema, else ``ValueError`` saying why.

    Checking a schema against its metaschema costs about a millisecond, and a fleet's agents
    send the same few schemas in every registration: the verdict is remembered per schema
    (its canonical JSON, keys sorted), for the last :data:`SCHEMA_VERDICTS` distinct ones."""
    try:
        canonical = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer past 64 bits, which orjson refuses: checked uncached
        problem = _schema_problem_of(schema)
    else:
        problem = _schema_problem(canonical)
    if problem is not None:
        raise ValueError(problem)
    return schema


SCHEMA_VERDICTS = 1024


@lru_cache(maxsize=SCHEMA_VERDICTS)
def _schema_problem(canonical: bytes) -> str | None:
    return _schema_problem_of(orjson.loads(canonical))


def _schema_problem_of(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON Schema, or ``None``."""
    if "$schema" in schema and not isinstance(schema["$schema"], str):
        return "not a valid JSON Schema: '$schema' must be a string"
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON Schema: {exc.message}"
    except Exception as exc:  # jsonschema raises odd types for odd input; all mean "invalid"
        return f"not a valid JSON Schema: {type(exc).__name__}: {exc}"
    return None


JsonSchemaDoc = Annotated[dict[str, Any], AfterValidator(_check_json_schema)]


class WireModel(BaseModel):
    """Base of every wire model: strict about unknown fields, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Message(WireModel):
    """A top-level message: its ``type`` names the schema it follows.

    ``ADDED_FIELDS`` names optional fields a message gained after its version was first
    released: they are left out of the body while unset, so a receiver that predates them
    (receivers refuse unknown fields) still decodes the message, and they are set only for
    receivers that said they know them (a registration's ``features``)."""

    TYPE: ClassVar[str]
    ADDED_FIELDS: ClassVar[frozenset[str]] = frozenset()
    type: str


class Capability(WireModel):
    """One versioned capability an agent offers."""

    name: CapabilityName
    version: SemVer
    input_schema: JsonSchemaDoc = Field(description="JSON Schema every task payload must match.")
    output_schema: JsonSchemaDoc = Field(description="JSON Schema every result must match.")
    max_concurrency: int = Field(ge=1, le=10_000)
    cost_class: CostClass = Field(description="A is cheapest, C is dearest.")
    description: str = Field(default="", max_length=1000)


class AgentRegistration(Message):
    """Agent -> manager: who I am and what I can do. Answered by accepted or refused."""

    TYPE = "mesh.agent-registration.v1"
    type: Literal["mesh.agent-registration.v1"] = "mesh.agent-registration.v1"
    agent_id: AgentId
    incarnation: Identifier = Field(description="Changes every time the agent process starts.")
    deployment: Identifier = Field(description="The pool (Kubernetes Deployment) it belongs to.")
    endpoint: str = Field(default="", max_length=512, description="Its HTTP endpoint, if any.")
    capabilities: list[Capability] = Field(min_length=1, max_length=64)
    heartbeat_interval_s: float = Field(default=DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, le=3600)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    features: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list,
        max_length=32,
        description="Protocol features the agent implements. 'descriptor-epochs': it refuses "
        "a grant issued under an older descriptor epoch than its pool's active one (unless "
        "the admission is on the pool's draining allowlist). A pool with a descriptor admits "
        "only agents that say so.",
    )

    @field_validator("capabilities")
    @classmethod
    def _names_unique(cls, caps: list[Capability]) -> list[Capability]:
        names = [c.name for c in caps]
        if len(set(names)) != len(names):
            raise ValueError("capability names must be unique within one registration")
        return caps


class Deregistration(Message):
    """Agent -> manager: I am leaving (after a drain, or on shutdown)."""

    TYPE = "mesh.agent-deregistration.v1"
    type: Literal["mesh.agent-deregistration.v1"] = "mesh.agent-deregistration.v1"
    agent_id: AgentId
    incarnation: Identifier
    reason: str = Field(default="", max_length=500)


class Heartbeat(Message):
    """Agent -> manager: still alive. Dynamic utilisation only; it grants nothing."""

    TYPE = "mesh.heartbeat.v1"
    type: Literal["mesh.heartbeat.v1"] = "mesh.heartbeat.v1"
    agent_id: AgentId
    incarnation: Identifier
    seq: int = Field(ge=0)
    in_flight: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict, max_length=64)
    pool_in_flight: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Of in_flight, the tasks from the pool's shared queue (granted) that have "
        "started, per capability: the manager adds them to the agent's leased slots, its one "
        "count of work. A full count each time, never a delta.",
    )
    draining: bool = Field(
        default=False,
        description="The agent takes no more pool tasks (its pool consumer is stopped).",
    )
    sent_at: Timestamp


class DrainRequest(Message):
    """Anyone -> manager: drain this agent (an operator, or the agent itself on SIGTERM).

    ``incarnation``: the agent's own, which a drain request on the announce exchange (the
    agent's own, on SIGTERM) must name; the operator's, on the control exchange, names only the
    agent."""

    TYPE = "mesh.drain-request.v1"
    ADDED_FIELDS = frozenset({"incarnation"})
    type: Literal["mesh.drain-request.v1"] = "mesh.drain-request.v1"
    agent_id: AgentId
    reason: str = Field(default="", max_length=500)
    incarnation: Identifier | None = None


class PoolEpoch(WireModel):
    """A pool's active descriptor epoch, as the manager last announced it (the ``detail`` of
    a ``descriptor_active`` event): grants of an older epoch are refused unless their
    admission is on ``draining``. ``draining`` absent (``None``): this manager did not advance
    the epoch and does not know the list — keep the one you have."""

    pool_id: Identifier
    descriptor_epoch: int = Field(ge=1)
    policy_generation: int = Field(ge=1)
    draining: list[Identifier] | None = Field(default=None, max_length=4096)


class RegistrationAccepted(Message):
    """Manager -> agent: you are Ready and will be handed work. ``pool_epoch``: the agent's
    pool's active epoch when its pool has a descriptor, so a new agent judges grants at once
    instead of waiting for the next periodic ``descriptor_active`` announcement. ``shard``
    (several managers, to an agent with the ``shards`` feature): the agent's shard, the last
    word of its heartbeat and announce keys from now on."""

    TYPE = "mesh.registration-accepted.v1"
    ADDED_FIELDS = frozenset({"pool_epoch", "shard"})
    type: Literal["mesh.registration-accepted.v1"] = "mesh.registration-accepted.v1"
    agent_id: AgentId
    incarnation: Identifier
    pool_epoch: PoolEpoch | None = None
    shard: int | None = Field(default=None, ge=0, lt=4096)


class RegistrationRefused(Message):
    """Manager -> agent: your registration was refused; ``reason`` says why."""

    TYPE = "mesh.registration-refused.v1"
    type: Literal["mesh.registration-refused.v1"] = "mesh.registration-refused.v1"
    agent_id: AgentId
    incarnation: Identifier
    reason: Reason
    detail: str = ""
    retry_after_ms: int | None = Field(
        default=None,
        ge=0,
        description="Set when the refusal is temporary (AGENT_ID_IN_USE): register again "
        "with the same incarnation after this long. Absent: the refusal is final.",
    )


class StandingRequest(Message):
    """Agent -> manager (``agent.<id>.standing`` on the announce exchange, answered on its
    control queue): after a silence (its connection lost for a while), is this incarnation
    still registered — or was it declared lost? The answer decides whether the results of
    tasks it claimed before the silence may still be delivered (:mod:`mesh.agent.core`,
    self-fencing)."""

    TYPE = "mesh.standing-request.v1"
    type: Literal["mesh.standing-request.v1"] = "mesh.standing-request.v1"
    agent_id: AgentId
    incarnation: Identifier


class Standing(Message):
    """Manager -> agent: ``registered`` true if the agent is registered with exactly that
    incarnation now; ``state`` its lifecycle state then, ``registered_for_s`` since when (a
    registration younger than the silence: it was declared lost and came back)."""

    TYPE = "mesh.standing.v1"
    type: Literal["mesh.standing.v1"] = "mesh.standing.v1"
    agent_id: AgentId
    incarnation: Identifier
    registered: bool
    state: str | None = Field(default=None, max_length=32)
    registered_for_s: float | None = Field(
        default=None,
        ge=0,
        description="How long this registration has stood: a registration younger than a "
        "task's claim means the agent was forgotten and registered again meanwhile.",
    )


class AdmissionStateRequest(Message):
    """Agent -> manager (``agent.<id>.admission`` on the announce exchange, answered on its
    control queue): a pool task came to this agent *redelivered* — another consumer took it
    and did not ack — and this agent has no answer of its own for it. Has the ledger settled
    its admission already? A released admission's task was answered (or given up on by its
    producer), so it is not run again; the agents that were live heard the release as a
    revocation, an agent started since did not, and asks."""

    TYPE = "mesh.admission-state-request.v1"
    type: Literal["mesh.admission-state-request.v1"] = "mesh.admission-state-request.v1"
    agent_id: AgentId
    incarnation: Identifier
    admission_id: Identifier


class AdmissionState(Message):
    """Manager -> agent: the ledger's state of one admission of the agent's pool
    (``PREPARING``, ``ACTIVE``, ``RELEASED``, ``EXPIRED``), with its fence; ``None`` when the
    ledger does not hold it or it is another pool's (nothing is told about other pools)."""

    TYPE = "mesh.admission-state.v1"
    type: Literal["mesh.admission-state.v1"] = "mesh.admission-state.v1"
    agent_id: AgentId
    admission_id: Identifier
    state: Literal["PREPARING", "ACTIVE", "RELEASED", "EXPIRED"] | None = None
    fence: int | None = Field(default=None, ge=0)


class LeaseStateRequest(Message):
    """Agent -> manager (``agent.<id>.standing`` on the announce exchange: a question about
    the agent's own standing, like :class:`StandingRequest`; answered on its control queue): a
    task came on the agent's own queue under a lease it was not told of. Its notice may be late
    or lost (sent while the control queue was being declared again after a broker restart):
    was ``lease_id`` issued to this incarnation, and has it not ended? The answer is a
    :class:`LeaseNotice` for that lease — ``ended`` when it is unknown, another agent's, or
    the asking incarnation is not registered."""

    TYPE = "mesh.lease-state-request.v1"
    type: Literal["mesh.lease-state-request.v1"] = "mesh.lease-state-request.v1"
    agent_id: AgentId
    incarnation: Identifier
    lease_id: Identifier
    capability: CapabilityName = Field(
        description="The capability the task asks for: named in the answer when the lease "
        "is unknown to the manager."
    )


class ReRegisterRequest(Message):
    """Manager -> agent: I do not know you (I restarted, or you were declared lost).
    ``leases_kept`` (several managers, to an agent with the ``hand-over`` feature): your
    shard moved to another manager; register with it, but keep serving the leases you were
    told of — they were granted and are still valid, only their bookkeeping moved."""

    TYPE = "mesh.reregister-request.v1"
    ADDED_FIELDS = frozenset({"leases_kept"})
    type: Literal["mesh.reregister-request.v1"] = "mesh.reregister-request.v1"
    agent_id: AgentId
    reason: str = ""
    leases_kept: bool | None = None


class DrainNotice(Message):
    """Manager -> agent: you are Draining; finish what you hold, take nothing new."""

    TYPE = "mesh.drain-notice.v1"
    type: Literal["mesh.drain-notice.v1"] = "mesh.drain-notice.v1"
    agent_id: AgentId
    reason: str = ""


class DrainComplete(Message):
    """Manager -> agent: every lease on you is released; you are Terminated and may exit."""

    TYPE = "mesh.drain-complete.v1"
    type: Literal["mesh.drain-complete.v1"] = "mesh.drain-complete.v1"
    agent_id: AgentId


class LeaseNotice(Message):
    """Manager -> agent: a lease on one of your slots was issued (``ended``: given back or
    expired). A task on your own queue runs only under a lease you were told of: its
    ``lease_id``, before ``expires_in_s`` from when you received this. Sent before the lease
    reaches the producer, to agents that list the ``lease-notices`` feature."""

    TYPE = "mesh.lease-notice.v1"
    type: Literal["mesh.lease-notice.v1"] = "mesh.lease-notice.v1"
    agent_id: AgentId
    lease_id: Identifier
    capability: CapabilityName
    expires_in_s: float = Field(ge=0)
    ended: bool = False


class InvocationLease(WireModel):
    """A short-lived credential for one admission, signed by the manager (Ed25519).

    Narrower than anything else an agent holds: it names one admission at one fence, one pool,
    the tools the task may use, and expires with the grant or sooner. What an attempt presents
    at each consumption point — the agent's own claim and result, and any tool service — which
    checks it with the manager's public key only (:mod:`mesh.leases`): no verifier can mint one.
    """

    lease_id: Identifier
    admission_id: Identifier
    pool_id: AgentId
    fence: Annotated[int, Field(ge=1)]
    descriptor_epoch: Annotated[int, Field(ge=1)]
    tools: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=64, description="The tools it may be presented to."
    )
    issued_at: Timestamp
    expires_at: Timestamp
    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")] = Field(
        description="Which manager key signed it: the first 16 hex digits of the SHA-256 of "
        "the raw public key."
    )
    signature: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{86}$")] = Field(
        description="Ed25519 over the canonical JSON (sorted keys) of every other field, "
        "base64url without padding."
    )


PoolId = Annotated[
    str,
    Field(
        pattern=f"^{AGENT_ID_WORD}$",  # the AgentId form: a routing-key word
        description="Pool identifier: the agent Deployment; usable as a routing-key word.",
        examples=["calc"],
    ),
]
MAX_SAFE_INT = 2**53 - 1
"""The largest integer every JSON reader keeps exactly (and far inside what the ledger's
64-bit counters hold): counts, fences and epochs past it are refused at the edge, not
deep in a batch where one of them would fail every other request decided with it."""
PositiveInt = Annotated[int, Field(ge=1, le=MAX_SAFE_INT)]
Count = Annotated[int, Field(ge=0, le=MAX_SAFE_INT)]


class AdmissionGrant(WireModel):
    """A reservation that reached ACTIVE: the grant an admission decision carries, and the
    one its task runs under (``Task.grant``) — one type on the wire. The agent revalidates it
    when it claims the task and again before it publishes the result
    (:mod:`mesh.agent.grants`)."""

    admission_id: Identifier
    pool_id: PoolId
    descriptor_epoch: PositiveInt
    policy_generation: PositiveInt
    fence: PositiveInt
    grant_ids: list[Identifier] = Field(
        default_factory=list, max_length=64, description="Ledger and external grant IDs."
    )
    expires_at: Timestamp
    fallback_for: PoolId | None = Field(
        default=None,
        description="Set when a fallback pool was granted: the primary pool it stands in for.",
    )
    lease: InvocationLease | None = Field(
        default=None,
        description="The invocation lease an attempt presents at each consumption point "
        "(when the manager signs them: mesh manager --lease-key).",
    )

    @classmethod
    def from_grant(cls, grant: AdmissionGrant) -> AdmissionGrant:
        """``grant`` itself: a task carries the decision's grant as it is (kept for the
        callers of ``TaskGrant.from_grant``)."""
        return grant


TaskGrant = AdmissionGrant
"""The grant a task runs under is the decision's :class:`AdmissionGrant`; this name, from
when a copy of it stood here, is kept for one version."""


class Task(Message):
    """Producer -> agent: run one capability on this payload.

    A task carries a ``lease_id`` (the lease path: a lease the manager issued to the agent it
    is sent to) or a ``grant`` (the admission path). An agent refuses a task whose grant is
    foreign, expired or revoked, whose lease it was not told of, or that carries neither
    (unless it runs with open tasks allowed): no credentials, no work.
    """

    TYPE = "mesh.task.v1"
    type: Literal["mesh.task.v1"] = "mesh.task.v1"
    task_id: Identifier
    capability: CapabilityName
    lease_id: Identifier | None = None
    payload: dict[str, Any]
    deadline: Timestamp | None = None
    submitted_at: Timestamp
    grant: AdmissionGrant | None = Field(
        default=None, description="The admission grant it runs under, revalidated by the agent."
    )
    allowed_degradations: Degradations = Field(
        default_factory=list,
        description="What the handler may give up to finish in time (from the requirements).",
    )


class ErrorInfo(WireModel):
    """Why a task failed, machine-readable first."""

    code: Reason
    message: str = Field(max_length=4000)


class AppliedDegradation(WireModel):
    """One degradation a handler applied, and the evidence its output therefore lacks."""

    kind: Degradation
    missing_evidence: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default_factory=list,
        max_length=64,
        description="What the output does not rest on, e.g. the sources not retrieved.",
    )
    note: str = Field(default="", max_length=1000)


def _one_per_kind(applied: list[AppliedDegradation]) -> list[AppliedDegradation]:
    distinct([d.kind for d in applied])
    return applied


class TaskResult(Message):
    """Agent -> producer: the outcome of one task."""

    TYPE = "mesh.task-result.v1"
    type: Literal["mesh.task-result.v1"] = "mesh.task-result.v1"
    task_id: Identifier
    agent_id: AgentId
    capability: CapabilityName
    status: Literal["ok", "error"]
    output: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    started_at: Timestamp
    finished_at: Timestamp
    degradations: Annotated[list[AppliedDegradation], AfterValidator(_one_per_kind)] = Field(
        default_factory=list,
        max_length=3,
        description="Degradations applied (each one the task allowed); empty: the full result.",
    )


# ---- Manager API (request/reply over the control exchange) -------------------------------


class FindRequest(Message):
    """Client -> manager: which agents can take this capability now?"""

    TYPE = "mesh.find-request.v1"
    type: Literal["mesh.find-request.v1"] = "mesh.find-request.v1"
    capability: CapabilityName
    version_spec: VersionSpec = ">=0"
    limit: int | None = Field(default=None, ge=1, le=10_000)


class AcquireRequest(Message):
    """Client -> manager: reserve one slot, on a named agent or on the best match."""

    TYPE = "mesh.acquire-request.v1"
    type: Literal["mesh.acquire-request.v1"] = "mesh.acquire-request.v1"
    capability: CapabilityName
    version_spec: VersionSpec = ">=0"
    agent_id: AgentId | None = Field(default=None, description="Omit to take the best match.")
    ttl_s: float | None = Field(default=None, gt=0, le=86_400)


class ReleaseRequest(Message):
    """Client -> manager: give back the slot a lease holds."""

    TYPE = "mesh.release-request.v1"
    type: Literal["mesh.release-request.v1"] = "mesh.release-request.v1"
    lease_id: Identifier


class AgentSummary(WireModel):
    """One agent as a find reply shows it."""

    agent_id: AgentId
    capability: CapabilityName
    version: SemVer
    cost_class: CostClass
    in_flight: int
    max_concurrency: int


class FindReply(Message):
    """Manager -> client: agents that can take work now, best first (may be empty). With
    several managers, ``unanswered_shards`` is how many of the shards the answering manager
    does not hold went unanswered (their owner did not answer in time): their agents are
    missing. It is set only for a client that lists ``unanswered-shards`` in its request's
    ``x-mesh-features`` header."""

    TYPE = "mesh.find-reply.v1"
    ADDED_FIELDS = frozenset({"unanswered_shards"})
    type: Literal["mesh.find-reply.v1"] = "mesh.find-reply.v1"
    agents: list[AgentSummary]
    unanswered_shards: int | None = Field(default=None, ge=0)


class Lease(WireModel):
    """One reserved slot on one agent for one capability."""

    lease_id: Identifier
    agent_id: AgentId
    capability: CapabilityName
    version: SemVer
    cost_class: CostClass
    expires_in_s: float


class LeaseGranted(Message):
    """Manager -> client: the slot is yours until you release it or it expires."""

    TYPE = "mesh.lease-granted.v1"
    type: Literal["mesh.lease-granted.v1"] = "mesh.lease-granted.v1"
    lease: Lease


class Released(Message):
    """Manager -> client: the lease is released."""

    TYPE = "mesh.released.v1"
    type: Literal["mesh.released.v1"] = "mesh.released.v1"
    lease_id: Identifier


class DrainAccepted(Message):
    """Manager -> client: the agent is Draining."""

    TYPE = "mesh.drain-accepted.v1"
    type: Literal["mesh.drain-accepted.v1"] = "mesh.drain-accepted.v1"
    agent_id: AgentId
    in_flight: int


class Refusal(Message):
    """Manager -> client: the request was refused. ``reason`` is machine-readable."""

    TYPE = "mesh.refusal.v1"
    type: Literal["mesh.refusal.v1"] = "mesh.refusal.v1"
    reason: Reason
    detail: str = ""
    retry_after_ms: int | None = Field(default=None, ge=0)


CORE_MESSAGE_TYPES: tuple[type[Message], ...] = (
    AgentRegistration,
    Deregistration,
    Heartbeat,
    DrainRequest,
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    StandingRequest,
    Standing,
    AdmissionStateRequest,
    AdmissionState,
    LeaseStateRequest,
    DrainNotice,
    DrainComplete,
    LeaseNotice,
    Task,
    TaskResult,
    FindRequest,
    AcquireRequest,
    ReleaseRequest,
    FindReply,
    LeaseGranted,
    Released,
    DrainAccepted,
    Refusal,
)
