"""The long-running commands: ``mesh manager``, ``mesh agent``, ``mesh demo`` and
``mesh conformance``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.cli.agent_options import agent_settings
from mesh.cli.common import _run, _stop_on_signals
from mesh.cli.demo_options import demo_settings
from mesh.cli.manager_options import manager_settings
from mesh.scaler.base import Scaler

if TYPE_CHECKING:
    pass


def _start_tracing(service: str) -> None:
    """OpenTelemetry set up from the ``OTEL_*`` environment for this process, named
    ``service`` unless ``OTEL_SERVICE_NAME`` says otherwise; nothing unless asked
    (:mod:`mesh.tracing.setup`)."""
    from mesh.tracing.setup import configure

    described = configure(service)
    if described is not None:
        logging.getLogger("mesh.tracing").info(described)


def cmd_manager(args: argparse.Namespace) -> int:
    from mesh.manager.service import ManagerService
    from mesh.tracing.setup import MANAGER_SERVICE

    _start_tracing(MANAGER_SERVICE)

    async def run() -> int:
        settings = manager_settings(args)
        scaler = _build_scaler(args)
        stop = asyncio.Event()
        _stop_on_signals(stop)
        await ManagerService(settings, scaler=scaler).run_until_stopped(stop, _tune_gc)
        return 0

    return _run(run())


def _tune_gc() -> None:
    """Once the manager is up: its start-up state out of the collector's sight
    (:mod:`mesh.gc_tuning`)."""
    from mesh.gc_tuning import tune_gc

    logging.getLogger("mesh.manager").info(tune_gc())


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


def cmd_agent(args: argparse.Namespace) -> int:
    from mesh.agent import run_agent
    from mesh.samples import SAMPLES
    from mesh.tracing.setup import agent_service

    settings = agent_settings(args)

    async def run() -> int:
        agent = SAMPLES[args.sample](args.agent_id, heartbeat_interval_s=args.heartbeat_interval)
        _start_tracing(agent_service(agent.agent_id))  # its ID known (maybe made up) by now
        stop = asyncio.Event()
        _stop_on_signals(stop)  # SIGTERM drains: no new work, in-flight finishes, then exit
        await run_agent(agent, settings, stop)
        return 0

    return _run(run())


def cmd_demo(args: argparse.Namespace) -> int:
    from mesh.demo import run_demo
    from mesh.tracing.setup import PRODUCER_SERVICE

    settings = demo_settings(args)
    _start_tracing(PRODUCER_SERVICE)  # the demo's own process is its producer
    return _run(run_demo(settings))


def cmd_conformance(args: argparse.Namespace) -> int:
    from mesh.conformance import CHECK_KEYS, KitSettings
    from mesh.conformance import run as run_kit

    settings = KitSettings(
        agent_cmd=args.agent_cmd,
        amqp_url=args.amqp_url,
        pool=args.pool,
        capability=args.capability,
        payload=args.payload,
        invalid_payload=args.invalid_payload,
        slow_payload=args.slow_payload,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        only=tuple(args.checks),
    )
    unknown = sorted(set(settings.only) - set(CHECK_KEYS))
    if unknown:
        print(f"mesh conformance: no check {', '.join(unknown)}; one of {', '.join(CHECK_KEYS)}")
        return 2
    if settings.work_dir is not None:
        settings.work_dir.mkdir(parents=True, exist_ok=True)

    # The kit's own manager and clients speak only on errors: the output is the checks' lines
    # (a kit manager without the management API warns about it, rightly but beside the point).
    for name in ("mesh", "aio_pika", "aiormq"):
        logging.getLogger(name).setLevel(max(logging.ERROR, logging.getLogger().level))

    async def check() -> int:
        results = await run_kit(settings, lambda line: print(line, flush=True))
        return 0 if results and all(r.passed for r in results) else 1

    return _run(check())
