"""One valid sample of every wire message, for the codec, schema and integration tests.

``SAMPLES`` maps each class in :data:`mesh.wire.MESSAGE_TYPES` to an instance whose optional
fields are filled in where that makes the sample say more (nested models, enums, nulls).
"""

from __future__ import annotations

from typing import Any

from mesh.wire import (
    AcquireRequest,
    AdmissionDecision,
    AdmissionGrant,
    AdmissionReason,
    AdmissionRelease,
    AdmissionReleaseReply,
    AdmissionRequest,
    AdmissionRevoke,
    AdmissionState,
    AdmissionStateRequest,
    AgentRegistration,
    AgentStatus,
    AgentSummary,
    Capability,
    CapabilityDescriptor,
    CapabilityLoadStatus,
    CapabilityRange,
    CapabilityStatus,
    Deregistration,
    DescriptorAccepted,
    DescriptorShadow,
    DrainAccepted,
    DrainComplete,
    DrainNotice,
    DrainRequest,
    ErrorInfo,
    ExplainReply,
    ExplainRequest,
    FindReply,
    FindRequest,
    HealthEvidence,
    Heartbeat,
    Lease,
    LeaseGranted,
    LeaseNotice,
    LeaseStateRequest,
    Message,
    ModelLimits,
    OrchestrationEvent,
    PoolEpoch,
    PoolStates,
    PoolTool,
    Reason,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    Released,
    ReleaseRequest,
    ReRegisterRequest,
    Sandbox,
    Standing,
    StandingRequest,
    StatusReply,
    StatusRequest,
    Task,
    TaskRequirements,
    TaskResult,
    TenantIsolation,
    ToolRequirement,
)

T0 = 1_700_000_000.0

ADD_INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD_OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"sum": {"type": "number"}},
    "required": ["sum"],
}

CALC_ADD = Capability(
    name="calc.add",
    version="1.2.0",
    input_schema=ADD_INPUT_SCHEMA,
    output_schema=ADD_OUTPUT_SCHEMA,
    max_concurrency=4,
    cost_class="A",
    description="Adds two numbers.",
)
TEXT_STATS = Capability(
    name="text.stats",
    version="0.3.1",
    input_schema={"type": "object", "properties": {"text": {"type": "string"}}},
    output_schema={"type": "object"},
    max_concurrency=2,
    cost_class="B",
)

CAPABILITY_STATUS = CapabilityStatus(
    name="calc.add", version="1.2.0", cost_class="A", in_flight=1, max_concurrency=4
)

DESCRIPTOR = CapabilityDescriptor(
    pool_id="rag-eu",
    descriptor_epoch=3,
    runtime_digest="sha256:" + "ab" * 32,
    capabilities=[
        CapabilityRange(name="rag.search", version_spec=">=2.0,<3"),
        CapabilityRange(name="rag.answer", version_spec="==1.*"),
    ],
    task_schema_range=">=1,<2",
    result_schema_range=">=1,<3",
    tools=[
        PoolTool(name="web-search", version="2.1.0", permits=8),
        PoolTool(name="code.exec", version="1.0.0", permits=2),
    ],
    data_classifications=["public", "internal", "confidential"],
    tenant_isolation=TenantIsolation(mode="shared", tenants=[]),
    regions=["eu-west-1", "eu-central-1"],
    model_limits=ModelLimits(context_tokens=128_000, max_output_tokens=8_192, slots=16),
    sandbox=Sandbox(kind="gvisor", count=4),
    policy_generation=7,
    health=HealthEvidence(status="healthy", checked_at=T0 - 5),
    issued_at=T0 - 60,
    expires_at=T0 + 3600,
    issued_by="operator-alice",
)
REQUIREMENTS = TaskRequirements(
    capability=CapabilityRange(name="rag.search", version_spec=">=2.1"),
    task_schema_version="1.4.0",
    result_schema_version="2.0.0",
    input_classifications=["internal"],
    required_tools=[ToolRequirement(name="web-search", version_spec=">=2", permits=2)],
    estimated_tokens=12_000,
    needs_sandbox=True,
    estimated_duration_s=30.0,
    deadline=T0 + 300,
    regions=["eu-west-1"],
    priority=5,
    service_class="interactive",
    allowed_degradations=["less_retrieval", "partial_results"],
    allowed_fallbacks=["rag-eu-2"],
)
GRANT = AdmissionGrant(
    admission_id="adm-1",
    pool_id="rag-eu",
    descriptor_epoch=3,
    policy_generation=7,
    fence=41,
    grant_ids=["ledger:adm-1", "web-search:g-77"],
    expires_at=T0 + 120,
)

_samples: list[Message] = [
    AgentRegistration(
        agent_id="calc-7f9c",
        incarnation="inc-0001",
        deployment="calc",
        endpoint="http://10.0.0.7:8080",
        capabilities=[CALC_ADD, TEXT_STATS],
        heartbeat_interval_s=10.0,
        metadata={"zone": "eu-west-1a"},
    ),
    Deregistration(agent_id="calc-7f9c", incarnation="inc-0001", reason="drained"),
    Heartbeat(
        agent_id="calc-7f9c",
        incarnation="inc-0001",
        seq=42,
        in_flight={"calc.add": 1, "text.stats": 0},
        draining=False,
        sent_at=T0,
    ),
    DrainRequest(agent_id="calc-7f9c", reason="rolling deploy"),
    RegistrationAccepted(
        agent_id="calc-7f9c",
        incarnation="inc-0001",
        pool_epoch=PoolEpoch(
            pool_id="calc", descriptor_epoch=3, policy_generation=1, draining=["adm-old-1"]
        ),
    ),
    RegistrationRefused(
        agent_id="calc-7f9c",
        incarnation="inc-0001",
        reason=Reason.HEARTBEAT_INTERVAL_TOO_SHORT,
        detail="heartbeat_interval_s=1 is below the minimum of 5 s",
    ),
    ReRegisterRequest(agent_id="calc-7f9c", reason="unknown agent"),
    StandingRequest(agent_id="calc-7f9c", incarnation="3b1f0c2d"),
    Standing(agent_id="calc-7f9c", incarnation="3b1f0c2d", registered=True, state="Busy"),
    AdmissionStateRequest(
        agent_id="echo-1", incarnation="3b1f0c2d", admission_id="01a236a9e93a772f9229eea15b5ecc1f"
    ),
    AdmissionState(
        agent_id="echo-1",
        admission_id="01a236a9e93a772f9229eea15b5ecc1f",
        state="RELEASED",
        fence=3,
    ),
    LeaseStateRequest(
        agent_id="calc-7f9c",
        incarnation="3b1f0c2d",
        lease_id="9d1c2b7a4e5f60718293a4b5c6d7e8f9",
        capability="math.add",
    ),
    DrainNotice(agent_id="calc-7f9c", reason="rolling deploy"),
    DrainComplete(agent_id="calc-7f9c"),
    LeaseNotice(
        agent_id="calc-7f9c", lease_id="lease-42", capability="math.evaluate", expires_in_s=30.0
    ),
    OrchestrationEvent(
        seq=7,
        at=T0,
        kind="acquired",
        agent_id="calc-7f9c",
        from_state="Ready",
        to_state="Busy",
        capability="calc.add",
        reason="slot leased",
        detail={"lease_id": "lease-1"},
    ),
    Task(
        task_id="task-1",
        capability="calc.add",
        lease_id="lease-1",
        payload={"a": 1, "b": 2},
        deadline=T0 + 30,
        submitted_at=T0,
    ),
    TaskResult(
        task_id="task-1",
        agent_id="calc-7f9c",
        capability="calc.add",
        status="error",
        output=None,
        error=ErrorInfo(code=Reason.INPUT_SCHEMA_VIOLATION, message="'b' is a required property"),
        started_at=T0,
        finished_at=T0 + 0.01,
    ),
    FindRequest(capability="calc.add", version_spec=">=1,<2", limit=3),
    AcquireRequest(capability="calc.add", version_spec=">=1.2", agent_id="calc-7f9c", ttl_s=60),
    ReleaseRequest(lease_id="lease-1"),
    StatusRequest(agents_offset=0, agents_limit=100),
    FindReply(
        agents=[
            AgentSummary(
                agent_id="calc-7f9c",
                capability="calc.add",
                version="1.2.0",
                cost_class="A",
                in_flight=1,
                max_concurrency=4,
            )
        ]
    ),
    LeaseGranted(
        lease=Lease(
            lease_id="lease-1",
            agent_id="calc-7f9c",
            capability="calc.add",
            version="1.2.0",
            cost_class="A",
            expires_in_s=300.0,
        )
    ),
    Released(lease_id="lease-1"),
    DrainAccepted(agent_id="calc-7f9c", in_flight=2),
    Refusal(reason=Reason.NO_AGENT_AVAILABLE, detail="every agent is full", retry_after_ms=250),
    StatusReply(
        manager_id="manager-1",
        uptime_s=12.5,
        agents=[
            AgentStatus(
                agent_id="calc-7f9c",
                deployment="calc",
                state="Busy",
                capabilities=[CAPABILITY_STATUS],
                in_flight=1,
                last_heartbeat_age_s=None,
                registered_age_s=12.0,
            )
        ],
        counters={"registered": 1},
        agents_total=1,
        agents_offset=0,
        pool_states=[PoolStates(pool_id="calc", states={"Busy": 1})],
        capability_loads=[
            CapabilityLoadStatus(name="calc.add", agents=1, taking_work=1, in_flight=1, capacity=4)
        ],
    ),
    DESCRIPTOR,
    REQUIREMENTS,
    AdmissionRequest(admission_id="adm-1", requirements=REQUIREMENTS),
    AdmissionDecision(
        admission_id="adm-1",
        outcome="admitted",
        grant=GRANT,
        detail="",
        allowed_degradations=["less_retrieval"],
    ),
    AdmissionRelease(admission_id="adm-1", fence=41),
    AdmissionRevoke(admission_id="adm-1", reason="the pool's credentials leaked"),
    AdmissionReleaseReply(
        admission_id="adm-1",
        released=False,
        reason=AdmissionReason.STALE_FENCE,
        detail="fence 41 is not the current fence 44",
    ),
    DescriptorAccepted(pool_id="rag-eu", descriptor_epoch=3),
    DescriptorShadow(pool_id="rag-eu", descriptor=DESCRIPTOR),
    ExplainRequest(admission_id="adm-1"),
    ExplainReply(
        admission_id="adm-1",
        found=True,
        decision=AdmissionDecision(admission_id="adm-1", outcome="admitted", grant=GRANT),
        eligibility={"eligible": ["rag-eu"], "verdicts": []},
        reservation={"state": "ACTIVE", "fence": 41},
    ),
]

SAMPLES: dict[type[Message], Message] = {type(m): m for m in _samples}

EVENT_DETAIL_SAMPLES: dict[str, dict[str, Any]] = {
    "registered": {},
    "ready": {},
    "refused": {"detail": "heartbeat_interval_s=1 is below the minimum of 5 s"},
    "acquired": {"lease_id": "lease-1"},
    "released": {"lease_id": "lease-1"},
    "busy": {},
    "draining": {},
    "terminated": {},
    "lost": {},
    "illegal_transition": {},
    "registration_refused": {"incarnation": "inc-0002", "live_incarnation": "inc-0001"},
    "drain_confirmed": {"pool_in_flight": {"calc.add": 1}, "leases": 0},
    "scale": {"deployment": "calc", "replicas": 3},
    "capability_available": {"version": "1.2.0", "cost_class": "A"},
    "capability_withdrawn": {"version": "1.2.0"},
    "version_drift": {"versions": ["1.2.0", "1.3.0"]},
    "manager_started": {},
    "manager_stalled": {},
    "connection_restored": {},
    "admission": {
        "admission_id": "adm-1",
        "outcome": "admitted",
        "tenant": "producer-a",
        "pool_id": "rag-eu",
        "fence": 41,
    },
    "admission_evicted": {
        "admission_id": "adm-0",
        "pool_id": "rag-eu",
        "fence": 40,
        "tenant": "producer-b",
        "for_admission": "adm-1",
    },
    "admission_revoked": {
        "admission_id": "adm-1",
        "pool_id": "rag-eu",
        "fence": 41,
        "by": "mesh-operator",
    },
    "admission_expired": {"admission_id": "adm-1", "pool_id": "rag-eu"},
    "pressure_stage": {
        "pool_id": "rag-eu",
        "from": "NORMAL",
        "to": "SHED_SPECULATIVE",
        "cause": "utilisation 6/8",
    },
    "descriptor": {"pool_id": "rag-eu", "epoch": 3, "draining": ["adm-old-1"]},
    "descriptor_shadow": {"pool_id": "rag-eu", "epoch": 4},
    "shard": {"shard": 3, "manager_id": "manager-b", "fence": 12},
    "descriptor_active": {
        "pool_id": "rag-eu",
        "descriptor_epoch": 3,
        "policy_generation": 7,
        "draining": ["adm-old-1"],
    },
    "grant_revoked": {
        "admission_id": "adm-1",
        "pool_id": "rag-eu",
        "fence": 41,
        "evicted": True,
        "security": "the pool's credentials leaked",
    },
}
"""One ``detail`` of every orchestration event kind, as its emitter writes it (JSON)."""


def sample_json(cls: type[Message]) -> dict[str, Any]:
    """The sample of ``cls`` as the JSON object a non-Python peer would put on the wire."""
    return SAMPLES[cls].model_dump(mode="json")
