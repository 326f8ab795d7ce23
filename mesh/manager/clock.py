"""The real clock, behind the small protocol the shells use (tests pass a fake one)."""

from __future__ import annotations

import time
from typing import Protocol

from mesh.core.events import Instant


class Clock(Protocol):
    def now(self) -> Instant: ...


class SystemClock:
    """Monotonic time for liveness and expiry, wall time for the log."""

    def now(self) -> Instant:
        return Instant(time.monotonic(), time.time())
