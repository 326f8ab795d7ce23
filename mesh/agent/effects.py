"""Side effects at most once per task: :func:`once`, keyed by the task's idempotency key.

A task can run more than once: the broker redelivers what an agent took but did not ack (the
agent was killed, its connection cut, its result not confirmed), and a redelivered pool task
may land on another agent of the pool. A handler whose work has effects outside the mesh —
charging a card, sending a mail, writing a row — wraps each effect in :func:`once`::

    from mesh.agent import current_task, once
    from mesh.agent.effects import SqliteEffectLog

    class Billing(Agent):
        effects = SqliteEffectLog("/var/lib/billing/effects.sqlite3")

        @capability("billing.charge", ...)
        async def charge(self, payload):
            receipt = await once("charge", lambda: psp.charge(payload["card"]), log=self.effects)
            return {"receipt": receipt}

The key is the task's :attr:`~mesh.agent.context.TaskContext.idempotency_key` (the admission
ID on the admission path, the task ID on the lease path: the same on every delivery of one
task) and the effect's name. The first run of an effect records ``started`` durably *before*
it runs, then its JSON result; every later run of the same key:

* finds the result: returns it, and the effect does not run again;
* finds ``started`` with no result yet: the first run may still be making it — the broker
  redelivers a task to another agent as soon as the first agent's connection dies, while its
  handler goes on — so it waits up to ``wait_s`` (30 s: a durable write can stall for seconds
  on a busy disk) for that run's result, and returns it;
* finds ``started`` without a result after that (the process died during the effect), or
  with what the effect raised: raises :class:`EffectOutcomeUnknown` — never a second run.
  Whether the effect happened is for the handler to find out (ask the system it called);
  ``retry_on`` names the exceptions that prove it did *not* happen, which free the key for a
  retry.

At most once, not exactly once: a crash between the effect and its record leaves the outcome
unknown, and the helper says so instead of guessing. A log every agent of the pool shares
(:class:`PostgresEffectLog`) covers a redelivery to another agent; a SQLite file covers the
restarts of one agent on one volume.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

from mesh.agent.context import current_task
from mesh.errors import MeshError

T = TypeVar("T")

__all__ = [
    "EffectLog",
    "EffectOutcomeUnknown",
    "MemoryEffectLog",
    "PostgresEffectLog",
    "SqliteEffectLog",
    "once",
]


class EffectOutcomeUnknown(MeshError):
    """An earlier run of this effect started and never recorded a result: it may or may not
    have happened, so it is not run again."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(
            f"effect {key!r} started before and its outcome is unknown ({detail}); it is not "
            "run twice — check with the system it calls"
        )
        self.key = key


class EffectLog(Protocol):
    """Where effects are recorded. ``claim`` is atomic: of concurrent claims of one key,
    exactly one gets ``None`` (run it); the others get the row as it is."""

    def claim(self, key: str, now: float) -> tuple[str, Any] | None:
        """``None``: the key is new and now ``started``; else ``(state, value)`` as stored:
        ``("done", result)`` or ``("started", note)``."""
        ...

    def done(self, key: str, result: Any, now: float) -> None: ...

    def note(self, key: str, note: str, now: float) -> None:
        """The effect raised: keep the key claimed, with what it raised."""
        ...

    def release(self, key: str) -> None:
        """Forget the key (the effect is known not to have happened)."""
        ...


async def once(
    name: str,
    effect: Callable[[], Awaitable[T]],
    *,
    log: EffectLog,
    retry_on: tuple[type[BaseException], ...] = (),
    wait_s: float = 30.0,
) -> T:
    """Run ``effect`` at most once for the current task and this ``name``; its result is
    recorded (JSON) and returned to every later run of the same task. ``wait_s``: how long a
    run that finds the effect begun and not finished waits for its result."""
    task = current_task()
    if not task.idempotency_key:
        raise MeshError("once() runs inside a task handler (no task is current)")
    key = f"{task.idempotency_key}/{name}"
    # The stores do blocking I/O (an fsync per write): off the event loop.
    found = await _claimed(log, key)
    if found == _BEGUN and wait_s > 0:
        found = await _finished_elsewhere(log, key, wait_s)
    if found is not None:
        state, value = found
        if state == "done":
            task.effects_replayed += 1
            return value  # type: ignore[no-any-return]
        raise EffectOutcomeUnknown(key, value or "no result was recorded")
    try:
        result = await effect()
    except retry_on:
        await _written(log.release, key)
        raise
    except BaseException as exc:
        why = f"the effect raised {type(exc).__name__}: {exc}"[:500]
        await _written(log.note, key, why, time.time())
        raise
    await _written(log.done, key, result, time.time())
    return result


async def _written(write: Callable[..., None], *args: Any) -> None:
    """A record of how the effect ended, written in a worker thread even if the handler is
    cancelled while it waits (its connection lost): a plain ``to_thread`` whose wait is
    cancelled before a worker is free drops the write, and the claim would read as an
    unknown outcome to every later run although the effect completed."""
    await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(write, *args)))


_BEGUN = ("started", "")  # claimed, and neither a result nor an exception recorded yet


async def _finished_elsewhere(log: EffectLog, key: str, wait_s: float) -> tuple[str, Any] | None:
    """The row of an effect another run began, once that run records how it ended — or as
    it is after ``wait_s``. ``None``: that run gave the key back (the effect did not happen)
    and this one holds the claim now."""
    give_up_at = time.monotonic() + wait_s
    pause = 0.02
    while True:
        await asyncio.sleep(min(pause, max(0.0, give_up_at - time.monotonic())))
        found = await _claimed(log, key)  # a claim of a key held is a read
        if found != _BEGUN or time.monotonic() >= give_up_at:
            return found
        pause = min(pause * 2, 0.5)


async def _claimed(log: EffectLog, key: str) -> tuple[str, Any] | None:
    """``log.claim`` in a worker thread. Cancelled while the claim runs (its handler cut off
    with its connection, say), the effect has not begun: a claim the thread still takes is
    given back, so the task's next run finds no half-made record (which would read as an
    unknown outcome, ``EffectOutcomeUnknown``) and runs the effect itself."""
    claim = asyncio.ensure_future(asyncio.to_thread(log.claim, key, time.time()))
    try:
        return await asyncio.shield(claim)
    except asyncio.CancelledError:

        def give_back(done: asyncio.Future[tuple[str, Any] | None]) -> None:
            if not done.cancelled() and done.exception() is None and done.result() is None:
                loop.run_in_executor(None, log.release, key)

        loop = asyncio.get_running_loop()
        claim.add_done_callback(give_back)
        raise


# ---- stores -----------------------------------------------------------------------------------
class MemoryEffectLog:
    """In memory: for tests, and for effects whose repetition a restart may allow."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[str, Any]] = {}
        self._lock = threading.Lock()

    def claim(self, key: str, now: float) -> tuple[str, Any] | None:
        with self._lock:
            if key in self._rows:
                return self._rows[key]
            self._rows[key] = ("started", "")
            return None

    def done(self, key: str, result: Any, now: float) -> None:
        with self._lock:
            self._rows[key] = ("done", orjson.loads(orjson.dumps(result)))

    def note(self, key: str, note: str, now: float) -> None:
        with self._lock:
            self._rows[key] = ("started", note)

    def release(self, key: str) -> None:
        with self._lock:
            self._rows.pop(key, None)


_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS mesh_effect (
    key        TEXT PRIMARY KEY,
    state      TEXT NOT NULL CHECK (state IN ('started', 'done')),
    value      TEXT NOT NULL,
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL
)
"""


class SqliteEffectLog:
    """One SQLite file (WAL, synchronous FULL: a recorded claim survives a power cut)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._conn.execute(_SQLITE_SCHEMA)
        self._lock = threading.Lock()

    def claim(self, key: str, now: float) -> tuple[str, Any] | None:
        with self._lock:
            inserted = self._conn.execute(
                "INSERT INTO mesh_effect (key, state, value, started_at, updated_at)"
                " VALUES (?, 'started', '\"\"', ?, ?) ON CONFLICT (key) DO NOTHING",
                (key, now, now),
            ).rowcount
            if inserted:
                return None
            state, value = self._conn.execute(
                "SELECT state, value FROM mesh_effect WHERE key = ?", (key,)
            ).fetchone()
        return str(state), orjson.loads(value)

    def done(self, key: str, result: Any, now: float) -> None:
        with self._lock:
            self._conn.execute(
                "UPDATE mesh_effect SET state = 'done', value = ?, updated_at = ? WHERE key = ?",
                (orjson.dumps(result).decode(), now, key),
            )

    def note(self, key: str, note: str, now: float) -> None:
        with self._lock:
            self._conn.execute(
                "UPDATE mesh_effect SET value = ?, updated_at = ? WHERE key = ?",
                (orjson.dumps(note).decode(), now, key),
            )

    def release(self, key: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM mesh_effect WHERE key = ?", (key,))

    def close(self) -> None:
        self._conn.close()


class PostgresEffectLog:
    """A table in PostgreSQL that every agent of a pool shares (``schema.mesh_effect``): a
    task redelivered to another agent finds the first one's record."""

    def __init__(self, dsn: str, *, schema: str = "public") -> None:
        import psycopg  # the ledger's driver; only needed for this store

        self._conn = psycopg.connect(dsn, autocommit=True)
        self._table = f'"{schema}".mesh_effect'
        # The pool's agents start together: concurrent IF NOT EXISTS creations can still
        # collide (a unique violation in the catalog), so they take turns.
        with self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self._table,))
            self._conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            self._conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self._table} (key TEXT PRIMARY KEY, state TEXT "
                "NOT NULL CHECK (state IN ('started', 'done')), value TEXT NOT NULL, started_at "
                "DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)"
            )
        self._lock = threading.Lock()

    def claim(self, key: str, now: float) -> tuple[str, Any] | None:
        with self._lock:
            row = self._conn.execute(
                f"INSERT INTO {self._table} (key, state, value, started_at, updated_at)"
                " VALUES (%s, 'started', '\"\"', %s, %s) ON CONFLICT (key) DO NOTHING"
                " RETURNING key",
                (key, now, now),
            ).fetchone()
            if row is not None:
                return None
            found = self._conn.execute(
                f"SELECT state, value FROM {self._table} WHERE key = %s", (key,)
            ).fetchone()
        assert found is not None  # rows are deleted only by release, of one's own claim
        return str(found[0]), orjson.loads(found[1])

    def done(self, key: str, result: Any, now: float) -> None:
        with self._lock:
            self._conn.execute(
                f"UPDATE {self._table} SET state = 'done', value = %s, updated_at = %s"
                " WHERE key = %s",
                (orjson.dumps(result).decode(), now, key),
            )

    def note(self, key: str, note: str, now: float) -> None:
        with self._lock:
            self._conn.execute(
                f"UPDATE {self._table} SET value = %s, updated_at = %s WHERE key = %s",
                (orjson.dumps(note).decode(), now, key),
            )

    def release(self, key: str) -> None:
        with self._lock:
            self._conn.execute(f"DELETE FROM {self._table} WHERE key = %s", (key,))

    def close(self) -> None:
        self._conn.close()
