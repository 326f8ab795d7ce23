"""Topology as data: exchanges, queues and bindings as frozen, hashable value objects.

:class:`Topology` turns a namespace into the specs the manager and each agent
declare. The transport declares them idempotently (and caches what it has
declared), so the same spec can be declared by every process that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mesh import constants as c
from mesh.topology import names

ExchangeType = Literal["topic", "direct", "fanout", "headers"]
Overflow = Literal["drop-head", "reject-publish", "reject-publish-dlx"]
QueueType = Literal["classic", "quorum"]


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    name: str
    type: ExchangeType = "topic"
    durable: bool = True


@dataclass(frozen=True, slots=True)
class QueueArguments:
    """The ``x-`` arguments we use, typed. ``None`` means "not set"."""

    queue_type: QueueType = "classic"
    max_length: int | None = None
    overflow: Overflow | None = None
    message_ttl_ms: int | None = None
    expires_ms: int | None = None
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    delivery_limit: int | None = None

    def to_amqp(self) -> dict[str, Any]:
        pairs: dict[str, Any] = {
            "x-queue-type": self.queue_type,
            "x-max-length": self.max_length,
            "x-overflow": self.overflow,
            "x-message-ttl": self.message_ttl_ms,
            "x-expires": self.expires_ms,
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-routing-key": self.dead_letter_routing_key,
            "x-delivery-limit": self.delivery_limit,
        }
        return {k: v for k, v in pairs.items() if v is not None}


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: QueueArguments = field(default_factory=QueueArguments)


@dataclass(frozen=True, slots=True)
class BindingSpec:
    queue: str
    exchange: str
    routing_key: str


@dataclass(frozen=True, slots=True)
class Declarations:
    """What one process declares: exchanges first, then queues, then bindings."""

    exchanges: tuple[ExchangeSpec, ...] = ()
    queues: tuple[QueueSpec, ...] = ()
    bindings: tuple[BindingSpec, ...] = ()

    def __add__(self, other: Declarations) -> Declarations:
        return Declarations(
            self.exchanges + other.exchanges,
            self.queues + other.queues,
            self.bindings + other.bindings,
        )


@dataclass(frozen=True, slots=True)
class Topology:
    """All names and specs of one mesh. Tests use a unique namespace to isolate themselves."""

    namespace: str = c.DEFAULT_NAMESPACE
    heartbeat_queue_max_length: int = 100_000
    heartbeat_ttl_ms: int = 5_000
    dead_letter_max_length: int = 100_000
    rpc_ttl_ms: int = 30_000
    rpc_max_length: int = 10_000
    agent_queue_expires_ms: int = 30 * 60 * 1000
    pool_queue_overshoot: int = 1  # a quorum queue accepts one message past x-max-length
    pool_delivery_limit: int = 5  # deliveries of one task before it is dead-lettered (poison)

    # -- exchanges ------------------------------------------------------------------------
    def exchange(self, suffix: str) -> str:
        return names.exchange(self.namespace, suffix)

    @property
    def announce_exchange(self) -> str:
        return self.exchange(c.ANNOUNCE_EXCHANGE)

    @property
    def heartbeat_exchange(self) -> str:
        return self.exchange(c.HEARTBEAT_EXCHANGE)

    @property
    def events_exchange(self) -> str:
        return self.exchange(c.EVENTS_EXCHANGE)

    @property
    def control_exchange(self) -> str:
        return self.exchange(c.CONTROL_EXCHANGE)

    @property
    def agents_exchange(self) -> str:
        return self.exchange(c.AGENTS_EXCHANGE)

    @property
    def tasks_exchange(self) -> str:
        return self.exchange(c.TASKS_EXCHANGE)

    @property
    def dead_letter_exchange(self) -> str:
        return self.exchange(c.DEAD_LETTER_EXCHANGE)

    # -- queues ---------------------------------------------------------------------------
    @property
    def announce_queue(self) -> str:
        return names.manager_queue(self.namespace, "announce")

    @property
    def heartbeat_queue(self) -> str:
        return names.manager_queue(self.namespace, "heartbeats")

    @property
    def rpc_queue(self) -> str:
        return names.manager_queue(self.namespace, "rpc")

    @property
    def dead_letter_queue(self) -> str:
        return names.dead_letter_queue(self.namespace)

    def agent_control_queue(self, agent_id: str) -> str:
        return names.agent_control_queue(self.namespace, agent_id)

    def agent_task_queue(self, agent_id: str) -> str:
        return names.agent_task_queue(self.namespace, agent_id)

    def pool_task_queue(self, pool_id: str) -> str:
        return names.pool_task_queue(self.namespace, pool_id)

    # -- what each role declares ----------------------------------------------------------
    def shared(self) -> Declarations:
        """Exchanges and the dead-letter queue; everyone may declare them."""
        exchanges = (
            *tuple(
                ExchangeSpec(self.exchange(s))
                for s in (
                    c.ANNOUNCE_EXCHANGE,
                    c.HEARTBEAT_EXCHANGE,
                    c.EVENTS_EXCHANGE,
                    c.CONTROL_EXCHANGE,
                    c.AGENTS_EXCHANGE,
                    c.DEAD_LETTER_EXCHANGE,
                )
            ),
            ExchangeSpec(self.tasks_exchange, type="direct"),
        )
        dlq = QueueSpec(
            self.dead_letter_queue,
            arguments=QueueArguments(max_length=self.dead_letter_max_length, overflow="drop-head"),
        )
        return Declarations(
            exchanges=exchanges,
            queues=(dlq,),
            bindings=(BindingSpec(dlq.name, self.dead_letter_exchange, "#"),),
        )

    def manager(self) -> Declarations:
        """The manager's three inputs: announcements (quorum: losing one matters),
        heartbeats (never backlog: drop-head and a short TTL), and API requests."""
        dlx = self.dead_letter_exchange
        announce = QueueSpec(
            self.announce_queue,
            arguments=QueueArguments(
                queue_type="quorum", dead_letter_exchange=dlx, delivery_limit=5
            ),
        )
        heartbeats = QueueSpec(
            self.heartbeat_queue,
            durable=False,
            arguments=QueueArguments(
                max_length=self.heartbeat_queue_max_length,
                overflow="drop-head",
                message_ttl_ms=self.heartbeat_ttl_ms,
            ),
        )
        rpc = QueueSpec(
            self.rpc_queue,
            durable=False,
            arguments=QueueArguments(
                max_length=self.rpc_max_length,
                overflow="reject-publish",
                message_ttl_ms=self.rpc_ttl_ms,
                dead_letter_exchange=dlx,
            ),
        )
        bindings = (
            BindingSpec(announce.name, self.announce_exchange, f"{c.RK_AGENT}.*.*"),
            BindingSpec(heartbeats.name, self.heartbeat_exchange, f"{c.RK_HEARTBEAT}.*"),
            BindingSpec(rpc.name, self.control_exchange, f"{c.RK_RPC}.*"),
        )
        return self.shared() + Declarations(queues=(announce, heartbeats, rpc), bindings=bindings)

    def pool(self, pool_id: str, model_slots: int) -> Declarations:
        """A pool's task queue: what the admission path publishes granted tasks to.

        Quorum (a granted task must not be lost), ``x-max-length`` = the pool's model slots
        with ``reject-publish``: every queued task holds a slot, so a full queue means tasks
        arrived around the ledger, and the publisher is nacked, not ignored. A quorum queue
        accepts one message past its limit, so it never holds more than
        :meth:`pool_queue_bound`. A delivery limit for poison tasks, dead letters to the DLX.
        The ledger holds the exact capacity; this bound is the safety net.
        """
        queue = QueueSpec(
            self.pool_task_queue(pool_id),
            arguments=QueueArguments(
                queue_type="quorum",
                max_length=max(1, model_slots),
                overflow="reject-publish",
                dead_letter_exchange=self.dead_letter_exchange,
                delivery_limit=self.pool_delivery_limit,
            ),
        )
        binding = BindingSpec(queue.name, self.tasks_exchange, names.pool_task_key(pool_id))
        return self.shared() + Declarations(queues=(queue,), bindings=(binding,))

    def pool_queue_bound(self, model_slots: int) -> int:
        """The most a pool's queue can hold: its limit and the quorum queue's overshoot."""
        return max(1, model_slots) + self.pool_queue_overshoot

    def shared_exchanges(self) -> tuple[str, ...]:
        """The names of the shared exchanges (what an agent that may not declare them checks)."""
        return tuple(exchange.name for exchange in self.shared().exchanges)

    def agent(self, agent_id: str, task_queue_bound: int) -> Declarations:
        """The shared topology and the agent's own queues (:meth:`agent_queues`)."""
        return self.shared() + self.agent_queues(agent_id, task_queue_bound)

    def agent_queues(self, agent_id: str, task_queue_bound: int) -> Declarations:
        """An agent's control queue (gone with the agent) and its bounded task queue."""
        control = QueueSpec(self.agent_control_queue(agent_id), durable=False, auto_delete=True)
        tasks = QueueSpec(
            self.agent_task_queue(agent_id),
            arguments=QueueArguments(
                max_length=task_queue_bound,
                overflow="reject-publish",
                dead_letter_exchange=self.dead_letter_exchange,
                expires_ms=self.agent_queue_expires_ms,
            ),
        )
        bindings = (
            BindingSpec(control.name, self.agents_exchange, agent_id),
            BindingSpec(tasks.name, self.tasks_exchange, agent_id),
        )
        return Declarations(queues=(control, tasks), bindings=bindings)
