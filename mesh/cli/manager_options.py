"""``mesh manager``'s options, one table: each row names the flag, the environment variable
that gives its default, and the setting of :class:`~mesh.manager.settings.ManagerSettings` it
sets (a field, or a path into one: ``admission.pressure.enabled``). The parser is built from
it (:func:`add_manager_options`) and so are the settings (:func:`manager_settings`); every
setting is either in the table or in :data:`NOT_FROM_THE_CLI` with the reason, which a test
checks field by field.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh.cli.common import (
    DEFAULT_JOURNAL,
    _count,
    _on_off,
    _positive_seconds,
    _probe_interval,
    _thresholds,
)
from mesh.cli.options import Option, add_options, settings_from

if TYPE_CHECKING:
    from mesh.manager.settings import ManagerSettings


def _path_or_none(value: str) -> Path | None:
    return Path(value) if value else None


def _port_or_off(value: int) -> int | None:
    return None if value < 0 else value


def _text_or_none(value: str) -> str | None:
    return value or None


def _scaling_policies(value: str | None) -> tuple[Any, ...]:
    from mesh.manager.settings import load_scaling_policies  # pydantic: only when used

    return load_scaling_policies(Path(value)) if value else ()


_SHEDDING = "load shedding"

MANAGER_OPTIONS: tuple[Option, ...] = (
    Option(
        "--journal", "MESH_JOURNAL", "journal_path", "SQLite orchestration log path",
        DEFAULT_JOURNAL, to_setting=Path,
    ),
    Option(
        "--manager-id", "MESH_MANAGER_ID", "manager_id",
        "this manager's name in the journal, status and metrics", "manager",
    ),
    Option(
        "--ledger", "MESH_LEDGER_URL", "ledger_url",
        "reservation ledger: sqlite:<path> or a postgresql:// DSN", "sqlite:.mesh/ledger.sqlite3",
    ),
    Option(
        "--operator-user", "MESH_OPERATOR_USER", "operator_user",
        "the operator's broker user: the only one whose descriptors, shadows, revocations and "
        "drains are accepted", "mesh-operator",
    ),
    Option(
        "--liveness-probe", "MESH_LIVENESS_PROBE_S", "liveness_probe_s",
        "probe the broker this often and reconnect when it stops answering; a silent path is "
        "noticed within two intervals (0: off)", "0", type=_probe_interval, metavar="SECONDS",
    ),
    Option(
        "--admission-capacity", "MESH_ADMISSION_CAPACITY", "admission_capacity",
        "live: a pool admits at most what its live agents can run and its descriptor allows "
        "(no live agent, no grant: NO_LIVE_AGENT; with --shards each pool's owner shares its "
        "figures through the ledger); descriptor: the descriptor alone, for several managers "
        "on one PostgreSQL ledger without --shards", "live", choices=("live", "descriptor"),
    ),
    Option(
        "--ledger-schema", "MESH_LEDGER_SCHEMA", "ledger_schema",
        "PostgreSQL ledgers: the schema of the ledger and the shard leases, so several "
        "namespaces can share one database", "mesh_ledger", metavar="NAME",
    ),
    Option(
        "--shards", "MESH_SHARDS", "shard_count",
        "several managers: split the registry into N shards, each owned by one manager at a "
        "time through a lease in the PostgreSQL ledger's database; every manager of a "
        "namespace uses the same N (0: no shards, one manager)", "0",
        type=int, metavar="N", to_setting=lambda n: n or None,
    ),
    Option(
        "--shard-lease", "MESH_SHARD_LEASE_S", "shard_lease_s",
        "how long a shard lease lasts unrenewed; renewed every third of it", "10",
        type=_positive_seconds, metavar="SECONDS",
    ),
    Option(
        "--agent-identity", "MESH_AGENT_IDENTITY", "agent_identity",
        "on: each agent has a broker user named as the agent, and a registration or heartbeat "
        "counts only when published by the agent it names (RabbitMQ validates user_id); off: "
        "agents may share one user", "off", type=_on_off, metavar="on|off",
    ),
    Option(
        "--lease-key", "MESH_LEASE_KEY", "lease_key_file",
        "sign an invocation lease into every grant with this Ed25519 key, created (with "
        "FILE.pub for agents and tools) if absent (empty: no leases)", "",
        metavar="FILE", to_setting=_path_or_none,
    ),
    Option(
        "--lease-ttl", "MESH_LEASE_TTL_S", "admission.lease_ttl_s",
        "a lease expires with its grant, or this long after issue if sooner", None,
        type=_positive_seconds, metavar="SECONDS",
    ),
    Option(
        "--http-port", "MESH_HTTP_PORT", "http_port",
        "serve the status page, /api/status and /metrics here; 0 any free port, -1 off", "8090",
        type=int, to_setting=_port_or_off,
    ),
    Option("--http-host", "MESH_HTTP_HOST", "http_host", "address to serve on", "0.0.0.0"),
    Option(
        "--management-url", "MESH_MANAGEMENT_URL", "management_url",
        "RabbitMQ management API (http://user:pass@host:15672) for queue depths on the status "
        "page and in /metrics, pool queue bounds and fencing lost agents (empty: off)", "",
        to_setting=_text_or_none,
    ),
    Option(
        "--shedding", "MESH_SHEDDING", "admission.pressure.enabled",
        "staged shedding, fair shares and drain-rate retry times; off: capacity alone decides "
        "and refusals say retry in 1 s", "on", type=_on_off, metavar="on|off", group=_SHEDDING,
    ),
    Option(
        "--shed-thresholds", "MESH_SHED_THRESHOLDS", "admission.pressure.thresholds",
        "slot utilisation at which speculative work is shed, batch paused and tenants held to "
        "fair shares", "0.7,0.85,0.95", type=_thresholds, metavar="A,B,C", group=_SHEDDING,
    ),
    Option(
        "--shed-queue-age", "MESH_SHED_QUEUE_AGE_S", "admission.pressure.queue_age_s",
        "a pool whose oldest queued task waited longer goes one stage up", "5",
        type=float, metavar="SECONDS", group=_SHEDDING,
    ),
    Option(
        "--shed-hysteresis", "MESH_SHED_HYSTERESIS", "admission.pressure.hysteresis",
        "a stage steps down only below its threshold less this share of the pool's slots", "0.1",
        type=float, metavar="FRACTION", group=_SHEDDING,
    ),
    Option(
        "--shed-min-dwell", "MESH_SHED_MIN_DWELL_S", "admission.pressure.min_dwell_s",
        "a pool stays in a stage at least this long, and steps down only after this long below "
        "the lowered threshold (a broker alarm acts at once)", "2",
        type=float, metavar="SECONDS", group=_SHEDDING,
    ),
    Option(
        "--low-priority", "MESH_LOW_PRIORITY", "admission.pressure.low_priority",
        "batch work at or below this priority is fan-out, shed with speculative work (unset: "
        "only the speculative class)", None,
        type=_count, metavar="0-9", choices=range(10), group=_SHEDDING,
    ),
    Option(
        "--eviction", "MESH_EVICTION", "admission.pressure.evict",
        "a full pool's interactive requests may evict rebuildable or retryable work", "on",
        type=_on_off, metavar="on|off", group=_SHEDDING,
    ),
    Option(
        "--scaling", "MESH_SCALING_FILE", "pool.scaling",
        "JSON file of scaling policies per deployment", None, to_setting=_scaling_policies,
    ),
    # The scaler's own options: who runs agent replicas, and how (mesh.scaler).
    Option(
        "--scaler", "MESH_SCALER", None,
        "who runs agent replicas: nobody, processes on this machine, or Kubernetes", "none",
        choices=("none", "local", "kubernetes"),
    ),
    Option(
        "--k8s-namespace", "MESH_K8S_NAMESPACE", None,
        "Kubernetes namespace of the agent Deployments (unset: the manager's own)",
    ),
    Option(
        "--agent-log-dir", "MESH_AGENT_LOG_DIR", None,
        "with --scaler local: where agent processes log", ".mesh/agents",
    ),
    Option(
        "--agent-heartbeat-interval", None, None,
        "with --scaler local: the agents' heartbeat interval",
        str(c.DEFAULT_HEARTBEAT_INTERVAL_S), type=float,
    ),
)  # fmt: skip

FROM_SHARED_OPTIONS = {"amqp_url": "--amqp-url", "namespace": "--namespace"}
"""Settings every command's connection options set."""

NOT_FROM_THE_CLI: dict[str, str] = {
    "tick_interval_s": "how often the core checks heartbeats and leases: a property of the "
    "loss rule (3 intervals), not a knob",
    "publish_timeout_s": "tuning; the broker's confirm latency decides it",
    "prefetch": "tuning of the RPC consumers",
    "announce_batch": "tuning of the registration batches",
    "admission_batch": "tuning of the ledger's group commit",
    "admission_linger_s": "tuning of the ledger's group commit",
    "admission_linger_quiet_s": "tuning of the ledger's group commit",
    "ledger_inline": "follows the ledger: on the loop for SQLite, a thread for PostgreSQL",
    "epoch_announce_interval_s": "a property of the protocol (agents rely on 30 s)",
    "queue_poll_interval_s": "tuning of the status page and the pressure board",
    "peer_timeout_s": "several managers: tuning of the forwarded requests",
    "peer_acquire_candidates": "several managers: tuning of an acquire across shards",
    "live_share_interval_s": "several managers: tuning of the shared live capacity",
    "live_handover_s": "several managers: follows the default heartbeat interval",
    "admission.prepare_ttl_s": "a property of the ledger's protocol",
    "admission.grant_ttl_s": "set per pool by its descriptor",
    "admission.active_generation": "set by the rollout of a new policy generation",
    "admission.default_tenant_tokens": "set per tenant by descriptors",
    "admission.pressure.*": "the rest of the shedding policy: retry-time bounds, jitter, the "
    "waiting line's sizes (mesh.core.policy.settings)",
    "pool.*": "the registry's protocol constants (heartbeat minimum, loss rule, seq bounds)",
}
"""Settings deliberately not on the command line, each with the reason: embed the manager
(``ManagerService(ManagerSettings(...))``) to set them."""


def add_manager_options(parser: argparse.ArgumentParser) -> None:
    """Every row of :data:`MANAGER_OPTIONS` as an option of ``parser``."""
    add_options(
        parser, MANAGER_OPTIONS, {_SHEDDING: "how an overloaded pool degrades (docs/admission.md)"}
    )


def manager_settings(args: argparse.Namespace) -> ManagerSettings:
    """The settings ``args`` (parsed with :func:`add_manager_options`) ask for."""
    from mesh.manager.settings import ManagerSettings

    base = ManagerSettings(amqp_url=args.amqp_url, namespace=args.namespace)
    return settings_from(base, MANAGER_OPTIONS, args)
