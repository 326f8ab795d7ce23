"""The one backoff of the project: how long to wait before retry number ``attempt``.

Every retry loop (a producer's ``submit`` after a deferral or a lost answer, ``run_task``
after a refusal, an agent's registration and result publishes) spaces its attempts with
:meth:`Backoff.delay_s`: an exponential step ``base_s * 2**attempt`` capped at ``cap_s``, of
which the share ``spread`` is random — 1.0 is "full jitter" (anywhere from 0 to the step),
0.5 "equal jitter" (half fixed, half random: spread out, never near 0) — after a floor the
caller knows (a manager's ``retry_after_ms``). Pure: the randomness is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """An exponential step ``base_s * 2**attempt`` capped at ``cap_s``, ``spread`` of it
    random (see the module doc)."""

    base_s: float = 0.05
    cap_s: float = 5.0
    spread: float = 1.0

    def delay_s(self, attempt: int, rand: Callable[[], float], *, at_least_s: float = 0.0) -> float:
        """Seconds to wait before retry number ``attempt`` (from 0): ``at_least_s``, then the
        step's fixed share and ``rand()`` (in [0, 1)) of its random share."""
        step = min(self.cap_s, self.base_s * 2.0 ** min(attempt, 32))
        return at_least_s + step * (1.0 - self.spread) + step * self.spread * rand()
