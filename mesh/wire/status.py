"""``mesh status`` on the wire: the request and the reply, and their parts — the fleet
summarised by pool, state and capability, one page of agent rows, what each pool can grant,
and with several managers who holds which shard."""

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
    may still be registering again with the new owner and be missing from the figures."""

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


STATUS_MESSAGE_TYPES: tuple[type[Message], ...] = (StatusRequest, StatusReply)
