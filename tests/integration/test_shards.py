"""Managers with ``shard_count`` set share the registry's shards through the real PostgreSQL
lease table, on the real broker: an even split, every transfer in the orchestration log, a
clean stop handing its shards over, and a clear error without a PostgreSQL ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from mesh.errors import LocalProtocolError
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.render import render_status
from mesh.wire.models import StatusRequest

from . import test_admission_competition as competition
from .harness import eventually
from .test_admission_competition import PgSchema

pg_schema = competition.pg_schema  # the competition tests' fixture: a schema of the test's own

pytestmark = pytest.mark.integration

SHARDS = 4
LEASE_S = 1.0

MakeManager = Callable[[str], ManagerSettings]


@pytest.fixture
async def started(
    amqp_url: str, namespace: str, pg_schema: PgSchema, tmp_path: Path
) -> AsyncIterator[Callable[[str], asyncio.Future[ManagerService]]]:
    dsn, schema = pg_schema.dsn, pg_schema.schema
    services: list[ManagerService] = []

    async def start(manager_id: str) -> ManagerService:
        settings = ManagerSettings(
            amqp_url=amqp_url,
            namespace=namespace,
            journal_path=tmp_path / f"{manager_id}.sqlite3",
            manager_id=manager_id,
            ledger_url=dsn,
            ledger_schema=schema,
            admission_capacity="descriptor",
            shard_count=SHARDS,
            shard_lease_s=LEASE_S,
        )
        service = ManagerService(settings)
        services.append(service)
        await service.start()
        return service

    yield start  # type: ignore[misc]
    for service in reversed(services):
        await service.stop()


def owned(service: ManagerService) -> set[int]:
    assert service.shards is not None
    return set(service.shards.owned())


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> float:
    """Seconds until ``check`` holds (``harness.eventually``, polled every 50 ms)."""
    started = time.monotonic()
    await eventually(check, what=what, timeout_s=timeout_s, poll_s=0.05)
    return time.monotonic() - started


def shard_log(service: ManagerService) -> list[tuple[str, int]]:
    assert service.journal is not None
    return [
        (e.reason, int(e.detail["shard"]))
        for e in service.journal.query(limit=None)
        if e.kind == "shard"
    ]


async def test_two_managers_split_the_shards_and_a_clean_stop_hands_them_over(
    started: Callable[[str], asyncio.Future[ManagerService]],
) -> None:
    a = await started("manager-a")
    assert owned(a) == set(range(SHARDS))  # alone, it holds everything from its start
    b = await started("manager-b")
    await until(lambda: len(owned(a)) == len(owned(b)) == SHARDS // 2, "an even split")
    assert owned(a) | owned(b) == set(range(SHARDS))
    assert sorted(s for change, s in shard_log(a) if change == "given_back") == sorted(owned(b))
    assert sorted(s for change, s in shard_log(b) if change == "taken") == sorted(owned(b))

    assert a.shards is not None
    await a.shards.step()  # a fresh read of the table for the status below
    reply = a.status(StatusRequest(agents_limit=10))
    assert reply.shard_count == SHARDS
    assert {(row.shard, row.owner) for row in reply.shards or []} == {
        *((s, "manager-a") for s in owned(a)),
        *((s, "manager-b") for s in owned(b)),
    }
    metrics = a.observer.metrics.render().decode()
    assert f'mesh_shards_held{{manager="manager-a"}} {len(owned(a))}.0' in metrics
    for shard, fence in a.shards.owned().items():
        assert f'mesh_shard_fence{{manager="manager-a",shard="{shard}"}} {fence}.0' in metrics
    assert 'mesh_shard_transfers_total{change="given_back",manager="manager-a"}' in metrics
    shown = render_status(reply)
    assert f"shards: {SHARDS} of {SHARDS} held" in shown
    assert "manager-b" in shown

    handed = owned(b)
    await b.stop()
    # No lease to wait out: a's next step (a third of a lease) takes them.
    took = await until(lambda: owned(a) == set(range(SHARDS)), "a takes b's shards back")
    assert took < LEASE_S
    reopened = SqliteJournal(b.settings.journal_path)  # b's own journal, closed with b
    try:
        given = [e.detail["shard"] for e in reopened.query(limit=None) if e.reason == "given_back"]
    finally:
        reopened.close()
    assert set(given) >= handed


async def test_shards_without_a_postgresql_ledger_are_a_clear_error(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    settings = ManagerSettings(
        amqp_url=amqp_url,
        namespace=namespace,
        journal_path=tmp_path / "journal.sqlite3",
        ledger_url=f"sqlite:{tmp_path / 'ledger.sqlite3'}",
        shard_count=4,
    )
    with pytest.raises(LocalProtocolError, match="shards need a PostgreSQL ledger"):
        await ManagerService(settings).start()
