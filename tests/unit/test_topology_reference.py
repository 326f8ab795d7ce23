"""docs/topology.md is generated from mesh.topology: regenerated here, it must be the same, and
it must name every queue's role and every routing key a process publishes."""

from __future__ import annotations

from pathlib import Path

from mesh import constants as c
from mesh.producer.client import _METHODS
from mesh.topology.reference import _declarations, _role, render
from mesh.topology.specs import Topology

PAGE = Path(__file__).parents[2] / "docs" / "topology.md"


def test_the_topology_page_is_what_the_code_declares() -> None:
    assert PAGE.read_text() == render(), (
        "docs/topology.md is out of date: python -m mesh.topology.reference > docs/topology.md"
    )


def test_every_queue_on_the_page_says_what_it_is_for() -> None:
    for queue in _declarations(Topology(c.DEFAULT_NAMESPACE)).queues:
        assert _role(queue.name.replace("shard-0", "shard-<k>")), queue.name


def test_the_page_lists_every_request_a_client_sends_and_every_verb_an_agent_announces() -> None:
    assert sorted(_METHODS.values()) == sorted(c.RPC_METHODS)
    page = render()
    assert all(f"`rpc.{method}`" in page for method in c.RPC_METHODS)
    assert all(f"`agent.<id>.{verb}`" in page for verb in c.AGENT_ANNOUNCE_VERBS)
