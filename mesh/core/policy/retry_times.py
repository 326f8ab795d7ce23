"""Retry times that mean something: when a refused or deferred request should come back,
from the pool's drain rate (``capacity / service time``, the service time measured from how
long grants were held), never a constant while the pool's figures are known."""

from __future__ import annotations

from collections.abc import Callable

from mesh.core.policy.settings import PressurePolicy

__all__ = ["line_retry_ms", "no_agent_retry_ms", "refusal_retry_ms"]


def refusal_retry_ms(
    slots_to_free: int,
    competitors: int,
    capacity: int,
    service_s: float,
    now: float,
    deadline: float | None,
    policy: PressurePolicy,
    rand: Callable[[], float],
) -> int | None:
    """After a refusal that needs ``slots_to_free`` slots freed, with ``competitors`` of the
    same tenant's refused requests still waiting to come back::

        wait = (slots_to_free + competitors) / drain_rate

    clamped to ``[retry_min_ms, retry_max_ms]`` and spread over ``wait * (1 ± jitter)`` so
    refused producers do not come back in step. ``None``: ``deadline`` passes before the wait
    and the service time are over. Disabled: the constant default."""
    if not policy.enabled:
        return policy.retry_default_ms
    if capacity <= 0 or service_s <= 0:
        wait_ms = float(policy.retry_default_ms)
    else:
        drain_rate = capacity / service_s  # grants ending per second when busy
        wait_ms = 1000.0 * (max(1, slots_to_free) + competitors) / drain_rate
    wait_ms = min(max(wait_ms, policy.retry_min_ms), policy.retry_max_ms)
    spread = wait_ms * (1.0 + policy.jitter * (2.0 * rand() - 1.0))
    retry_ms = int(min(max(spread, policy.retry_min_ms), policy.retry_max_ms))
    if deadline is not None and now + retry_ms / 1000.0 + service_s > deadline:
        return None
    return retry_ms


def line_retry_ms(
    position: int,
    free: int,
    capacity: int,
    service_s: float,
    queue_wait_s: float,
    now: float,
    deadline: float | None,
    policy: PressurePolicy,
    rand: Callable[[], float],
    *,
    joining: bool = False,
) -> int | None:
    """For a request at ``position`` in the pool's line (``free`` slots free now): once the
    ``position - free`` grants before its turn have ended at the pool's drain rate, coming
    back up to ``line_jitter`` of one drain interval early, never late. ``None`` when its
    deadline would pass first — the predicted finish (back, then ``queue_wait_s`` and the
    service time) plus a slack: ``line_join_slack`` of the time until then for a request
    ``joining`` the line, a tenth for one already placed."""
    if capacity <= 0 or service_s <= 0:
        interval_ms = wait_ms = float(policy.retry_default_ms)
    else:
        interval_ms = 1000.0 * service_s / capacity  # between grants ending, when busy
        wait_ms = interval_ms * max(1, position - free)
    floor = policy.line_retry_min_ms
    wait_ms = min(max(wait_ms, floor), policy.retry_max_ms)
    spread = wait_ms - policy.line_jitter * interval_ms * rand()
    retry_ms = int(min(max(spread, floor), policy.retry_max_ms))
    if deadline is not None:
        # What the gate will predict when it comes back (queue wait and service), and a
        # slack for coming back a little late: better told now than refused at its turn.
        finish = now + retry_ms / 1000.0 + queue_wait_s + service_s
        slack = policy.line_join_slack if joining else 0.1
        if finish + 0.05 + slack * (finish - now) > deadline:
            return None
    return retry_ms


def no_agent_retry_ms(
    expected_s: float | None,
    now: float,
    deadline: float | None,
    policy: PressurePolicy,
    rand: Callable[[], float],
) -> int | None:
    """For a request refused because no live agent can take it: when one may be live — the
    scale planner's estimate (``expected_s``) where the pool has a scaling policy, else
    ``retry_default_ms`` — spread up to a fifth later so producers do not return in step.
    ``None``: ``deadline`` passes first."""
    if expected_s is None:
        wait_ms = float(policy.retry_default_ms)
    else:
        wait_ms = 1000.0 * expected_s
    wait_ms *= 1.0 + 0.2 * rand()  # spread the producers' returns
    if deadline is not None and now + wait_ms / 1000.0 >= deadline:
        return None
    return max(1, round(wait_ms))
