"""The effect logs behind ``mesh.agent.once``, each on its real store (SQLite file,
PostgreSQL, memory): an effect runs at most once per task and name, its result is replayed,
an effect that raised is never run again unless the exception proves it did not happen, and
of concurrent claims exactly one runs."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import Context
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mesh.agent import EffectOutcomeUnknown, once
from mesh.agent.context import TaskContext, _current
from mesh.agent.effects import EffectLog, MemoryEffectLog, PostgresEffectLog, SqliteEffectLog
from mesh.errors import MeshError


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def log(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EffectLog]:
    if request.param == "memory":
        yield MemoryEffectLog()
    elif request.param == "sqlite":
        store = SqliteEffectLog(tmp_path / "effects.sqlite3")
        yield store
        store.close()
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        schema = f"effects_{uuid.uuid4().hex[:8]}"
        pg = PostgresEffectLog(dsn, schema=schema)
        yield pg
        pg.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def in_task(key: str, attempt: int = 1) -> TaskContext:
    """Enter a task's context, as the runtime does around a handler."""
    context = TaskContext("t", "cap", None, frozenset(), idempotency_key=key, attempt=attempt)
    _current.set(context)
    return context


async def test_an_effect_runs_once_and_later_deliveries_get_its_result(log: EffectLog) -> None:
    runs: list[int] = []

    async def charge() -> dict[str, Any]:
        runs.append(1)
        return {"receipt": "r-1", "cents": 500}

    in_task("admission:a1")
    first = await once("charge", charge, log=log)
    again = in_task("admission:a1", attempt=2)
    second = await once("charge", charge, log=log)

    assert first == second == {"receipt": "r-1", "cents": 500}
    assert runs == [1] and again.effects_replayed == 1
    in_task("admission:a2")  # another task: its own effect
    await once("charge", charge, log=log)
    in_task("admission:a1")
    await once("refund", charge, log=log)  # another effect of the same task
    assert len(runs) == 3


async def test_an_effect_that_raised_is_not_run_again(log: EffectLog) -> None:
    runs: list[int] = []

    async def flaky() -> str:
        runs.append(1)
        raise ConnectionError("the PSP hung up mid-call")

    in_task("admission:b1")
    with pytest.raises(ConnectionError):
        await once("charge", flaky, log=log)
    with pytest.raises(EffectOutcomeUnknown, match="PSP hung up"):
        await once("charge", flaky, log=log)
    assert runs == [1]


async def test_an_exception_that_proves_nothing_happened_frees_the_key(log: EffectLog) -> None:
    class Declined(Exception):
        pass

    outcomes = iter([Declined("card declined"), "r-2"])

    async def charge() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    in_task("admission:c1")
    with pytest.raises(Declined):
        await once("charge", charge, log=log, retry_on=(Declined,))
    assert await once("charge", charge, log=log, retry_on=(Declined,)) == "r-2"


def test_of_concurrent_claims_exactly_one_runs(log: EffectLog) -> None:
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def claim(i: int) -> None:
        barrier.wait()
        if log.claim("admission:d1/charge", 0.0) is None:
            winners.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1


async def test_outside_a_task_once_refuses() -> None:
    async def effect() -> int:
        return 1

    # A fresh context (as outside any handler): no task is current.
    task = asyncio.get_running_loop().create_task(
        once("x", effect, log=MemoryEffectLog()), context=Context()
    )
    with pytest.raises(MeshError, match="inside a task handler"):
        await task


def test_the_agents_of_a_pool_can_open_one_postgres_log_at_the_same_moment(
    postgres_dsn: str,
) -> None:
    """Agents of one pool start together: each creates the schema and the table if missing,
    and none of them may fail for another doing the same (concurrent ``IF NOT EXISTS``
    creations collide in PostgreSQL's catalog unless they take turns)."""
    schema = f"effects_{uuid.uuid4().hex[:8]}"
    barrier = threading.Barrier(6)
    opened: list[PostgresEffectLog] = []
    failed: list[BaseException] = []

    def open_log() -> None:
        barrier.wait()
        try:
            opened.append(PostgresEffectLog(postgres_dsn, schema=schema))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_log) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failed == [] and len(opened) == 6
        assert opened[0].claim("k", 0.0) is None and opened[5].claim("k", 0.0) is not None
    finally:
        for store in opened:
            store.close()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class SlowClaims:
    """``log``, with each claim held in its thread until ``go`` is set."""

    def __init__(self, log: EffectLog) -> None:
        self.log, self.go, self.claiming = log, threading.Event(), threading.Event()

    def claim(self, key: str, now: float) -> tuple[str, Any] | None:
        self.claiming.set()
        self.go.wait(10)
        return self.log.claim(key, now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)


async def test_a_handler_cancelled_while_it_claims_leaves_the_effect_to_its_next_run(
    log: EffectLog,
) -> None:
    """Cancelled while the claim runs in its thread (the handler's connection lost), the
    effect had not begun: the claim the thread still takes is given back, and the task's
    next run makes the effect — it is not refused as an unknown outcome."""
    runs: list[int] = []

    async def charge() -> str:
        runs.append(1)
        return "r-3"

    slow = SlowClaims(log)
    in_task("admission:d1")
    first = asyncio.create_task(once("charge", charge, log=slow))  # type: ignore[arg-type]
    await asyncio.to_thread(slow.claiming.wait, 10)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    slow.go.set()  # the claim is taken now, after the cancel: then given back

    key = "admission:d1/charge"
    for _ in range(100):  # the give-back runs in a worker thread: until the key is free
        await asyncio.sleep(0.02)
        if log.claim(key, 0.0) is None:  # free: this probe took it, and gives it back
            log.release(key)
            break
    in_task("admission:d1", attempt=2)
    assert await once("charge", charge, log=log) == "r-3"
    assert runs == [1]


async def test_a_run_that_finds_the_effect_begun_waits_for_its_result(log: EffectLog) -> None:
    """The task redelivered to another agent while the first run still makes the effect (the
    broker requeues as soon as the first agent's connection dies): the second run waits for
    the first's result and returns it; the effect happens once."""
    runs: list[int] = []
    begun, go = asyncio.Event(), asyncio.Event()

    async def charge() -> str:
        runs.append(1)
        begun.set()
        await go.wait()
        return "r-4"

    async def first_run() -> str:
        in_task("admission:e1")
        return await once("charge", charge, log=log)

    async def second_run() -> str:
        in_task("admission:e1", attempt=2)
        return await once("charge", charge, log=log)

    first = asyncio.create_task(first_run())
    await begun.wait()
    second = asyncio.create_task(second_run())
    await asyncio.sleep(0.2)
    assert not second.done()  # waiting, not refused
    go.set()
    assert await first == await second == "r-4"
    assert runs == [1]


async def test_a_run_that_finds_the_effect_begun_long_ago_refuses_after_waiting(
    log: EffectLog,
) -> None:
    """A claim left by a run that died during the effect: waited for ``wait_s``, then the
    outcome is unknown — never a second run."""
    assert log.claim("admission:f1/charge", 0.0) is None  # the run that died
    in_task("admission:f1", attempt=2)
    started = time.monotonic()
    with pytest.raises(EffectOutcomeUnknown):
        await once("charge", _never, log=log, wait_s=0.3)
    assert time.monotonic() - started >= 0.3


async def _never() -> str:
    raise AssertionError("the effect ran a second time")


async def test_a_handler_cancelled_while_its_record_waits_for_a_worker_still_records_it(
    log: EffectLog,
) -> None:
    """The effect completed; the handler is cancelled (its connection lost) while the write
    of the result waits for a free worker thread. The write still happens, so a later run
    gets the result — not an unknown outcome for an effect that completed."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    gate, made = threading.Event(), asyncio.Event()
    busy: list[asyncio.Future[bool]] = []

    async def charge() -> str:
        busy.append(loop.run_in_executor(None, gate.wait, 10))  # the only worker, taken
        made.set()
        return "r-5"

    in_task("admission:g1")
    first = asyncio.create_task(once("charge", charge, log=log))
    await made.wait()
    await asyncio.sleep(0.05)  # the result's write is queued behind the busy worker
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    await busy[0]
    for _ in range(100):  # the write runs once the worker is free
        if log.claim("admission:g1/charge", 0.0) == ("done", "r-5"):
            break
        await asyncio.sleep(0.02)
    in_task("admission:g1", attempt=2)
    assert await once("charge", _never, log=log, wait_s=0.5) == "r-5"
