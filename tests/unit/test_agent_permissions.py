"""The broker permissions of one agent's user, as regular expressions over names (pure).

RabbitMQ matches them with PCRE against whole resource names; Python's ``re.fullmatch`` of
these anchored patterns agrees for the names the mesh uses (``[A-Za-z0-9_.-]``). The broker's
own verdicts are checked in ``tests/integration/test_agent_permissions.py``.
"""

from __future__ import annotations

import re

import pytest

from mesh.topology import Topology, names
from mesh.topology.permissions import agent_permissions, literal, pool_agents_permissions

NS, AGENT, POOL = "prod-eu", "calc-1", "calc"
P = agent_permissions(NS, AGENT, POOL)
T = Topology(NS)


def allows(pattern: str, name: str) -> bool:
    return re.fullmatch(pattern, name) is not None


def test_it_may_configure_its_own_two_queues_and_nothing_shared() -> None:
    assert allows(P.configure, T.agent_control_queue(AGENT))
    assert allows(P.configure, T.agent_task_queue(AGENT))
    for name in (*T.shared_exchanges(), T.dead_letter_queue, T.pool_task_queue(POOL)):
        assert not allows(P.configure, name), name


@pytest.mark.parametrize(
    "other", ["calc-10", "calc-", "calc", "xcalc-1", "calc-1x", "calc_1"], ids=repr
)
def test_similar_agent_ids_get_nothing_of_its_own(other: str) -> None:
    for pattern in (P.configure, P.write, P.read):
        assert not allows(pattern, T.agent_task_queue(other))
        assert not allows(pattern, T.agent_control_queue(other))
    announce, heartbeat = P.topics
    assert not allows(heartbeat.write, names.heartbeat_key(other))
    assert not allows(announce.write, names.agent_announce_key(other, "register"))
    assert not allows(heartbeat.write, names.heartbeat_key(other, 3))
    assert not allows(announce.write, names.agent_announce_key(other, "drain", 3))


def test_with_several_managers_it_publishes_its_own_keys_with_a_shard_as_last_word() -> None:
    announce, heartbeat = P.topics
    for shard in (0, 7, 4095):
        assert allows(heartbeat.write, names.heartbeat_key(AGENT, shard))
        assert allows(announce.write, names.agent_announce_key(AGENT, "drain", shard))
    for bad in ("hb.calc-1.", "hb.calc-1.x", "hb.calc-1.3.4", "hb.calc-1.12345"):
        assert not allows(heartbeat.write, bad), bad


def test_it_writes_where_an_agent_publishes_and_reads_what_it_consumes() -> None:
    for exchange in (T.announce_exchange, T.heartbeat_exchange, T.dead_letter_exchange):
        assert allows(P.write, exchange)
    assert allows(P.write, "amq.default")  # results to reply_to queues
    for forbidden in (T.events_exchange, T.tasks_exchange, T.control_exchange, T.agents_exchange):
        assert not allows(P.write, forbidden), forbidden
    for readable in (T.pool_task_queue(POOL), T.agents_exchange, T.tasks_exchange):
        assert allows(P.read, readable)
    for unreadable in (
        T.pool_task_queue("search"),
        T.dead_letter_queue,
        T.announce_queue,
        T.heartbeat_queue,
        T.rpc_queue,
    ):
        assert not allows(P.read, unreadable), unreadable


def test_its_topic_permissions_name_only_its_own_routing_keys() -> None:
    announce, heartbeat = P.topics
    assert (announce.exchange, heartbeat.exchange) == (T.announce_exchange, T.heartbeat_exchange)
    for verb in ("register", "deregister", "drain"):
        assert allows(announce.write, names.agent_announce_key(AGENT, verb))
    assert not allows(announce.write, names.agent_announce_key(AGENT, "anything"))
    assert allows(heartbeat.write, names.heartbeat_key(AGENT))
    assert not allows(heartbeat.write, f"{names.heartbeat_key(AGENT)}.x")


def test_another_namespace_is_another_world() -> None:
    other = Topology("prod-eux")
    for pattern in (P.configure, P.write, P.read):
        assert not allows(pattern, other.agent_task_queue(AGENT))
    assert not allows(P.write, other.heartbeat_exchange)


def test_a_literal_escapes_only_metacharacters() -> None:
    assert literal("prod-eu.agent.calc_1.tasks") == r"prod-eu\.agent\.calc_1\.tasks"
    assert allows(literal("a+b(c)"), "a+b(c)") and not allows(literal("a.b"), "axb")


# ---- one user for every agent of some pools (a Deployment's pods) ----------------------------

SHARED = pool_agents_permissions(NS, ["calc", "echo"])


@pytest.mark.parametrize("agent", ["calc-7f9c4d-x2v8q", "a", "A_1", "x" * 63], ids=len)
def test_a_pool_user_may_do_for_any_agent_id_what_one_agents_user_may(agent: str) -> None:
    one = agent_permissions(NS, agent, "calc")
    for name in (T.agent_control_queue(agent), T.agent_task_queue(agent)):
        for shared, own in (
            (SHARED.configure, one.configure),
            (SHARED.write, one.write),
            (SHARED.read, one.read),
        ):
            assert allows(shared, name) and allows(own, name)
    announce, heartbeat = SHARED.topics
    for shard in (None, 3):
        assert allows(heartbeat.write, names.heartbeat_key(agent, shard))
        for verb in ("register", "deregister", "drain", "standing", "admission"):
            assert allows(announce.write, names.agent_announce_key(agent, verb, shard))


@pytest.mark.parametrize(
    "name",
    ["a.b", "-a", "", "x" * 64, "a b", "a*"],
    ids=repr,
)
def test_a_pool_user_gets_nothing_for_what_is_not_an_agent_id(name: str) -> None:
    for pattern in (SHARED.configure, SHARED.write, SHARED.read):
        assert not allows(pattern, T.agent_task_queue(name)), name
    announce, heartbeat = SHARED.topics
    assert not allows(heartbeat.write, names.heartbeat_key(name))
    assert not allows(announce.write, names.agent_announce_key(name, "register"))


def test_a_pool_user_reads_only_its_pools_queues_and_writes_nothing_of_the_managers() -> None:
    for pool in ("calc", "echo"):
        assert allows(SHARED.read, T.pool_task_queue(pool))
    assert not allows(SHARED.read, T.pool_task_queue("search"))
    for forbidden in (T.events_exchange, T.tasks_exchange, T.control_exchange, T.agents_exchange):
        assert not allows(SHARED.write, forbidden), forbidden
    for name in (*T.shared_exchanges(), T.dead_letter_queue, T.rpc_queue, T.announce_queue):
        assert not allows(SHARED.configure, name), name
    announce, _ = SHARED.topics
    assert not allows(announce.write, names.agent_announce_key("calc-1", "anything"))


def test_an_agent_id_like_the_placeholder_is_not_a_wildcard() -> None:
    # One agent's own user never matches another agent, whatever its ID looks like.
    sneaky = agent_permissions(NS, "any-agent", POOL)
    assert not allows(sneaky.configure, T.agent_task_queue("calc-1"))


def test_a_pool_user_needs_a_pool() -> None:
    with pytest.raises(ValueError, match="at least one pool"):
        pool_agents_permissions(NS, [])
