"""Every name the mesh puts on the wire, in one place.

Exchange and queue names are built from these by the pure functions in
:mod:`mesh.topology.names`; header keys and limits are used by the transport,
the manager and the SDKs alike.
"""

from __future__ import annotations

from typing import Final

DEFAULT_AMQP_URL: Final = "amqp://guest:guest@localhost:5672/"
DEFAULT_NAMESPACE: Final = "mesh"

# Exchange suffixes (the full name is "<namespace>.<suffix>").
ANNOUNCE_EXCHANGE: Final = "announce"  # agent -> manager: register, deregister, drain
HEARTBEAT_EXCHANGE: Final = "heartbeat"  # agent -> manager: liveness and utilisation
EVENTS_EXCHANGE: Final = "events"  # manager -> anyone: orchestration log, capabilities
CONTROL_EXCHANGE: Final = "control"  # client -> manager: find/acquire/release/drain/status
AGENTS_EXCHANGE: Final = "agents"  # manager -> one agent: acks, drain, re-register
TASKS_EXCHANGE: Final = "tasks"  # producer -> one agent: tasks
DEAD_LETTER_EXCHANGE: Final = "dead-letter"

AGENT_ID_WORD: Final = "[A-Za-z0-9][A-Za-z0-9_-]{0,62}"
"""An agent ID (and a pool ID): one routing-key word, no dots — the wire's ``AgentId``."""

# Routing-key prefixes.
RK_AGENT: Final = "agent"  # agent.<agent_id>.<verb>, a verb of AGENT_ANNOUNCE_VERBS
FEATURE_DESCRIPTOR_EPOCHS: Final = "descriptor-epochs"
# It reports its pool tasks (heartbeat ``pool_in_flight``, also sent when that count changes)
# and says ``draining`` only once it stopped taking them: the manager waits for that report.
FEATURE_WORK_REPORTS: Final = "work-reports"
# It runs a lease-path task only under a lease the manager told it of (mesh.lease-notice.v1).
FEATURE_LEASE_NOTICES: Final = "lease-notices"
# It takes its pool's epoch in registration-accepted (``pool_epoch``): a v1 message gains an
# optional field only for receivers that said they know it, since receivers refuse unknown
# fields.
FEATURE_POOL_EPOCH: Final = "pool-epoch"
# It takes its shard in registration-accepted (``shard``, several managers) and from then on
# adds it as the last word of its heartbeat and announce keys (all but ``register`` and
# ``admission``), so they reach only the shard's owner.
FEATURE_SHARDS: Final = "shards"
# It takes ``leases_kept`` in reregister-request (a shard handed to another manager): it
# registers again but keeps the leases it was told of, so tasks granted just before the
# hand-over still run.
FEATURE_HAND_OVER: Final = "hand-over"
AGENT_FEATURES: Final = (  # what the SDK runtime implements
    FEATURE_DESCRIPTOR_EPOCHS,
    FEATURE_WORK_REPORTS,
    FEATURE_LEASE_NOTICES,
    FEATURE_POOL_EPOCH,
    FEATURE_SHARDS,
    FEATURE_HAND_OVER,
)
AGENT_ANNOUNCE_VERBS: Final = (
    "register",
    "deregister",
    "drain",
    "standing",
    "admission",
)  # <verb> above
RK_HEARTBEAT: Final = "hb"  # hb.<agent_id>, or hb.<agent_id>.<shard>
RK_LOG: Final = "log"  # log.<agent_id>.<kind>
RK_CAPABILITY: Final = "capability"  # capability.<capability name>.<agent_id>
RK_WARNING: Final = "warning"  # warning.<kind>
RK_RPC: Final = "rpc"  # rpc.<method>, a method of RPC_METHODS
RPC_METHODS: Final = (
    "find",
    "acquire",
    "release",
    "drain",
    "status",
    "admit",
    "admission-release",
    "admission-revoke",
    "descriptor",
    "descriptor-shadow",
    "explain",
)  # <method> above: what a client asks the manager (MeshClient's requests)
RK_GRANT: Final = "grant"  # grant.<pool_id>.<admission_id>: grant revocations (events exchange)
EVENT_GRANT_REVOKED: Final = "grant_revoked"  # the OrchestrationEvent kind published on it
EVENT_DESCRIPTOR_ACTIVE: Final = "descriptor_active"  # a pool's active epoch, on grant.<pool>

# Headers.
H_REASON: Final = "x-mesh-reason"  # reason code on a dead-lettered message
H_FORWARDED_FOR: Final = "x-mesh-forwarded-for"  # forwarded by a manager: the user it came from
H_FORWARDED_BY: Final = "x-mesh-forwarded-by"  # … and the manager that forwarded it
H_DETAIL: Final = "x-mesh-detail"  # human-readable detail on a dead-lettered message
H_SOURCE_QUEUE: Final = "x-mesh-source-queue"
H_ORIGINAL_SIZE: Final = "x-mesh-original-size"  # a dead letter's body size before it was cut
H_TRUNCATED: Final = "x-mesh-truncated"  # true: the dead letter keeps only a prefix of its body
H_AGENT_ID: Final = "x-mesh-agent-id"
# An agent's connection carries its incarnation as a client property beside its name
# (``agent:<id>``), so the manager fences a lost incarnation without cutting its successor.
CLIENT_PROPERTY_INCARNATION: Final = "mesh_incarnation"
H_LEASE_ID: Final = "x-mesh-lease-id"
# A forwarded acquire that asks only for the lease its ID already holds (its request was
# redelivered): the owner answers with that lease, or UNKNOWN_LEASE — never a new one.
H_HELD_ONLY: Final = "x-mesh-held-only"
H_ADMISSION_ID: Final = "x-mesh-admission-id"  # the business ID of a granted task's publish
# W3C Trace Context (docs/protocol.md, "Trace context"): carried on every message of a task's
# life, and copied from a task onto its result by any agent, traced or not.
H_TRACEPARENT: Final = "traceparent"
H_TRACESTATE: Final = "tracestate"
# A client's request: the reply fields added after their message's release that it knows,
# comma-separated (docs/protocol.md 1.2); a manager sets such a field only for a client that
# lists it, as it does for an agent that lists a feature in its registration.
H_FEATURES: Final = "x-mesh-features"
FEATURE_UNANSWERED: Final = "unanswered-shards"  # {Status,Find}Reply.unanswered_shards
FEATURE_SETTLING: Final = "settling-shards"  # StatusReply.settling_shards
FEATURE_POOL_SIGNALS: Final = "pool-signals"  # StatusReply.pool_signals

CONTENT_TYPE: Final = "application/json"

# Limits.
MAX_MESSAGE_BYTES: Final = 256 * 1024  # larger bodies are refused before they are parsed
DEAD_LETTER_KEEP_BYTES: Final = 4 * 1024  # of a larger refused body, the dead letter keeps this
MIN_HEARTBEAT_INTERVAL_S: Final = 5.0
DEFAULT_HEARTBEAT_INTERVAL_S: Final = 10.0
MISSED_HEARTBEATS_BEFORE_LOST: Final = 3
DEFAULT_PUBLISH_TIMEOUT_S: Final = 5.0
DEFAULT_LEASE_TTL_S: Final = 300.0
