"""Shard ownership when a manager dies or freezes: three ``mesh manager --shards`` processes on
one PostgreSQL ledger and the real broker.

1. kill -9 the manager holding the most shards: the two others hold every shard again within
   the lease time plus a step (a third of a lease), and say so in their journals — the
   takeover time is printed;
2. SIGSTOP a manager past its lease, then SIGCONT: the others have taken its shards; the first
   thing it journals on waking is the loss of each (``shard`` / ``lost``), and whatever it
   holds afterwards it holds under a new, larger fence.

The same faults with agents and producers' requests under way are in
``test_shard_failover_load.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from integration.harness import eventually
from integration.test_admission_competition import PgSchema

from mesh.ledger.shard_leases import ShardLeases, ShardView
from mesh.manager.journal import SqliteJournal

SHARDS = 6
LEASE_S = 1.5
STEP_S = LEASE_S / 3


class Fleet:
    """Three manager processes sharing a namespace, a ledger schema and the shard leases."""

    def __init__(
        self,
        amqp_url: str,
        namespace: str,
        dsn: str,
        schema: str,
        tmp: Path,
        *,
        lease_s: float = LEASE_S,
    ) -> None:
        self.amqp_url, self.namespace, self.dsn, self.schema, self.tmp = (
            amqp_url,
            namespace,
            dsn,
            schema,
            tmp,
        )
        self.lease_s = lease_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[IO[bytes]] = []
        self.leases = ShardLeases(dsn, SHARDS, schema=schema)

    def start(self, manager_id: str, amqp_url: str | None = None) -> None:
        """A manager process; ``amqp_url`` another way to the broker (a TCP proxy)."""
        self.logs.append((self.tmp / f"{manager_id}.log").open("wb"))
        self.procs[manager_id] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mesh",
                "manager",
                "--manager-id",
                manager_id,
                "--journal",
                str(self.journal_path(manager_id)),
                "--ledger",
                self.dsn,
                "--ledger-schema",
                self.schema,
                "--shards",
                str(SHARDS),
                "--shard-lease",
                str(self.lease_s),
                "--http-port",
                "-1",
                "--operator-user",  # the test's producer publishes the descriptors
                "guest",
            ],
            env={
                **os.environ,
                "MESH_AMQP_URL": amqp_url or self.amqp_url,
                "MESH_NAMESPACE": self.namespace,
            },
            stdout=subprocess.DEVNULL,
            stderr=self.logs[-1],
        )

    def journal_path(self, manager_id: str) -> Path:
        return self.tmp / f"{manager_id}.sqlite3"

    def view(self) -> ShardView:
        return self.leases.view()

    def held_by(self) -> dict[str, set[int]]:
        owners: dict[str, set[int]] = {}
        for shard, lease in self.view().leases.items():
            owners.setdefault(lease.owner, set()).add(shard)
        return owners

    def shard_log(self, manager_id: str) -> list[tuple[str, int, int | None]]:
        journal = SqliteJournal(self.journal_path(manager_id))
        try:
            return [
                (e.reason, int(e.detail["shard"]), e.detail.get("fence"))
                for e in journal.query(kinds=["shard"], limit=None)
            ]
        finally:
            journal.close()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        self.leases.close()


def managers_of(fleet: Fleet, count: int) -> Iterator[Fleet]:
    """``fleet`` with managers ``m0`` … running, stopped afterwards (a fixture's body)."""
    try:
        for n in range(count):
            fleet.start(f"m{n}")
        yield fleet
    finally:
        fleet.stop_all()  # before the schema is dropped


@pytest.fixture
def fleet(amqp_url: str, namespace: str, pg_schema: PgSchema, tmp_path: Path) -> Iterator[Fleet]:
    yield from managers_of(Fleet(amqp_url, namespace, pg_schema.dsn, pg_schema.schema, tmp_path), 3)


async def until(
    check: Callable[[], bool] | Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0
) -> float:
    """Seconds until ``check`` holds (``harness.eventually``, polled every 50 ms)."""
    started = time.monotonic()
    await eventually(check, what=what, timeout_s=timeout_s, poll_s=0.05)
    return time.monotonic() - started


def balanced(fleet: Fleet, managers: set[str]) -> bool:
    held = fleet.held_by()
    return (
        set(held) == managers
        and sum(map(len, held.values())) == SHARDS
        and all(len(s) == SHARDS // len(managers) for s in held.values())
    )


async def test_a_killed_managers_shards_are_taken_over_within_the_lease_and_a_step(
    fleet: Fleet,
) -> None:
    await until(lambda: balanced(fleet, {"m0", "m1", "m2"}), "an even split over three")
    held = fleet.held_by()
    victim = max(held, key=lambda m: (len(held[m]), m))
    orphaned = held[victim]
    fleet.procs[victim].send_signal(signal.SIGKILL)
    fleet.procs[victim].wait()
    killed = time.monotonic()

    def taken_over() -> bool:
        owners = fleet.held_by()
        return victim not in owners and sum(map(len, owners.values())) == SHARDS

    took = await until(taken_over, "the survivors hold every shard")
    print(f"\ntakeover of {len(orphaned)} shards after kill -9: {took:.2f} s (lease {LEASE_S} s)")
    assert took <= LEASE_S + 2 * STEP_S + 0.5  # the lease, a step, and the test's polling
    await until(lambda: balanced(fleet, {"m0", "m1", "m2"} - {victim}), "an even split of two")
    survivors_took = {
        shard
        for m in {"m0", "m1", "m2"} - {victim}
        for change, shard, _ in fleet.shard_log(m)
        if change == "taken"
    }
    assert orphaned <= survivors_took  # every transfer is in the orchestration log
    assert time.monotonic() - killed < 30


async def test_a_manager_frozen_past_its_lease_wakes_to_its_losses_and_new_fences(
    fleet: Fleet,
) -> None:
    await until(lambda: balanced(fleet, {"m0", "m1", "m2"}), "an even split over three")
    frozen = "m1"
    before = {shard: lease.fence for shard, lease in fleet.view().leases.items()}
    mine = {s for s, lease in fleet.view().leases.items() if lease.owner == frozen}
    fleet.procs[frozen].send_signal(signal.SIGSTOP)
    await until(
        lambda: frozen not in fleet.held_by() and sum(map(len, fleet.held_by().values())) == 6,
        "the others take the frozen manager's shards",
    )
    fleet.procs[frozen].send_signal(signal.SIGCONT)
    await until(
        lambda: {s for change, s, _ in fleet.shard_log(frozen) if change == "lost"} >= mine,
        "the woken manager journals each loss",
    )
    log = fleet.shard_log(frozen)
    first_loss = next(i for i, (change, _, _) in enumerate(log) if change == "lost")
    after_wake = log[first_loss:]
    assert all(change != "taken" for change, _, _ in after_wake[: len(mine)])  # losses first
    await until(lambda: balanced(fleet, {"m0", "m1", "m2"}), "an even split again")
    for shard, lease in fleet.view().leases.items():
        if lease.owner == frozen:
            assert lease.fence > before[shard]  # held again only under a new tenure
