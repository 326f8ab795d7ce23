"""What the pressure policies are tuned by: the shedding stages and :class:`PressurePolicy`
(``mesh manager`` flags and settings set it; ``enabled=False`` turns every policy off)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["PressurePolicy", "Stage"]


class Stage(IntEnum):
    NORMAL = 0
    SHED_SPECULATIVE = 1
    PAUSE_BATCH = 2
    TIGHTEN = 3
    REJECT_INTERACTIVE = 4


@dataclass(frozen=True, slots=True)
class PressurePolicy:
    enabled: bool = True
    # Utilisation (model slots) at which SHED_SPECULATIVE, PAUSE_BATCH and TIGHTEN begin.
    thresholds: tuple[float, float, float] = (0.7, 0.85, 0.95)
    queue_age_s: float = 5.0  # the oldest queued task waited longer: one stage up
    # Batch work at or below this priority is low-priority fan-out, shed with speculative work
    # (None: only the speculative service class is; priority 0 is every request's default).
    low_priority: int | None = None
    retry_min_ms: int = 50
    retry_max_ms: int = 30_000
    retry_default_ms: int = 1_000  # constant when disabled; before any service time is known
    jitter: float = 0.5  # retry times spread over wait * (1 ± jitter)
    service_window: int = 256  # releases whose hold times make the service-time estimate
    demand_window_s: float = 5.0  # a tenant or a refusal this recent still counts
    evict: bool = True  # a full pool's interactive requests may evict recoverable work
    # A stage steps down only once utilisation has stayed below its threshold less this
    # (a fraction of capacity) for min_dwell_s; and no stage is left sooner than min_dwell_s
    # after it was entered (a broker alarm excepted): a pool at steady load holds still.
    hysteresis: float = 0.1
    min_dwell_s: float = 2.0
    # Requests deferred for capacity keep a place in the pool's line (mesh.core.line): a free
    # slot goes to those ahead first. A place is kept for the retry time plus this grace.
    line: bool = True
    line_grace_s: float = 2.0
    line_max: int = 10_000  # waiting requests per pool; beyond, deferred without a place
    # A placed request comes back up to this share of one drain interval (capacity / service
    # time) before its turn, never after: its place already spreads the returns, and a slot
    # kept for a waiter that comes late stands idle, while one that comes early only asks again.
    line_jitter: float = 0.5
    # A newcomer gets a place only if its predicted finish, plus this share of the time until
    # then, is still before its deadline; once placed, only the predicted finish must be. A
    # place is a promise: kept loosely, given strictly, so a prediction that slips still ends
    # in time instead of in a refusal at the turn (a missed deadline the producer waited for).
    line_join_slack: float = 1.0
    line_retry_min_ms: int = 10  # the head of the line may ask again this soon: its slot waits
