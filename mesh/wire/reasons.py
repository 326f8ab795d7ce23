"""Machine-readable reason codes: one enum for every refusal, decision, task error and dead
letter, whichever path or layer says it (the admission decisions' and the ledger's codes are
members of it, ``AdmissionReason`` and ``LedgerReason`` its old names, kept for one version).
The strings on the wire are stable."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why something was refused, failed or dead-lettered. Stable strings on the wire."""

    # Admission (decisions and releases; the ledger's own refusals are among them).
    NO_ELIGIBLE_POOL = "NO_ELIGIBLE_POOL"
    CAPACITY = "CAPACITY"  # a pool counter (model or live slots, sandboxes, tools) is short
    NO_LIVE_AGENT = "NO_LIVE_AGENT"  # no Ready agent of the pool offers it now: retry later
    TENANT_BUDGET = "TENANT_BUDGET"
    STALE_EPOCH = "STALE_EPOCH"
    STALE_GENERATION = "STALE_GENERATION"
    DESCRIPTOR_EXPIRED = "DESCRIPTOR_EXPIRED"
    CONFLICT = "CONFLICT"  # the admission ID is used with other requirements
    INVALID_REQUEST = "INVALID_REQUEST"
    STALE_FENCE = "STALE_FENCE"
    NOT_FOUND = "NOT_FOUND"
    EXTERNAL_GRANT_FAILED = "EXTERNAL_GRANT_FAILED"
    LEDGER_UNAVAILABLE = "LEDGER_UNAVAILABLE"  # the store failed; retry the same admission ID
    SHED = "SHED"  # the pool is under pressure and sheds this service class for now
    TENANT_FAIR_SHARE = "TENANT_FAIR_SHARE"  # the pool is busy and the tenant holds its share
    DEADLINE_UNREACHABLE = "DEADLINE_UNREACHABLE"  # it would finish after its deadline
    RUN_CONCURRENCY = "RUN_CONCURRENCY"  # the pool is tight and the task's run holds its share

    # Capacity and lookup (replies to find / acquire).
    NO_AGENT_AVAILABLE = "NO_AGENT_AVAILABLE"
    UNKNOWN_CAPABILITY = "UNKNOWN_CAPABILITY"
    INVALID_VERSION_SPEC = "INVALID_VERSION_SPEC"
    UNKNOWN_AGENT = "UNKNOWN_AGENT"
    AGENT_DRAINING = "AGENT_DRAINING"
    AGENT_TERMINATED = "AGENT_TERMINATED"
    AGENT_AT_CAPACITY = "AGENT_AT_CAPACITY"
    CAPABILITY_NOT_OFFERED = "CAPABILITY_NOT_OFFERED"
    UNKNOWN_LEASE = "UNKNOWN_LEASE"
    NOT_AUTHORIZED = "NOT_AUTHORIZED"  # the authenticated publisher may not do this
    # Registration.
    HEARTBEAT_INTERVAL_TOO_SHORT = "HEARTBEAT_INTERVAL_TOO_SHORT"
    AGENT_ID_IN_USE = "AGENT_ID_IN_USE"  # a live incarnation holds the ID: retry after it is gone
    # It joins a pool whose tasks carry epoch-bound grants but does not say it checks epochs.
    EPOCHS_UNSUPPORTED = "EPOCHS_UNSUPPORTED"
    SHARDS_UNSUPPORTED = "SHARDS_UNSUPPORTED"  # several managers: the agent must route by shard
    # Bad messages (dead-letter reasons).
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    MALFORMED_JSON = "MALFORMED_JSON"
    MISSING_TYPE = "MISSING_TYPE"
    UNKNOWN_MESSAGE_TYPE = "UNKNOWN_MESSAGE_TYPE"
    UNEXPECTED_MESSAGE_TYPE = "UNEXPECTED_MESSAGE_TYPE"
    UNKNOWN_FIELD = "UNKNOWN_FIELD"
    SCHEMA_VIOLATION = "SCHEMA_VIOLATION"
    # Task execution (carried in task results).
    INPUT_SCHEMA_VIOLATION = "INPUT_SCHEMA_VIOLATION"
    OUTPUT_SCHEMA_VIOLATION = "OUTPUT_SCHEMA_VIOLATION"
    CAPABILITY_NOT_HANDLED = "CAPABILITY_NOT_HANDLED"
    HANDLER_ERROR = "HANDLER_ERROR"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    AGENT_SHUTDOWN = "AGENT_SHUTDOWN"  # the agent left (drain deadline) before running it
    GRANT_INVALID = "GRANT_INVALID"  # the task's admission grant is foreign, expired or revoked
    EVICTED = "EVICTED"  # its grant was taken back for more urgent work: resubmit it
    DEGRADATION_NOT_ALLOWED = "DEGRADATION_NOT_ALLOWED"  # degraded beyond what the task allowed
    # Transport outcomes surfaced to callers.
    QUEUE_FULL = "QUEUE_FULL"  # a bounded queue refused the publish (a nack)
    UNROUTABLE = "UNROUTABLE"
    PUBLISH_OUTCOME_UNKNOWN = "PUBLISH_OUTCOME_UNKNOWN"


ADMISSION_REASONS = frozenset(
    {
        Reason.NO_ELIGIBLE_POOL, Reason.CAPACITY, Reason.NO_LIVE_AGENT, Reason.TENANT_BUDGET,
        Reason.STALE_EPOCH, Reason.STALE_GENERATION, Reason.DESCRIPTOR_EXPIRED, Reason.CONFLICT,
        Reason.INVALID_REQUEST, Reason.STALE_FENCE, Reason.NOT_FOUND,
        Reason.EXTERNAL_GRANT_FAILED, Reason.LEDGER_UNAVAILABLE, Reason.SHED,
        Reason.TENANT_FAIR_SHARE, Reason.DEADLINE_UNREACHABLE, Reason.RUN_CONCURRENCY,
        Reason.QUEUE_FULL, Reason.EVICTED, Reason.NOT_AUTHORIZED,
    }
)  # fmt: skip
"""The codes an admission decision or release reply says (docs/admission.md)."""
