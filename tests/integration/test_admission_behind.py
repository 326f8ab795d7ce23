"""The manager's admission pipeline on PostgreSQL, over the broker: batches decided while the
batch before them is written (``Admitter.admit_begin``) answer every request once, in a pool
that fills up and empties again, and the ledger keeps exactly what was answered."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from ledger.conftest import DEFAULT_TEST_POSTGRES_DSN, START_POSTGRES_HINT, schema_name
from ledger.test_ledger_contract import assert_conserved

from mesh.ledger import PostgresLedger
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.transport import AmqpTransport
from mesh.wire import DescriptorAccepted

from .harness import live_member, start_manager
from .test_admission import RAG_AGENT, REQUIREMENTS, settings_for
from .test_admission_competition import descriptor

pytestmark = pytest.mark.integration

SANDBOXES = 16  # the pool's tightest counter: more requests than this are in flight
TASKS = 6  # per producer, each retried until admitted


@pytest.fixture
def pg_schema(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    dsn = os.environ.get("MESH_TEST_POSTGRES_DSN", DEFAULT_TEST_POSTGRES_DSN)
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.Error as exc:
        pytest.fail(f"No PostgreSQL answers ({exc}); {START_POSTGRES_HINT}.", pytrace=False)
    schema = schema_name(request.node.name)
    yield dsn, schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
async def manager(
    amqp_url: str, namespace: str, tmp_path: Path, pg_schema: tuple[str, str]
) -> AsyncIterator[ManagerService]:
    dsn, schema = pg_schema
    settings = settings_for(
        amqp_url, namespace, tmp_path, ledger_url=dsn, ledger_schema=schema,
        admission_write_behind=True,
    )  # fmt: skip
    service = await start_manager(settings)
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    await live_member(service, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
    yield service
    await transport.close()
    await service.stop()


async def test_admissions_decided_behind_are_answered_once_and_kept_exactly(
    manager: ManagerService, amqp_url: str, namespace: str, pg_schema: tuple[str, str]
) -> None:
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        accepted = await client.publish_descriptor(descriptor(SANDBOXES))
        assert isinstance(accepted, DescriptorAccepted)
        outcomes: Counter[str] = Counter()
        held: list[object] = []

        async def producer(n: int) -> None:
            for task in range(TASKS):
                admission_id = uuid.uuid4().hex
                while True:  # a deferred request comes back with the same ID, as producers do
                    decision = await client.admit(REQUIREMENTS, admission_id=admission_id)
                    outcomes[decision.outcome] += 1
                    if decision.grant is not None:
                        break
                    await asyncio.sleep(0.02)
                if n % 2 and task == TASKS - 1:  # half the producers keep their last grant
                    held.append(decision.grant)
                else:
                    assert (await client.release_admission(decision.grant)).released

        await asyncio.wait_for(asyncio.gather(*(producer(n) for n in range(24))), timeout=120)
    finally:
        await client.close()

    assert outcomes["admitted"] == 24 * TASKS  # every task got its grant, once
    assert outcomes["deferred"] > 0 and len(held) == 12  # the pool was full at times
    assert manager.counters["admission_batches_behind"] > 0  # the pipeline ran
    dsn, schema = pg_schema
    ledger = PostgresLedger(dsn, schema=schema)
    try:
        assert sorted(r.admission_id for r in ledger.active()) == sorted(
            g.admission_id
            for g in held  # type: ignore[attr-defined]
        )
        assert_conserved(ledger)
    finally:
        ledger.close()
