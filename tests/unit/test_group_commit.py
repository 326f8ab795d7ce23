"""GroupCommit: concurrent submissions coalesce into batches, results go back in order."""

from __future__ import annotations

import asyncio

import pytest

from mesh.errors import LocalProtocolError
from mesh.manager.batching import GroupCommit


class Recorder:
    """A batch function that records each batch and holds it until released."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def run(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        return [item * 10 for item in items]


async def test_a_lone_item_is_run_at_once_as_its_own_batch() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run)

    assert await asyncio.wait_for(commit.submit(7), timeout=5) == 70
    assert recorder.batches == [[7]]


async def test_items_arriving_while_a_batch_runs_form_the_next_batch() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run)
    recorder.gate.clear()
    first = asyncio.create_task(commit.submit(1))
    for _ in range(20):
        await asyncio.sleep(0)
    assert recorder.batches == [[1]]  # running, held at the gate

    rest = [asyncio.create_task(commit.submit(n)) for n in range(2, 7)]
    await asyncio.sleep(0)
    recorder.gate.set()

    assert await first == 10
    assert [await task for task in rest] == [20, 30, 40, 50, 60]
    assert recorder.batches == [[1], [2, 3, 4, 5, 6]]
    assert (commit.batches, commit.items, commit.largest) == (2, 6, 5)


async def test_callers_scheduled_in_the_same_loop_iteration_share_one_batch() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run)
    tasks = [asyncio.create_task(commit.submit(n)) for n in range(5)]

    assert await asyncio.gather(*tasks) == [0, 10, 20, 30, 40]
    assert recorder.batches == [[0, 1, 2, 3, 4]]


async def test_a_batch_never_exceeds_max_batch() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run, max_batch=3)
    recorder.gate.clear()
    tasks = [asyncio.create_task(commit.submit(n)) for n in range(8)]
    await asyncio.sleep(0)
    recorder.gate.set()

    assert await asyncio.gather(*tasks) == [n * 10 for n in range(8)]
    assert recorder.batches == [[0, 1, 2], [3, 4, 5], [6, 7]]


async def test_a_failing_batch_fails_its_callers_only() -> None:
    calls = 0

    async def run(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("ledger down")
        return items

    commit = GroupCommit(run)
    with pytest.raises(RuntimeError, match="ledger down"):
        await commit.submit(1)
    assert await commit.submit(2) == 2


async def test_a_batch_returning_the_wrong_number_of_results_is_an_error() -> None:
    async def run(items: list[int]) -> list[int]:
        return items[:-1]

    commit = GroupCommit(run)
    with pytest.raises(LocalProtocolError, match="returned 0 results"):
        await commit.submit(1)


async def test_a_cancelled_caller_does_not_break_the_batch_for_the_others() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run)
    recorder.gate.clear()
    doomed = asyncio.create_task(commit.submit(1))
    kept = asyncio.create_task(commit.submit(2))
    await asyncio.sleep(0)
    doomed.cancel()
    recorder.gate.set()

    assert await kept == 20
    with pytest.raises(asyncio.CancelledError):
        await doomed
    await commit.close()


def test_max_batch_must_be_positive() -> None:
    async def run(items: list[int]) -> list[int]:
        return items

    with pytest.raises(LocalProtocolError):
        GroupCommit(run, max_batch=0)


async def test_an_idle_group_commit_never_lingers() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run, linger_s=5.0)

    assert await asyncio.wait_for(commit.submit(1), timeout=1) == 10  # no 5 s wait


async def test_under_load_a_batch_lingers_for_company() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run, linger_s=0.3, busy_gap_s=60.0)
    await commit.submit(0)  # a batch just ended: the next one is "under load"

    first = asyncio.create_task(commit.submit(1))
    await asyncio.sleep(0.05)  # arrives while the batch lingers
    second = asyncio.create_task(commit.submit(2))

    assert await asyncio.wait_for(asyncio.gather(first, second), timeout=5) == [10, 20]
    assert recorder.batches == [[0], [1, 2]]


async def test_under_load_a_batch_stops_lingering_when_company_stops_coming() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run, linger_s=5.0, quiet_s=0.05, busy_gap_s=60.0)
    await commit.submit(0)

    loop = asyncio.get_running_loop()
    started = loop.time()
    burst = [asyncio.create_task(commit.submit(n)) for n in (1, 2, 3)]
    assert await asyncio.wait_for(asyncio.gather(*burst), timeout=2) == [10, 20, 30]
    assert recorder.batches == [[0], [1, 2, 3]]
    assert loop.time() - started < 1.0  # one quiet step (0.05 s), not the 5 s linger


async def test_under_load_a_batch_keeps_lingering_while_company_keeps_coming() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.run, linger_s=5.0, quiet_s=0.2, busy_gap_s=60.0)
    await commit.submit(0)

    callers = []
    for n in range(1, 6):  # one every 0.05 s: each quiet step of 0.2 s sees a newcomer
        callers.append(asyncio.create_task(commit.submit(n)))
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(asyncio.gather(*callers), timeout=5) == [10, 20, 30, 40, 50]
    assert recorder.batches == [[0], [1, 2, 3, 4, 5]]


def test_negative_linger_is_refused() -> None:
    async def run(items: list[int]) -> list[int]:
        return items

    with pytest.raises(LocalProtocolError):
        GroupCommit(run, linger_s=-1)
