"""Benchmark of several managers on one PostgreSQL ledger: CPU per admission, one vs two.

Run: ``.venv/bin/python bench/managers.py`` (``--quick`` for a smoke run). It prints one row
per manager per round, the medians, and the target with PASS/FAIL; exit code 1 if it fails.
Without a broker or PostgreSQL it says so in one sentence and skips (not a failure).

Admissions are decided by any manager against the shared ledger (docs/admission.md), so a
second manager should add decisions without making each one dearer. What could make it
dearer: the two managers' batches contending for the same counter rows (lock waits, aborted
and replayed batches), and smaller group commits when the load is split. This bench measures
that cost where it lands, in the managers' own CPU.

Each configuration (one manager, then two; the order alternates by round) runs real manager
processes — this script started again with ``--serve-manager``: a ``ManagerService`` with the
PostgreSQL ledger (a database of its own, created and dropped by the run), the descriptor's
capacity (``admission_capacity="descriptor"``, what several managers on one ledger use), the
same descriptor, requirements and policy as ``bench/admission.py`` — on one fresh
``bench-<uuid8>`` namespace, so they share the ``rpc`` queue and the broker hands each request
to one of them. This process is the load generator (``MeshClient.admit``, fresh time-ordered
IDs, closed loop): ``--per-manager`` requests in flight for each manager (16: each manager
sees the same offered load in both configurations, so what changes is only that another
manager shares the ledger). A manager reports its own process CPU and its count of admitted
decisions when asked (a line on its stdin), before and after the measured window; the row
is its CPU over its decisions. Every decision must be ``admitted`` (checked).

Targets: the median CPU per admission of a manager with two managers is at most 1.1x the
single manager's; two managers decide more admissions per second in total than one. On a
2-core machine the broker, the load generator and the managers share two cores, so the total
shows the machine's limit more than the design's: the CPU figure is the one that carries to a
machine where each manager has a core of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson
import psycopg
from admission import POLICY, closed_loop, descriptor, requirements
from report import Report, Target, add_json_argument, broker_unreachable, postgres_unreachable

from mesh import constants as c
from mesh.producer import MeshClient
from mesh.topology.specs import Topology
from mesh.transport.amqp import AmqpTransport, redact
from mesh.wire import DescriptorAccepted

DEFAULT_PG_DSN = "postgresql://postgres@127.0.0.1:5432/mesh_test"
TARGET_CPU_GROWTH = 1.1  # CPU per admission with two managers / with one, at most


# ---- a manager process ------------------------------------------------------------------------


async def serve_manager(url: str, namespace: str, dsn: str, journal: Path, manager_id: str) -> None:
    """One manager on the shared ledger; answers ``stats`` lines on stdin with its CPU seconds
    admitted count and ledger batches (one JSON line on stdout), stops at end of input."""
    from mesh.gc_tuning import tune_gc
    from mesh.manager.service import ManagerService
    from mesh.manager.settings import ManagerSettings

    settings = ManagerSettings(
        amqp_url=url,
        namespace=namespace,
        journal_path=journal,
        ledger_url=dsn,
        manager_id=manager_id,
        admission=POLICY,
        admission_capacity="descriptor",
        operator_user=urlsplit(url).username or "guest",
        http_port=None,
    )
    service = ManagerService(settings)
    await service.start()
    tune_gc()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(orjson.dumps({"started": manager_id}).decode(), flush=True)
    try:
        while await reader.readline():
            stats = {
                "cpu": time.process_time(),
                "admitted": service.counters["admission.admitted"],
                "batches": service.counters["admission_batches"],
            }
            print(orjson.dumps(stats).decode(), flush=True)
    finally:
        await service.stop()


class ManagerProcess:
    """A ``--serve-manager`` child: started, asked for its figures, stopped."""

    def __init__(self, proc: asyncio.subprocess.Process, manager_id: str) -> None:
        self.proc = proc
        self.manager_id = manager_id

    @classmethod
    async def start(
        cls, url: str, namespace: str, dsn: str, journal: Path, manager_id: str
    ) -> ManagerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--serve-manager",
            namespace,
            dsn,
            str(journal),
            manager_id,
            "--amqp-url",
            url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self = cls(proc, manager_id)
        line = await self._line(timeout_s=60)
        if line.get("started") != manager_id:
            raise RuntimeError(f"manager {manager_id} did not start: {line}")
        return self

    async def _line(self, timeout_s: float = 10) -> dict[str, object]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not raw:
            raise RuntimeError(f"manager {self.manager_id} exited ({await self.proc.wait()})")
        return dict(orjson.loads(raw))

    async def stats(self) -> tuple[float, int, int]:
        """(CPU seconds, admitted decisions, ledger batches) so far."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        line = await self._line()
        return float(line["cpu"]), int(line["admitted"]), int(line["batches"])  # type: ignore[arg-type]

    async def stop(self) -> None:
        if self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# ---- the load and one configuration -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManagerFigures:
    manager_id: str
    decisions: int
    cpu_seconds: float
    batches: int  # ledger transactions the decisions took (the group commits)

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / max(self.decisions, 1) * 1e6


@dataclass(frozen=True, slots=True)
class ConfigRound:
    managers: int
    seconds: float
    requests: int
    per_manager: list[ManagerFigures]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


async def admit_all(client: MeshClient, count: int, in_flight: int) -> float:
    """``count`` admissions, ``in_flight`` at a time (``admission.closed_loop``), each of
    which must be admitted; the wall seconds they took."""
    needs = requirements(time.time())
    refused: list[str] = []

    async def admit(_: int) -> None:
        decision = await client.admit(needs)
        if decision.outcome != "admitted":
            refused.append(f"{decision.outcome} {decision.reason}: {decision.detail}")

    done = await closed_loop(admit, count, in_flight)
    if refused:
        raise RuntimeError(f"{len(refused)} admissions not admitted: {refused[0]}")
    return done.seconds


async def run_config(
    url: str, dsn: str, workdir: Path, managers: int, count: int, per_manager: int
) -> ConfigRound:
    """``managers`` fresh manager processes on a fresh namespace and the shared ledger."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    procs: list[ManagerProcess] = []
    client: MeshClient | None = None
    try:
        procs = list(
            await asyncio.gather(
                *(
                    ManagerProcess.start(
                        url, namespace, dsn, workdir / f"{namespace}-{n}.sqlite3", f"m{n}"
                    )
                    for n in range(managers)
                )
            )
        )
        client = await MeshClient.connect(url, namespace=namespace, name="bench-managers-load")
        accepted = await client.publish_descriptor(descriptor(time.time()))
        if not isinstance(accepted, DescriptorAccepted):
            raise RuntimeError(f"the manager refused the descriptor: {accepted}")
        await warm_up(client, managers, per_manager)
        before = [await p.stats() for p in procs]
        seconds = await admit_all(client, count * managers, per_manager * managers)
        after = [await p.stats() for p in procs]
        figures = [
            ManagerFigures(p.manager_id, a[1] - b[1], a[0] - b[0], a[2] - b[2])
            for p, b, a in zip(procs, before, after, strict=True)
        ]
        return ConfigRound(managers, seconds, count * managers, figures)
    finally:
        if client is not None:
            await client.close()
        for proc in procs:
            await proc.stop()
        await delete_namespace(url, namespace)


async def warm_up(client: MeshClient, managers: int, per_manager: int) -> None:
    """Until every manager has loaded the descriptor from the ledger (each does on its tick),
    some requests are refused; then a few hundred more warm the caches and the ledger."""
    deadline = time.monotonic() + 30
    while True:
        try:
            await admit_all(client, 50 * managers, per_manager * managers)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    await admit_all(client, 300 * managers, per_manager * managers)


async def delete_namespace(url: str, namespace: str) -> None:
    transport = await AmqpTransport.connect(url, name="bench-managers-cleanup")
    try:
        with contextlib.suppress(Exception):
            topology = Topology(namespace=namespace)
            # With the pool's task queue, which a manager declared on accepting the descriptor.
            pool_id = descriptor(time.time()).pool_id
            await transport.delete_declared(topology.manager() + topology.pool(pool_id))
    finally:
        await transport.close()


# ---- the shared ledger's database ---------------------------------------------------------------


@contextlib.contextmanager
def fresh_database(dsn: str):  # type: ignore[no-untyped-def]
    """A database of its own on the server of ``dsn``, dropped afterwards: its DSN."""
    name = f"bench_{uuid.uuid4().hex[:8]}"
    parts = urlsplit(dsn)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---- main ---------------------------------------------------------------------------------------


async def run(url: str, dsn: str, count: int, rounds: int, per_manager: int) -> list[ConfigRound]:
    results: list[ConfigRound] = []
    with tempfile.TemporaryDirectory(prefix="bench-managers-") as tmp:
        print(
            f"   {'round':>5}  {'managers':>8}  {'manager':>7}  {'decisions':>9}  "
            f"{'CPU µs/admission':>16}  {'per batch':>9}  {'total adm/s':>11}"
        )
        for n in range(1, rounds + 1):
            for managers in (1, 2) if n % 2 else (2, 1):
                result = await run_config(url, dsn, Path(tmp), managers, count, per_manager)
                results.append(result)
                for m in result.per_manager:
                    print(
                        f"   {n:>5}  {managers:>8}  {m.manager_id:>7}  {m.decisions:>9,}  "
                        f"{m.cpu_us:>16,.0f}  {m.decisions / max(m.batches, 1):>9.1f}  "
                        f"{result.rate:>11,.0f}",
                        flush=True,
                    )
    return results


def summarise(results: list[ConfigRound], report: Report) -> None:
    cpu = {
        m: statistics.median(f.cpu_us for r in results if r.managers == m for f in r.per_manager)
        for m in (1, 2)
    }
    rate = {m: statistics.median(r.rate for r in results if r.managers == m) for m in (1, 2)}
    print()
    for m in (1, 2):
        print(
            f"   median with {m} manager{'s' if m > 1 else ' '}: {cpu[m]:,.0f} µs CPU per "
            f"admission per manager, {rate[m]:,.0f} admissions/s in total"
        )
        report.figure(managers=m, cpu_us_per_admission=cpu[m], rate=rate[m], unit="µs CPU")
    growth = cpu[2] / cpu[1]
    report.targets.append(
        Target(
            "cpu_per_admission_two_managers",
            growth <= TARGET_CPU_GROWTH,
            f"with two managers on one PostgreSQL ledger each spends {growth:.2f}x the CPU per "
            f"admission of one manager alone (target ≤ {TARGET_CPU_GROWTH:g}x)",
            value=cpu[2],
            baseline=cpu[1],
            ratio=growth,
            bound=f"<= {TARGET_CPU_GROWTH:g}",
        )
    )
    total = rate[2] / rate[1]
    report.targets.append(
        Target(
            "total_rate_two_managers",
            total > 1.0,
            f"two managers decide {total:.2f}x the admissions per second of one in total "
            "(target > 1x)",
            value=rate[2],
            baseline=rate[1],
            ratio=total,
            bound="> 1",
        )
    )


async def reachable(url: str, dsn: str) -> str | None:
    """Why the bench cannot run here, or ``None``."""
    return await broker_unreachable(url, "bench-managers-probe") or postgres_unreachable(dsn)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller rounds (about a minute)")
    parser.add_argument("--amqp-url", default=os.environ.get("MESH_AMQP_URL", c.DEFAULT_AMQP_URL))
    parser.add_argument(
        "--postgres-dsn", default=os.environ.get("MESH_TEST_POSTGRES_DSN", DEFAULT_PG_DSN)
    )
    parser.add_argument("--per-manager", type=int, default=16, help="requests in flight each")
    parser.add_argument("--serve-manager", nargs=4, metavar=("NS", "DSN", "JOURNAL", "ID"))
    add_json_argument(parser)
    args = parser.parse_args()
    logging.getLogger("mesh").setLevel(logging.ERROR)
    for client in ("aio_pika", "aiormq"):
        logging.getLogger(client).setLevel(logging.CRITICAL)
    if args.serve_manager:
        namespace, dsn, journal, manager_id = args.serve_manager
        asyncio.run(serve_manager(args.amqp_url, namespace, dsn, Path(journal), manager_id))
        return 0

    started = time.perf_counter()
    report = Report("managers")
    count, rounds = (1_000, 2) if args.quick else (3_000, 3)
    why_not = asyncio.run(reachable(args.amqp_url, args.postgres_dsn))
    if why_not is not None:
        print(f"skipped: {why_not}.")
        report.skipped.append(f"several managers: {why_not}")
        return report.finish(started, args.json)
    print(
        f"several managers on one PostgreSQL ledger, broker {redact(args.amqp_url)}: "
        f"{count:,} admissions per manager per round, {args.per_manager} in flight per manager"
    )
    with fresh_database(args.postgres_dsn) as dsn:
        results = asyncio.run(run(args.amqp_url, dsn, count, rounds, args.per_manager))
    summarise(results, report)
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
