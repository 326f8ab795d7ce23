"""The managers through a PostgreSQL crash and a failover (issue 47, fault test 2).

Two ``mesh manager --shards`` processes share a ledger and the shard leases in a PostgreSQL
of the suite's own (:mod:`tests.faults.pg_node`: a primary and a synchronous standby), reached
through libpq's multi-host URL (``host=a,b`` with ``target_session_attrs=read-write``), at the
documented 10 s shard lease. Producers run ``submit`` (admission: the ledger) and ``run_task``
(the lease path: the registry) in a loop the whole time, then:

1. the primary is killed -9 and started again (crash recovery);
2. the primary is killed -9 and the standby promoted (a failover, as an operator or Patroni
   would do it): the managers find the new primary by themselves.

Each ends on: every call answered (nothing lost); while PostgreSQL was away admissions were
*deferred* (``LEDGER_UNAVAILABLE``, with a retry time), never a transport error; admissions
flowing again within 10 s of PostgreSQL taking writes again; the ledger holds each admission
once under a fence of its own, every one released (0 double grants); no agent declared lost;
the lease path served throughout. Counts and times are printed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration.test_backpressure import echo_requirements

from mesh.ledger import PostgresLedger, ReservationState
from mesh.producer import MeshClient
from mesh.wire.admission import AdmissionDecision

from .pg_node import PgPair, pg_unavailable_reason
from .test_shard_failover import Fleet, balanced, managers_of, until
from .test_shard_failover_load import Load, agents, all_released, lost_in_journals, ready_for_load
from .test_shard_failover_load import producer as producer  # the fixture, used by name

assert agents  # the fixture, used by name (it asks for this module's ``fleet``)

LEASE_S = 10.0  # the documented default
SCHEMA = "mesh_pg_faults"
BACK_WITHIN_S = 10.0  # admissions flowing again after PostgreSQL takes writes


@pytest.fixture
def pg() -> Iterator[PgPair]:
    reason = pg_unavailable_reason()
    if reason is not None:
        pytest.fail(reason)  # never a skip: a fault suite that did not run is a red build
    pair = PgPair()
    pair.start()
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def fleet(amqp_url: str, namespace: str, pg: PgPair, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(amqp_url, namespace, pg.multi_host_dsn(), SCHEMA, tmp_path, lease_s=LEASE_S)
    yield from managers_of(fleet, 2)


@pytest.fixture
def ledger(pg: PgPair, fleet: Fleet) -> Iterator[PostgresLedger]:
    store = PostgresLedger(pg.multi_host_dsn(), schema=SCHEMA, application_name="test-view")
    try:
        yield store
    finally:
        store.close()


class WatchedLoad(Load):
    """:class:`Load`, counting every deferral's reason on the admission path."""

    def __init__(self, producer: MeshClient) -> None:
        super().__init__(producer)
        self.deferrals: Counter[str] = Counter()

    async def _admission_path(self) -> None:
        def deferred(decision: AdmissionDecision) -> bool:
            self.deferrals[str(decision.reason)] += 1
            assert decision.retry_after_ms is not None, decision
            return True

        while not self._stop.is_set():
            try:
                submitted = await self.producer.submit(
                    echo_requirements(),
                    {"message": "admitted", "sleep_ms": 20},
                    timeout_s=30,
                    on_deferred=deferred,
                )
                self.admitted.append(submitted.decision.admission_id)
                self.done["submit"] += 1
            except Exception as exc:
                self.failures.append(f"submit: {exc!r}")


async def _under_fault(
    fleet: Fleet, producer: MeshClient, ledger: PostgresLedger, agents: list[str], fault: str,
    pg: PgPair,
) -> None:  # fmt: skip
    everyone_registered = await ready_for_load(fleet, producer, len(agents))
    await until(lambda: balanced(fleet, {"m0", "m1"}), "an even split over two")
    load = WatchedLoad(producer)
    load.start()
    await asyncio.sleep(3.0)
    before = dict(load.done)

    away_at = time.monotonic()
    pg.primary.crash()
    if fault == "restart":
        await asyncio.sleep(2.0)  # away for a while: requests arrive meanwhile
        await asyncio.to_thread(pg.primary.start)
    else:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg.standby.promote)
    writes_at = time.monotonic()
    done_at_writes = dict(load.done)
    run_tasks_while_away = done_at_writes.get("run_task", 0) - before.get("run_task", 0)

    def admitted_since_writes() -> bool:
        return load.done["submit"] > done_at_writes.get("submit", 0) + 3

    back = await until(admitted_since_writes, "admissions flowing again", timeout_s=40)
    await until(everyone_registered, "every agent registered")
    await asyncio.sleep(3.0)
    await load.stop()
    await until(lambda: all_released(ledger), "every grant released (releases asked again)")

    reservations = {r: state for r, (state, _) in ledger.replay_log().items()}
    fences = [fence for _, fence in ledger.replay_log().values()]
    sent = sum(load.done.values()) + len(load.failures)
    print(
        f"\nPostgreSQL {fault}: away {writes_at - away_at:.2f} s; admissions flowing again "
        f"{back:.2f} s after it took writes; sent {sent}, completed {dict(load.done)}, "
        f"lost {len(load.failures)}, granted twice {len(fences) - len(set(fences))}; "
        f"deferrals {dict(load.deferrals)}; run_task done while it was away "
        f"{run_tasks_while_away}"
    )
    assert load.failures == []
    assert back <= BACK_WITHIN_S
    assert load.deferrals["LEDGER_UNAVAILABLE"] > 0  # it was away, and admission said so
    assert set(load.admitted) <= set(reservations)
    assert Counter(reservations.values()) == {ReservationState.RELEASED: len(reservations)}
    assert len(fences) == len(set(fences))
    assert lost_in_journals(fleet) == []
    assert run_tasks_while_away > 0  # the registry kept serving leases


async def test_a_postgres_crash_and_restart_under_load_loses_nothing(
    fleet: Fleet, producer: MeshClient, ledger: PostgresLedger, agents: list[str], pg: PgPair
) -> None:
    await _under_fault(fleet, producer, ledger, agents, "restart", pg)


async def test_a_postgres_failover_to_its_standby_under_load_loses_nothing(
    fleet: Fleet, producer: MeshClient, ledger: PostgresLedger, agents: list[str], pg: PgPair
) -> None:
    await _under_fault(fleet, producer, ledger, agents, "failover", pg)
