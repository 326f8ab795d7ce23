"""docs/topology.md, generated from :class:`~mesh.topology.specs.Topology` and the routing-key
rules in :mod:`mesh.topology.names`: every exchange with the keys published to it, and every
queue with its exact arguments and bindings, as the code declares them. ``python -m
mesh.topology.reference > docs/topology.md`` writes it; a unit test regenerates it and diffs.
What each one is for is said here, beside the facts the code supplies."""

from __future__ import annotations

from mesh import constants as c
from mesh.topology import names
from mesh.topology.specs import Declarations, QueueSpec, Topology

NAMESPACE = c.DEFAULT_NAMESPACE

_EXCHANGE_KEYS = {
    c.ANNOUNCE_EXCHANGE: " · ".join(
        f"`{names.agent_announce_key('<id>', verb)}`" for verb in c.AGENT_ANNOUNCE_VERBS
    )
    + " (agents; with several managers each ends in `.<shard>`)",
    c.HEARTBEAT_EXCHANGE: f"`{names.heartbeat_key('<id>')}` (with several managers "
    f"`{names.heartbeat_key('<id>', 0).replace('.0', '.<shard>')}`)",
    c.EVENTS_EXCHANGE: f"`{names.log_key('<id>', '<kind>')}` (the orchestration log) · "
    f"`{names.capability_key('<name>', '<id>')}` (capability announcements) · "
    f"`{names.grant_key('<pool>', '<admission>')}` (grant revocations) · "
    f"`{names.pool_grant_key('<pool>')}` (the pool's active descriptor epoch)",
    c.CONTROL_EXCHANGE: " · ".join(f"`{names.rpc_key(m)}`" for m in c.RPC_METHODS)
    + " (clients' requests to the managers)",
    c.AGENTS_EXCHANGE: "`<id>`: a manager's messages to one agent",
    c.DEAD_LETTER_EXCHANGE: "refused messages with their reason (`x-mesh-reason`), any key",
    c.TASKS_EXCHANGE: "`<id>`: a leased task to one agent · "
    f"`{names.pool_task_key('<pool>')}`: an admitted task to a pool's queue",
}

_QUEUE_ROLES = {
    "dead-letters": "every refused message, with its reason; declared by the manager",
    "manager.announce": "registrations, deregistrations, drain requests and agents' "
    "questions, taken by any manager",
    "manager.heartbeats": "heartbeats, never backlogged, consumed without acks",
    "manager.rpc": "clients' requests, answered on their `reply_to`",
    "manager.shard-<k>.announce": "several managers: a shard's announcements, consumed by its "
    "owner",
    "manager.shard-<k>.heartbeats": "several managers: a shard's heartbeats",
    "manager.shard-<k>.rpc": "several managers: requests one manager forwards to a shard's "
    "owner (default exchange, by queue name)",
    "agent.<id>.control": "the agent's inbox: the managers' messages and its pool's grant feed",
    "agent.<id>.tasks": "leased tasks for one agent; deleted by the agent when it leaves empty",
    "pool.<pool>.tasks": "admitted tasks of one pool, shared by its agents; bounded at the "
    "pool's model slots by the policy `<queue>.bound`, which the manager sets through the "
    "management API",
}


def _arguments(queue: QueueSpec) -> str:
    args = queue.arguments.to_amqp()
    flags = [] if queue.durable else ["not durable"]
    if queue.auto_delete:
        flags.append("auto-delete")
    shown = [f"`{k}: {str(v).lower() if isinstance(v, bool) else v}`" for k, v in args.items()]
    return ", ".join(flags + shown)


def _role(name: str) -> str:
    return _QUEUE_ROLES.get(name.removeprefix(f"{NAMESPACE}."), "")


def _declarations(t: Topology) -> Declarations:
    shard = t.manager_shards(1)
    return t.manager() + shard + t.agent_queues("<id>", 2) + t.pool("<pool>")


def render() -> str:
    """The page as Markdown, for the default namespace."""
    t = Topology(NAMESPACE)
    every = _declarations(t)
    bound_to: dict[str, list[str]] = {}
    for b in every.bindings:
        key = b.routing_key.replace(".0", ".<k>") if ".shard-0." in b.queue else b.routing_key
        bound_to.setdefault(b.queue, []).append(f"`{b.exchange}` `{key}`")
    lines = [
        "# RabbitMQ topology",
        "",
        "Generated from `mesh.topology` by `python -m mesh.topology.reference >"
        " docs/topology.md` (a test keeps it in step). Every name starts with the namespace"
        f" (`{NAMESPACE}` by default, `MESH_NAMESPACE`), so it reads well in the management"
        " UI. The normative rules — who publishes what, with which properties — are in"
        " [protocol.md](protocol.md); each queue's bound and how to upgrade one an older"
        " version declared, in [architecture.md](architecture.md#queues-and-their-bounds).",
        "",
        "## Exchanges",
        "",
        "| exchange | type | routing keys |",
        "|---|---|---|",
    ]
    seen: set[str] = set()
    for exchange in every.exchanges:
        if exchange.name in seen:
            continue
        seen.add(exchange.name)
        suffix = exchange.name.removeprefix(f"{NAMESPACE}.")
        lines.append(f"| `{exchange.name}` | {exchange.type} | {_EXCHANGE_KEYS[suffix]} |")
    lines += [
        "",
        "## Queues",
        "",
        "`<id>` is an agent's ID, `<pool>` a pool's, `<k>` a shard's number (with `--shards`);"
        " an agent's task queue is bounded at twice its total `max_concurrency` (2 shown).",
        "",
        "| queue | what | arguments | bound to |",
        "|---|---|---|---|",
    ]
    for queue in every.queues:
        name = queue.name.replace("shard-0", "shard-<k>")
        bindings = "<br>".join(bound_to.get(queue.name, [])) or "(default exchange)"
        lines.append(f"| `{name}` | {_role(name)} | {_arguments(queue)} | {bindings} |")
    lines += [
        "",
        "Every publish that matters uses publisher confirms, `mandatory` with returns raised"
        " (`PublishUnroutable`), a fresh `message_id` per attempt and a timeout"
        ' (`PublishTimeout` means "the outcome is unknown"). Heartbeats and the events feed'
        " are fire-and-forget: the next heartbeat supersedes the last, and the journal is the"
        " durable copy of the log. Connections are robust: after a broker restart or a cut"
        " connection, channels, queues, bindings and consumers come back.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
