"""Topology as data: readable names, and the x-arguments that keep queues bounded."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mesh.topology import (
    BindingSpec,
    Declarations,
    ExchangeSpec,
    QueueArguments,
    QueueSpec,
    Topology,
    names,
)
from mesh.topology.specs import reply_queue

topology = Topology()


def queue(declarations: Declarations, name: str) -> QueueSpec:
    [spec] = [q for q in declarations.queues if q.name == name]
    return spec


# ---- names -----------------------------------------------------------------------------------


def test_queue_names_say_what_they_hold() -> None:
    assert topology.announce_queue == "mesh.manager.announce"
    assert topology.heartbeat_queue == "mesh.manager.heartbeats"
    assert topology.rpc_queue == "mesh.manager.rpc"
    assert topology.dead_letter_queue == "mesh.dead-letters"
    assert topology.classic_dead_letter_queue == "mesh.dead-letter"  # before quorum queues
    assert topology.agent_control_queue("calc-1") == "mesh.agent.calc-1.control"
    assert topology.agent_task_queue("calc-1") == "mesh.agent.calc-1.tasks"
    assert names.reply_queue("mesh", "cli", "ab12") == "mesh.reply.cli.ab12"


def test_exchange_names_are_namespaced() -> None:
    assert topology.announce_exchange == "mesh.announce"
    assert topology.heartbeat_exchange == "mesh.heartbeat"
    assert topology.events_exchange == "mesh.events"
    assert topology.control_exchange == "mesh.control"
    assert topology.agents_exchange == "mesh.agents"
    assert topology.tasks_exchange == "mesh.tasks"
    assert topology.dead_letter_exchange == "mesh.dead-letter"


def test_a_test_namespace_renames_every_exchange_and_queue() -> None:
    isolated = Topology(namespace="t-1a2b")

    everything = isolated.manager() + isolated.agent("calc-1", task_queue_bound=10)

    assert everything.exchanges and everything.queues and everything.bindings
    assert all(e.name.startswith("t-1a2b.") for e in everything.exchanges)
    assert all(q.name.startswith("t-1a2b.") for q in everything.queues)
    assert all(b.exchange.startswith("t-1a2b.") for b in everything.bindings)
    assert all(b.queue.startswith("t-1a2b.") for b in everything.bindings)


def test_routing_keys_let_anyone_follow_one_agent_or_one_capability() -> None:
    assert names.agent_announce_key("calc-1", "register") == "agent.calc-1.register"
    assert names.heartbeat_key("calc-1") == "hb.calc-1"
    assert names.heartbeat_key("calc-1", 3) == "hb.calc-1.3"
    assert names.agent_announce_key("calc-1", "drain", 3) == "agent.calc-1.drain.3"
    assert names.capability_key("rag.search", "calc-1") == "capability.rag.search.calc-1"
    assert names.log_key("calc-1", "lost") == "log.calc-1.lost"
    assert names.log_key("", "version_drift") == "log.-.version_drift"
    assert names.rpc_key("acquire") == "rpc.acquire"


@pytest.mark.parametrize(
    ("key", "pattern", "matches"),
    [
        ("capability.rag.search.calc-1", "capability.rag.search.*", True),
        ("capability.rag.search-v2.calc-1", "capability.rag.search.*", False),
        ("capability.rag.search.calc-1", "capability.#.calc-1", True),
        ("capability.calc.add.calc-1", "capability.#.calc-1", True),
        ("capability.calc.add.calc-2", "capability.#.calc-1", False),
        ("agent.calc-1.register", "agent.*.*", True),
        ("hb.calc-1", "hb.*", True),
    ],
)
def test_capability_routing_keys_work_with_topic_wildcards(
    key: str, pattern: str, matches: bool
) -> None:
    assert topic_matches(pattern, key) is matches


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` is zero or more words."""

    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        return bool(k) and p[0] in ("*", k[0]) and match(p[1:], k[1:])

    return match(pattern.split("."), key.split("."))


def test_the_manager_binds_its_queues_to_the_keys_agents_publish_on() -> None:
    bindings = {(b.queue, b.exchange): b.routing_key for b in topology.manager().bindings}

    announce = bindings[topology.announce_queue, topology.announce_exchange]
    heartbeats = bindings[topology.heartbeat_queue, topology.heartbeat_exchange]
    assert topic_matches(announce, names.agent_announce_key("calc-1", "register"))
    assert topic_matches(announce, names.agent_announce_key("calc-1", "drain"))
    assert topic_matches(heartbeats, names.heartbeat_key("calc-1"))
    assert topic_matches(bindings[topology.rpc_queue, topology.control_exchange], "rpc.find")


def test_each_shard_queue_gets_its_own_shard_s_keys_and_the_shared_queues_none_of_them() -> None:
    shards = topology.manager_shards(4)
    bindings = {(b.queue, b.exchange): b.routing_key for b in shards.bindings}
    shared = {(b.queue, b.exchange): b.routing_key for b in topology.manager().bindings}
    for shard in range(4):
        announce = bindings[topology.shard_announce_queue(shard), topology.announce_exchange]
        heartbeats = bindings[topology.shard_heartbeat_queue(shard), topology.heartbeat_exchange]
        for verb in ("register", "drain", "deregister", "standing"):
            assert topic_matches(announce, names.agent_announce_key("calc-1", verb, shard))
            assert not topic_matches(announce, names.agent_announce_key("calc-1", verb))
            assert not topic_matches(
                announce, names.agent_announce_key("calc-1", verb, (shard + 1) % 4)
            )
            assert not topic_matches(
                shared[topology.announce_queue, topology.announce_exchange],
                names.agent_announce_key("calc-1", verb, shard),
            )
        assert topic_matches(heartbeats, names.heartbeat_key("calc-1", shard))
        assert not topic_matches(heartbeats, names.heartbeat_key("calc-1"))
        assert not topic_matches(
            shared[topology.heartbeat_queue, topology.heartbeat_exchange],
            names.heartbeat_key("calc-1", shard),
        )
    # One consumer at a time on each (a handover may briefly have two subscribed).
    assert all(q.arguments.single_active_consumer for q in shards.queues)
    assert len(shards.queues) == 12  # announce, heartbeats and rpc per shard


# ---- queue arguments -------------------------------------------------------------------------


def test_the_heartbeat_queue_never_backlogs() -> None:
    spec = queue(topology.manager(), topology.heartbeat_queue)
    args = spec.arguments.to_amqp()

    assert args["x-overflow"] == "drop-head"
    assert args["x-message-ttl"] == topology.heartbeat_ttl_ms
    assert 0 < args["x-message-ttl"] <= 10_000
    assert args["x-max-length"] == topology.heartbeat_queue_max_length
    assert args["x-queue-type"] == "classic"


def test_an_agent_task_queue_is_bounded_rejects_publishes_and_dead_letters() -> None:
    spec = queue(topology.agent("calc-1", task_queue_bound=8), topology.agent_task_queue("calc-1"))
    args = spec.arguments.to_amqp()

    assert spec.durable
    assert args["x-max-length"] == 8
    assert args["x-overflow"] == "reject-publish"
    assert args["x-dead-letter-exchange"] == topology.dead_letter_exchange
    # Leased tasks wait here: quorum, so a broker node's loss loses none and stops no agent.
    assert args["x-queue-type"] == "quorum" and spec.replaces_classic


def test_the_announce_queue_is_a_quorum_queue_with_a_dead_letter_exchange() -> None:
    spec = queue(topology.manager(), topology.announce_queue)
    args = spec.arguments.to_amqp()

    assert spec.durable
    assert args["x-queue-type"] == "quorum"
    assert args["x-dead-letter-exchange"] == topology.dead_letter_exchange
    assert args["x-delivery-limit"] >= 1


def test_the_rpc_queue_is_bounded_and_dead_letters() -> None:
    args = queue(topology.manager(), topology.rpc_queue).arguments.to_amqp()

    assert args["x-overflow"] == "reject-publish"
    assert args["x-max-length"] == topology.rpc_max_length
    assert args["x-dead-letter-exchange"] == topology.dead_letter_exchange


def test_the_dead_letter_queue_is_a_bounded_quorum_queue_that_catches_every_reason() -> None:
    made = topology.dead_letters()
    args = queue(made, topology.dead_letter_queue).arguments.to_amqp()

    assert args["x-queue-type"] == "quorum"
    assert args["x-max-length"] == topology.dead_letter_max_length
    assert args["x-overflow"] == "drop-head"
    assert BindingSpec(topology.dead_letter_queue, topology.dead_letter_exchange, "#") in (
        made.bindings
    )
    assert queue(topology.manager(), topology.dead_letter_queue) == made.queues[0]


def test_only_the_manager_declares_a_durable_queue_of_the_shared_topology() -> None:
    """Agents and clients declare the shared exchanges only: a process that merely publishes
    dead letters never redeclares a queue (whose nodes may be down) on a reconnect."""
    assert topology.shared().queues == ()
    assert topology.shared().bindings == ()


def test_every_queue_the_mesh_declares_has_a_bound_by_count() -> None:
    everything = (
        topology.manager()
        + topology.agent("calc-1", task_queue_bound=4)
        + topology.pool("echo")
        + Declarations(queues=(reply_queue("amq.gen-1"),))
    )

    assert len({spec.name for spec in everything.queues}) == 8
    for spec in everything.queues:
        args = spec.arguments.to_amqp()
        assert isinstance(args.get("x-max-length"), int), spec.name
        assert args.get("x-overflow") in ("drop-head", "reject-publish"), spec.name


def test_queues_that_take_bodies_from_outside_are_bounded_by_bytes_too() -> None:
    manager = topology.manager()
    for name in (
        topology.announce_queue,
        topology.heartbeat_queue,
        topology.rpc_queue,
        topology.dead_letter_queue,
    ):
        args = queue(manager, name).arguments.to_amqp()
        assert 0 < args["x-max-length-bytes"] <= 256 * 1024 * 1024, name


def test_the_announce_queue_nacks_registrations_when_full() -> None:
    args = queue(topology.manager(), topology.announce_queue).arguments.to_amqp()

    assert args["x-max-length"] == topology.announce_max_length
    assert args["x-overflow"] == "reject-publish"  # an agent is told, and retries


def test_a_pool_queue_is_declared_the_same_whatever_its_capacity() -> None:
    spec = queue(topology.pool("echo"), topology.pool_task_queue("echo"))
    args = spec.arguments.to_amqp()

    assert args == {
        "x-queue-type": "quorum",
        "x-max-length": topology.pool_queue_max_length,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": topology.dead_letter_exchange,
        "x-delivery-limit": topology.pool_delivery_limit,
    }


def test_a_pool_queues_capacity_bound_is_a_policy_on_exactly_that_queue() -> None:
    policy = topology.pool_bound_policy("rag.search-v2", 12)
    name = topology.pool_task_queue("rag.search-v2")

    assert policy.definition == {"max-length": 12, "overflow": "reject-publish"}
    assert re.fullmatch(policy.pattern[1:-1], name)
    assert not re.search(policy.pattern, name + "x") and not re.search(policy.pattern, "x" + name)
    assert not re.search(policy.pattern, name.replace(".", "-"))  # dots are escaped
    assert policy.to_api() == {
        "pattern": policy.pattern,
        "definition": {"max-length": 12, "overflow": "reject-publish"},
        "priority": 10,
        "apply-to": "queues",
    }
    assert topology.pool_bound_policy("echo", 0).definition["max-length"] == 1


def test_queue_arguments_leave_out_what_is_not_set() -> None:
    assert QueueArguments().to_amqp() == {"x-queue-type": "classic"}
    assert QueueArguments(max_length=5, overflow="reject-publish").to_amqp() == {
        "x-queue-type": "classic",
        "x-max-length": 5,
        "x-overflow": "reject-publish",
    }
    assert None not in QueueArguments(message_ttl_ms=0).to_amqp().values()
    assert QueueArguments(message_ttl_ms=0).to_amqp()["x-message-ttl"] == 0


def test_every_queue_argument_has_its_amqp_name() -> None:
    everything_set = QueueArguments(
        queue_type="quorum",
        max_length=1,
        max_length_bytes=5,
        overflow="drop-head",
        message_ttl_ms=2,
        expires_ms=3,
        dead_letter_exchange="dlx",
        dead_letter_routing_key="dlk",
        delivery_limit=4,
        single_active_consumer=True,
    )

    assert everything_set.to_amqp() == {
        "x-queue-type": "quorum",
        "x-max-length": 1,
        "x-max-length-bytes": 5,
        "x-overflow": "drop-head",
        "x-message-ttl": 2,
        "x-expires": 3,
        "x-dead-letter-exchange": "dlx",
        "x-dead-letter-routing-key": "dlk",
        "x-delivery-limit": 4,
        "x-single-active-consumer": True,
    }
    assert len(everything_set.to_amqp()) == len(dataclasses.fields(QueueArguments))


# ---- value objects ---------------------------------------------------------------------------


def test_declarations_add_up_in_order() -> None:
    first = Declarations(
        exchanges=(ExchangeSpec("a"),),
        queues=(QueueSpec("q1"),),
        bindings=(BindingSpec("q1", "a", "k"),),
    )
    second = Declarations(exchanges=(ExchangeSpec("b", type="direct"),), queues=(QueueSpec("q2"),))

    total = first + second

    assert total.exchanges == (ExchangeSpec("a"), ExchangeSpec("b", type="direct"))
    assert total.queues == (QueueSpec("q1"), QueueSpec("q2"))
    assert total.bindings == (BindingSpec("q1", "a", "k"),)
    assert first + Declarations() == first


def test_specs_are_frozen_and_hashable_so_declarations_can_be_cached() -> None:
    spec = queue(topology.manager(), topology.heartbeat_queue)

    assert {spec, queue(topology.manager(), topology.heartbeat_queue)} == {spec}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_the_same_topology_declares_the_same_specs_every_time() -> None:
    assert Topology().manager() == topology.manager()
    assert Topology().agent("calc-1", 4) == topology.agent("calc-1", 4)


def test_every_role_declares_exchanges_before_binding_to_them() -> None:
    for declarations in (topology.manager(), topology.agent("calc-1", task_queue_bound=4)):
        exchanges = {e.name for e in declarations.exchanges}
        queues = {q.name for q in declarations.queues}
        for binding in declarations.bindings:
            assert binding.exchange in exchanges
            assert binding.queue in queues


def test_the_tasks_exchange_is_direct_and_routes_by_agent_id() -> None:
    agent = topology.agent("calc-1", task_queue_bound=4)
    [tasks_exchange] = [e for e in agent.exchanges if e.name == topology.tasks_exchange]

    assert tasks_exchange.type == "direct"
    assert BindingSpec(topology.agent_task_queue("calc-1"), topology.tasks_exchange, "calc-1") in (
        agent.bindings
    )
