"""The lifecycle table, and the diagram in docs/lifecycle.md rendered from it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from mesh.core.lifecycle import (
    ACQUIRABLE,
    TRANSITIONS,
    AgentState,
    Trigger,
    next_state,
    render_mermaid,
)

S, T = AgentState, Trigger
LIVE = (S.SPAWNING, S.REGISTERING, S.READY, S.BUSY, S.DRAINING)

# The lifecycle, written out by hand: the table must be exactly this.
EXPECTED: dict[tuple[AgentState, Trigger], AgentState] = {
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
    **{(state, T.LOSE): S.TERMINATED for state in LIVE},
    **{(state, T.DEREGISTER): S.TERMINATED for state in LIVE},
}

ILLEGAL = sorted(
    set(itertools.product(AgentState, Trigger)) - set(EXPECTED),
    key=lambda pair: (pair[0].value, pair[1].value),
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_the_table_holds_exactly_the_intended_edges() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("edge", "target"), EXPECTED.items(), ids=lambda v: str(v))
def test_every_legal_edge_leads_where_the_table_says(
    edge: tuple[AgentState, Trigger], target: AgentState
) -> None:
    assert next_state(*edge) is target


@pytest.mark.parametrize("edge", ILLEGAL, ids=lambda e: f"{e[0].value}-{e[1].value}")
def test_every_other_edge_is_illegal(edge: tuple[AgentState, Trigger]) -> None:
    assert next_state(*edge) is None


@pytest.mark.parametrize(
    ("state", "trigger"),
    [
        (S.DRAINING, T.ACQUIRE),
        (S.TERMINATED, T.ACQUIRE),
        (S.READY, T.ACCEPT),
        (S.TERMINATED, T.ACCEPT),
        (S.TERMINATED, T.REGISTER),
        (S.READY, T.REGISTER),
        (S.READY, T.RELEASE),
        (S.READY, T.IDLE),
        (S.DRAINING, T.IDLE),
        (S.DRAINING, T.DRAIN),
        (S.BUSY, T.DRAINED),
        (S.TERMINATED, T.LOSE),
        (S.TERMINATED, T.DEREGISTER),
    ],
)
def test_notable_illegal_transitions_are_refused(state: AgentState, trigger: Trigger) -> None:
    assert next_state(state, trigger) is None


def test_terminated_is_final() -> None:
    assert not [edge for edge in TRANSITIONS if edge[0] is S.TERMINATED]


def test_every_state_is_reachable_from_spawning_and_can_reach_terminated() -> None:
    reachable = {S.SPAWNING}
    frontier = [S.SPAWNING]
    while frontier:
        state = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is state and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(AgentState)
    for state in LIVE:
        assert next_state(state, T.LOSE) is S.TERMINATED
        assert next_state(state, T.DEREGISTER) is S.TERMINATED


def test_only_ready_and_busy_are_acquirable() -> None:
    assert frozenset({S.READY, S.BUSY}) == ACQUIRABLE
    assert {src for (src, trigger) in TRANSITIONS if trigger is T.ACQUIRE} == ACQUIRABLE


def test_the_mermaid_diagram_has_one_line_per_distinct_edge() -> None:
    lines = render_mermaid().splitlines()

    assert lines[0] == "stateDiagram-v2"
    assert lines[1].strip() == "[*] --> Spawning"
    assert lines[-1].strip() == "Terminated --> [*]"
    edges = {}
    for line in lines[2:-1]:
        match = re.fullmatch(r"    (\w+) --> (\w+): (.+)", line)
        assert match, line
        src, dst, triggers = match.groups()
        assert (src, dst) not in edges, f"duplicate edge {src} --> {dst}"
        edges[src, dst] = set(triggers.split(" / "))
    expected: dict[tuple[str, str], set[str]] = {}
    for (src_state, trigger), dst_state in EXPECTED.items():
        expected.setdefault((src_state.value, dst_state.value), set()).add(trigger.value)
    assert edges == expected


def _mermaid_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```mermaid\n(.*?)^```\s*$", markdown, flags=re.DOTALL | re.MULTILINE)


def test_the_docs_diagram_is_exactly_what_the_table_renders() -> None:
    blocks = _mermaid_blocks(DOC.read_text(encoding="utf-8"))

    assert len(blocks) == 1, f"{DOC} must hold exactly one ```mermaid block"
    assert blocks[0] == render_mermaid(), (
        f"{DOC} is out of date with mesh/core/lifecycle.py: replace its ```mermaid block "
        "with the output of mesh.core.lifecycle.render_mermaid()"
    )


def test_the_docs_check_would_notice_a_changed_edge() -> None:
    doc = DOC.read_text(encoding="utf-8")
    tampered = doc.replace("Busy --> Ready: idle", "Busy --> Ready: release", 1)

    assert tampered != doc
    assert _mermaid_blocks(tampered)[0] != render_mermaid()
