"""Typed manager settings. Environment parsing lives in the CLI, not here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mesh import constants as c
from mesh.core.pool import PoolSettings
from mesh.core.scaling import ScalingPolicy
from mesh.errors import LocalProtocolError
from mesh.ledger.store import LedgerStore
from mesh.manager.admission import AdmissionPolicy


@dataclass(frozen=True, slots=True)
class ManagerSettings:
    amqp_url: str = c.DEFAULT_AMQP_URL
    namespace: str = c.DEFAULT_NAMESPACE
    journal_path: Path = Path(".mesh/orchestration.sqlite3")
    manager_id: str = "manager"
    tick_interval_s: float = 1.0
    publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S
    prefetch: int = 64
    # Announcements handled as one batch at most; the announce queue's prefetch is twice
    # that, so the next batch gathers while one is handled.
    announce_batch: int = 128
    pool: PoolSettings = field(default_factory=PoolSettings)
    # The reservation ledger: "sqlite:<path>" (embedded default) or a postgresql:// DSN
    # when several managers share one ledger.
    ledger_url: str = "sqlite:.mesh/ledger.sqlite3"
    # The PostgreSQL schema of the ledger (and of the shard leases): namespaces, or tests,
    # sharing one database keep apart by schema. Ignored for SQLite.
    ledger_schema: str = "mesh_ledger"
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    # At most this many admissions are decided in one ledger transaction (group commit); a
    # batch holds what arrived while the previous one ran, so it never waits to fill up.
    admission_batch: int = 64
    # Under load (batches back to back) a batch waits up to this long for company before it
    # is decided; an idle manager decides a lone request at once. 0 turns lingering off.
    admission_linger_s: float = 0.002
    # ... and stops waiting at the first step of this long in which no request arrived.
    # ``None``: 0.1 ms where batches are decided on the event loop (SQLite, ``ledger_inline``:
    # there the wait is idle time once a closed loop of producers has sent its burst), the
    # whole linger otherwise (PostgreSQL: its batches are dearer, a wait costs the loop
    # nothing, and the larger batches took less CPU per admission in bench/managers.py).
    admission_linger_quiet_s: float | None = None
    # Decide admissions on the event loop itself instead of a worker thread. ``None``: yes for
    # an SQLite ledger (a batch is a short local transaction, and a thread would fight the
    # loop for the GIL on every statement), no for PostgreSQL (network round trips).
    ledger_inline: bool | None = None
    # How often every pool's active descriptor epoch is announced to its agents (also at once
    # whenever a descriptor is accepted or adopted from the shared ledger).
    epoch_announce_interval_s: float = 30.0
    # The status page, /api/status and /metrics: served on this port when set (0: any free
    # port, see ManagerService.web.url); not served when None.
    http_port: int | None = None
    http_host: str = "0.0.0.0"
    # The RabbitMQ management API (http://user:pass@host:15672), polled for queue depths and
    # ages every ``queue_poll_interval_s``; the status page links to its UI. None: not polled.
    management_url: str | None = None
    queue_poll_interval_s: float = 5.0
    # Descriptors are accepted only from this broker user (RabbitMQ validates user_id).
    operator_user: str = "mesh-operator"
    # Agents have broker users of their own, named as the agent: a registration, heartbeat,
    # deregistration or drain request counts only if published by the agent it names (its
    # user_id, which RabbitMQ validates). Off: every agent may share one user (development).
    agent_identity: bool = False
    # Sign an invocation lease into every grant with this Ed25519 key (PKCS#8 PEM; created
    # with its public key ``<file>.pub`` if absent; managers sharing a ledger share it).
    # Agents and tools check leases with the public key (mesh.leases). None: no leases.
    lease_key_file: Path | None = None
    # Probe the broker every so many seconds and reconnect when it stops answering (a
    # blackholed path is noticed within two intervals; the AMQP heartbeat alone takes
    # minutes at RabbitMQ's default). None: off.
    liveness_probe_s: float | None = None
    # What bounds admission in a pool: "live", the smaller of its descriptor's limits and the
    # free concurrency of its live agents (no live agent, no grant); "descriptor", the
    # descriptor's limits alone (several managers sharing one PostgreSQL ledger without
    # shards, each of which sees only the agents that registered with it).
    admission_capacity: Literal["live", "descriptor"] = "live"
    # Several managers (docs/architecture.md, "Several managers"): the registry's shards,
    # owned through lease rows in the PostgreSQL ledger's database, renewed every third of
    # ``shard_lease_s``. The same count for every manager of a namespace; None: no shards
    # (one manager owns the whole registry, as with SQLite).
    shard_count: int | None = None
    shard_lease_s: float = 10.0
    # With shards, a manager's broker connection asks for an AMQP heartbeat of half the lease
    # (at least 1 s) unless its URL names one: the broker then closes a frozen or cut-off
    # manager's connection within about a lease, and the shard queues' single-active-consumer
    # hands their deliveries to the new owner as the lease table hands it the shard.
    # With shards, a lease-path request (find, acquire, release, drain) asks the other owners
    # too (mesh.manager.peers): how long to wait for each, and how many of the best
    # candidates an acquire tries by name before it gives up.
    peer_timeout_s: float = 2.0
    peer_acquire_candidates: int = 8
    # With shards and live admission capacity (mesh.manager.live_share): how often each
    # manager writes its shards' live figures and reads everyone's, and how long a new owner
    # keeps the previous owner's figures while the shard's agents register again (each at its
    # next heartbeat: two default intervals cover one delayed under load). While it does, a
    # capability those figures count is "not available for now", never "not offered".
    live_share_interval_s: float = 0.25
    live_handover_s: float = 2 * c.DEFAULT_HEARTBEAT_INTERVAL_S


_DEFAULT = ScalingPolicy(deployment="-")  # the defaults a scaling file may leave out


class ScalingEntry(BaseModel):
    """One deployment of a scaling file: how it may scale (:class:`ScalingPolicy`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: str = Field(min_length=1)
    capabilities: tuple[str, ...] = ()
    min_replicas: int = Field(default=_DEFAULT.min_replicas, ge=0)
    max_replicas: int = Field(default=_DEFAULT.max_replicas, ge=0)
    scale_up_step: int = Field(default=_DEFAULT.scale_up_step, ge=1)
    window_s: float = Field(default=_DEFAULT.window_s, gt=0)
    scale_down_idle_s: float = Field(default=_DEFAULT.scale_down_idle_s, gt=0)
    start_s: float = Field(default=_DEFAULT.start_s, gt=0)
    scale_to_zero_after_s: float = Field(default=_DEFAULT.scale_to_zero_after_s, gt=0)

    @model_validator(mode="after")
    def _min_at_most_max(self) -> ScalingEntry:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})"
            )
        return self

    def policy(self) -> ScalingPolicy:
        return ScalingPolicy(**self.model_dump())


class ScalingFile(BaseModel):
    """A scaling file (``mesh manager --scaling FILE``, JSON)::

        {"deployments": [{"deployment": "calc", "capabilities": ["math.evaluate"],
          "min_replicas": 1, "max_replicas": 10, "scale_up_step": 1, "window_s": 5,
          "scale_down_idle_s": 300, "start_s": 5, "scale_to_zero_after_s": 300}, ...]}

    Every field but ``deployment`` has the default :class:`ScalingPolicy` gives it; an
    unknown field is an error (a typo must not pass for a default). ``min_replicas: 0``
    lets the pool go to zero replicas once idle for ``scale_to_zero_after_s``
    (docs/scaling.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployments: tuple[ScalingEntry, ...]


def load_scaling_policies(path: Path) -> tuple[ScalingPolicy, ...]:
    """Read a scaling file (:class:`ScalingFile`). Raises :class:`LocalProtocolError` naming
    the file and, for each mistake, where it is (``deployments.0.max_replicas``) and why."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LocalProtocolError(f"bad scaling file {path}: {exc}") from None
    try:
        parsed = ScalingFile.model_validate_json(raw)
    except ValidationError as exc:
        mistakes = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in exc.errors()
        )
        raise LocalProtocolError(f"bad scaling file {path}: {mistakes}") from None
    return tuple(entry.policy() for entry in parsed.deployments)


def open_ledger(url: str, schema: str = "mesh_ledger") -> LedgerStore:
    """``sqlite:<path>`` or ``postgresql://…`` (in ``schema``) → a ledger store (blocking:
    call in a thread)."""
    if url.startswith(("postgresql://", "postgres://")):
        from mesh.ledger.postgres import PostgresLedger

        return PostgresLedger(url, schema=schema)
    if url.startswith("sqlite:"):
        from mesh.ledger.sqlite import SqliteLedger

        path = Path(url.removeprefix("sqlite:"))
        if str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
        return SqliteLedger(path)
    raise LocalProtocolError(f"unknown ledger URL {url!r}: use sqlite:<path> or postgresql://…")
