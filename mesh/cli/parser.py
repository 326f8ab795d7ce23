"""The parser (one function per command's options) and ``main``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh import logs
from mesh.broker_admin import DEFAULT_MANAGEMENT_URL
from mesh.cli.agent_options import add_agent_options
from mesh.cli.common import (
    DEFAULT_JOURNAL,
    SCHEMAS_DIR,
    _count,
    _env,
    _json_object,
    _page_size,
)
from mesh.cli.demo_options import add_demo_options
from mesh.cli.log import DEFAULT_LOG_LINES, cmd_log
from mesh.cli.manager_options import add_manager_options
from mesh.cli.ops import (
    cmd_admission,
    cmd_broker,
    cmd_descriptor,
    cmd_drain,
    cmd_explain,
    cmd_schemas,
    cmd_status,
    cmd_top,
)
from mesh.cli.services import cmd_agent, cmd_conformance, cmd_demo, cmd_manager
from mesh.wire.status import MAX_STATUS_AGENTS

if TYPE_CHECKING:
    pass


Command = Callable[..., argparse.ArgumentParser]
"""Adds a command's parser, with the connection and logging options every command takes."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mesh", description="agent-mesh: a control plane for AI agents over RabbitMQ"
    )
    # The connection and logging options are accepted before the command and after it
    # (``mesh --amqp-url U status`` and ``mesh status --amqp-url U``): each command's parser
    # has them too, defaulting to nothing so the one before the command stands.
    shared = argparse.ArgumentParser(add_help=False)
    for target, default_of in ((parser, lambda d: d), (shared, lambda d: argparse.SUPPRESS)):
        target.add_argument(
            "--amqp-url",
            default=default_of(_env("MESH_AMQP_URL", c.DEFAULT_AMQP_URL)),
            help=f"broker URL (env MESH_AMQP_URL; default {c.DEFAULT_AMQP_URL})",
        )
        target.add_argument(
            "--namespace",
            default=default_of(_env("MESH_NAMESPACE", c.DEFAULT_NAMESPACE)),
            help="prefix of every exchange and queue name (env MESH_NAMESPACE)",
        )
        target.add_argument(
            "--log-level",
            default=default_of(_env("MESH_LOG_LEVEL", "INFO")),
            choices=("DEBUG", "INFO", "WARNING", "ERROR"),
            type=str.upper,
            help="what the logs say, from DEBUG to ERROR (env MESH_LOG_LEVEL, default INFO)",
        )
        target.add_argument(
            "--log-format",
            choices=("json", "text"),
            default=default_of(_env("MESH_LOG_FORMAT", "json")),
            help="services log JSON lines by default",
        )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return add_parser(name, parents=[shared], **kwargs)

    _manager_command(command)
    _agent_command(command)
    _demo_command(command)
    _conformance_command(command)
    _status_command(command)
    _log_command(command)
    _top_command(command)
    _drain_command(command)
    _explain_command(command)
    _descriptor_command(command)
    _admission_command(command)
    _broker_command(command)
    _schemas_command(command)
    return parser


def _manager_command(command: Command) -> None:
    p = command("manager", help="run the pool manager")
    add_manager_options(p)  # one table: flag, environment variable, setting
    p.set_defaults(func=cmd_manager)


def _agent_command(command: Command) -> None:
    p = command("agent", help="run a sample agent")
    p.add_argument("sample", choices=("calc", "textstats", "echo"), help="which sample agent")
    add_agent_options(p)  # one table: flag, environment variable, setting
    p.set_defaults(func=cmd_agent)


def _demo_command(command: Command) -> None:
    p = command("demo", help="run manager, sample agents and a producer on this machine")
    add_demo_options(p)  # one table: flag and setting
    p.set_defaults(func=cmd_demo)


def _conformance_command(command: Command) -> None:
    p = command(
        "conformance",
        help="check an agent command against the protocol (docs/protocol.md)",
        description="Start a manager in a namespace of its own, run the agent command (told "
        "MESH_AMQP_URL, MESH_NAMESPACE, AGENT_ID, MESH_POOL and HEARTBEAT_INTERVAL_S in its "
        "environment) and check it against the protocol: one line per check, then a summary; "
        "exit 1 if any check failed. The defaults fit `mesh agent echo`.",
    )
    p.add_argument(
        "--agent-cmd",
        required=True,
        help='the command that runs one agent, e.g. "python -m mesh agent echo" or '
        '"node examples/node-agent/agent.js"',
    )
    p.add_argument("--pool", default="echo", help="the pool it is told to join (MESH_POOL)")
    p.add_argument(
        "--capability", default="test.echo", help="the capability the checks send tasks to"
    )
    p.add_argument(
        "--payload",
        type=_json_object,
        default={"message": "conformance"},
        help="a valid task payload (JSON object)",
    )
    p.add_argument(
        "--invalid-payload",
        type=_json_object,
        default={"message": 42},
        help="a payload its input schema refuses (JSON object)",
    )
    p.add_argument(
        "--slow-payload",
        type=_json_object,
        default={"message": "slow", "sleep_ms": 1500},
        help="a valid payload its handler takes a second or more on (the drain checks)",
    )
    p.add_argument(
        "--work-dir",
        default="",
        help="keep the kit's journal, ledger and the agent's logs here (default: a "
        "temporary directory, removed)",
    )
    p.add_argument(
        "--check",
        dest="checks",
        action="append",
        default=[],
        metavar="KEY",
        # The keys of mesh.conformance.CHECKS, in order (not imported here: it would load the
        # manager into every `mesh` command; tests/unit/test_cli_help.py keeps them equal).
        help="run only this check (repeatable; the registration check always runs): "
        "register, heartbeats, lease-path, input-schema, admission-path, trace-context, grants, "
        "epochs, reregister, hand-over, signed, pool-queue, forged-heartbeat, restart, fence, "
        "drain, sigterm, short-interval",
    )
    p.set_defaults(func=cmd_conformance)


def _status_command(command: Command) -> None:
    p = command(
        "status",
        help="the fleet by pool, state and capability; agent rows with --agents",
        description="The fleet summarised by pool and lifecycle state, load by capability, "
        "what each described pool can grant, and the manager's counters. The summary is the "
        "manager's running tally, so it answers at once at any fleet size; agent rows come "
        "a page at a time (--agents, --offset, --limit), in agent-ID order.",
    )
    p.add_argument("--json", action="store_true", help="the manager's status reply as JSON")
    p.add_argument("--agents", action="store_true", help="also list agents, one page of rows")
    p.add_argument("--offset", type=_count, default=0, metavar="N", help="first row (default 0)")
    p.add_argument(
        "--limit",
        type=_page_size,
        default=100,
        metavar="N",
        help=f"rows a page, at most {MAX_STATUS_AGENTS:,} (default 100)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the manager's answer (default 5)",
    )
    p.set_defaults(func=cmd_status)


def _log_command(command: Command) -> None:
    p = command("log", help="the orchestration log, filtered")
    p.add_argument(
        "-n",
        "--limit",
        "--lines",
        dest="limit",
        type=_count,
        default=None,
        help=f"the newest N matching entries (default {DEFAULT_LOG_LINES}; 0: all); "
        "with -f: stop after N",
    )
    p.add_argument("-f", "--follow", action="store_true", help="follow live events via the broker")
    p.add_argument("--agent", help="only this agent ('-': entries about no agent)")
    p.add_argument("--capability", help="only entries about this capability")
    p.add_argument(
        "--kind",
        dest="kinds",
        action="append",
        default=[],
        help="only this kind (repeatable): registered, ready, acquired, lost, admission, …",
    )
    p.add_argument(
        "--since", help="from this time: 10m, 2h, 30s ago, or ISO-8601 (2026-11-30T13:05)"
    )
    p.add_argument("--until", help="before this time (same forms as --since)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--journal",
        default=_env("MESH_JOURNAL", DEFAULT_JOURNAL),
        help="the manager's SQLite orchestration log",
    )
    p.set_defaults(func=cmd_log)


def _top_command(command: Command) -> None:
    p = command("top", help="a live view: pools, agents, capacity, queues, refusals")
    p.add_argument(
        "--url",
        default=_env("MESH_MANAGER_URL", "http://127.0.0.1:8090/"),
        help="the manager's HTTP address (mesh manager --http-port; env MESH_MANAGER_URL; "
        "default %(default)s)",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=cmd_top)


def _drain_command(command: Command) -> None:
    p = command("drain", help="drain an agent: no new work, in-flight finishes, then exit")
    p.add_argument("agent_id", help="the agent to drain")
    p.add_argument(
        "--reason",
        default="operator request",
        help="why, for the journal and the agent's log (default: operator request)",
    )
    p.set_defaults(func=cmd_drain)


def _explain_command(command: Command) -> None:
    p = command("explain", help="why an admission was decided as it was")
    p.add_argument("admission_id", help="the admission ID a decision or log entry names")
    p.add_argument("--json", action="store_true", help="the explain reply as JSON")
    p.set_defaults(func=cmd_explain)


def _descriptor_command(command: Command) -> None:
    p = command("descriptor", help="operators: publish or shadow a pool's descriptor")
    p.add_argument(
        "action",
        choices=("publish", "shadow", "unshadow"),
        help="make it the pool's active descriptor, evaluate it beside the active one, or "
        "stop evaluating it",
    )
    p.add_argument(
        "file",
        help="publish, shadow: a JSON file holding one mesh.capability-descriptor.v1; "
        "unshadow: the pool ID",
    )
    p.set_defaults(func=cmd_descriptor)


def _admission_command(command: Command) -> None:
    p = command("admission", help="operators: revoke an admission for security")
    p.add_argument("action", choices=("revoke",), help="take the grant back")
    p.add_argument("admission_id", help="the admission whose grant to revoke")
    p.add_argument("--reason", required=True, help="why (journaled, and shown to the agent)")
    p.set_defaults(func=cmd_admission)


def _broker_command(command: Command) -> None:
    p = command("broker", help="operators: broker users of agents (management API)")
    p.add_argument(
        "action",
        choices=("add-agent", "add-pool-agents", "remove-agent"),
        help="add-agent: create one agent's broker user with its permissions; "
        "add-pool-agents: one user for every agent of the --pool(s) (a Deployment's pods, "
        "whose IDs are not known in advance); remove-agent: delete a broker user",
    )
    p.add_argument(
        "agent_id",
        metavar="NAME",
        help="the agent's ID, which is also its broker user's name (add-pool-agents: the "
        "user's name)",
    )
    p.add_argument(
        "--pool",
        action="append",
        help="the pool (Deployment) whose task queue its agents read; add-pool-agents takes "
        "it more than once",
    )
    p.add_argument(
        "--password-env",
        metavar="VAR",
        help="take the password from this environment variable (default: a new random one, "
        "printed once in the user's AMQP URL)",
    )
    p.add_argument(
        "--management-url",
        default=_env("MESH_MANAGEMENT_URL", DEFAULT_MANAGEMENT_URL),
        help="RabbitMQ management API with an administrator's credentials "
        "(env MESH_MANAGEMENT_URL; default http://guest:***@127.0.0.1:15672)",
    )
    p.set_defaults(func=cmd_broker)


def _schemas_command(command: Command) -> None:
    p = command("schemas", help="export or check the JSON Schemas of the wire contract")
    p.add_argument(
        "action",
        choices=("export", "check"),
        help="write the schemas, or check the ones in --dir match the code",
    )
    p.add_argument(
        "--dir", default=str(SCHEMAS_DIR), help=f"where they are (default {SCHEMAS_DIR})"
    )
    p.set_defaults(func=cmd_schemas)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    is_service = args.command in ("manager", "agent")
    logs.configure(args.log_level, json=is_service and args.log_format == "json")
    code: int = args.func(args)
    return code
