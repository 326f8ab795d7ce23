"""``mesh``: the command line. Thin by design: parse, build settings, call a ``run_…``.

This is the only place that reads ``MESH_…`` environment variables and the only
place that configures logging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

from mesh import constants as c
from mesh import logs
from mesh.errors import BrokerUnavailable, MeshError, RequestTimeout
from mesh.scaler.base import Scaler
from mesh.wire.models import OrchestrationEvent, Refusal, StatusReply

SCHEMAS_DIR = Path("schemas")


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


# ---- shared helpers -------------------------------------------------------------------------


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command; turn the errors a user can fix into one sentence and an exit code."""
    try:
        return asyncio.run(coro)
    except BrokerUnavailable as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 2
    except RequestTimeout as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 3
    except MeshError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _with_client(args: argparse.Namespace, fn: Callable[[Any], Awaitable[int]]) -> int:
    from mesh.producer import MeshClient

    client = await MeshClient.connect(args.amqp_url, namespace=args.namespace, name="mesh-cli")
    try:
        return await fn(client)
    finally:
        await client.close()


# ---- mesh manager ---------------------------------------------------------------------------


def cmd_manager(args: argparse.Namespace) -> int:
    from mesh.core.pool import PoolSettings
    from mesh.manager.service import ManagerService
    from mesh.manager.settings import ManagerSettings, load_scaling_policies

    async def run() -> int:
        policies = load_scaling_policies(Path(args.scaling)) if args.scaling else ()
        settings = ManagerSettings(
            amqp_url=args.amqp_url,
            namespace=args.namespace,
            journal_path=Path(args.journal),
            manager_id=args.manager_id,
            pool=PoolSettings(scaling=policies),
            ledger_url=args.ledger,
            operator_user=args.operator_user,
        )
        scaler = _build_scaler(args)
        stop = asyncio.Event()
        _stop_on_signals(stop)
        await ManagerService(settings, scaler=scaler).run_until_stopped(stop)
        return 0

    return _run(run())


def _build_scaler(args: argparse.Namespace) -> Scaler | None:
    if args.scaler == "kubernetes":
        from mesh.scaler.kubernetes import KubernetesScaler

        return KubernetesScaler.from_environment(args.k8s_namespace)
    if args.scaler == "local":
        from mesh.scaler.local import LocalProcessScaler, sample_command

        # The broker URL goes through the environment: `ps` would show it on a command line.
        command = sample_command(args.namespace, None, args.agent_heartbeat_interval)
        return LocalProcessScaler(
            command,
            log_dir=Path(args.agent_log_dir),
            env={"MESH_AMQP_URL": args.amqp_url},
            # An agent's default drain (60 s) plus its shutdown grace (30 s), and a margin.
            termination_grace_s=100.0,
        )
    return None


# ---- mesh agent -----------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    from mesh.agent import AgentSettings, run_agent
    from mesh.samples import SAMPLES

    settings = AgentSettings(
        amqp_url=args.amqp_url,
        namespace=args.namespace,
        drain_timeout_s=args.drain_timeout,
        http_host=args.http_host,
        http_port=args.http_port,
    )

    async def run() -> int:
        agent = SAMPLES[args.sample](args.agent_id, heartbeat_interval_s=args.heartbeat_interval)
        stop = asyncio.Event()
        _stop_on_signals(stop)  # SIGTERM drains: no new work, in-flight finishes, then exit
        await run_agent(agent, settings, stop)
        return 0

    return _run(run())


# ---- mesh status ----------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    async def show(client: Any) -> int:
        reply: StatusReply = await client.status(timeout_s=args.timeout)
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_status(reply))
        return 0

    return _run(_with_client(args, show))


def render_status(reply: StatusReply) -> str:
    lines = [
        f"manager {reply.manager_id} · up {reply.uptime_s:.0f} s · {len(reply.agents)} agent(s)",
        "",
        f"{'AGENT':<24} {'DEPLOYMENT':<12} {'STATE':<11} {'IN-FLIGHT':>9}  "
        f"{'HEARTBEAT':<10} CAPABILITIES",
    ]
    for agent in reply.agents:
        hb = "-" if agent.last_heartbeat_age_s is None else f"{agent.last_heartbeat_age_s:.1f}s ago"
        caps = ", ".join(
            f"{cap.name}@{cap.version} ({cap.cost_class}, {cap.in_flight}/{cap.max_concurrency})"
            for cap in agent.capabilities
        )
        lines.append(
            f"{agent.agent_id:<24} {agent.deployment:<12} {agent.state:<11} "
            f"{agent.in_flight:>9}  {hb:<10} {caps}"
        )
    if not reply.agents:
        lines.append("(no agents registered)")
    counters = " ".join(f"{k}={v}" for k, v in reply.counters.items())
    lines += ["", f"counters: {counters or '-'}"]
    return "\n".join(lines)


# ---- mesh drain -----------------------------------------------------------------------------


def cmd_drain(args: argparse.Namespace) -> int:
    async def drain(client: Any) -> int:
        reply = await client.drain(args.agent_id, args.reason)
        if isinstance(reply, Refusal):
            print(f"refused: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{reply.agent_id} is draining; {reply.in_flight} task(s) in flight")
        return 0

    return _run(_with_client(args, drain))


# ---- mesh log -------------------------------------------------------------------------------


def format_event(ev: OrchestrationEvent) -> str:
    when = datetime.fromtimestamp(ev.at).strftime("%H:%M:%S.%f")[:-3]
    seq = "" if ev.seq is None else f"#{ev.seq:<6}"
    move = f"{ev.from_state}→{ev.to_state}" if ev.to_state else ""
    parts = [seq, when, f"{ev.kind:<20}", f"{ev.agent_id or '-':<22}", f"{move:<22}"]
    if ev.capability:
        parts.append(ev.capability)
    if ev.reason:
        parts.append(f"({ev.reason})")
    return " ".join(p for p in parts if p)


def cmd_log(args: argparse.Namespace) -> int:
    if args.follow:
        return _run(_follow_log(args))
    from mesh.manager.journal import SqliteJournal

    path = Path(args.journal)
    if not path.exists():
        print(
            f"mesh: no journal at {path}; run `mesh log --follow` to watch a remote manager, "
            "or pass --journal",
            file=sys.stderr,
        )
        return 1
    journal = SqliteJournal(path)
    try:
        for ev in journal.tail(args.lines, agent_id=args.agent):
            print(format_event(ev))
    finally:
        journal.close()
    return 0


async def _follow_log(args: argparse.Namespace) -> int:
    import uuid

    from mesh.topology import Topology
    from mesh.topology.specs import BindingSpec, Declarations
    from mesh.transport import AmqpTransport
    from mesh.wire import decode

    transport = await AmqpTransport.connect(args.amqp_url, name="mesh-log")
    topology = Topology(namespace=args.namespace)
    queue = f"{args.namespace}.log-tail.{uuid.uuid4().hex[:8]}"
    await transport.declare_reply_queue(queue)
    key = f"{c.RK_LOG}.{args.agent or '*'}.#"
    await transport.declare(
        topology.shared()
        + Declarations(bindings=(BindingSpec(queue, topology.events_exchange, key),))
    )
    stop = asyncio.Event()
    _stop_on_signals(stop)

    async def show(delivery: Any) -> None:
        ev = decode(delivery.body)
        if isinstance(ev, OrchestrationEvent):
            print(format_event(ev), flush=True)

    consumer = await transport.consume(queue, show, no_ack=True)
    print(f"following {topology.events_exchange} ({key}); Ctrl-C to stop", file=sys.stderr)
    try:
        await stop.wait()
    finally:
        await consumer.cancel()
        await transport.close()
    return 0


# ---- mesh explain ---------------------------------------------------------------------------


def cmd_explain(args: argparse.Namespace) -> int:
    async def explain(client: Any) -> int:
        reply = await client.explain(args.admission_id)
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_explain(reply))
        return 0 if reply.found else 1

    return _run(_with_client(args, explain))


def render_explain(reply: Any) -> str:
    if not reply.found:
        return f"no admission {reply.admission_id!r} is known to this manager or its ledger"
    lines = [f"admission {reply.admission_id}"]
    decision = reply.decision
    if decision is not None:
        why = decision.reason.value if decision.reason else ""
        lines.append(f"  decision     {decision.outcome} {why} {decision.detail}".rstrip())
        if decision.grant is not None:
            g = decision.grant
            lines.append(
                f"  grant        pool {g.pool_id} · epoch {g.descriptor_epoch} · "
                f"generation {g.policy_generation} · fence {g.fence}"
            )
    record = reply.eligibility
    if record is not None:
        lines.append(f"  generation   {record.get('active_generation')} (active when decided)")
        for pool in record.get("pools", []):
            rule = pool.get("rule") or "eligible"
            detail = f" — {pool['detail']}" if pool.get("detail") else ""
            lines.append(
                f"  pool {pool.get('pool_id'):<14} epoch {pool.get('descriptor_epoch')}"
                f"/{pool.get('active_epoch')}  {rule}{detail}"
            )
    if reply.reservation is not None:
        r = reply.reservation
        lines.append(f"  reservation  {r['state']} · fence {r['fence']} · pool {r['pool_id']}")
    return "\n".join(lines)


# ---- mesh descriptor ------------------------------------------------------------------------


def cmd_descriptor(args: argparse.Namespace) -> int:
    from mesh.errors import MessageRejected
    from mesh.wire import CapabilityDescriptor, decode_as

    try:
        descriptor = decode_as(Path(args.file).read_bytes(), CapabilityDescriptor)
    except OSError as exc:
        print(f"mesh: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    except MessageRejected as exc:
        print(f"mesh: {args.file} is not a valid descriptor: {exc}", file=sys.stderr)
        return 1

    async def publish(client: Any) -> int:
        reply = await client.publish_descriptor(descriptor)
        if isinstance(reply, Refusal):
            print(f"refused: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{reply.pool_id}: descriptor epoch {reply.descriptor_epoch} is active")
        return 0

    return _run(_with_client(args, publish))


# ---- mesh schemas ---------------------------------------------------------------------------


def cmd_schemas(args: argparse.Namespace) -> int:
    from mesh.wire import schemas

    directory = Path(args.dir)
    if args.action == "export":
        written = schemas.export(directory)
        print(f"wrote {len(written)} schemas to {directory}/")
        return 0
    problems = schemas.drift(directory)
    if problems:
        for problem in problems:
            print(f"schema drift: {problem}", file=sys.stderr)
        print("run `mesh schemas export` and commit the result", file=sys.stderr)
        return 1
    print(f"{len(schemas.generate())} schemas in {directory}/ match the models")
    return 0


# ---- mesh demo ------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from mesh.demo import DemoSettings, run_demo

    settings = DemoSettings(
        amqp_url=args.amqp_url,
        namespace=args.namespace,
        duration_s=args.duration,
        concurrency=args.concurrency,
        producer_only=args.producer_only,
        work_dir=Path(args.work_dir),
    )
    return _run(run_demo(settings))


# ---- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh", description="agent-mesh: a control plane for AI agents over RabbitMQ"
    )
    parser.add_argument(
        "--amqp-url",
        default=_env("MESH_AMQP_URL", c.DEFAULT_AMQP_URL),
        help="broker URL (env MESH_AMQP_URL; default %(default)s)",
    )
    parser.add_argument(
        "--namespace",
        default=_env("MESH_NAMESPACE", c.DEFAULT_NAMESPACE),
        help="prefix of every exchange and queue name (env MESH_NAMESPACE)",
    )
    parser.add_argument("--log-level", default=_env("MESH_LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=_env("MESH_LOG_FORMAT", "json"),
        help="services log JSON lines by default",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    journal_default = _env("MESH_JOURNAL", ".mesh/orchestration.sqlite3")

    p = sub.add_parser("manager", help="run the pool manager")
    p.add_argument("--journal", default=journal_default, help="SQLite orchestration log path")
    p.add_argument("--manager-id", default=_env("MESH_MANAGER_ID", "manager"))
    p.add_argument(
        "--ledger",
        default=_env("MESH_LEDGER_URL", "sqlite:.mesh/ledger.sqlite3"),
        help="reservation ledger: sqlite:<path> or a postgresql:// DSN (env MESH_LEDGER_URL)",
    )
    p.add_argument(
        "--operator-user",
        default=_env("MESH_OPERATOR_USER", "mesh-operator"),
        help="the broker user whose descriptors are accepted (env MESH_OPERATOR_USER)",
    )
    p.add_argument(
        "--scaler",
        choices=("none", "local", "kubernetes"),
        default=_env("MESH_SCALER", "none"),
        help="who runs agent replicas: nobody, processes on this machine, or Kubernetes",
    )
    p.add_argument(
        "--scaling",
        default=os.environ.get("MESH_SCALING_FILE"),
        help="JSON file of scaling policies per deployment (env MESH_SCALING_FILE)",
    )
    p.add_argument(
        "--k8s-namespace",
        default=os.environ.get("MESH_K8S_NAMESPACE"),
        help="Kubernetes namespace of the agent Deployments (default: the manager's own)",
    )
    p.add_argument(
        "--agent-log-dir",
        default=_env("MESH_AGENT_LOG_DIR", ".mesh/agents"),
        help="with --scaler local: where agent processes log",
    )
    p.add_argument(
        "--agent-heartbeat-interval",
        type=float,
        default=c.DEFAULT_HEARTBEAT_INTERVAL_S,
        help="with --scaler local: the agents' heartbeat interval",
    )
    p.set_defaults(func=cmd_manager)

    p = sub.add_parser("agent", help="run a sample agent")
    p.add_argument("sample", choices=("calc", "textstats", "echo"))
    p.add_argument("--id", dest="agent_id", default=os.environ.get("AGENT_ID"))
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_env("HEARTBEAT_INTERVAL_S", str(c.DEFAULT_HEARTBEAT_INTERVAL_S)),
        help="seconds between heartbeats, at least 5 (env HEARTBEAT_INTERVAL_S)",
    )
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument(
        "--http-port",
        type=int,
        default=os.environ.get("MESH_HTTP_PORT") or None,
        help="serve /ready, /healthz and /drain on this port (env MESH_HTTP_PORT; default: off)",
    )
    p.add_argument(
        "--http-host",
        default=_env("MESH_HTTP_HOST", "0.0.0.0"),
        help="address of the HTTP endpoints (env MESH_HTTP_HOST; default %(default)s)",
    )
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("demo", help="run manager, sample agents and a producer on this machine")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of traffic (0: forever)")
    p.add_argument("--concurrency", type=int, default=4, help="tasks in flight at once")
    p.add_argument(
        "--producer-only",
        action="store_true",
        help="only run the producer, against a mesh that is already running",
    )
    p.add_argument("--work-dir", default=".mesh/demo", help="journal and process logs")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("status", help="agents, states, capabilities, in-flight")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("log", help="the orchestration log")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true", help="follow live events via the broker")
    p.add_argument("--agent", help="only this agent")
    p.add_argument("--journal", default=journal_default)
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("drain", help="drain an agent: no new work, in-flight finishes, then exit")
    p.add_argument("agent_id")
    p.add_argument("--reason", default="operator request")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("explain", help="why an admission was decided as it was")
    p.add_argument("admission_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("descriptor", help="operators: publish a pool's capability descriptor")
    p.add_argument("action", choices=("publish",))
    p.add_argument("file", help="a JSON file holding one mesh.capability-descriptor.v1")
    p.set_defaults(func=cmd_descriptor)

    p = sub.add_parser("schemas", help="export or check the JSON Schemas of the wire contract")
    p.add_argument("action", choices=("export", "check"))
    p.add_argument("--dir", default=str(SCHEMAS_DIR))
    p.set_defaults(func=cmd_schemas)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    is_service = args.command in ("manager", "agent")
    logs.configure(args.log_level, json=is_service and args.log_format == "json")
    code: int = args.func(args)
    return code
