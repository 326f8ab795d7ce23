"""Staged shedding: which work each stage refuses, the slot limits the stages begin at, and
the stage a pool's state calls for (see :mod:`mesh.core.pressure` for how the board holds a
stage still between calls)."""

from __future__ import annotations

import math

from mesh.core.policy.settings import PressurePolicy, Stage

__all__ = ["RANK_STOPS_AT", "shed_rank", "stage_called_for", "stage_limits"]


def shed_rank(service_class: str, priority: int, policy: PressurePolicy) -> int:
    """0: speculative and low-priority fan-out; 1: batch; 2: interactive."""
    if service_class == "interactive":
        return 2
    if service_class == "speculative":
        return 0
    if policy.low_priority is not None and priority <= policy.low_priority:
        return 0
    return 1


# The stage at which each rank stops being admitted (interactive: only on signals or full).
RANK_STOPS_AT = {0: Stage.SHED_SPECULATIVE, 1: Stage.PAUSE_BATCH, 2: Stage.REJECT_INTERACTIVE}


def stage_limits(
    capacity: int, policy: PressurePolicy
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Slots in use at which SHED_SPECULATIVE, PAUSE_BATCH and TIGHTEN begin —
    ``floor(threshold * capacity)``, at least 1 — and the same at ``threshold - hysteresis``
    (below these a stage may step down)."""
    limits = tuple(max(1, math.floor(t * capacity)) for t in policy.thresholds)
    lowered = tuple(
        max(1, math.floor(max(0.0, t - policy.hysteresis) * capacity)) for t in policy.thresholds
    )
    return limits, lowered  # type: ignore[return-value]  # three thresholds, three limits


def stage_called_for(
    *,
    used: int,
    capacity: int,
    limits: tuple[int, int, int],
    blocked: bool,
    queue_depth: int,
    oldest_age_s: float,
    policy: PressurePolicy,
) -> tuple[Stage, str]:
    """The stage a pool's state calls for, and which source calls for it: ``utilisation``
    (the highest stage whose slot limit ``used`` has reached), ``queue age`` (the oldest
    queued task waited longer than ``queue_age_s``: one stage above utilisation's, up to
    ``TIGHTEN`` — ``REJECT_INTERACTIVE`` if the pool is full), ``blocked`` (a broker alarm:
    ``REJECT_INTERACTIVE``) or ``off``."""
    if not policy.enabled:
        return Stage.NORMAL, "off"
    by_use = Stage.NORMAL
    if capacity > 0:
        shed, pause, tighten = limits
        if used >= tighten:
            by_use = Stage.TIGHTEN
        elif used >= pause:
            by_use = Stage.PAUSE_BATCH
        elif used >= shed:
            by_use = Stage.SHED_SPECULATIVE
    if blocked:
        return Stage.REJECT_INTERACTIVE, "blocked"
    if queue_depth > 0 and oldest_age_s > policy.queue_age_s:
        full = capacity > 0 and used >= capacity
        top = Stage.REJECT_INTERACTIVE if full else Stage.TIGHTEN
        by_signal = Stage(min(top, by_use + 1))
        if by_signal > by_use:
            return by_signal, "queue age"
    return by_use, "utilisation"
