"""``mesh manager``'s collector settings (:mod:`mesh.gc_tuning`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from mesh.gc_tuning import OLDER_THRESHOLDS, YOUNG_THRESHOLD, tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_tuning_freezes_what_is_alive_and_raises_the_thresholds() -> None:
    described = tune_gc()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    assert gc.get_freeze_count() > 1000  # at least the imports
    assert f"{gc.get_freeze_count():,} start-up objects frozen" in described


@pytest.mark.usefixtures("restored_gc")
def test_cycles_made_after_tuning_are_still_collected() -> None:
    import weakref

    tune_gc()

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
