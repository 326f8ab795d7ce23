"""Running aggregates of the registry: agents by pool and state, load by capability.

The metrics, the status summary and the status page read these figures on every scrape,
request or tick. Computing them from the agent records would cost O(agents) each time (at
100k agents a scrape blocked the event loop for over a second), so the pool core moves them
as it changes an agent instead: :meth:`FleetTally.count` takes an agent's contribution out
before a change (``sign=-1``) and puts it back after (``+1``), O(the agent's capabilities).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

K = TypeVar("K")

TAKING_WORK = frozenset({"Ready", "Busy"})
"""The lifecycle states whose agents' concurrency counts as capacity."""


class SlotLike(Protocol):
    @property
    def capability(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...


@dataclass(slots=True)
class CapabilityLoad:
    """One capability across agents: how many offer it, and in-flight against concurrency
    on those that take work (Ready or Busy)."""

    agents: int = 0
    taking_work: int = 0  # of them Ready or Busy
    in_flight: int = 0
    capacity: int = 0


class FleetTally:
    """Agents by pool and state, by capability and state, and load by capability; counts
    that reach zero are removed, so a capability or pool nobody offers any more is gone."""

    __slots__ = ("agents", "by_capability_state", "by_pool_state", "by_state", "loads")

    def __init__(self) -> None:
        self.agents = 0
        self.by_state: dict[str, int] = {}  # state -> agents
        self.by_capability_state: dict[tuple[str, str], int] = {}  # (capability, state)
        self.by_pool_state: dict[tuple[str, str], int] = {}  # (deployment, state)
        self.loads: dict[str, CapabilityLoad] = {}

    def count(self, deployment: str, state: str, slots: Iterable[SlotLike], sign: int) -> None:
        """Add (``sign=1``) or take away (``-1``) one agent as it stands now."""
        self.agents += sign
        move_count(self.by_state, state, sign)
        move_count(self.by_pool_state, (deployment, state), sign)
        taking_work = state in TAKING_WORK
        for slot in slots:
            name = slot.capability
            move_count(self.by_capability_state, (name, state), sign)
            load = self.loads.get(name)
            if load is None:
                load = self.loads[name] = CapabilityLoad()
            load.agents += sign
            if taking_work:
                load.taking_work += sign
                load.in_flight += sign * slot.in_flight
                load.capacity += sign * slot.max_concurrency
            if load.agents <= 0:
                del self.loads[name]

    @property
    def taking_work(self) -> int:
        """Agents Ready or Busy now."""
        return sum(self.by_state.get(state, 0) for state in TAKING_WORK)

    def pools(self) -> dict[str, dict[str, int]]:
        """``{deployment: {state: agents}}``, sorted by deployment."""
        out: dict[str, dict[str, int]] = {}
        for (deployment, state), n in sorted(self.by_pool_state.items()):
            out.setdefault(deployment, {})[state] = n
        return out


def move_count(counts: dict[K, int], key: K, delta: int) -> None:
    """``counts[key] += delta``; a count that reaches 0 is removed."""
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
