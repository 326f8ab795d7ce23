"""Machine-readable reason codes carried by refusals, errors and dead letters."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why something was refused, failed or dead-lettered. Stable strings on the wire."""

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
    # It joins a pool whose tasks carry epoch-bound grants but does not say it checks epochs.
    EPOCHS_UNSUPPORTED = "EPOCHS_UNSUPPORTED"
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
    EVICTED = "EVICTED"  # its grant was taken back for more urgent work (it was recoverable)
    DEGRADATION_NOT_ALLOWED = "DEGRADATION_NOT_ALLOWED"  # degraded beyond what the task allowed
    # Transport outcomes surfaced to callers.
    QUEUE_FULL = "QUEUE_FULL"
    UNROUTABLE = "UNROUTABLE"
    PUBLISH_OUTCOME_UNKNOWN = "PUBLISH_OUTCOME_UNKNOWN"
