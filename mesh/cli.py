"""``mesh``: the command line. Thin by design: parse, build settings, call a ``run_…``.

This is the only place that reads ``MESH_…`` environment variables and the only
place that configures logging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from datetime import time as dt_time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh import logs
from mesh.broker_admin import DEFAULT_MANAGEMENT_URL
from mesh.errors import BrokerUnavailable, MeshError, MessageRejected, RequestTimeout
from mesh.render import format_event, render_explain, render_status
from mesh.scaler.base import Scaler
from mesh.topology import names
from mesh.transport.addresses import first_url
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import MAX_STATUS_AGENTS, Refusal, StatusReply

if TYPE_CHECKING:
    from mesh.manager.admission import AdmissionPolicy
    from mesh.manager.journal import SqliteJournal

SCHEMAS_DIR = Path("schemas")
DEFAULT_JOURNAL = ".mesh/orchestration.sqlite3"  # mesh manager's, unless --journal says
DEMO_JOURNAL = Path(".mesh/demo/orchestration.sqlite3")  # mesh demo's manager's


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _page_size(text: str) -> int:
    """An argparse type: agent rows a status page, 1 to MAX_STATUS_AGENTS."""
    value = _count(text)
    if not 1 <= value <= MAX_STATUS_AGENTS:
        raise argparse.ArgumentTypeError(f"{text!r}: from 1 to {MAX_STATUS_AGENTS:,} rows a page")
    return value


def _thresholds(text: str) -> tuple[float, float, float]:
    """An argparse type: three utilisation fractions, ascending, in (0, 1]: ``0.7,0.85,0.95``."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not three numbers") from None
    if len(values) != 3 or not all(0 < v <= 1 for v in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: need three ascending fractions in (0, 1], e.g. 0.7,0.85,0.95"
        )
    low, mid, high = values
    return low, mid, high


def _probe_interval(text: str) -> float | None:
    """An argparse type: seconds between broker liveness probes; 0 (or empty) is off."""
    try:
        seconds = float(text) if text.strip() else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: say a number of seconds") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return seconds or None


def _add_liveness_probe(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--liveness-probe",
        type=_probe_interval,
        default=_env("MESH_LIVENESS_PROBE_S", "0"),
        metavar="SECONDS",
        help="probe the broker this often and reconnect when it stops answering; a silent "
        "path is noticed within two intervals (env MESH_LIVENESS_PROBE_S, default 0: off)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: say on or off")
    return text == "on"


def _admission_policy(args: argparse.Namespace) -> AdmissionPolicy:
    """The manager's admission policy with the shedding knobs from the command line."""
    from mesh.core.pressure import PressurePolicy
    from mesh.manager.admission import AdmissionPolicy

    return AdmissionPolicy(
        pressure=PressurePolicy(
            enabled=args.shedding,
            thresholds=args.shed_thresholds,
            queue_age_s=args.shed_queue_age,
            hysteresis=args.shed_hysteresis,
            min_dwell_s=args.shed_min_dwell,
            low_priority=args.low_priority,
            evict=args.eviction,
        ),
        lease_ttl_s=args.lease_ttl,
    )


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


async def _with_client(
    args: argparse.Namespace, fn: Callable[[Any], Awaitable[int]], *, read_only: bool = False
) -> int:
    """Run ``fn`` with a client. ``read_only``: a command that only asks (status, explain)
    declares nothing on the broker; a namespace no manager has set up is said in one
    sentence, with the exit code of a manager that does not answer (3)."""
    from mesh.errors import TopologyMissing
    from mesh.producer import MeshClient

    try:
        client = await MeshClient.connect(
            args.amqp_url, namespace=args.namespace, name="mesh-cli", declare=not read_only
        )
    except TopologyMissing:
        print(
            f"mesh: no manager has set up namespace {args.namespace!r} on this broker (its "
            "exchanges do not exist): is `mesh manager` running, and is --namespace right?",
            file=sys.stderr,
        )
        return 3
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
            agent_identity=args.agent_identity,
            lease_key_file=Path(args.lease_key) if args.lease_key else None,
            liveness_probe_s=args.liveness_probe,
            http_port=None if args.http_port < 0 else args.http_port,
            http_host=args.http_host,
            management_url=args.management_url or None,
            admission=_admission_policy(args),
            admission_capacity=args.admission_capacity,
            ledger_schema=args.ledger_schema,
            shard_count=args.shards,
            shard_lease_s=args.shard_lease,
        )
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
        liveness_probe_s=args.liveness_probe,
        shared_topology=args.shared_topology,
        lease_public_keys=tuple(Path(path) for path in args.lease_public_key),
        open_tasks=args.open_tasks,
        manager_user=args.manager_user,
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
        reply: StatusReply = await client.status(
            timeout_s=args.timeout,
            agents_offset=args.offset,
            agents_limit=args.limit if args.agents else 0,
        )
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_status(reply))
        return 0

    return _run(_with_client(args, show, read_only=True))


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

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_CLOCK_TIME = re.compile(r"\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?")


def parse_duration(text: str) -> float:
    """``30s``, ``10m``, ``2h``, ``1d``, ``1w``, ``250ms`` or a sum like ``1h30m`` → seconds.

    Raises :class:`ValueError` for anything else (a bare number has no unit: ambiguous).
    """
    compact = text.strip().lower()
    parts = _DURATION_PART.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"{text!r} is not a duration (like 30s, 10m, 2h, 1d, 1h30m)")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def parse_when(text: str, *, now: float) -> float:
    """A point in time as Unix seconds: a duration ago (``10m`` = ten minutes before
    ``now``), an ISO-8601 timestamp (``2026-11-30T13:05:00Z``, ``2026-11-30 13:05``,
    ``2026-11-30``) or a clock time today (``13:05``, ``13:05:30``). Without an offset,
    timestamps are local time, as ``mesh log`` prints them. Raises :class:`ValueError`."""
    stripped = text.strip()
    with contextlib.suppress(ValueError):
        return now - parse_duration(stripped)
    try:
        if _CLOCK_TIME.fullmatch(stripped):
            today = datetime.fromtimestamp(now).date()
            moment = datetime.combine(today, dt_time.fromisoformat(stripped.zfill(5)))
        else:
            moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (30s, 10m, 2h, 1d) "
            "nor an ISO-8601 timestamp (2026-11-30T13:05:00Z, 13:05)"
        ) from None
    return moment.timestamp()  # a naive datetime is taken as local time


@dataclass(frozen=True, slots=True)
class LogFilter:
    """What ``mesh log`` shows: every filter given must match. ``agent_id=""`` is the entries
    about no agent (``-`` on the command line and in routing keys)."""

    agent_id: str | None = None
    capability: str | None = None
    kinds: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None

    def matches(self, ev: OrchestrationEvent) -> bool:
        """The journal query's ``WHERE``, for events from the live feed."""
        return (
            (self.agent_id is None or ev.agent_id == self.agent_id)
            and (self.capability is None or ev.capability == self.capability)
            and (not self.kinds or ev.kind in self.kinds)
            and (self.since is None or ev.at >= self.since)
            and (self.until is None or ev.at < self.until)
        )

    def binding_keys(self) -> tuple[str, ...]:
        """The narrowest bindings on the events exchange: ``log.<agent>.<kind>``
        (:func:`mesh.topology.names.log_key`) carries the agent and the kind; capability
        and time are filtered by :meth:`matches`, and so is a value that is not one
        routing-key word (it would bind something else)."""
        agent = self.agent_id if self.agent_id is None or _one_word(self.agent_id) else None
        kinds = self.kinds if all(map(_one_word, self.kinds)) else ()
        if agent is None:
            if not kinds:
                return (f"{c.RK_LOG}.#",)
            return tuple(f"{c.RK_LOG}.*.{kind}" for kind in kinds)
        if not kinds:
            return (f"{c.RK_LOG}.{agent or '-'}.#",)
        return tuple(names.log_key(agent, kind) for kind in kinds)

    def query(self, journal: SqliteJournal, limit: int | None) -> list[OrchestrationEvent]:
        return journal.query(
            agent_id=self.agent_id,
            capability=self.capability,
            kinds=self.kinds,
            since=self.since,
            until=self.until,
            limit=limit,
        )


def _one_word(value: str) -> bool:
    """Whether ``value`` is one routing-key word ('' is the "no agent" word ``-``)."""
    return not any(ch in value for ch in ".*#")


def log_filter(args: argparse.Namespace, now: float) -> LogFilter:
    """The filter the ``mesh log`` flags describe; :class:`ValueError` names the bad flag."""
    since = until = None
    if args.since is not None:
        try:
            since = parse_when(args.since, now=now)
        except ValueError as exc:
            raise ValueError(f"--since: {exc}") from None
    if args.until is not None:
        try:
            until = parse_when(args.until, now=now)
        except ValueError as exc:
            raise ValueError(f"--until: {exc}") from None
    if since is not None and until is not None and since >= until:
        raise ValueError(f"--since {args.since} is not before --until {args.until}")
    agent = args.agent
    return LogFilter(
        agent_id="" if agent == "-" else agent,
        capability=args.capability,
        kinds=tuple(dict.fromkeys(args.kinds)),
        since=since,
        until=until,
    )


def _print_event(ev: OrchestrationEvent, as_json: bool) -> None:
    print(ev.model_dump_json() if as_json else format_event(ev), flush=True)


DEFAULT_LOG_LINES = 50


def cmd_log(args: argparse.Namespace) -> int:
    try:
        flt = log_filter(args, time.time())
    except ValueError as exc:
        print(f"mesh log: {exc}", file=sys.stderr)
        return 2
    if args.follow:
        if flt.until is not None and flt.until <= time.time():
            print("mesh log: --until is already past: nothing live to follow", file=sys.stderr)
            return 2
        return _run(_follow_log(args, flt))
    from mesh.manager.journal import SqliteJournal

    path = Path(args.journal)
    if not path.exists() and path == Path(DEFAULT_JOURNAL) and DEMO_JOURNAL.exists():
        # Nothing at the default place, but `mesh demo` has run (or runs) here: read its log.
        print(f"mesh log: reading mesh demo's journal, {DEMO_JOURNAL}", file=sys.stderr)
        path = DEMO_JOURNAL
    if not path.exists():
        print(
            f"mesh: no journal at {path}; run `mesh log --follow` to watch a remote manager, "
            "or pass --journal",
            file=sys.stderr,
        )
        return 1
    limit = DEFAULT_LOG_LINES if args.limit is None else args.limit or None
    try:
        journal = SqliteJournal(path)
        try:
            events = flt.query(journal, limit)
            never = [] if events else sorted(set(flt.kinds) - journal.kinds_present(flt.kinds))
        finally:
            journal.close()
    except MeshError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    if never:  # a misspelt kind matches nothing, silently: say so
        print(
            f"mesh log: the journal holds no entry of kind {', '.join(map(repr, never))} "
            "(kinds are words like registered, ready, lost, admission, pressure_stage: "
            "docs/lifecycle.md and `mesh log` without --kind show them)",
            file=sys.stderr,
        )
        return 1
    for ev in events:
        _print_event(ev, args.json)
    return 0


async def _follow_log(args: argparse.Namespace, flt: LogFilter) -> int:
    import uuid

    from mesh.topology import Topology
    from mesh.topology.specs import BindingSpec, Declarations
    from mesh.transport import AmqpTransport
    from mesh.wire import decode

    transport = await AmqpTransport.connect(args.amqp_url, name="mesh-log")
    topology = Topology(namespace=args.namespace)
    queue = f"{args.namespace}.log-tail.{uuid.uuid4().hex[:8]}"
    await transport.declare_reply_queue(queue)
    keys = flt.binding_keys()
    bindings = tuple(BindingSpec(queue, topology.events_exchange, key) for key in keys)
    await transport.declare(topology.shared() + Declarations(bindings=bindings))
    stop = asyncio.Event()
    _stop_on_signals(stop)
    if flt.until is not None:
        asyncio.get_running_loop().call_later(flt.until - time.time(), stop.set)
    shown = 0

    async def show(delivery: Any) -> None:
        nonlocal shown
        try:
            ev = decode(delivery.body)
        except MessageRejected as exc:  # e.g. a kind a newer manager emits: say so, go on
            print(f"mesh log: an event this version cannot read: {exc}", file=sys.stderr)
            return
        if stop.is_set() or not isinstance(ev, OrchestrationEvent) or not flt.matches(ev):
            return
        _print_event(ev, args.json)
        shown += 1
        if args.limit and shown >= args.limit:
            stop.set()

    consumer = await transport.consume(queue, show, no_ack=True)
    note = ""
    if not flt.kinds or "admission" in flt.kinds:
        note = " (admissions appear live only when refused or deferred)"
    print(
        f"following {topology.events_exchange} ({', '.join(keys)}){note}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await consumer.cancel()
        await transport.close()
    return 0


# ---- mesh top -------------------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    from mesh.top import run_top

    try:
        return run_top(args.url, interval_s=args.interval, once=args.once)
    except KeyboardInterrupt:
        return 0


# ---- mesh explain ---------------------------------------------------------------------------


def cmd_explain(args: argparse.Namespace) -> int:
    async def explain(client: Any) -> int:
        reply = await client.explain(args.admission_id)
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_explain(reply, now=time.time()))
        return 0 if reply.found else 1

    return _run(_with_client(args, explain, read_only=True))


# ---- mesh descriptor ------------------------------------------------------------------------


def cmd_descriptor(args: argparse.Namespace) -> int:
    from mesh.wire import CapabilityDescriptor, decode_as

    descriptor = None
    if args.action != "unshadow":
        try:
            descriptor = decode_as(Path(args.file).read_bytes(), CapabilityDescriptor)
        except OSError as exc:
            print(f"mesh: cannot read {args.file}: {exc}", file=sys.stderr)
            return 1
        except MessageRejected as exc:
            print(f"mesh: {args.file} is not a valid descriptor: {exc}", file=sys.stderr)
            return 1

    async def send(client: Any) -> int:
        if args.action == "publish":
            reply = await client.publish_descriptor(descriptor)
            done = "is active"
        elif args.action == "shadow" and descriptor is not None:
            reply = await client.shadow_descriptor(descriptor.pool_id, descriptor)
            done = "is evaluated in shadow (recorded with every decision, not enforced)"
        else:
            reply = await client.shadow_descriptor(args.file, None)
            done = "routes alone: no shadow"
        if isinstance(reply, Refusal):
            print(f"refused: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{reply.pool_id}: descriptor epoch {reply.descriptor_epoch} {done}")
        return 0

    return _run(_with_client(args, send))


# ---- mesh admission -------------------------------------------------------------------------


def cmd_admission(args: argparse.Namespace) -> int:
    async def revoke(client: Any) -> int:
        reply = await client.revoke_admission(args.admission_id, args.reason)
        if not reply.released:
            print(f"not revoked: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{args.admission_id}: revoked; its attempt is cancelled and its result refused")
        return 0

    return _run(_with_client(args, revoke))


# ---- mesh broker ----------------------------------------------------------------------------


def cmd_broker(args: argparse.Namespace) -> int:
    from mesh.broker_admin import BrokerAdmin, BrokerAdminError

    vhost = urllib.parse.unquote(urllib.parse.urlsplit(first_url(args.amqp_url)).path[1:]) or "/"
    pools = list(dict.fromkeys(args.pool or []))
    try:
        admin = BrokerAdmin(args.management_url, vhost=vhost)
        if args.action == "remove-agent":
            if admin.remove_agent(args.agent_id):
                print(f"{args.agent_id}: broker user deleted; its connections are closed")
            else:
                print(f"{args.agent_id}: no such broker user")
            return 0
        if args.action == "add-agent" and len(pools) != 1:
            print("mesh: broker add-agent needs one --pool POOL", file=sys.stderr)
            return 2
        if not pools:
            print("mesh: broker add-pool-agents needs --pool POOL (one or more)", file=sys.stderr)
            return 2
        password, generated = os.environ.get(args.password_env or "", ""), False
        if args.password_env and not password:
            print(f"mesh: ${args.password_env} is empty or unset", file=sys.stderr)
            return 2
        if not password:
            password, generated = secrets.token_urlsafe(24), True
        if args.action == "add-agent":
            permissions = admin.add_agent(
                args.agent_id, password, namespace=args.namespace, pool_id=pools[0]
            )
            print(f"{args.agent_id}: broker user with its own permissions on vhost {vhost!r}")
        else:
            permissions = admin.add_pool_agents(
                args.agent_id, password, namespace=args.namespace, pool_ids=pools
            )
            print(
                f"{args.agent_id}: broker user shared by the agents of {', '.join(pools)} on "
                f"vhost {vhost!r} (they may speak for one another, never for the managers)"
            )
    except BrokerAdminError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    print(f"  configure  {permissions.configure}")
    print(f"  write      {permissions.write}")
    print(f"  read       {permissions.read}")
    for topic in permissions.topics:
        print(f"  topic      {topic.exchange}: write {topic.write}")
    if generated:
        parts = urllib.parse.urlsplit(first_url(args.amqp_url))
        netloc = f"{urllib.parse.quote(args.agent_id)}:{password}@{parts.hostname}"
        netloc += f":{parts.port}" if parts.port else ""
        print(
            "  its AMQP URL (shown once; pass it as MESH_AMQP_URL with MESH_SHARED_TOPOLOGY=check"
            " and MESH_MANAGER_USER=<the managers' broker user>):"
        )
        print(f"  {urllib.parse.urlunsplit(parts._replace(netloc=netloc))}")
    return 0


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


def _json_object(text: str) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return value


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


# ---- parser ---------------------------------------------------------------------------------


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

    journal_default = _env("MESH_JOURNAL", DEFAULT_JOURNAL)

    p = command("manager", help="run the pool manager")
    p.add_argument("--journal", default=journal_default, help="SQLite orchestration log path")
    p.add_argument(
        "--manager-id",
        default=_env("MESH_MANAGER_ID", "manager"),
        help="this manager's name in the journal, status and metrics (env MESH_MANAGER_ID)",
    )
    p.add_argument(
        "--ledger",
        default=_env("MESH_LEDGER_URL", "sqlite:.mesh/ledger.sqlite3"),
        help="reservation ledger: sqlite:<path> or a postgresql:// DSN (env MESH_LEDGER_URL)",
    )
    p.add_argument(
        "--operator-user",
        default=_env("MESH_OPERATOR_USER", "mesh-operator"),
        help="the operator's broker user: the only one whose descriptors, shadows, "
        "revocations and drains are accepted (env MESH_OPERATOR_USER)",
    )
    _add_liveness_probe(p)
    p.add_argument(
        "--admission-capacity",
        choices=("live", "descriptor"),
        default=_env("MESH_ADMISSION_CAPACITY", "live"),
        help="live: a pool admits at most what its live agents can run and its descriptor "
        "allows (no live agent, no grant: NO_LIVE_AGENT; with --shards each pool's owner "
        "shares its figures through the ledger); descriptor: the descriptor alone, for "
        "several managers on one PostgreSQL ledger without --shards "
        "(env MESH_ADMISSION_CAPACITY, default live)",
    )
    p.add_argument(
        "--ledger-schema",
        default=_env("MESH_LEDGER_SCHEMA", "mesh_ledger"),
        metavar="NAME",
        help="PostgreSQL ledgers: the schema of the ledger and the shard leases, so several "
        "namespaces can share one database (env MESH_LEDGER_SCHEMA, default mesh_ledger)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=int(_env("MESH_SHARDS", "0")) or None,
        metavar="N",
        help="several managers: split the registry into N shards, each owned by one manager "
        "at a time through a lease in the PostgreSQL ledger's database; every manager of a "
        "namespace uses the same N (env MESH_SHARDS; default: no shards, one manager)",
    )
    p.add_argument(
        "--shard-lease",
        type=_positive_seconds,
        default=_env("MESH_SHARD_LEASE_S", "10"),
        metavar="SECONDS",
        help="how long a shard lease lasts unrenewed; renewed every third of it "
        "(env MESH_SHARD_LEASE_S, default 10)",
    )
    p.add_argument(
        "--agent-identity",
        type=_on_off,
        default=_env("MESH_AGENT_IDENTITY", "off"),
        metavar="on|off",
        help="on: each agent has a broker user named as the agent, and a registration or "
        "heartbeat counts only when published by the agent it names (RabbitMQ validates "
        "user_id); off: agents may share one user (env MESH_AGENT_IDENTITY, default off)",
    )
    p.add_argument(
        "--lease-key",
        metavar="FILE",
        default=_env("MESH_LEASE_KEY", ""),
        help="sign an invocation lease into every grant with this Ed25519 key, created (with "
        "FILE.pub for agents and tools) if absent (env MESH_LEASE_KEY; default: no leases)",
    )
    p.add_argument(
        "--lease-ttl",
        type=_positive_seconds,
        default=_env("MESH_LEASE_TTL_S", "") or None,
        metavar="SECONDS",
        help="a lease expires with its grant, or this long after issue if sooner "
        "(env MESH_LEASE_TTL_S)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=int(_env("MESH_HTTP_PORT", "8090")),
        help="serve the status page, /api/status and /metrics here; 0 any free port, -1 off "
        "(env MESH_HTTP_PORT, default 8090)",
    )
    p.add_argument(
        "--http-host", default=_env("MESH_HTTP_HOST", "0.0.0.0"), help="address to serve on"
    )
    p.add_argument(
        "--management-url",
        default=os.environ.get("MESH_MANAGEMENT_URL", ""),
        help="RabbitMQ management API (http://user:pass@host:15672) for queue depths on the "
        "status page and in /metrics (env MESH_MANAGEMENT_URL; off when empty)",
    )
    shed = p.add_argument_group(
        "load shedding", "how an overloaded pool degrades (docs/admission.md, Backpressure)"
    )
    shed.add_argument(
        "--shedding",
        type=_on_off,
        default=_env("MESH_SHEDDING", "on"),
        metavar="on|off",
        help="staged shedding, fair shares and drain-rate retry times; off: capacity alone "
        "decides and refusals say retry in 1 s (env MESH_SHEDDING, default on)",
    )
    shed.add_argument(
        "--shed-thresholds",
        type=_thresholds,
        default=_env("MESH_SHED_THRESHOLDS", "0.7,0.85,0.95"),
        metavar="A,B,C",
        help="slot utilisation at which speculative work is shed, batch paused and tenants "
        "held to fair shares (env MESH_SHED_THRESHOLDS, default 0.7,0.85,0.95)",
    )
    shed.add_argument(
        "--shed-queue-age",
        type=float,
        default=_env("MESH_SHED_QUEUE_AGE_S", "5"),
        metavar="SECONDS",
        help="a pool whose oldest queued task waited longer goes one stage up "
        "(env MESH_SHED_QUEUE_AGE_S, default 5)",
    )
    shed.add_argument(
        "--shed-hysteresis",
        type=float,
        default=_env("MESH_SHED_HYSTERESIS", "0.1"),
        metavar="FRACTION",
        help="a stage steps down only below its threshold less this share of the pool's "
        "slots (env MESH_SHED_HYSTERESIS, default 0.1)",
    )
    shed.add_argument(
        "--shed-min-dwell",
        type=float,
        default=_env("MESH_SHED_MIN_DWELL_S", "2"),
        metavar="SECONDS",
        help="a pool stays in a stage at least this long, and steps down only after this "
        "long below the lowered threshold (a broker alarm acts at once; env "
        "MESH_SHED_MIN_DWELL_S, default 2)",
    )
    shed.add_argument(
        "--low-priority",
        type=_count,
        choices=range(10),
        default=os.environ.get("MESH_LOW_PRIORITY") or None,
        metavar="0-9",
        help="batch work at or below this priority is fan-out, shed with speculative work "
        "(env MESH_LOW_PRIORITY; default: only the speculative class)",
    )
    shed.add_argument(
        "--eviction",
        type=_on_off,
        default=_env("MESH_EVICTION", "on"),
        metavar="on|off",
        help="a full pool's interactive requests may evict rebuildable or retryable work "
        "(env MESH_EVICTION, default on)",
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

    p = command("agent", help="run a sample agent")
    p.add_argument("sample", choices=("calc", "textstats", "echo"), help="which sample agent")
    p.add_argument(
        "--id",
        dest="agent_id",
        default=os.environ.get("AGENT_ID"),
        help="the agent's ID, unique in the namespace (env AGENT_ID; default: its "
        "deployment and a random suffix)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_env("HEARTBEAT_INTERVAL_S", str(c.DEFAULT_HEARTBEAT_INTERVAL_S)),
        help="seconds between heartbeats, at least 5 (env HEARTBEAT_INTERVAL_S)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM or a drain, how long queued work may still run before what is left "
        "is answered AGENT_SHUTDOWN (default 60)",
    )
    p.add_argument(
        "--shared-topology",
        choices=("declare", "check"),
        default=_env("MESH_SHARED_TOPOLOGY", "declare"),
        help="declare the namespace's shared exchanges, or only check that the manager has "
        "(for a broker user made by `mesh broker add-agent`; env MESH_SHARED_TOPOLOGY, "
        "default %(default)s)",
    )
    p.add_argument(
        "--lease-public-key",
        action="append",
        metavar="FILE",
        default=[path for path in [os.environ.get("MESH_LEASE_PUBLIC_KEY")] if path],
        help="require an invocation lease signed by this manager key on every granted task "
        "(the manager's --lease-key FILE.pub; repeat for a key rotation; env "
        "MESH_LEASE_PUBLIC_KEY)",
    )
    p.add_argument(
        "--open-tasks",
        action="store_true",
        default=os.environ.get("MESH_OPEN_TASKS", "") in ("1", "on", "true"),
        help="also run tasks that carry neither a grant nor a lease the manager issued to this "
        "agent (a mesh without admission and leases; env MESH_OPEN_TASKS; default: refused, "
        "NOT_AUTHORIZED)",
    )
    p.add_argument(
        "--manager-user",
        default=os.environ.get("MESH_MANAGER_USER") or None,
        metavar="USER",
        help="take control messages (drain notices, requests to register again, lease "
        "notices, events) only from this broker user, the managers' (env MESH_MANAGER_USER; "
        "default: the user that signed the acceptance of this agent's registration)",
    )
    _add_liveness_probe(p)
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

    p = command("demo", help="run manager, sample agents and a producer on this machine")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of traffic (0: forever)")
    p.add_argument("--concurrency", type=int, default=4, help="tasks in flight at once")
    p.add_argument(
        "--producer-only",
        action="store_true",
        help="only run the producer, against a mesh that is already running",
    )
    p.add_argument("--work-dir", default=".mesh/demo", help="journal and process logs")
    p.set_defaults(func=cmd_demo)

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
        "register, heartbeats, lease-path, input-schema, admission-path, grants, epochs, "
        "reregister, hand-over, signed, pool-queue, forged-heartbeat, restart, fence, drain, "
        "sigterm, short-interval",
    )
    p.set_defaults(func=cmd_conformance)

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
        "--journal", default=journal_default, help="the manager's SQLite orchestration log"
    )
    p.set_defaults(func=cmd_log)

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

    p = command("drain", help="drain an agent: no new work, in-flight finishes, then exit")
    p.add_argument("agent_id", help="the agent to drain")
    p.add_argument(
        "--reason",
        default="operator request",
        help="why, for the journal and the agent's log (default: operator request)",
    )
    p.set_defaults(func=cmd_drain)

    p = command("explain", help="why an admission was decided as it was")
    p.add_argument("admission_id", help="the admission ID a decision or log entry names")
    p.add_argument("--json", action="store_true", help="the explain reply as JSON")
    p.set_defaults(func=cmd_explain)

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

    p = command("admission", help="operators: revoke an admission for security")
    p.add_argument("action", choices=("revoke",), help="take the grant back")
    p.add_argument("admission_id", help="the admission whose grant to revoke")
    p.add_argument("--reason", required=True, help="why (journaled, and shown to the agent)")
    p.set_defaults(func=cmd_admission)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    is_service = args.command in ("manager", "agent")
    logs.configure(args.log_level, json=is_service and args.log_format == "json")
    code: int = args.func(args)
    return code
