"""What one agent's broker user may do: RabbitMQ permissions, computed from the names.

RabbitMQ checks three regular expressions per user and vhost — *configure* (declare and delete),
*write* (publish to an exchange; bind a queue), *read* (consume a queue; bind *from* an
exchange) — against resource names, and, per topic exchange, *topic permissions*: which
routing keys the user may publish with. An agent ``X`` of pool ``P`` in namespace ``N`` gets
exactly what it uses (see docs/security.md for the table and what each is for):

- configure: its two queues, ``N.agent.X.control`` and ``N.agent.X.tasks`` — nothing shared,
  since configure on an exchange would also let it delete the exchange (the agent only checks
  the shared exchanges with passive declares: ``AgentSettings.shared_topology = "check"``);
- write: its two queues (to bind them), the ``N.announce``, ``N.heartbeat`` and
  ``N.dead-letter`` exchanges, and ``amq.default`` (results go to ``reply_to`` queues);
- read: its two queues, its pool's queue ``N.pool.P.tasks``, and the exchanges its queues are
  bound from: ``N.agents``, ``N.tasks``, ``N.events``;
- topic: on ``N.announce`` only ``agent.X.<verb>`` for the verbs of ``AGENT_ANNOUNCE_VERBS``;
  on ``N.heartbeat`` only ``hb.X`` — each also with a shard number as a last word
  (``agent.X.drain.3``, ``hb.X.3``: several managers). Another agent's routing key is
  refused by the broker (``ACCESS_REFUSED``).

Names are matched whole (``^…$``) with every literal part escaped.

Where agents' IDs are not known in advance (a Kubernetes Deployment names its pods),
:func:`pool_agents_permissions` gives one user shared by the agents of some pools the same,
with the agent ID matched by its form (:data:`mesh.constants.AGENT_ID_WORD`) instead of
spelled out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from mesh import constants as c
from mesh.topology import names


@dataclass(frozen=True, slots=True)
class TopicPermission:
    exchange: str
    write: str
    read: str


@dataclass(frozen=True, slots=True)
class AgentPermissions:
    """The vhost permissions and topic permissions of one agent's broker user."""

    configure: str
    write: str
    read: str
    topics: tuple[TopicPermission, ...]


NOTHING = "^$"
"""A pattern no resource name matches (RabbitMQ's way to grant nothing)."""


_META = re.compile(r"([.\\^$|?*+()\[\]{}])")


def literal(name: str) -> str:
    """``name`` as a pattern matching itself: only real metacharacters escaped (names are
    ``[A-Za-z0-9_.-]``, so in practice the dots), which keeps them readable in the UI."""
    return _META.sub(r"\\\1", name)


def _any_of(*literals: str) -> str:
    return "^(" + "|".join(literal(name) for name in literals) + ")$"


_ANY_AGENT = "\x00any-agent\x00"
"""Stands in for the agent ID while a pool user's names are built with the usual name
functions, then replaced by :data:`mesh.constants.AGENT_ID_WORD` in the escaped pattern
(NUL: no real name holds it, so one agent's own ID can never be taken for it)."""


def agent_permissions(namespace: str, agent_id: str, pool_id: str) -> AgentPermissions:
    """One agent's user: what agent ``agent_id`` of pool ``pool_id`` uses, nothing else."""
    return _permissions(namespace, agent_id, [pool_id], any_agent=False)


def pool_agents_permissions(namespace: str, pool_ids: Sequence[str]) -> AgentPermissions:
    """One user shared by every agent of ``pool_ids`` (the pods of a Deployment, whose IDs
    are not known in advance): what :func:`agent_permissions` gives one agent, for any agent
    ID — so these agents may speak for one another, and read one another's queues, but not
    for the managers, nor read another pool's queue."""
    if not pool_ids:
        raise ValueError("a pool agents' user needs at least one pool")
    return _permissions(namespace, _ANY_AGENT, pool_ids, any_agent=True)


def _permissions(
    namespace: str, agent_id: str, pool_ids: Sequence[str], *, any_agent: bool
) -> AgentPermissions:
    own = (
        names.agent_control_queue(namespace, agent_id),
        names.agent_task_queue(namespace, agent_id),
    )
    announce = names.exchange(namespace, c.ANNOUNCE_EXCHANGE)
    heartbeat = names.exchange(namespace, c.HEARTBEAT_EXCHANGE)

    def any_of(*literals: str) -> str:
        pattern = _any_of(*literals)
        return pattern.replace(_ANY_AGENT, c.AGENT_ID_WORD) if any_agent else pattern

    return AgentPermissions(
        configure=any_of(*own),
        write=any_of(
            *own,
            announce,
            heartbeat,
            names.exchange(namespace, c.DEAD_LETTER_EXCHANGE),
            "amq.default",
        ),
        read=any_of(
            *own,
            *(names.pool_task_queue(namespace, pool_id) for pool_id in pool_ids),
            names.exchange(namespace, c.AGENTS_EXCHANGE),
            names.exchange(namespace, c.TASKS_EXCHANGE),
            names.exchange(namespace, c.EVENTS_EXCHANGE),
        ),
        topics=(
            TopicPermission(
                announce,
                write=_with_shard(
                    any_of(*(names.agent_announce_key(agent_id, v) for v in c.AGENT_ANNOUNCE_VERBS))
                ),
                read=NOTHING,
            ),
            TopicPermission(
                heartbeat, write=_with_shard(any_of(names.heartbeat_key(agent_id))), read=NOTHING
            ),
        ),
    )


def _with_shard(pattern: str) -> str:
    """``pattern`` (``^(…)$``) also matching its keys with a shard number as a last word
    (``….<k>``, several managers): the agent's own keys still, in any shard."""
    assert pattern.startswith("^") and pattern.endswith("$")
    return pattern[:-1] + r"(\.[0-9]{1,4})?$"
