"""Naming rules for exchanges, queues and routing keys: pure functions, readable results.

Operators read these names in the RabbitMQ management UI, so they say what they
hold: ``mesh.manager.heartbeats``, ``mesh.agent.calc-1.tasks``.
"""

from __future__ import annotations

from mesh import constants as c


def exchange(namespace: str, suffix: str) -> str:
    return f"{namespace}.{suffix}"


def manager_queue(namespace: str, purpose: str) -> str:
    """``mesh.manager.announce``, ``mesh.manager.heartbeats``, ``mesh.manager.rpc``."""
    return f"{namespace}.manager.{purpose}"


def agent_control_queue(namespace: str, agent_id: str) -> str:
    return f"{namespace}.agent.{agent_id}.control"


def agent_task_queue(namespace: str, agent_id: str) -> str:
    return f"{namespace}.agent.{agent_id}.tasks"


def pool_task_queue(namespace: str, pool_id: str) -> str:
    """``<ns>.pool.<pool_id>.tasks``: the admitted tasks of one pool, shared by its agents."""
    return f"{namespace}.pool.{pool_id}.tasks"


def pool_task_key(pool_id: str) -> str:
    """``pool.<pool_id>`` on the tasks exchange; never an agent ID (those have no dots)."""
    return f"pool.{pool_id}"


def dead_letter_queue(namespace: str) -> str:
    """``<ns>.dead-letters``: a quorum queue (the dead-letter exchange is ``<ns>.dead-letter``)."""
    return f"{namespace}.dead-letters"


def classic_dead_letter_queue(namespace: str) -> str:
    """``<ns>.dead-letter``: the classic dead-letter queue of versions before quorum queues,
    emptied into :func:`dead_letter_queue` by a manager at start."""
    return f"{namespace}.dead-letter"


def reply_queue(namespace: str, client_name: str, unique: str) -> str:
    return f"{namespace}.reply.{client_name}.{unique}"


def agent_announce_key(agent_id: str, verb: str, shard: int | None = None) -> str:
    """``agent.<agent_id>.register`` | ``.deregister`` | ``.drain`` …; with several managers
    (shards) an agent told its shard adds it as a last word, ``agent.<agent_id>.drain.<k>``:
    only that shard's queue is bound to such keys, so only the shard's owner gets them."""
    key = f"{c.RK_AGENT}.{agent_id}.{verb}"
    return key if shard is None else f"{key}.{shard}"


def heartbeat_key(agent_id: str, shard: int | None = None) -> str:
    """``hb.<agent_id>``, or ``hb.<agent_id>.<k>`` for an agent of shard ``k``."""
    key = f"{c.RK_HEARTBEAT}.{agent_id}"
    return key if shard is None else f"{key}.{shard}"


def shard_queue(namespace: str, shard: int, purpose: str) -> str:
    """``<ns>.manager.shard-<k>.announce`` | ``.heartbeats``: one shard's agent traffic,
    consumed by the shard's owner only."""
    return f"{namespace}.manager.shard-{shard}.{purpose}"


def log_key(agent_id: str, kind: str) -> str:
    """``log.<agent_id>.<kind>``; events about no agent use ``-`` as the agent."""
    return f"{c.RK_LOG}.{agent_id or '-'}.{kind}"


def capability_key(capability: str, agent_id: str) -> str:
    """``capability.<name>.<agent_id>``: bind ``capability.rag.search.*`` for one capability,
    ``capability.#.<agent_id>`` for one agent."""
    return f"{c.RK_CAPABILITY}.{capability}.{agent_id}"


def rpc_key(method: str) -> str:
    return f"{c.RK_RPC}.{method}"


def grant_key(pool_id: str, admission_id: str) -> str:
    """``grant.<pool_id>.<admission_id>``: a grant of that pool was revoked (events exchange).

    Agents bind ``grant.<pool_id>.#`` (``#``, not ``*``: an admission ID may contain dots).
    An admission ID too long for AMQP's 255-byte routing key becomes ``-`` (the event's body
    names it anyway).
    """
    key = f"{c.RK_GRANT}.{pool_id}.{admission_id}"
    if len(key.encode()) > 255:
        return f"{c.RK_GRANT}.{pool_id}.-"
    return key


def pool_grant_key(pool_id: str) -> str:
    """``grant.<pool_id>``: news about every grant of one pool (its active descriptor epoch);
    matched by :func:`grant_binding`, since ``#`` also matches no word at all."""
    return f"{c.RK_GRANT}.{pool_id}"


def grant_binding(pool_id: str) -> str:
    """The binding key for every grant revocation of one pool."""
    return f"{c.RK_GRANT}.{pool_id}.#"
