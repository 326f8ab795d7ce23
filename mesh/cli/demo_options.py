"""``mesh demo``'s options, one table like ``mesh manager``'s (:mod:`mesh.cli.options`): each
row names the flag and the field of :class:`~mesh.demo.DemoSettings` it sets; every field is in
the table or in :data:`NOT_FROM_THE_CLI` with the reason, which a test checks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.cli.options import Option, add_options, settings_from

if TYPE_CHECKING:
    from mesh.demo import DemoSettings


DEMO_OPTIONS: tuple[Option, ...] = (
    Option("--duration", None, "duration_s", "seconds of traffic (0: forever)", "30", type=float),
    Option("--concurrency", None, "concurrency", "tasks in flight at once", "4", type=int),
    Option(
        "--producer-only", None, "producer_only",
        "only run the producer, against a mesh that is already running", action="store_true",
    ),
    Option(
        "--work-dir", None, "work_dir", "journal and process logs", ".mesh/demo", to_setting=Path
    ),
)  # fmt: skip

FROM_SHARED_OPTIONS = {"amqp_url": "--amqp-url", "namespace": "--namespace"}
"""Settings every command's connection options set."""

NOT_FROM_THE_CLI: dict[str, str] = {
    "replicas": "the demo's fleet is fixed: two calc agents, one textstats, one echo",
    "heartbeat_interval_s": "the demo's agents beat every 5 s, so a loss shows within a run",
    "http_port": "the status page is on 8090, or another free port when that one is taken",
}
"""Settings deliberately not on the command line, each with the reason: call
``run_demo(DemoSettings(...))`` to set them."""


def add_demo_options(parser: argparse.ArgumentParser) -> None:
    """Every row of :data:`DEMO_OPTIONS` as an option of ``parser``."""
    add_options(parser, DEMO_OPTIONS)


def demo_settings(args: argparse.Namespace) -> DemoSettings:
    """The settings ``args`` (parsed with :func:`add_demo_options`) ask for."""
    from mesh.demo import DemoSettings

    base: Any = DemoSettings(amqp_url=args.amqp_url, namespace=args.namespace)
    return settings_from(base, DEMO_OPTIONS, args)  # type: ignore[no-any-return]
