"""Garbage-collector settings for a long-running mesh process (``mesh manager``).

CPython's cyclic collector runs a young-generation pass every 700 net allocations and, every
hundred of those, a full pass over every tracked object — including the tens of thousands a
process holds for good after start-up (modules, pydantic schemas, the journal's and ledger's
state). An admission allocates a few hundred short-lived objects, so with the defaults a full
pass lands every few hundred admissions, and whichever decision triggers it waits for it: in
``bench/admission.py`` that is the spread between a decision's usual cost and the slow runs
(68 vs 85 to 104 µs per decision in core), and part of the end-to-end p99.

:func:`tune_gc` does what long-running Python services commonly do: ``gc.freeze()`` moves
everything alive at that moment (imports, start-up state) out of the collector's sight —
those objects are never freed anyway — and a larger young-generation threshold makes passes
rarer, each over more (mostly dead) objects. Cycles are still collected; memory stays
bounded by the same mechanism, only in larger steps.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 5_000
"""Net allocations between young-generation passes (CPython's default is 700)."""
OLDER_THRESHOLDS = (20, 20)
"""Passes of one generation between passes of the next (CPython's default is 10, 10)."""


def tune_gc() -> str:
    """Freeze what is alive now and raise the thresholds; returns a one-line description
    (for the start-up log). Call it once start-up is done, in the process's own entry point
    — never from a library, whose host owns the collector."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    return (
        f"gc: {gc.get_freeze_count():,} start-up objects frozen, "
        f"thresholds {YOUNG_THRESHOLD:,}/{OLDER_THRESHOLDS[0]}/{OLDER_THRESHOLDS[1]}"
    )
