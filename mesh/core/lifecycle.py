"""The agent lifecycle, as one table.

Theory of operation
-------------------
An agent's state changes only when the manager core applies a *trigger* to it,
and the only legal changes are the rows of :data:`TRANSITIONS`. Everything
else (acquiring a draining agent, re-accepting a terminated one) is refused by
:func:`next_state` returning ``None``; the core turns that into a typed refusal
and logs it. The docs' state diagram is rendered from this table by
:func:`render_mermaid`, and a test keeps the two in step.

Busy means "at least one unit of work in flight" — a leased slot, or a task of
the pool's shared queue the agent reported it started (one count of work, see
:mod:`mesh.core.pool`); it is a label for operators. Whether an agent can take
*more* work is decided by its per-capability in-flight counters, never by this
label: an agent with ``max_concurrency > 1`` stays acquirable while Busy until
it is full.
"""

from __future__ import annotations

from enum import StrEnum


class AgentState(StrEnum):
    SPAWNING = "Spawning"
    REGISTERING = "Registering"
    READY = "Ready"
    BUSY = "Busy"
    DRAINING = "Draining"
    TERMINATED = "Terminated"


class Trigger(StrEnum):
    REGISTER = "register"  # a registration arrived
    ACCEPT = "accept"  # it passed validation
    REFUSE = "refuse"  # it did not
    ACQUIRE = "acquire"  # a slot was leased
    RELEASE = "release"  # a slot was given back, others remain leased
    WORK = "work"  # the agent reported it started pool work (a granted task)
    IDLE = "idle"  # the last unit of work (leased or pool) ended
    DRAIN = "drain"  # take no new work
    DRAINED = "drained"  # draining and nothing in flight on either path any more
    LOSE = "lose"  # heartbeats stopped for 3 intervals
    DEREGISTER = "deregister"  # the agent said goodbye


S, T = AgentState, Trigger
_LIVE = (S.SPAWNING, S.REGISTERING, S.READY, S.BUSY, S.DRAINING)

TRANSITIONS: dict[tuple[AgentState, Trigger], AgentState] = {
    (S.SPAWNING, T.REGISTER): S.REGISTERING,
    (S.REGISTERING, T.ACCEPT): S.READY,
    (S.REGISTERING, T.REFUSE): S.TERMINATED,
    (S.READY, T.ACQUIRE): S.BUSY,
    (S.BUSY, T.ACQUIRE): S.BUSY,
    (S.BUSY, T.RELEASE): S.BUSY,
    (S.READY, T.WORK): S.BUSY,
    (S.BUSY, T.IDLE): S.READY,
    (S.READY, T.DRAIN): S.DRAINING,
    (S.BUSY, T.DRAIN): S.DRAINING,
    (S.DRAINING, T.RELEASE): S.DRAINING,
    (S.DRAINING, T.DRAINED): S.TERMINATED,
    **{(state, T.LOSE): S.TERMINATED for state in _LIVE},
    **{(state, T.DEREGISTER): S.TERMINATED for state in _LIVE},
}

ACQUIRABLE = frozenset({S.READY, S.BUSY})


def next_state(state: AgentState, trigger: Trigger) -> AgentState | None:
    """The state ``trigger`` leads to from ``state``, or ``None`` if that is illegal."""
    return TRANSITIONS.get((state, trigger))


def render_mermaid() -> str:
    """The lifecycle as a Mermaid state diagram, one edge per distinct (from, to) pair."""
    edges: dict[tuple[AgentState, AgentState], list[str]] = {}
    for (src, trigger), dst in TRANSITIONS.items():
        edges.setdefault((src, dst), []).append(trigger.value)
    lines = ["stateDiagram-v2", f"    [*] --> {S.SPAWNING.value}"]
    for (src, dst), triggers in edges.items():
        lines.append(f"    {src.value} --> {dst.value}: {' / '.join(triggers)}")
    lines.append(f"    {S.TERMINATED.value} --> [*]")
    return "\n".join(lines) + "\n"
