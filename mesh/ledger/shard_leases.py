"""Shard ownership in PostgreSQL: one lease row per shard, with a fencing number.

How it works. When several managers share a namespace, each shard of the registry
(:mod:`mesh.core.shards`) is owned by one manager at a time through its row in
``"<schema>".shard_lease``: ``owner``, ``fence`` and ``expires_at``. Every time is the database
server's (``clock_timestamp()``), so the managers' own clocks never have to agree.

- **Take.** A manager takes a shard with one conditional ``UPDATE``: only if nobody holds it
  (no owner, or the lease has expired). Taking increments the fence, so every tenure of a
  shard has a fence larger than any before it.
- **Renew.** The holder extends its leases well before they expire; a renewal names the fence
  it holds and only succeeds while that lease is still its own and unexpired. A manager that
  was stopped (SIGSTOP, a long pause, a cut network) past its lease finds on waking that its
  renewal returns nothing: it has lost the shard and must not act on it.
- **Fenced writes.** A write the owner makes on behalf of a shard (the live capacity of its
  pools, :meth:`ShardLeases.publish_live`) runs :func:`fenced` in the same transaction first:
  it locks the lease row ``FOR SHARE`` and checks owner, fence and expiry. So a manager whose
  lease lapsed is refused by the store, and a take by the next owner waits for a write already
  under way to commit: nothing an old owner writes lands after the new owner has begun.
- **Give back.** A manager hands a shard over (rebalancing, a clean stop) by clearing its
  owner; the next take bumps the fence.

Who is live is kept in ``"<schema>".manager_presence``: each manager renews its row as it renews
its leases; a row past its expiry is a manager that is gone. The shard count is stored once in
``"<schema>".shard_config``: a manager configured with another count is refused at open, since
two counts would route the same pool to two shards.
"""

from __future__ import annotations

import logging
import re
import select
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import orjson
import psycopg
from psycopg import sql

from mesh.errors import LocalProtocolError, StoreError
from mesh.ledger.pg_connection import PgConnection
from mesh.ledger.shared_live import LiveOffer, PoolLive, check_shard_count

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SCHEMA: Final = "mesh_ledger"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True, slots=True)
class ShardLease:
    """A live holder of a shard and its fence."""

    owner: str
    fence: int


@dataclass(frozen=True, slots=True)
class ShardView:
    """One read of the table: live managers, live leases, and the server's time then."""

    managers: tuple[str, ...]
    leases: Mapping[int, ShardLease]  # only unexpired leases with an owner
    server_time: float  # Unix seconds, the database's clock

    def owners(self) -> dict[int, str | None]:
        return {shard: lease.owner for shard, lease in self.leases.items()}

    def fences(self) -> dict[int, int]:
        return {shard: lease.fence for shard, lease in self.leases.items()}


def _ddl(s: str) -> list[str]:
    return [
        f'CREATE SCHEMA IF NOT EXISTS "{s}"',
        f"""CREATE TABLE IF NOT EXISTS "{s}".shard_config (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        )""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".shard_lease (
            shard      INTEGER     PRIMARY KEY CHECK (shard >= 0),
            owner      TEXT,
            fence      BIGINT      NOT NULL DEFAULT 0,
            expires_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity'
        )""",
        f"""CREATE TABLE IF NOT EXISTS "{s}".manager_presence (
            manager_id TEXT        PRIMARY KEY,
            expires_at TIMESTAMPTZ NOT NULL
        )""",
        # Each pool's live offers as its shard's owner last wrote them ([[capability, version,
        # cost class, agents, free], ...]), for the other managers' admission decisions.
        f"""CREATE TABLE IF NOT EXISTS "{s}".live_offer (
            pool_id    TEXT             PRIMARY KEY,
            shard      INTEGER          NOT NULL,
            fence      BIGINT           NOT NULL,
            offers     JSONB            NOT NULL,
            retry_s    DOUBLE PRECISION,
            written_at TIMESTAMPTZ      NOT NULL
        )""",
    ]


def fenced(cursor: psycopg.Cursor[Any], schema: str, shard: int, owner: str, fence: int) -> bool:
    """Inside a write transaction: lock shard ``shard``'s lease row for share and say whether
    ``owner`` still holds it at ``fence``. On ``False`` the caller must roll back."""
    cursor.execute(
        f'SELECT 1 FROM "{schema}".shard_lease WHERE shard = %s AND owner = %s AND fence = %s '
        "AND expires_at > clock_timestamp() FOR SHARE",
        (shard, owner, fence),
    )
    return cursor.fetchone() is not None


class ShardLeases:
    """The lease table of one namespace's shards in PostgreSQL schema ``schema``."""

    def __init__(
        self,
        dsn: str,
        shard_count: int,
        *,
        schema: str = DEFAULT_SCHEMA,
        application_name: str = "mesh-shards",
        connect_timeout_s: int = 10,
    ) -> None:
        if not _SCHEMA_NAME.fullmatch(schema):
            raise LocalProtocolError(f"schema must match {_SCHEMA_NAME.pattern}, got {schema!r}")
        self.shard_count = check_shard_count(shard_count)
        self.schema = schema
        self._dsn = dsn
        self._connect_kwargs: dict[str, Any] = {
            "application_name": application_name,
            "connect_timeout": connect_timeout_s,
        }
        self._pg = PgConnection(
            dsn, what=f"the shard lease table (schema {schema})", **self._connect_kwargs
        )
        self._lock = threading.Lock()
        try:
            self._transaction(self._create)
        except BaseException:
            self.close()
            raise

    # ---- the operations -----------------------------------------------------------------------
    def announce(self, manager_id: str, ttl_s: float) -> None:
        """Say ``manager_id`` is live for ``ttl_s`` more seconds (of the server's clock)."""
        self._statement(
            lambda cur: cur.execute(
                f'INSERT INTO "{self.schema}".manager_presence (manager_id, expires_at) '
                "VALUES (%s, clock_timestamp() + make_interval(secs => %s)) "
                "ON CONFLICT (manager_id) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                (manager_id, ttl_s),
            )
        )

    def view(self) -> ShardView:
        """Live managers and live leases, in one statement (one snapshot, one round trip)."""

        def read(cur: psycopg.Cursor[Any]) -> ShardView:
            cur.execute(
                "SELECT extract(epoch FROM clock_timestamp())::float8, "
                f'ARRAY(SELECT manager_id FROM "{self.schema}".manager_presence '
                "WHERE expires_at > clock_timestamp() ORDER BY manager_id), "
                f'ARRAY(SELECT ARRAY[shard::text, owner, fence::text] FROM "{self.schema}".'
                "shard_lease WHERE owner IS NOT NULL AND expires_at > clock_timestamp() "
                "ORDER BY shard)"
            )
            now, managers, leases = cur.fetchone() or (0.0, [], [])
            return ShardView(
                tuple(str(m) for m in managers),
                {int(s): ShardLease(str(o), int(f)) for s, o, f in leases},
                float(now),
            )

        return self._statement(read)

    def take(self, manager_id: str, shard: int, ttl_s: float) -> int | None:
        """Take ``shard`` if nobody holds it: the new fence, or ``None`` if it is held."""
        self._check_shard(shard)

        def take(cur: psycopg.Cursor[Any]) -> int | None:
            cur.execute(
                f'UPDATE "{self.schema}".shard_lease SET owner = %s, fence = fence + 1, '
                "expires_at = clock_timestamp() + make_interval(secs => %s) "
                "WHERE shard = %s AND (owner IS NULL OR expires_at <= clock_timestamp()) "
                "RETURNING fence",
                (manager_id, ttl_s, shard),
            )
            row = cur.fetchone()
            return None if row is None else int(row[0])

        return self._statement(take)

    def renew(self, manager_id: str, held: Mapping[int, int], ttl_s: float) -> dict[int, int]:
        """Extend the leases ``manager_id`` holds (shard → fence) and its presence; the ones
        still its own, extended. A shard missing from the answer is lost: do not act on it."""
        if not held:
            self.announce(manager_id, ttl_s)
            return {}

        def renew(cur: psycopg.Cursor[Any]) -> dict[int, int]:
            # One statement (a data-modifying WITH): presence and leases in one round trip,
            # all or nothing.
            cur.execute(
                "WITH presence AS ("
                f'INSERT INTO "{self.schema}".manager_presence (manager_id, expires_at) '
                "VALUES (%s, clock_timestamp() + make_interval(secs => %s)) "
                "ON CONFLICT (manager_id) DO UPDATE SET expires_at = EXCLUDED.expires_at) "
                f'UPDATE "{self.schema}".shard_lease AS l '
                "SET expires_at = clock_timestamp() + make_interval(secs => %s) "
                "FROM unnest(%s::int[], %s::bigint[]) AS h(shard, fence) "
                "WHERE l.shard = h.shard AND l.fence = h.fence AND l.owner = %s "
                "AND l.expires_at > clock_timestamp() RETURNING l.shard, l.fence",
                (manager_id, ttl_s, ttl_s, list(held), list(held.values()), manager_id),
            )
            return {int(s): int(f) for s, f in cur.fetchall()}

        return self._statement(renew)

    def give_back(self, manager_id: str, shard: int, fence: int) -> bool:
        """Hand ``shard`` over: its lease is cleared if ``manager_id`` still holds it at
        ``fence``. True if it did."""
        self._check_shard(shard)

        def give_back(cur: psycopg.Cursor[Any]) -> bool:
            cur.execute(
                f'UPDATE "{self.schema}".shard_lease SET owner = NULL, '
                "expires_at = clock_timestamp() WHERE shard = %s AND owner = %s AND fence = %s",
                (shard, manager_id, fence),
            )
            return cur.rowcount == 1

        return self._statement(give_back)

    def leave(self, manager_id: str) -> int:
        """A clean stop: give back every shard ``manager_id`` holds and drop its presence.
        The number of shards given back."""

        def leave(cur: psycopg.Cursor[Any]) -> int:
            cur.execute(
                f'UPDATE "{self.schema}".shard_lease SET owner = NULL, '
                "expires_at = clock_timestamp() WHERE owner = %s",
                (manager_id,),
            )
            given = cur.rowcount
            cur.execute(
                f'DELETE FROM "{self.schema}".manager_presence WHERE manager_id = %s',
                (manager_id,),
            )
            return given

        return self._transaction(leave)

    def run_fenced(
        self, shard: int, owner: str, fence: int, work: Callable[[psycopg.Cursor[Any]], T]
    ) -> T | None:
        """``work`` in one transaction, only while ``owner`` holds ``shard`` at ``fence``;
        ``None`` (nothing written) when it no longer does."""

        def guarded(cur: psycopg.Cursor[Any]) -> T | None:
            if not fenced(cur, self.schema, shard, owner, fence):
                return None
            return work(cur)

        return self._transaction(guarded)

    def publish_live(
        self,
        shard: int,
        owner: str,
        fence: int,
        pools: Mapping[str, PoolLive],
        capacities: Mapping[tuple[str, str], int],
    ) -> bool:
        """As ``shard``'s owner at ``fence``: replace the shard's rows of the live-offer table
        by ``pools`` (a pool of the shard left out has no live offer) and set the ledger's
        live-slot ``capacities`` ((pool, resource) → capacity; the ledger's own table, same
        schema), in one transaction fenced by the lease. False: refused, nothing written."""
        self._check_shard(shard)
        rows = [
            (
                pool_id,
                orjson.dumps(
                    [[c, o.version, o.cost_class, o.agents, o.free] for c, o in row.offers]
                ).decode(),
                row.retry_s,
            )
            for pool_id, row in sorted(pools.items())
        ]

        def write(cur: psycopg.Cursor[Any]) -> bool:
            cur.execute(
                f'DELETE FROM "{self.schema}".live_offer WHERE shard = %s '
                "AND NOT (pool_id = ANY(%s::text[]))",
                (shard, [pool_id for pool_id, _, _ in rows]),
            )
            if rows:
                cur.executemany(
                    f'INSERT INTO "{self.schema}".live_offer '
                    "(pool_id, shard, fence, offers, retry_s, written_at) "
                    "VALUES (%s, %s, %s, %s::jsonb, %s, clock_timestamp()) "
                    "ON CONFLICT (pool_id) DO UPDATE SET shard = EXCLUDED.shard, "
                    "fence = EXCLUDED.fence, offers = EXCLUDED.offers, "
                    "retry_s = EXCLUDED.retry_s, written_at = EXCLUDED.written_at",
                    [(pool_id, shard, fence, offers, retry) for pool_id, offers, retry in rows],
                )
            # Every manager listening reads the rows again (delivered on commit only).
            cur.execute("SELECT pg_notify(%s, %s)", (self.live_channel, str(shard)))
            # In the (pool, resource) byte order admission batches lock counters in.
            for (pool_id, resource), capacity in sorted(capacities.items()):
                cur.execute(
                    f'INSERT INTO "{self.schema}".ledger_capacity '
                    "(pool_id, resource, capacity, used) VALUES (%s, %s, %s, 0) "
                    "ON CONFLICT (pool_id, resource) DO UPDATE SET capacity = EXCLUDED.capacity",
                    (pool_id, resource, capacity),
                )
            return True

        return self.run_fenced(shard, owner, fence, write) is not None

    @property
    def live_channel(self) -> str:
        """The NOTIFY channel a live-offer write signals on (one per schema)."""
        return f"mesh_live_{self.schema}"[:63]

    def listen_live(self, stop: threading.Event, on_change: Callable[[], None]) -> None:
        """Until ``stop`` is set (checked every second): call ``on_change`` after every
        committed live-offer write, from this (blocking) call's thread, on a connection of
        its own. Also once after every (re)connection, since writes made while it was not
        listening were not signalled. A lost connection is opened again after a second."""
        while not stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, **self._connect_kwargs) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.live_channel)))
                    on_change()
                    while not stop.is_set():
                        # select() itself: psycopg's notifies() wakes every 0.1 s to poll.
                        readable, _, _ = select.select([conn.fileno()], [], [], 1.0)
                        if readable:
                            for _ in conn.notifies(timeout=0.0):
                                on_change()
            except psycopg.Error as exc:
                log.warning("not listening for live-offer writes", extra={"error": str(exc)})
                stop.wait(1.0)

    def read_live(self) -> dict[str, PoolLive]:
        """Every pool's live offers as its owner last wrote them."""

        def read(cur: psycopg.Cursor[Any]) -> dict[str, PoolLive]:
            cur.execute(
                f'SELECT pool_id, shard, fence, offers, retry_s FROM "{self.schema}".live_offer'
            )
            return {
                str(pool_id): PoolLive(
                    int(shard),
                    int(fence),
                    tuple(
                        (str(c), LiveOffer(str(v), int(agents), int(free), str(cost)))
                        for c, v, cost, agents, free in offers
                    ),
                    None if retry is None else float(retry),
                )
                for pool_id, shard, fence, offers, retry in cur.fetchall()
            }

        return self._statement(read)

    def close(self) -> None:
        with self._lock:
            self._pg.close()

    # ---- plumbing -----------------------------------------------------------------------------
    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.shard_count:
            raise LocalProtocolError(f"shard must be 0..{self.shard_count - 1}, got {shard}")

    def _create(self, cur: psycopg.Cursor[Any]) -> None:
        # Concurrent first opens take turns: CREATE … IF NOT EXISTS is not race-free.
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"mesh-shards:{self.schema}",))
        for statement in _ddl(self.schema):
            cur.execute(statement)
        cur.execute(
            f'INSERT INTO "{self.schema}".shard_config (key, value) VALUES (%s, %s) '
            "ON CONFLICT (key) DO NOTHING",
            ("shard_count", str(self.shard_count)),
        )
        cur.execute(
            f'SELECT value FROM "{self.schema}".shard_config WHERE key = %s', ("shard_count",)
        )
        (stored,) = cur.fetchone() or (str(self.shard_count),)
        if int(stored) != self.shard_count:
            raise LocalProtocolError(
                f"this namespace's ledger (schema {self.schema}) is split into {stored} shards, "
                f"this manager was started with {self.shard_count}: every manager of a "
                "namespace must use the same shard count"
            )
        cur.execute(
            f'INSERT INTO "{self.schema}".shard_lease (shard) '
            "SELECT generate_series(0, %s - 1) ON CONFLICT (shard) DO NOTHING",
            (self.shard_count,),
        )

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        return self._pg.get()

    def _statement(self, work: Callable[[psycopg.Cursor[Any]], T]) -> T:
        """``work`` that runs a single statement: in autocommit it is its own transaction,
        so no BEGIN and COMMIT round trips around it (a third of the cost of a small read)."""
        with self._lock:
            try:
                with self._connection().cursor() as cur:
                    return work(cur)
            except psycopg.Error as exc:
                raise StoreError(f"shard lease statement failed in {self.schema}: {exc}") from exc

    def _transaction(self, work: Callable[[psycopg.Cursor[Any]], T]) -> T:
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction(), conn.cursor() as cur:
                    return work(cur)
            except psycopg.Error as exc:
                raise StoreError(f"shard lease transaction failed in {self.schema}: {exc}") from exc
