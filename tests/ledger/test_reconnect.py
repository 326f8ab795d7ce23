"""A server that closed the ledger's connection while it was idle (a PostgreSQL restart, a
failover, an administrator's ``pg_terminate_backend``) costs the next call nothing: the
connection is found dead before anything is sent on it and opened again, so the first
statement after a restart neither fails nor leaves an outcome unknown. On the shared test
PostgreSQL, by ending only this test's own backends."""

from __future__ import annotations

import time

import psycopg
import pytest

from mesh.ledger import PostgresLedger
from mesh.ledger.pg_connection import PgConnection, usable
from mesh.ledger.shard_leases import ShardLeases

from .conftest import schema_name

pytestmark = pytest.mark.integration


def terminate(dsn: str, application_name: str) -> int:
    """End every backend of ``application_name`` as an administrator would; how many."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchall()
    time.sleep(0.2)  # the goodbye reaches the client's socket
    return len(rows)


def drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_connection_the_server_closed_while_idle_is_not_usable(postgres_dsn: str) -> None:
    pg = PgConnection(postgres_dsn, what="a test", application_name="mesh-test-usable")
    first = pg.get()
    assert usable(first)
    assert terminate(postgres_dsn, "mesh-test-usable") == 1
    assert not usable(first)
    second = pg.get()
    assert second is not first and usable(second)
    assert second.execute("SELECT 1").fetchone() == (1,)
    pg.close()


def test_the_ledger_writes_and_reads_at_once_after_its_backend_was_terminated(
    postgres_dsn: str,
) -> None:
    schema = schema_name("reconnect")
    ledger = PostgresLedger(postgres_dsn, schema=schema, application_name="mesh-test-ledger-rc")
    try:
        ledger.set_capacity("pool-a", "model_slots", 3)
        assert terminate(postgres_dsn, "mesh-test-ledger-rc") == 1
        ledger.set_capacity("pool-a", "model_slots", 4)  # a write first: no StoreError
        assert terminate(postgres_dsn, "mesh-test-ledger-rc") == 1
        assert ledger.usage()[("pool-a", "model_slots")] == (0, 4)  # and a read
    finally:
        ledger.close()
        drop(postgres_dsn, schema)


def test_the_shard_leases_renew_at_once_after_their_backend_was_terminated(
    postgres_dsn: str,
) -> None:
    schema = schema_name("reconnect_shards")
    leases = ShardLeases(postgres_dsn, 2, schema=schema, application_name="mesh-test-shards-rc")
    try:
        fence = leases.take("m0", 0, 10.0)
        assert fence is not None
        assert terminate(postgres_dsn, "mesh-test-shards-rc") == 1
        assert leases.renew("m0", {0: fence}, 10.0) == {0: fence}
    finally:
        leases.close()
        drop(postgres_dsn, schema)
