"""Fresh IDs: admission IDs that sort by time (UUIDv7, RFC 9562, as 32 hex digits), and
cheap unique sequences for message and correlation IDs (:class:`IdSequence`).

An admission ID is the key of a reservation and of a decision in the ledger, and a producer
chooses it (the manager never does: retrying with the same ID is how a producer stays
idempotent). A random ID (UUIDv4) lands anywhere in the ledger's key indexes, so each
admission of a batch dirties an index page of its own; an ID that starts with the time lands
next to the previous one, and a batch of admissions shares a page or two. With the SQLite
ledger that is about a fifth less per decision (``bench/ledger_layout.py``, figures in
bench/README.md); PostgreSQL's primary-key indexes gain the same way.

Any string of 1 to 128 characters is still a valid admission ID — these are just cheaper to
store. The IDs one process makes are strictly increasing: within a millisecond the 12 bits
after the version count up from a random start (RFC 9562's "fixed bit-length dedicated
counter"); if the clock steps back, the last millisecond goes on being used. The low 62 bits
are random, so IDs stay unguessable.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

_MS_MASK = (1 << 48) - 1
_COUNTER_MAX = 0xFFF  # 12 bits
_START_MAX = 0x7FF  # a millisecond's counter starts in the lower half: room to count up

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_admission_id() -> str:
    """A UUIDv7 in hex: 48 bits of Unix milliseconds, the version, a 12-bit counter, the
    variant, 62 random bits. Strictly increasing within one process; thread-safe."""
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter = ms, int.from_bytes(os.urandom(2), "big") & _START_MAX
        elif _counter < _COUNTER_MAX:
            _counter += 1  # the same millisecond (or the clock stepped back): count on
        else:
            _last_ms, _counter = _last_ms + 1, 0  # 2,048+ in one millisecond: borrow the next
        ms, counter = _last_ms, _counter
    random_bits = int.from_bytes(os.urandom(8), "big") >> 2  # 62 bits
    value = (ms & _MS_MASK) << 80 | 0x7 << 76 | counter << 64 | 0x2 << 62 | random_bits
    return f"{value:032x}"


class IdSequence:
    """Unique IDs without an ``os.urandom`` call or a UUID object each: a random 64-bit
    prefix per sequence, then a counter in hex. For message and correlation IDs, which must
    never repeat but need not sort or be unguessable."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"
