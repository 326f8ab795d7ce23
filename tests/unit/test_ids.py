"""Admission IDs from the SDK: valid UUIDv7s that sort by the time they were made."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import pytest

import mesh.ids
from mesh.ids import new_admission_id


def test_an_admission_id_is_a_uuid7_in_hex() -> None:
    made = new_admission_id()
    parsed = uuid.UUID(hex=made)
    assert len(made) == 32 and made == parsed.hex
    assert parsed.variant == uuid.RFC_4122 and parsed.version == 7


def test_its_first_48_bits_are_the_unix_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    made = new_admission_id()
    after = time.time_ns() // 1_000_000
    assert before <= int(made[:12], 16) <= after + 1  # +1: a full millisecond borrows the next


def test_ids_of_one_process_strictly_increase_even_within_a_millisecond() -> None:
    made = [new_admission_id() for _ in range(20_000)]  # far more than one per millisecond
    assert all(a < b for a, b in itertools.pairwise(made))


def test_ids_made_on_many_threads_never_repeat() -> None:
    made: list[list[str]] = [[] for _ in range(4)]

    def make(out: list[str]) -> None:
        out.extend(new_admission_id() for _ in range(5_000))

    threads = [threading.Thread(target=make, args=(out,)) for out in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [i for out in made for i in out]
    assert len(set(everything)) == len(everything)
    assert all(out == sorted(out) for out in made)


def test_a_clock_that_steps_back_does_not_make_ids_go_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = new_admission_id()
    monkeypatch.setattr(mesh.ids.time, "time_ns", lambda: 1_000_000_000)  # 1970: far back
    later = [new_admission_id() for _ in range(5)]
    assert first < later[0] and later == sorted(later)
