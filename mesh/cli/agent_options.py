"""``mesh agent``'s options, one table like ``mesh manager``'s (:mod:`mesh.cli.options`):
each row names the flag, the environment variable that gives its default, and the field of
:class:`~mesh.agent.settings.AgentSettings` it sets; every field is in the table or in
:data:`NOT_FROM_THE_CLI` with the reason, which a test checks field by field.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh.cli.common import _probe_interval
from mesh.cli.options import Option, add_options, settings_from

if TYPE_CHECKING:
    from mesh.agent.settings import AgentSettings


def _paths(values: list[str]) -> tuple[Path, ...]:
    return tuple(Path(value) for value in values)


def _text_or_none(value: str | None) -> str | None:
    return value or None


AGENT_OPTIONS: tuple[Option, ...] = (
    Option(
        "--id", "AGENT_ID", None,
        "the agent's ID, unique in the namespace (default: its deployment and a random suffix)",
        name="agent_id",
    ),
    Option(
        "--heartbeat-interval", "HEARTBEAT_INTERVAL_S", None,
        "seconds between heartbeats, at least 5", str(c.DEFAULT_HEARTBEAT_INTERVAL_S),
        type=float,
    ),
    Option(
        "--drain-timeout", None, "drain_timeout_s",
        "on SIGTERM or a drain, how long queued work may still run before what is left is "
        "answered AGENT_SHUTDOWN", "60", type=float, metavar="SECONDS",
    ),
    Option(
        "--shared-topology", "MESH_SHARED_TOPOLOGY", "shared_topology",
        "declare the namespace's shared exchanges, or only check that the manager has (for a "
        "broker user made by `mesh broker add-agent`)", "declare", choices=("declare", "check"),
    ),
    Option(
        "--lease-public-key", "MESH_LEASE_PUBLIC_KEY", "lease_public_keys",
        "require an invocation lease signed by this manager key on every granted task (the "
        "manager's --lease-key FILE.pub; repeat for a key rotation)",
        metavar="FILE", action="append", to_setting=_paths,
    ),
    Option(
        "--open-tasks", "MESH_OPEN_TASKS", "open_tasks",
        "also run tasks that carry neither a grant nor a lease the manager issued to this "
        "agent (a mesh without admission and leases; default: refused, NOT_AUTHORIZED)",
        action="store_true",
    ),
    Option(
        "--manager-user", "MESH_MANAGER_USER", "manager_user",
        "take control messages (drain notices, requests to register again, lease notices, "
        "events) only from this broker user, the managers' (default: the user that signed the "
        "acceptance of this agent's registration)", metavar="USER", to_setting=_text_or_none,
    ),
    Option(
        "--liveness-probe", "MESH_LIVENESS_PROBE_S", "liveness_probe_s",
        "probe the broker this often and reconnect when it stops answering; a silent path is "
        "noticed within two intervals (0: off)", "0", type=_probe_interval, metavar="SECONDS",
    ),
    Option(
        "--http-port", "MESH_HTTP_PORT", "http_port",
        "serve /ready, /healthz and /drain on this port (default: off)", type=int,
    ),
    Option(
        "--http-host", "MESH_HTTP_HOST", "http_host",
        "address of the HTTP endpoints", "0.0.0.0",
    ),
)  # fmt: skip

FROM_SHARED_OPTIONS = {"amqp_url": "--amqp-url", "namespace": "--namespace"}
"""Settings every command's connection options set."""

NOT_FROM_THE_CLI: dict[str, str] = {
    "registration_timeout_s": "tuning of the registration's retries",
    "registration_backoff_cap_s": "tuning of the registration's retries",
    "max_registration_attempts": "a sample agent retries until the manager answers",
    "stop_timeout_s": "used by AgentRuntime.stop() when embedded, not by a signal's drain",
    "shutdown_grace_s": "follows the drain: what is still running after it",
    "publish_timeout_s": "tuning; the broker's confirm latency decides it",
    "result_publish_attempts": "tuning of the result publishes",
    "connect_timeout_s": "tuning of the first connection",
    "http_drain_deadline_s": "follows --drain-timeout (its default is derived from it)",
    "self_fence_after_s": "follows the heartbeat interval and the managers' loss rule",
    "lease_notice_wait_s": "a property of the lease path's protocol",
}
"""Settings deliberately not on the command line, each with the reason: embed the runtime
(``run_agent(agent, AgentSettings(...))``) to set them."""


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """Every row of :data:`AGENT_OPTIONS` as an option of ``parser``."""
    add_options(parser, AGENT_OPTIONS)


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """The settings ``args`` (parsed with :func:`add_agent_options`) ask for."""
    from mesh.agent.settings import AgentSettings

    base: Any = AgentSettings(amqp_url=args.amqp_url, namespace=args.namespace)
    return settings_from(base, AGENT_OPTIONS, args)  # type: ignore[no-any-return]
