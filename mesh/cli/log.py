"""``mesh log``: the orchestration log from the journal or live, filtered."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from datetime import time as dt_time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh import constants as c
from mesh.cli.common import DEFAULT_JOURNAL, DEMO_JOURNAL, _run, _stop_on_signals
from mesh.errors import MeshError, MessageRejected
from mesh.render import format_event
from mesh.topology import names
from mesh.wire.events import OrchestrationEvent

if TYPE_CHECKING:
    from mesh.manager.journal import SqliteJournal


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
