"""Topology as data: exchanges, queues and bindings as frozen, hashable value objects.

:class:`Topology` turns a namespace into the specs the manager and each agent
declare. The transport declares them idempotently (and caches what it has
declared), so the same spec can be declared by every process that needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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
    max_length_bytes: int | None = None
    overflow: Overflow | None = None
    message_ttl_ms: int | None = None
    expires_ms: int | None = None
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    delivery_limit: int | None = None
    single_active_consumer: bool | None = None

    def to_amqp(self) -> dict[str, Any]:
        pairs: dict[str, Any] = {
            "x-queue-type": self.queue_type,
            "x-max-length": self.max_length,
            "x-max-length-bytes": self.max_length_bytes,
            "x-overflow": self.overflow,
            "x-message-ttl": self.message_ttl_ms,
            "x-expires": self.expires_ms,
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-routing-key": self.dead_letter_routing_key,
            "x-delivery-limit": self.delivery_limit,
            "x-single-active-consumer": self.single_active_consumer,
        }
        return {k: v for k, v in pairs.items() if v is not None}


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: QueueArguments = field(default_factory=QueueArguments)
    # An older version declared this queue classic under the same name: the transport moves
    # it to this declaration, messages and all (mesh.transport.moves), before declaring it.
    replaces_classic: bool = False


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A RabbitMQ policy on queues (set through the management API). ``priority`` 10 puts it
    above a catch-all operator policy of priority 0; one policy applies to a queue at a
    time, so a user policy on the same queue with a higher priority replaces ours."""

    name: str
    pattern: str
    definition: Mapping[str, Any]
    priority: int = 10
    apply_to: Literal["queues"] = "queues"

    def to_api(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "definition": dict(self.definition),
            "priority": self.priority,
            "apply-to": self.apply_to,
        }


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


MiB = 1024 * 1024
REPLY_MAX_LENGTH = 10_000  # a client's reply queue: answers it has not read yet


def reply_queue(name: str) -> QueueSpec:
    """A client's exclusive, auto-deleted reply queue, bounded like every other queue."""
    return QueueSpec(
        name,
        durable=False,
        exclusive=True,
        auto_delete=True,
        arguments=QueueArguments(max_length=REPLY_MAX_LENGTH, overflow="reject-publish"),
    )


@dataclass(frozen=True, slots=True)
class Topology:
    """All names and specs of one mesh. Tests use a unique namespace to isolate themselves.

    Every queue has a bound, by count and, where bodies come from outside the mesh's
    control, by bytes too; docs/architecture.md lists them ("Queues and their bounds"). The
    bounds are part of each queue's declaration and never follow anything that changes at
    run time: a pool's capacity bound is a broker policy (:meth:`pool_bound_policy`), so a
    changed capacity never needs a new queue.
    """

    namespace: str = c.DEFAULT_NAMESPACE
    heartbeat_queue_max_length: int = 100_000
    heartbeat_queue_max_bytes: int = 64 * MiB
    heartbeat_ttl_ms: int = 5_000
    announce_max_length: int = 100_000
    announce_max_bytes: int = 256 * MiB
    dead_letter_max_length: int = 100_000
    dead_letter_max_bytes: int = 256 * MiB
    rpc_ttl_ms: int = 30_000
    rpc_max_length: int = 10_000
    rpc_max_bytes: int = 128 * MiB
    agent_control_max_length: int = 1_000
    agent_queue_expires_ms: int = 30 * 60 * 1000
    pool_queue_max_length: int = 100_000  # the declared ceiling; the policy bounds it at slots
    pool_queue_overshoot: int = 1  # a quorum queue accepts one message past its max length
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

    @property
    def classic_dead_letter_queue(self) -> str:
        """Where versions before the quorum dead-letter queue kept dead letters."""
        return names.classic_dead_letter_queue(self.namespace)

    def agent_control_queue(self, agent_id: str) -> str:
        return names.agent_control_queue(self.namespace, agent_id)

    def agent_task_queue(self, agent_id: str) -> str:
        return names.agent_task_queue(self.namespace, agent_id)

    def pool_task_queue(self, pool_id: str) -> str:
        return names.pool_task_queue(self.namespace, pool_id)

    # -- what each role declares ----------------------------------------------------------
    def shared(self) -> Declarations:
        """The exchanges; everyone may declare them. (Not the dead-letter queue: only the
        manager declares it, :meth:`dead_letters`, so a process that merely dead-letters
        never redeclares a queue whose nodes may be down.)"""
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
        return Declarations(exchanges=exchanges)

    def dead_letters(self) -> Declarations:
        """The dead-letter queue, bound to the dead-letter exchange for every key: quorum, so
        a broker node's loss loses no dead letter and stops no process; bounded by count and
        bytes, the oldest dropped first. (An older version's classic queue of the same role
        was ``<ns>.dead-letter``: :attr:`classic_dead_letter_queue`.)"""
        dlq = QueueSpec(
            self.dead_letter_queue,
            arguments=QueueArguments(
                queue_type="quorum",
                max_length=self.dead_letter_max_length,
                max_length_bytes=self.dead_letter_max_bytes,
                overflow="drop-head",
            ),
        )
        return self.shared() + Declarations(
            queues=(dlq,), bindings=(BindingSpec(dlq.name, self.dead_letter_exchange, "#"),)
        )

    def manager(self) -> Declarations:
        """The manager's three inputs: announcements (quorum: losing one matters; a full
        queue nacks the agent, which retries), heartbeats (never backlog: drop-head and a
        short TTL), and API requests (a full queue nacks the requester)."""
        announce = self._announce_spec(self.announce_queue)
        heartbeats = self._heartbeat_spec(self.heartbeat_queue)
        rpc = self._rpc_spec(self.rpc_queue)
        bindings = (
            BindingSpec(announce.name, self.announce_exchange, f"{c.RK_AGENT}.*.*"),
            BindingSpec(heartbeats.name, self.heartbeat_exchange, f"{c.RK_HEARTBEAT}.*"),
            BindingSpec(rpc.name, self.control_exchange, f"{c.RK_RPC}.*"),
        )
        return self.dead_letters() + Declarations(
            queues=(announce, heartbeats, rpc), bindings=bindings
        )

    def shard_announce_queue(self, shard: int) -> str:
        return names.shard_queue(self.namespace, shard, "announce")

    def shard_heartbeat_queue(self, shard: int) -> str:
        return names.shard_queue(self.namespace, shard, "heartbeats")

    def shard_rpc_queue(self, shard: int) -> str:
        return names.shard_queue(self.namespace, shard, "rpc")

    def manager_shards(self, shard_count: int) -> Declarations:
        """Several managers: each shard's announce and heartbeat queues, like the shared ones
        (:meth:`manager`) and bound to the same exchanges by the shard's number as the keys'
        last word (``agent.<id>.<verb>.<k>``, ``hb.<id>.<k>``), and its RPC queue, where
        other managers ask the owner by queue name (the default exchange). The shard's owner
        consumes them; single-active-consumer keeps deliveries on one manager while a handover has
        the old and the new owner subscribed for a moment. Every manager declares all of
        them, so a registration can be forwarded to a shard nobody holds yet."""
        queues, bindings = [], []
        for shard in range(shard_count):
            announce = self._announce_spec(self.shard_announce_queue(shard), single=True)
            heartbeats = self._heartbeat_spec(self.shard_heartbeat_queue(shard), single=True)
            rpc = self._rpc_spec(self.shard_rpc_queue(shard), single=True)
            queues += [announce, heartbeats, rpc]
            bindings += [
                BindingSpec(announce.name, self.announce_exchange, f"{c.RK_AGENT}.*.*.{shard}"),
                BindingSpec(
                    heartbeats.name, self.heartbeat_exchange, f"{c.RK_HEARTBEAT}.*.{shard}"
                ),
            ]
        return Declarations(queues=tuple(queues), bindings=tuple(bindings))

    def _announce_spec(self, name: str, *, single: bool | None = None) -> QueueSpec:
        """Announcements: quorum (losing one matters), a full queue nacks the agent."""
        return QueueSpec(
            name,
            arguments=QueueArguments(
                queue_type="quorum",
                max_length=self.announce_max_length,
                max_length_bytes=self.announce_max_bytes,
                overflow="reject-publish",
                dead_letter_exchange=self.dead_letter_exchange,
                delivery_limit=5,
                single_active_consumer=single,
            ),
        )

    def _heartbeat_spec(self, name: str, *, single: bool | None = None) -> QueueSpec:
        """Heartbeats never backlog: drop-head and a short TTL."""
        return QueueSpec(
            name,
            durable=False,
            arguments=QueueArguments(
                max_length=self.heartbeat_queue_max_length,
                max_length_bytes=self.heartbeat_queue_max_bytes,
                overflow="drop-head",
                message_ttl_ms=self.heartbeat_ttl_ms,
                single_active_consumer=single,
            ),
        )

    def _rpc_spec(self, name: str, *, single: bool | None = None) -> QueueSpec:
        """Requests: a full queue nacks the requester; unanswered ones expire."""
        return QueueSpec(
            name,
            durable=False,
            arguments=QueueArguments(
                max_length=self.rpc_max_length,
                max_length_bytes=self.rpc_max_bytes,
                overflow="reject-publish",
                message_ttl_ms=self.rpc_ttl_ms,
                dead_letter_exchange=self.dead_letter_exchange,
                single_active_consumer=single,
            ),
        )

    def pool(self, pool_id: str) -> Declarations:
        """A pool's task queue: what the admission path publishes granted tasks to.

        Quorum (a granted task must not be lost), ``reject-publish``: a full queue nacks the
        publisher rather than dropping anything. Its declared ``x-max-length`` is a fixed
        ceiling (:attr:`pool_queue_max_length`); the bound that follows the pool's model
        slots is the broker policy of :meth:`pool_bound_policy` (the broker applies the
        lower of the two), so a descriptor that changes the slots changes a policy, never the
        queue. Every queued task holds a slot, so a full queue means tasks arrived around the
        ledger. A delivery limit for poison tasks, dead letters to the DLX. The ledger holds
        the exact capacity; these bounds are the safety net.
        """
        queue = QueueSpec(
            self.pool_task_queue(pool_id),
            arguments=QueueArguments(
                queue_type="quorum",
                max_length=self.pool_queue_max_length,
                overflow="reject-publish",
                dead_letter_exchange=self.dead_letter_exchange,
                delivery_limit=self.pool_delivery_limit,
            ),
        )
        binding = BindingSpec(queue.name, self.tasks_exchange, names.pool_task_key(pool_id))
        return self.shared() + Declarations(queues=(queue,), bindings=(binding,))

    def pool_bound_policy(self, pool_id: str, model_slots: int) -> PolicySpec:
        """The broker policy that bounds a pool's queue at its model slots (one queue,
        matched by its exact name)."""
        queue = self.pool_task_queue(pool_id)
        return PolicySpec(
            name=f"{queue}.bound",
            pattern="^" + re.escape(queue) + "$",
            definition={"max-length": max(1, model_slots), "overflow": "reject-publish"},
        )

    def pool_queue_bound(self, model_slots: int) -> int:
        """The most a pool's queue can hold under its policy: the slots and the quorum
        queue's overshoot."""
        return max(1, model_slots) + self.pool_queue_overshoot

    def shared_exchanges(self) -> tuple[str, ...]:
        """The names of the shared exchanges (what an agent that may not declare them checks)."""
        return tuple(exchange.name for exchange in self.shared().exchanges)

    def agent(self, agent_id: str, task_queue_bound: int) -> Declarations:
        """The shared topology and the agent's own queues (:meth:`agent_queues`)."""
        return self.shared() + self.agent_queues(agent_id, task_queue_bound)

    def agent_queues(self, agent_id: str, task_queue_bound: int) -> Declarations:
        """An agent's control queue (per connection: gone with the agent, declared on the node
        it connects to) and its bounded task queue (quorum: leased tasks wait there, and a
        broker node's loss must neither lose them nor stop the agent reconnecting)."""
        control = QueueSpec(
            self.agent_control_queue(agent_id),
            durable=False,
            auto_delete=True,
            arguments=QueueArguments(
                max_length=self.agent_control_max_length, overflow="reject-publish"
            ),
        )
        tasks = QueueSpec(
            self.agent_task_queue(agent_id),
            arguments=QueueArguments(
                queue_type="quorum",
                max_length=task_queue_bound,
                overflow="reject-publish",
                dead_letter_exchange=self.dead_letter_exchange,
                expires_ms=self.agent_queue_expires_ms,
            ),
            replaces_classic=True,
        )
        bindings = (
            BindingSpec(control.name, self.agents_exchange, agent_id),
            BindingSpec(tasks.name, self.tasks_exchange, agent_id),
        )
        return Declarations(queues=(control, tasks), bindings=bindings)
