"""Benchmark of a simulated fleet against real manager processes over the real broker.

Run: ``.venv/bin/python bench/fleet.py`` (``--quick`` for a run of a few minutes). It prints
one table per configuration (one manager, two managers), the largest fleet one manager holds,
and the targets with PASS/FAIL; exit code 1 if a target fails. Without a broker it says so in
one sentence and skips (not a failure); without PostgreSQL the two-manager configuration is
skipped (several managers share their shard leases there).

The managers are ``mesh manager`` processes, started as an operator starts them (JSON logs at
INFO into a file of the run, the SQLite journal, ``--http-port`` for ``/metrics``), on a fresh
``bench-<uuid8>`` namespace. Two managers run with ``--shards`` on a PostgreSQL ledger of
their own (a database created and dropped by the run): each owns half the shards, agents
route their heartbeats to their shard's queue. This process is the fleet and nothing else
(the managers run in their own processes): simulated agents that speak the wire contract as
an agent in another language would — an ``AgentRegistration`` published on the announce
exchange with confirms, heartbeats on the heartbeat exchange without, JSON built from the
schemas, the acceptance read from the agents exchange (one queue bound to ``#`` stands for
every agent's control queue), a ``ReRegisterRequest`` answered by registering again.
Registrations go out on a raw aiormq channel with confirms; heartbeats go out a step's worth
in one write (``AmqpTransport.publish_fast_many``) and the answers are read on the project's
consume-only connection (``consume_raw``, decoded with orjson), so the fleet — thousands of
agents in one process on the managers' own two cores — costs the machine as little as it
can (~0.07 of a core at 30,000 agents, from 0.4 to 0.5 with a pydantic model per answer). Each agent
beats every 10 s from its acceptance on. Two managers run first, then one manager, whose
fleet keeps beating through the ramp.

Figures, per configuration:

* registration agents/s. One manager (the target): N registrations wait in the announce
  queue when it starts (as when a whole fleet registers at once after a restart), and the
  rate is N - 1 over the time from the first acceptance read back to the N-th, so it is the
  manager's rate and not the fleet's publishing. Two managers: the fleet registers live
  once both hold their shards (both consume the shared announce queue, so no backlog can
  wait for both), N over the time from the first publish to the N-th acceptance — this
  includes the fleet's own publishing, so it is not comparable with the backlog figure;
* heartbeats handled per second by each manager (its ``mesh_heartbeat_lag_seconds_count``,
  one observation per heartbeat it took) over a steady window with the whole fleet beating;
* CPU per manager: its process CPU time (``/proc/<pid>/stat``) over that window, as a share
  of one core, and over the registrations;
* RSS per agent: the manager's resident memory (``/proc/<pid>/status``) with the fleet
  registered, less its RSS before the first registration, over N;
* false losses: agents the managers declared lost (``log.<agent>.lost`` events on the events
  exchange) although the fleet kept sending their heartbeats on time (its own lag behind the
  schedule is printed: a fleet that fell behind would make its own losses).

``--decompose`` checks nothing: it takes the two-manager CPU ratio apart instead, one manager
alone at a time on PostgreSQL — the whole fleet without shards, half of it without shards (the
floor: what half the heartbeats cost before sharding costs anything), half of it holding all
eight shards, half of it with one shard, and each idle — so the share of sharding, of the
number of queues and of the fixed cost can be read off one table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiormq
import orjson
from report import Report, Target, add_json_argument, broker_unreachable, postgres_unreachable

from mesh import constants as c
from mesh.errors import RequestTimeout, TransportError
from mesh.producer import MeshClient
from mesh.topology import names
from mesh.topology.specs import Topology
from mesh.transport.amqp import AmqpTransport, RawBatch, redact
from mesh.wire.codec import decode_as
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import AgentRegistration, Heartbeat, RegistrationAccepted, ReRegisterRequest

DEFAULT_PG_DSN = "postgresql://postgres@127.0.0.1:5432/mesh_test"
TARGET_REGISTRATIONS_PER_S = 2_000.0  # one manager, agents/s
TARGET_CPU_SHARE = 0.6  # each of two managers' CPU for the same fleet / one manager's
TARGET_STATUS_S = 1.0  # the manager's answer to `mesh status`, at the largest fleet held
INTERVAL_S = 10.0  # the agents' heartbeat interval (the default)
POOLS = 64  # pools the fleet is spread over (shards are chosen by pool)
SHARDS = 8  # shards of the two-manager configuration
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- one manager process, seen from outside ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat_cpu_seconds(stat: Path) -> float:
    """utime + stime of a process's (or a thread's) ``/proc`` stat file, in seconds."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class ManagerProcess:
    """A ``mesh manager`` child process: its CPU and RSS from /proc, its counters from
    ``/metrics``."""

    def __init__(self, proc: asyncio.subprocess.Process, manager_id: str, port: int, log: Path):
        self.proc = proc
        self.manager_id = manager_id
        self.port = port
        self.log = log

    @classmethod
    async def start(
        cls,
        url: str,
        namespace: str,
        workdir: Path,
        manager_id: str,
        extra: list[str],
        profile_to: Path | None = None,
    ) -> ManagerProcess:
        port = free_port()
        log = workdir / f"{manager_id}.log"
        profile = [] if profile_to is None else ["-m", "cProfile", "-o", str(profile_to)]
        command = [
            sys.executable,
            *profile,
            "-m",
            "mesh",
            "manager",
            "--amqp-url",
            url,
            "--namespace",
            namespace,
            "--manager-id",
            manager_id,
            "--journal",
            str(workdir / f"{manager_id}-journal.sqlite3"),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(port),
            *extra,
        ]
        if "--ledger" not in extra:
            command += ["--ledger", f"sqlite:{workdir / f'{manager_id}-ledger.sqlite3'}"]
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *command, stdout=out, stderr=asyncio.subprocess.STDOUT
            )
        self = cls(proc, manager_id, port, log)
        deadline = time.monotonic() + 60
        while b'"manager started"' not in log.read_bytes():
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"manager {manager_id} did not start: {self.tail()}")
            await asyncio.sleep(0.1)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def cpu_seconds(self) -> float:
        return _stat_cpu_seconds(Path(f"/proc/{self.proc.pid}/stat"))

    def main_thread_cpu_seconds(self) -> float:
        """CPU of the manager's main thread alone (its event loop; the ledger's worker and
        PostgreSQL's LISTEN thread are left out)."""
        return _stat_cpu_seconds(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat"))

    async def wait_for_shards(self, count: float, deadline: float) -> bool:
        """Whether the manager holds ``count`` shards before ``deadline`` (monotonic)."""
        while await self.metric("mesh_shards_held") != count:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.3)
        return True

    def rss_bytes(self) -> int:
        return int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1]) * PAGE

    async def metric(self, name: str) -> float:
        """The sum of every series of ``name`` on the manager's ``/metrics``."""

        def fetch() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
                return str(r.read().decode())

        text = await asyncio.to_thread(fetch)
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        return sum(float(value) for value in pattern.findall(text))

    async def stop(self) -> None:
        if self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# ---- the simulated fleet -------------------------------------------------------------------------


@dataclass(slots=True)
class SimAgent:
    agent_id: str
    incarnation: str
    pool: str
    registration: bytes
    seq: int = 0
    shard: int | None = None
    accepted: bool = False


def registration_body(agent_id: str, incarnation: str, pool: str, sharded: bool) -> bytes:
    """An ``AgentRegistration`` as JSON, written from the schema (one capability)."""
    features = [c.FEATURE_DESCRIPTOR_EPOCHS, *([c.FEATURE_SHARDS] if sharded else [])]
    return orjson.dumps(
        {
            "type": AgentRegistration.TYPE,
            "agent_id": agent_id,
            "incarnation": incarnation,
            "deployment": pool,
            "capabilities": [
                {
                    "name": "fleet.echo",
                    "version": "1.0.0",
                    "input_schema": {"type": "object"},
                    "output_schema": {"type": "object"},
                    "max_concurrency": 4,
                    "cost_class": "B",
                }
            ],
            "heartbeat_interval_s": INTERVAL_S,
            "features": features,
        }
    )


def heartbeat_body(agent: SimAgent, sent_at: float) -> bytes:
    return orjson.dumps(
        {
            "type": Heartbeat.TYPE,
            "agent_id": agent.agent_id,
            "incarnation": agent.incarnation,
            "seq": agent.seq,
            "sent_at": sent_at,
        }
    )


@dataclass
class FleetCounts:
    accepted: int = 0
    refused: int = 0
    reregister_asked: int = 0
    reregister_failed: int = 0
    lost: set[str] = field(default_factory=set)
    other: int = 0


class Fleet:
    """Simulated agents: registrations on a raw aiormq connection (publisher confirms, as an
    agent's); heartbeats and the answers to the agents on the project's transport, in
    batches — a simulator of thousands of agents in one process on the manager's machine
    must leave the CPU to the manager and the broker (an agent is one process elsewhere)."""

    def __init__(self, url: str, topology: Topology, sharded: bool) -> None:
        self.url = url
        self.topology = topology
        self.sharded = sharded
        self.agents: list[SimAgent] = []
        self.live: list[SimAgent] = []  # accepted, so heartbeating (in order of acceptance)
        self.by_id: dict[str, SimAgent] = {}
        self.counts = FleetCounts()
        self.accepted_event = asyncio.Event()
        self.wanted = 0
        self.first_accepted_at = 0.0
        self.last_accepted_at = 0.0
        self.beat_lag_s = 0.0  # the most the heartbeat schedule ran behind
        self._beating: asyncio.Task[None] | None = None
        self._connection: aiormq.abc.AbstractConnection | None = None
        self._confirming: aiormq.abc.AbstractChannel | None = None
        self._transport: AmqpTransport | None = None  # heartbeats out, answers in
        self._inbox = f"bench-fleet-inbox-{uuid.uuid4().hex[:8]}"
        self._background: set[asyncio.Task[Any]] = set()
        self._tag = uuid.uuid4().hex[:6]

    async def open(self) -> None:
        self._connection = await aiormq.connect(
            self.url, client_properties={"connection_name": "bench-fleet"}
        )
        self._confirming = await self._connection.channel(publisher_confirms=True)
        inbox = await self._connection.channel()
        t = self.topology
        await inbox.queue_declare(self._inbox, auto_delete=True)
        await inbox.queue_bind(self._inbox, t.agents_exchange, routing_key="#")
        await inbox.queue_bind(self._inbox, t.events_exchange, routing_key=f"{c.RK_LOG}.*.lost")
        self._transport = await AmqpTransport.connect(self.url, name="bench-fleet-beats")
        await self._transport.consume_raw(self._inbox, _Inbox(self))

    async def close(self) -> None:
        await self.stop_heartbeats()
        if self._transport is not None:
            await self._transport.close()
        if self._connection is not None:
            with contextlib.suppress(aiormq.exceptions.AMQPError):
                channel = await self._connection.channel()
                await channel.queue_delete(self._inbox)
            await self._connection.close()

    def grow(self, count: int) -> list[SimAgent]:
        """``count`` new agents (not registered yet), spread over the pools."""
        new = []
        for n in range(len(self.agents), len(self.agents) + count):
            agent_id = f"fleet-{self._tag}-{n:06d}"
            incarnation = uuid.uuid4().hex
            pool = f"fleet-pool-{n % POOLS:02d}"
            body = registration_body(agent_id, incarnation, pool, self.sharded)
            new.append(SimAgent(agent_id, incarnation, pool, body))
        if new:  # the wire contract: the manager's own decoder takes what the fleet writes
            decode_as(new[0].registration, AgentRegistration)
            decode_as(heartbeat_body(new[0], time.time()), Heartbeat)
        self.agents += new
        self.by_id.update((a.agent_id, a) for a in new)
        return new

    async def register(self, agents: list[SimAgent], window: int = 256) -> None:
        """Publish the registrations, ``window`` confirms in flight at a time."""
        assert self._confirming is not None
        exchange = self.topology.announce_exchange
        for start in range(0, len(agents), window):
            await asyncio.gather(
                *(
                    self._confirming.basic_publish(
                        a.registration,
                        exchange=exchange,
                        routing_key=names.agent_announce_key(a.agent_id, "register"),
                        properties=aiormq.spec.Basic.Properties(
                            content_type=c.CONTENT_TYPE, delivery_mode=2
                        ),
                        mandatory=True,
                        wait=False,  # the confirm is the wait (not each frame's flush)
                    )
                    for a in agents[start : start + window]
                )
            )

    async def register_paced(
        self, agents: list[SimAgent], per_s: float, give_up_after_losses: int
    ) -> bool:
        """Publish the registrations at about ``per_s``, in chunks of a tenth of a second;
        stop early (``False``) once more than ``give_up_after_losses`` agents were declared
        lost or the broker refused a registration (the announce queue full)."""
        chunk = max(1, int(per_s / 10))
        started = time.monotonic()
        for n in range(0, len(agents), chunk):
            if len(self.counts.lost) > give_up_after_losses:
                return False
            try:
                await self.register(agents[n : n + chunk])
            except aiormq.exceptions.AMQPError:
                return False
            await asyncio.sleep(max(0.0, started + (n + chunk) / per_s - time.monotonic()))
        return True

    async def wait_accepted(
        self, total: int, timeout_s: float, give_up_after_losses: int | None = None
    ) -> bool:
        """Until ``total`` agents are accepted (or ``timeout_s``, or the fleet has more than
        ``give_up_after_losses`` agents declared lost): whether they were."""
        self.wanted = total
        deadline = time.monotonic() + timeout_s
        while self.counts.accepted < total:
            if give_up_after_losses is not None and len(self.counts.lost) > give_up_after_losses:
                return False
            self.accepted_event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.accepted_event.wait(), min(remaining, 1.0))
        return True

    def on_answer(self, answer: dict[str, Any]) -> None:
        """An answer to an agent, or a ``lost`` orchestration event (JSON, as sent)."""
        kind = answer.get("type")
        if kind == OrchestrationEvent.TYPE:
            self.counts.lost.add(answer.get("agent_id") or "-")
        elif kind == RegistrationAccepted.TYPE:
            agent = self.by_id.get(answer["agent_id"])
            if agent is None or agent.incarnation != answer["incarnation"]:
                return
            agent.shard = answer.get("shard")
            if not agent.accepted:
                agent.accepted = True
                self.live.append(agent)
                self.counts.accepted += 1
                self.last_accepted_at = time.perf_counter()
                if self.counts.accepted == 1:
                    self.first_accepted_at = self.last_accepted_at
                if self.counts.accepted >= self.wanted:
                    self.accepted_event.set()
        elif kind == ReRegisterRequest.TYPE:
            agent = self.by_id.get(answer["agent_id"])
            self.counts.reregister_asked += 1
            if agent is not None:
                task = asyncio.create_task(self._register_again(agent))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        elif kind == "mesh.registration-refused.v1":
            self.counts.refused += 1
        else:
            self.counts.other += 1

    async def _register_again(self, agent: SimAgent) -> None:
        """Asked to: registers again (a refused publish, the announce queue full, is counted;
        the manager asks again on the agent's next heartbeat)."""
        try:
            await self.register([agent])
        except aiormq.exceptions.AMQPError:
            self.counts.reregister_failed += 1

    def start_heartbeats(self) -> None:
        self._beating = asyncio.create_task(self._beat_forever())

    async def stop_heartbeats(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
            self._beating = None

    async def _beat_forever(self, step_s: float = 0.05) -> None:
        """Every agent beats once per interval, spread evenly: each step sends the share of
        the fleet due since the last step, walking the fleet in order with a cursor, so an
        agent's beats are one interval apart whatever the fleet's size (agents accepted
        meanwhile join the end of the walk; a position taken as a counter modulo the fleet's
        size would jump as the fleet grows and skip agents — at 300 new agents a second over
        40,000 it left the oldest silent past the loss window). How late a step ran (the loop
        busy elsewhere) is kept in ``beat_lag_s``: the fleet's own share of any lateness."""
        assert self._transport is not None
        transport, exchange = self._transport, self.topology.heartbeat_exchange
        last = time.monotonic()
        credit = 0.0
        cursor = 0
        while True:
            await asyncio.sleep(step_s)
            now = time.monotonic()
            self.beat_lag_s = max(self.beat_lag_s, now - last - step_s)
            agents = self.live
            credit += (now - last) * len(agents) / INTERVAL_S
            last = now
            sent_at = time.time()
            beats = []
            while credit >= 1 and agents:
                credit -= 1
                if cursor >= len(agents):
                    cursor = 0
                agent = agents[cursor]
                cursor += 1
                agent.seq += 1
                key = names.heartbeat_key(agent.agent_id, agent.shard if self.sharded else None)
                beats.append((key, heartbeat_body(agent, sent_at)))
            with contextlib.suppress(TransportError):  # the manager notices the silence
                await transport.publish_fast_many(exchange, beats)  # one write for the step


class _Inbox:
    """The fleet's answers, as the consume-only connection hands them over (a read's worth
    at a time)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def __call__(self, body: bytes, user_id: str | None, /) -> None:
        self._fleet.on_answer(orjson.loads(body))

    def ingest_many(self, bodies: RawBatch, /) -> None:
        for body, _ in bodies:
            self._fleet.on_answer(orjson.loads(body))


# ---- one configuration ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManagerFigures:
    manager_id: str
    heartbeats_per_s: float
    cpu_share: float  # of one core, over the steady window
    rss_per_agent: float  # bytes
    registration_cpu_us: float  # per registration, over the registrations


@dataclass(frozen=True, slots=True)
class ConfigFigures:
    name: str
    agents: int
    registrations_per_s: float
    how: str  # how the registrations reached the managers
    managers: list[ManagerFigures]
    false_losses: int
    fleet_lag_s: float
    reregister_asked: int


async def sample(managers: list[ManagerProcess]) -> list[tuple[float, float, int]]:
    """(CPU seconds, heartbeats handled, RSS bytes) of each manager now."""
    return [
        (m.cpu_seconds(), await m.metric("mesh_heartbeat_lag_seconds_count"), m.rss_bytes())
        for m in managers
    ]


async def steady_window(
    fleet: Fleet, managers: list[ManagerProcess], warm_s: float, window_s: float
) -> tuple[list[tuple[float, float]], list[int]]:
    """The fleet beating: after ``warm_s`` (every agent has beaten at least once), each
    manager's heartbeats per second and CPU share over ``window_s``; and its RSS at the end."""
    await asyncio.sleep(warm_s)
    before = await sample(managers)
    started = time.monotonic()
    await asyncio.sleep(window_s)
    after = await sample(managers)
    seconds = time.monotonic() - started
    rates = [
        ((a[1] - b[1]) / seconds, (a[0] - b[0]) / seconds)
        for b, a in zip(before, after, strict=True)
    ]
    return rates, [a[2] for a in after]


async def fresh_namespace(url: str) -> Topology:
    """A ``bench-<uuid8>`` namespace with the manager's topology declared."""
    topology = Topology(namespace=f"bench-{uuid.uuid4().hex[:8]}")
    admin = await AmqpTransport.connect(url, name="bench-fleet-admin")
    await admin.declare(topology.manager())
    await admin.close()
    return topology


async def run_one_manager(
    url: str, workdir: Path, agents: int, warm_s: float, window_s: float
) -> tuple[ConfigFigures, Fleet, ManagerProcess]:
    """One manager, fed a backlog: ``agents`` registrations waiting in the announce queue
    when it starts (as after a restart, when the whole fleet registers at once), so the rate
    is the manager's, not the fleet's publishing. Returned running, for the ramp."""
    topology = await fresh_namespace(url)
    fleet = Fleet(url, topology, sharded=False)
    manager: ManagerProcess | None = None
    try:
        await fleet.open()
        # An agent beats from its acceptance on (the beats cover accepted agents only): the
        # first of a large backlog would be declared lost waiting for the last otherwise.
        fleet.start_heartbeats()
        new = fleet.grow(agents)
        await fleet.register(new, window=1000)
        manager = await ManagerProcess.start(url, topology.namespace, workdir, "m0", [])
        figures = await one_manager_figures(fleet, manager, agents, warm_s, window_s)
    except BaseException:
        await fleet.close()
        if manager is not None:
            await manager.stop()
        await delete_namespace(url, topology)
        raise
    return figures, fleet, manager


async def one_manager_figures(
    fleet: Fleet, manager: ManagerProcess, agents: int, warm_s: float, window_s: float
) -> ConfigFigures:
    cpu0, rss0 = manager.cpu_seconds(), manager.rss_bytes()
    if not await fleet.wait_accepted(agents, timeout_s=agents / 50 + 60):
        raise RuntimeError(f"only {fleet.counts.accepted} of {agents} accepted")
    registration_cpu = manager.cpu_seconds() - cpu0
    rate = (agents - 1) / max(fleet.last_accepted_at - fleet.first_accepted_at, 1e-9)
    rates, rss = await steady_window(fleet, [manager], warm_s, window_s)
    return ConfigFigures(
        "one manager",
        agents,
        rate,
        "backlog",
        [
            ManagerFigures(
                "m0",
                rates[0][0],
                rates[0][1],
                (rss[0] - rss0) / agents,
                registration_cpu / agents * 1e6,
            )
        ],
        len(fleet.counts.lost),
        fleet.beat_lag_s,
        fleet.counts.reregister_asked,
    )


async def run_two_managers(
    url: str, dsn: str, workdir: Path, agents: int, warm_s: float, window_s: float
) -> ConfigFigures:
    """Two managers with ``--shards`` on one PostgreSQL ledger, each holding half the shards
    before the fleet registers (live: the shared announce queue is consumed by both, so no
    backlog can wait for them both to be up)."""
    topology = Topology(namespace=f"bench-{uuid.uuid4().hex[:8]}")
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    extra = [
        "--shards",
        str(SHARDS),
        "--ledger",
        dsn,
        "--ledger-schema",
        schema,
        "--shard-lease",
        "5",
    ]
    managers: list[ManagerProcess] = []
    fleet = Fleet(url, topology, sharded=True)
    try:
        for n in range(2):
            managers.append(
                await ManagerProcess.start(url, topology.namespace, workdir, f"s{n}", extra)
            )
        deadline = time.monotonic() + 60
        for manager in managers:
            if not await manager.wait_for_shards(SHARDS / 2, deadline):
                raise RuntimeError("the two managers did not split the shards evenly")
        await fleet.open()
        fleet.start_heartbeats()  # each agent from its acceptance on
        base = [(m.cpu_seconds(), m.rss_bytes()) for m in managers]
        new = fleet.grow(agents)
        started = time.perf_counter()
        await fleet.register(new, window=1000)
        if not await fleet.wait_accepted(agents, timeout_s=agents / 50 + 60):
            raise RuntimeError(f"only {fleet.counts.accepted} of {agents} accepted")
        rate = agents / (fleet.last_accepted_at - started)
        registration_cpu = [m.cpu_seconds() - b[0] for m, b in zip(managers, base, strict=True)]
        rates, rss = await steady_window(fleet, managers, warm_s, window_s)
        return ConfigFigures(
            "two managers",
            agents,
            rate,
            "live",
            [
                ManagerFigures(
                    m.manager_id,
                    r[0],
                    r[1],
                    (now - b[1]) / (agents / 2),
                    cpu / (agents / 2) * 1e6,
                )
                for m, r, now, b, cpu in zip(
                    managers, rates, rss, base, registration_cpu, strict=True
                )
            ],
            len(fleet.counts.lost),
            fleet.beat_lag_s,
            fleet.counts.reregister_asked,
        )
    finally:
        await fleet.close()
        for manager in managers:
            await manager.stop()
        await delete_namespace(url, topology, SHARDS)
        with contextlib.suppress(Exception):
            drop_schema(dsn, schema)


# ---- the largest fleet one manager holds ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    agents: int
    held: bool  # every registration of the step came through, and the size was held
    registrations_per_s: float
    heartbeats_per_s: float
    cpu_share: float
    false_losses: int
    fleet_lag_s: float
    status_s: float  # `mesh status` (the summary), the whole command, wall time
    status_bytes: int  # what it printed
    status_page_s: float  # `mesh status --agents --limit 100`
    status_answer_s: float  # the status request's round trip from a connected client


async def timed_status(url: str, namespace: str, *extra: str) -> tuple[float, int]:
    """Run the real ``mesh status`` command as an operator would (a fresh process: start,
    connect, ask, print) against the manager; its wall time and the bytes it printed."""
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", "--amqp-url", url, "--namespace", namespace,
        "status", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    took = time.perf_counter() - began
    if proc.returncode != 0:  # no answer in time: shown (and judged) as such, not a crash
        print(f"   mesh status failed ({proc.returncode}): {err.decode().strip()[-300:]}")
        return float("inf"), 0
    return took, len(out)


async def command_start_s() -> float:
    """What any ``mesh`` command costs before it does anything: ``mesh --help``'s wall time
    (the interpreter, the imports, the argument parser), the median of three."""
    took = []
    for _ in range(3):
        began = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mesh", "--help", stdout=asyncio.subprocess.DEVNULL
        )
        await proc.wait()
        took.append(time.perf_counter() - began)
    return sorted(took)[1]


async def status_answer_s(url: str, namespace: str) -> float:
    """The manager's answer to a status request (the summary, no rows), from a client
    already connected: the median of three round trips."""
    client = await MeshClient.connect(url, namespace=namespace, name="bench-fleet-status")
    try:
        took = []
        for _ in range(3):
            began = time.perf_counter()
            try:
                await client.status(agents_limit=0, timeout_s=30)
            except RequestTimeout:
                took.append(float("inf"))
                continue
            took.append(time.perf_counter() - began)
    finally:
        await client.close()
    return sorted(took)[1]


async def ramp(
    fleet: Fleet,
    manager: ManagerProcess,
    step: int,
    per_s: float,
    hold_s: float,
    budget_s: float,
) -> list[Step]:
    """Grow the fleet by ``step`` agents at a time, registered at about ``per_s`` (a fleet
    scaling out, not a burst: the question is what one manager holds), holding each size for
    ``hold_s`` (past the loss window, three intervals) while every agent beats, until an
    agent is falsely lost, the registrations do not all come through, or the time budget
    would be overrun by one more step."""
    steps: list[Step] = []
    started = time.monotonic()
    last_step_s = 0.0
    while time.monotonic() - started + last_step_s < budget_s:
        step_started = time.monotonic()
        lost_before = len(fleet.counts.lost)
        fleet.beat_lag_s = 0.0
        new = fleet.grow(step)
        begun = time.perf_counter()
        published = await fleet.register_paced(new, per_s, give_up_after_losses=lost_before)
        accepted = published and await fleet.wait_accepted(
            len(fleet.agents), timeout_s=60, give_up_after_losses=lost_before
        )
        rate = step / max(fleet.last_accepted_at - begun, 1e-9)
        before = await sample([manager])
        await asyncio.sleep(hold_s if accepted else 0.0)
        after = await sample([manager])
        held_s = hold_s if accepted else float("nan")  # not held: no steady figures
        lost = len(fleet.counts.lost) - lost_before
        namespace = fleet.topology.namespace
        status_s, status_bytes = await timed_status(fleet.url, namespace)
        page_s, _ = await timed_status(fleet.url, namespace, "--agents", "--limit", "100")
        answer_s = await status_answer_s(fleet.url, namespace)
        steps.append(
            Step(
                len(fleet.agents),
                bool(accepted),
                rate if accepted else 0.0,
                (after[0][1] - before[0][1]) / held_s,
                (after[0][0] - before[0][0]) / held_s,
                lost,
                fleet.beat_lag_s,
                status_s,
                status_bytes,
                page_s,
                answer_s,
            )
        )
        line = (
            f"   {len(fleet.agents):>8,}  {steps[-1].registrations_per_s:>10,.0f}  "
            f"{steps[-1].heartbeats_per_s:>10,.0f}  {steps[-1].cpu_share:>8.0%}  "
            f"{lost:>6,}  {fleet.beat_lag_s:>7.2f}  {status_s:>8.2f}  {status_bytes:>8,}  "
            f"{page_s:>8.2f}  {answer_s:>8.3f}"
        )
        print(line.replace("nan%", "  —").replace("nan", "—"), flush=True)
        if lost or not accepted:
            break
        last_step_s = time.monotonic() - step_started
    return steps


# ---- clean-up ------------------------------------------------------------------------------------


async def delete_namespace(url: str, topology: Topology, shards: int | None = None) -> None:
    transport = await AmqpTransport.connect(url, name="bench-fleet-cleanup")
    try:
        made = topology.manager()
        if shards is not None:
            made = made + topology.manager_shards(shards)
        with contextlib.suppress(Exception):
            await transport.delete_declared(made)
    finally:
        await transport.close()


def drop_schema(dsn: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# ---- where a sharded manager's CPU goes (--decompose) -------------------------------------------


async def run_lone(
    url: str,
    dsn: str,
    workdir: Path,
    agents: int,
    shards: int | None,
    warm_s: float,
    window_s: float,
) -> tuple[float, float, float]:
    """One manager on a PostgreSQL ledger (with ``--shards shards`` holding all of them,
    or without shards), nobody else: its heartbeats/s, CPU share and main thread's share
    over ``window_s`` once ``agents`` registered and beat for ``warm_s``."""
    topology = await fresh_namespace(url)
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    extra = ["--ledger", dsn, "--ledger-schema", schema]
    if shards is not None:
        extra += ["--shards", str(shards), "--shard-lease", "5"]
    fleet = Fleet(url, topology, sharded=shards is not None)
    manager: ManagerProcess | None = None
    try:
        manager = await ManagerProcess.start(url, topology.namespace, workdir, "lone", extra)
        if shards is not None and not await manager.wait_for_shards(shards, time.monotonic() + 60):
            raise RuntimeError("the lone manager did not take every shard")
        await fleet.open()
        fleet.start_heartbeats()
        await fleet.register(fleet.grow(agents), window=1000)
        if not await fleet.wait_accepted(agents, timeout_s=agents / 50 + 60):
            raise RuntimeError(f"only {fleet.counts.accepted} of {agents} accepted")
        await asyncio.sleep(warm_s)
        main0, started = manager.main_thread_cpu_seconds(), time.monotonic()
        rates, _ = await steady_window(fleet, [manager], 0.0, window_s)
        main = (manager.main_thread_cpu_seconds() - main0) / (time.monotonic() - started)
        return rates[0][0], rates[0][1], main
    finally:
        await fleet.close()
        if manager is not None:
            await manager.stop()
        await delete_namespace(url, topology, shards)
        with contextlib.suppress(Exception):
            drop_schema(dsn, schema)


async def decompose(args: argparse.Namespace, agents: int, report: Report) -> None:
    """The two-manager target's ratio taken apart, one manager alone each time (no second
    manager competing for the cores), every configuration on PostgreSQL: the whole fleet
    without shards (the reference); half of it without shards (the floor — what a manager
    with half the heartbeats costs before sharding costs anything); half of it holding every
    shard (sharding's own cost); half of it with one shard (how much of that is the number of
    queues); and each idle (no agent: the fixed cost)."""
    half = agents // 2
    warm_s, window_s = (11.0, 12.0) if args.quick else (12.0, 25.0)
    plan = [
        ("no shards, whole fleet", agents, None),
        ("no shards, half the fleet", half, None),
        (f"{SHARDS} shards, half the fleet", half, SHARDS),
        ("1 shard, half the fleet", half, 1),
        ("no shards, idle", 0, None),
        (f"{SHARDS} shards, idle", 0, SHARDS),
    ]
    print()
    print(
        "   where a sharded manager's CPU goes: one manager alone each time (PostgreSQL "
        f"ledger), {window_s:g} s windows"
    )
    print(
        f"   {'configuration':<28} {'agents':>7}  {'hb/s':>7}  {'CPU':>6}  {'main':>6}  "
        f"{'µs/hb':>6}  {'÷ whole fleet':>13}"
    )
    reference: float | None = None  # the whole fleet's CPU share (the first row)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-lone-") as tmp:
        for label, size, shards in plan:
            hb, cpu, main = await run_lone(
                args.amqp_url, args.postgres_dsn, Path(tmp), size, shards, warm_s, window_s
            )
            reference = reference or cpu
            per_hb = f"{cpu / hb * 1e6:>6.1f}" if hb else f"{'-':>6}"
            print(
                f"   {label:<28} {size:>7,}  {hb:>7,.0f}  {cpu:>6.2%}  {main:>6.2%}  {per_hb}  "
                f"{cpu / reference:>12.2f}x"
            )
            report.figure(
                decompose=label,
                agents=size,
                heartbeats_per_s=hb,
                cpu_share=cpu,
                main_thread_share=main,
                of_whole_fleet=cpu / reference,
            )
    print(
        "   (µs/hb: the process's CPU over the heartbeats it took, fixed cost included; the "
        "last column is each row's CPU over the first's)"
    )


# ---- main ----------------------------------------------------------------------------------------


def print_config(figures: ConfigFigures, report: Report) -> None:
    for m in figures.managers:
        print(
            f"   {figures.name:<13} {figures.agents:>7,}  {figures.registrations_per_s:>8,.0f} "
            f"({figures.how:<7})  {m.manager_id:>4}  {m.registration_cpu_us:>8,.0f}  "
            f"{m.heartbeats_per_s:>8,.0f}  {m.cpu_share:>6.1%}  {m.rss_per_agent:>8,.0f}  "
            f"{figures.false_losses:>5,}  {figures.fleet_lag_s:>6.2f}"
        )
        report.figure(
            configuration=figures.name,
            agents=figures.agents,
            registrations_per_s=figures.registrations_per_s,
            registrations_reached=figures.how,
            manager=m.manager_id,
            registration_cpu_us=m.registration_cpu_us,
            heartbeats_per_s=m.heartbeats_per_s,
            cpu_share=m.cpu_share,
            rss_per_agent_bytes=m.rss_per_agent,
            false_losses=figures.false_losses,
            fleet_lag_s=figures.fleet_lag_s,
            reregister_asked=figures.reregister_asked,
        )


def fleet_size(args: argparse.Namespace) -> int:
    return int(args.agents or (5_000 if args.quick else 30_000))


async def run(args: argparse.Namespace, report: Report) -> None:
    quick = args.quick
    agents = fleet_size(args)
    warm_s, window_s = (11.0, 12.0) if quick else (12.0, 30.0)
    step = args.step or (5_000 if quick else 20_000)
    ramp_rate = args.ramp_rate or (300.0 if quick else 1_000.0)
    hold_s = 35.0  # past the loss window (3 x 10 s), with a margin
    budget_s = 100.0 if quick else 420.0
    why_not_pg = postgres_unreachable(args.postgres_dsn)
    header = (
        f"   {'configuration':<13} {'agents':>7}  {'reg/s':>8} {'(how)':<9}  {'mgr':>4}  "
        f"{'µs/reg':>8}  {'hb/s':>8}  {'CPU':>6}  {'B/agent':>8}  {'lost':>5}  {'lag s':>6}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        workdir = Path(tmp)
        print(header)
        # Two managers first: the one manager's fleet then beats on through the ramp.
        two: ConfigFigures | None = None
        if why_not_pg is None:
            two = await run_two_managers(
                args.amqp_url, args.postgres_dsn, workdir, agents, warm_s, window_s
            )
            print_config(two, report)
        else:
            print(f"   two managers skipped: {why_not_pg}")
            report.skipped.append(f"two managers: {why_not_pg}")
        one, fleet, manager = await run_one_manager(
            args.amqp_url, workdir, agents, warm_s, window_s
        )
        print_config(one, report)
        try:
            print()
            print(
                f"   the largest fleet one manager holds at a {INTERVAL_S:g} s heartbeat, "
                f"+{step:,} agents a step registered at {ramp_rate:g}/s, each held "
                f"{hold_s:g} s"
            )
            print(
                f"   {'agents':>8}  {'reg/s':>10}  {'hb/s':>10}  {'CPU':>8}  {'lost':>6}  "
                f"{'lag s':>7}  {'status s':>8}  {'bytes':>8}  {'page s':>8}  {'answer s':>8}"
            )
            steps = await ramp(fleet, manager, step, ramp_rate, hold_s, budget_s)
        finally:
            await fleet.close()
            await manager.stop()
            await delete_namespace(args.amqp_url, fleet.topology)
    held = [s.agents for s in steps if s.held and not s.false_losses] + (
        [agents] if not one.false_losses else []
    )
    largest = max(held, default=0)
    for s in steps:
        report.figure(ramp_agents=s.agents, **{k: getattr(s, k) for k in Step.__slots__})
    last = steps[-1] if steps else None
    reached = last is None or not last.held or last.false_losses
    limit = "" if reached else "not reached within the time budget"
    print(
        f"   largest fleet held with no false loss: {largest:,} agents"
        + (f" ({limit})" if limit else "")
    )
    report.figure(largest_fleet_without_false_loss=largest, limit_reached=not limit)
    targets(one, two, report)
    if steps:
        held_steps = [s for s in steps if s.held and not s.false_losses] or steps
        biggest = max(held_steps, key=lambda s: s.agents)
        start_s = await command_start_s()
        report.targets.append(
            Target(
                "mesh_status_at_the_largest_fleet",
                biggest.status_answer_s <= TARGET_STATUS_S,
                f"at {biggest.agents:,} agents the manager answers a status request in "
                f"{biggest.status_answer_s:.3f} s; the whole `mesh status` command (a fresh "
                f"process) takes {biggest.status_s:.2f} s ({biggest.status_bytes:,} bytes), "
                f"a page of 100 agent rows {biggest.status_page_s:.2f} s — "
                f"{start_s:.2f} s of either is the interpreter and imports (`mesh --help`) — "
                f"(target: the answer ≤ {TARGET_STATUS_S:g} s)",
                value=biggest.status_answer_s,
                bound=f"<= {TARGET_STATUS_S:g}",
            )
        )


def targets(one: ConfigFigures, two: ConfigFigures | None, report: Report) -> None:
    rate = one.registrations_per_s
    report.targets.append(
        Target(
            "registrations_per_s_one_manager",
            rate >= TARGET_REGISTRATIONS_PER_S,
            f"one manager registers {rate:,.0f} agents/s from a backlog of {one.agents:,} "
            f"(target ≥ {TARGET_REGISTRATIONS_PER_S:,.0f})",
            value=rate,
            bound=f">= {TARGET_REGISTRATIONS_PER_S:g}",
        )
    )
    single = one.managers[0].cpu_share
    if two is not None:
        worst = max(m.cpu_share for m in two.managers)
        ratio = worst / single
        # Half the CPU each is only a result if the two hold the fleet between them: every
        # heartbeat handled (by its agent's owner: a manager handed another's heartbeat asks
        # that agent to register again) and nobody lost. Two managers without shards share
        # the heartbeat queue, so each sees half the beats too — and fails these.
        beats = sum(m.heartbeats_per_s for m in two.managers) / (two.agents / INTERVAL_S)
        held = two.reregister_asked == 0 and two.false_losses == 0 and beats >= 0.9
        report.targets.append(
            Target(
                "cpu_per_manager_two_vs_one",
                ratio <= TARGET_CPU_SHARE and held,
                f"with two managers the busier spends {ratio:.2f}x the CPU of one manager "
                f"holding the same fleet of {one.agents:,} ({worst:.1%} vs {single:.1%} of a "
                f"core; target ≤ {TARGET_CPU_SHARE:g}x), holding it between them: "
                f"{beats:.0%} of the fleet's heartbeats handled (≥ 90 %), "
                f"{two.reregister_asked} agents asked to register again and "
                f"{two.false_losses} lost (target 0 each)",
                value=worst,
                baseline=single,
                ratio=ratio,
                bound=f"<= {TARGET_CPU_SHARE:g}",
            )
        )
    for figures in (one, two):
        if figures is not None:
            report.targets.append(
                Target(
                    f"false_losses_{figures.name.replace(' ', '_')}",
                    figures.false_losses == 0,
                    f"{figures.name}: {figures.false_losses} agents declared lost while they "
                    "kept beating (target 0)",
                    value=figures.false_losses,
                    bound="== 0",
                )
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet, a few minutes")
    parser.add_argument("--amqp-url", default=os.environ.get("MESH_AMQP_URL", c.DEFAULT_AMQP_URL))
    parser.add_argument(
        "--postgres-dsn", default=os.environ.get("MESH_TEST_POSTGRES_DSN", DEFAULT_PG_DSN)
    )
    parser.add_argument("--agents", type=int, help="the fleet of both configurations")
    parser.add_argument(
        "--step", type=int, help="agents added per step of the ramp (default 20,000; 5,000 quick)"
    )
    parser.add_argument(
        "--ramp-rate",
        type=float,
        help="registrations/s during the ramp (default 1,000; 300 with --quick)",
    )
    parser.add_argument(
        "--decompose",
        action="store_true",
        help="instead of the targets, take the two-manager CPU ratio apart: one manager alone, "
        "with and without shards, on the whole fleet, on half of it and idle (PostgreSQL; "
        "~4 minutes at the default 30,000 agents)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    logging.getLogger("mesh").setLevel(logging.ERROR)
    for client in ("aio_pika", "aiormq"):
        logging.getLogger(client).setLevel(logging.CRITICAL)
    # A TERM (``timeout``, a CI's stop) unwinds like Ctrl-C: managers stopped, queues deleted.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    report = Report("fleet")
    why_not = asyncio.run(broker_unreachable(args.amqp_url, "bench-fleet-probe"))
    if why_not is not None:
        print(f"skipped: {why_not}.")
        report.skipped.append(f"fleet: {why_not}")
        return report.finish(started, args.json)
    print(
        f"a simulated fleet against mesh manager processes, broker {redact(args.amqp_url)}, "
        f"heartbeat interval {INTERVAL_S:g} s"
    )
    if args.decompose:
        why_not_pg = postgres_unreachable(args.postgres_dsn)
        if why_not_pg is not None:
            print(f"skipped: {why_not_pg}.")
            report.skipped.append(f"decompose: {why_not_pg}")
        else:
            asyncio.run(decompose(args, fleet_size(args), report))
        report.skipped.append("targets: --decompose measures, it checks nothing")
        return report.finish(started, args.json)
    asyncio.run(run(args, report))
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
