"""``mesh status`` on the wire: the request and the reply, and their parts — the fleet
summarised by pool, state and capability, one page of agent rows, what each pool can grant,
each pool's signals for scaling, and with several managers who holds which shard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mesh.wire.models import AgentId, CapabilityName, CostClass, Message, SemVer, WireModel

MAX_STATUS_AGENTS = 5_000
"""Agent rows one status reply carries at most (the fleet is paged through, not sent whole)."""


class StatusRequest(Message):
    """Client -> manager: the fleet summarised by pool, state and capability, the manager's
    counters, and one page of agent rows in agent-ID order (``agents_limit`` rows from
    ``agents_offset``; 0 rows: the summary alone).

    A request without ``agents_limit`` is one from a client that predates paging: it gets
    every agent's row and no summary, as before (costly at a large fleet)."""

    TYPE = "mesh.status-request.v1"
    ADDED_FIELDS = frozenset({"agents_offset", "agents_limit"})
    type: Literal["mesh.status-request.v1"] = "mesh.status-request.v1"
    agents_offset: int | None = Field(default=None, ge=0)
    agents_limit: int | None = Field(default=None, ge=0, le=MAX_STATUS_AGENTS)


class CapabilityStatus(WireModel):
    """One capability of one agent, with its live in-flight count."""

    name: CapabilityName
    version: SemVer
    cost_class: CostClass
    in_flight: int
    max_concurrency: int


class AgentStatus(WireModel):
    """One agent as ``mesh status`` shows it."""

    agent_id: AgentId
    deployment: str
    state: str
    capabilities: list[CapabilityStatus]
    in_flight: int
    last_heartbeat_age_s: float | None
    registered_age_s: float


class PoolCapacity(WireModel):
    """One described pool's capability as admission counts it (``mesh status``)."""

    pool_id: str
    capability: str
    live_agents: int = Field(description="Ready and Busy agents offering it, in range.")
    live_slots: int = Field(description="Their concurrency not held by leases.")
    granted: int | None = Field(
        default=None, description="Grants holding a live slot (the ledger's count)."
    )
    model_slots: int | None = Field(default=None, description="The descriptor's limit.")
    model_slots_granted: int | None = None


class PoolStates(WireModel):
    """One pool's agents by lifecycle state (``mesh status``)."""

    pool_id: str
    states: dict[str, int]


class CapabilityLoadStatus(WireModel):
    """One capability across the fleet (``mesh status``)."""

    name: str
    agents: int = Field(description="Agents offering it, in any state.")
    taking_work: int = Field(description="Of them Ready or Busy.")
    in_flight: int = Field(description="Tasks in flight on those.")
    capacity: int = Field(description="Their concurrency.")


class ShardOwner(WireModel):
    """Who holds one shard of the registry (several managers), and under which fence."""

    shard: int = Field(ge=0)
    owner: str
    fence: int = Field(ge=1)


class PoolSignals(WireModel):
    """One pool's figures to scale on, as one manager knows them now (docs/operating.md,
    "Pool signals"): what waits, how fast work arrives and leaves, what runs, what the live
    agents offer. Counts are whole numbers; times are seconds; rates are per second over the
    last ``window_s``. The same object is served by ``GET /api/pools`` on the manager."""

    pool_id: str
    backlog: int = Field(ge=0, description="queued + deferred: work waiting for the pool.")
    queued: int = Field(
        ge=0, description="Tasks ready in the pool's task queue, as last polled (0: none known)."
    )
    deferred: int = Field(ge=0, description="Requests holding a place in the pool's line.")
    oldest_wait_s: float = Field(
        ge=0, description="The longer of oldest_deferred_s and oldest_queued_s (0: none waits)."
    )
    oldest_deferred_s: float | None = Field(
        default=None, description="Since the oldest place in the pool's line was first taken."
    )
    oldest_queued_s: float | None = Field(
        default=None,
        description="Age of the task at the head of the pool's queue (the management API's "
        "head message timestamp; None: not known).",
    )
    add_rate: float = Field(ge=0, description="Admission decisions for the pool, per second.")
    dispatch_rate: float = Field(ge=0, description="Grants on the pool, per second.")
    window_s: float = Field(gt=0, description="The window the rates and refusals count over.")
    in_flight: int = Field(
        ge=0, description="Grants held and not released (task queued or running)."
    )
    demand: int = Field(ge=0, description="in_flight + deferred: the slots asked for now.")
    live_capacity: int = Field(
        ge=0,
        description="Slots the pool's live (Ready, Busy) agents offer admission now: their "
        "concurrency not held by leases (grants held are not subtracted: see in_flight).",
    )
    model_slots: int | None = Field(default=None, description="The descriptor's slot limit.")
    agents: int = Field(ge=0, description="The pool's registered agents, in any state.")
    agents_ready: int = Field(ge=0, description="Of them Ready or Busy (taking work).")
    desired_replicas: int | None = Field(
        default=None, description="The manager's scaler's target (None: not scaled here)."
    )
    refusals: dict[str, int] = Field(
        default_factory=dict,
        description="Deferrals and rejections within the window, by reason code.",
    )
    refusals_total: dict[str, int] = Field(
        default_factory=dict,
        description="Deferrals and rejections since the manager started, by reason code.",
    )


class StatusReply(Message):
    """Manager -> client: the fleet summarised (``agents_total``, ``pool_states``,
    ``capability_loads``), one page of agent rows from ``agents_offset``, the manager's
    counters, and what each described pool can grant. The summary fields are set only in
    reply to a request that asked for a page (``agents_limit``); to an older client's
    request ``agents`` holds every agent and they are left out. With shards
    (``shard_count``), ``shards`` lists the live holder of each held shard as this manager
    last read the lease table, and ``unanswered_shards`` how many of the shards this manager
    does not hold went unanswered (their owner, or the shard's own queue where nobody was
    seen holding it, did not answer in time): their agents are missing from the figures. It
    is set only for a client that lists ``unanswered-shards`` in its request's
    ``x-mesh-features`` header. ``settling_shards`` (for a client that lists
    ``settling-shards``) is how many shards have no live lease or changed hands within the
    last default heartbeat interval, as this manager last read the lease table: their agents
    may still be registering again with the new owner and be missing from the figures.
    ``pool_signals`` (for a client that lists ``pool-signals``) holds each pool's signals
    for scaling (:class:`PoolSignals`), as this manager knows them."""

    TYPE = "mesh.status-reply.v1"
    ADDED_FIELDS = frozenset(
        {
            "agents_total",
            "agents_offset",
            "pool_states",
            "capability_loads",
            "shard_count",
            "shards",
            "unanswered_shards",
            "settling_shards",
            "pool_signals",
        }
    )
    type: Literal["mesh.status-reply.v1"] = "mesh.status-reply.v1"
    manager_id: str
    uptime_s: float
    agents: list[AgentStatus]
    counters: dict[str, int]
    pools: list[PoolCapacity] = Field(default_factory=list)
    agents_total: int | None = None
    agents_offset: int | None = None
    pool_states: list[PoolStates] | None = None
    capability_loads: list[CapabilityLoadStatus] | None = None
    shard_count: int | None = Field(default=None, ge=1)
    shards: list[ShardOwner] | None = None
    unanswered_shards: int | None = Field(default=None, ge=0)
    settling_shards: int | None = Field(default=None, ge=0)
    pool_signals: dict[str, PoolSignals] | None = None


STATUS_MESSAGE_TYPES: tuple[type[Message], ...] = (StatusRequest, StatusReply)
