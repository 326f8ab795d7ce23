"""Fixtures for the reservation ledger: one contract, run against both stores.

``ledger`` is parametrised: ``sqlite`` (a file in ``tmp_path``) and ``postgres`` (a schema of
the test's own in ``MESH_TEST_POSTGRES_DSN``, default
``postgresql://postgres@127.0.0.1:5432/mesh_test``, dropped afterwards). The ``postgres``
variants are marked ``integration``. An unreachable PostgreSQL fails those tests with one
sentence — never a skip: in CI that must be a red build (``bash scripts/ensure-postgres.sh``
brings the server and the database up).
"""

from __future__ import annotations

import os
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from mesh.ledger import LedgerStore, PostgresLedger, SqliteLedger

DEFAULT_TEST_POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/mesh_test"
START_POSTGRES_HINT = "run `bash scripts/ensure-postgres.sh`"
STORE_KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _redact(dsn: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    return urllib.parse.urlunsplit(
        parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    )


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The test PostgreSQL's DSN, once it is known to answer (else the test fails)."""
    dsn = os.environ.get("MESH_TEST_POSTGRES_DSN", DEFAULT_TEST_POSTGRES_DSN)
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.Error as exc:
        error = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    else:
        return dsn
    why = "CI=true, so this is a failure, not a skip; " if _in_ci() else ""
    pytest.fail(
        f"No PostgreSQL answers at {_redact(dsn)} ({error}); "
        f"{why}{START_POSTGRES_HINT}, or set MESH_TEST_POSTGRES_DSN to a running server.",
        pytrace=False,
    )


def schema_name(test_name: str) -> str:
    """``t_<short test name>_<8 hex>``: a PostgreSQL identifier of the test's own."""
    short = re.sub(r"[^a-z0-9]+", "_", test_name.lower().removeprefix("test_")).strip("_")
    return f"t_{short[:40].rstrip('_') or 'x'}_{uuid.uuid4().hex[:8]}"


class LedgerFactory:
    """Opens ledgers of one kind for a test and cleans up after it.

    ``open()`` opens the test's ledger (again: closing and reopening is how recovery is
    tested); ``open(fresh())`` opens a separate, empty one. ``location()`` is what another
    process needs to open the same ledger. Stores close last-in-first-out; PostgreSQL schemas
    are dropped at the end.
    """

    def __init__(self, kind: str, tmp_path: Path, test_name: str, dsn: str | None) -> None:
        self.kind = kind
        self.dsn = dsn
        self._tmp_path = tmp_path
        self._test_name = test_name
        self._opened: list[LedgerStore] = []
        self._schemas: list[str] = []
        self.main = self.fresh()

    def fresh(self) -> str:
        """A new, empty location: a file path (sqlite) or a schema name (postgres)."""
        if self.kind == "sqlite":
            return str(self._tmp_path / f"ledger-{uuid.uuid4().hex[:8]}.sqlite3")
        schema = schema_name(self._test_name)
        self._schemas.append(schema)
        return schema

    def open(self, location: str | None = None) -> LedgerStore:
        where = location or self.main
        store: LedgerStore
        if self.kind == "sqlite":
            store = SqliteLedger(where)
        else:
            assert self.dsn is not None
            store = PostgresLedger(self.dsn, schema=where, application_name=self._test_name[:60])
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        while self._opened:
            self._opened.pop().close()
        if self._schemas:
            assert self.dsn is not None
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for schema in self._schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def ledger_factory(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[LedgerFactory]:
    dsn = request.getfixturevalue("postgres_dsn") if store_kind == "postgres" else None
    factory = LedgerFactory(store_kind, tmp_path, request.node.name, dsn)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture
def ledger(ledger_factory: LedgerFactory) -> LedgerStore:
    """The test's own, empty ledger (SQLite or PostgreSQL)."""
    return ledger_factory.open()
