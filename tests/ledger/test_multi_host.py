"""The PostgreSQL ledger URL goes to libpq as it is, so its multi-host form reaches the
primary: ``postgresql://user@a,b/db?target_session_attrs=read-write`` (docs/architecture.md,
"Production topology"). Here the first host is a port nobody listens on — a primary that
failed — and the second the test PostgreSQL: the ledger opens, writes and reads through it."""

from __future__ import annotations

import socket
import urllib.parse

import psycopg
import pytest

from mesh.manager.settings import open_ledger

from .conftest import schema_name

pytestmark = pytest.mark.integration


def a_port_nobody_listens_on() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: connections to it are refused


def test_a_multi_host_ledger_url_reaches_the_host_that_answers_as_primary(
    postgres_dsn: str,
) -> None:
    live = urllib.parse.urlsplit(postgres_dsn)
    hosts = f"127.0.0.1:{a_port_nobody_listens_on()},{live.hostname}:{live.port or 5432}"
    user = f"{live.username}@" if live.username else ""
    url = f"postgresql://{user}{hosts}{live.path}?target_session_attrs=read-write"
    schema = schema_name("multi_host")
    ledger = open_ledger(url, schema=schema)
    try:
        ledger.set_capacity("pool-a", "model_slots", 3)
        assert ledger.usage()[("pool-a", "model_slots")] == (0, 3)
    finally:
        ledger.close()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
