"""The one preference order (mesh.core.ranking.rank), and that both find and pool choice
follow it: changing the order is changing that function."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ledger.helpers import prepare

from mesh.core import LiveCapacity, LiveOffer, ranking
from mesh.core.pool_order import by_preference
from mesh.core.ranking import rank
from mesh.ledger.model import Prepared
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter

from .builders import Pool, capability
from .samples import DESCRIPTOR, REQUIREMENTS, T0


def test_cheapest_cost_class_first_then_least_loaded() -> None:
    keys = [rank("C", 0), rank("A", 5), rank(None, 0), rank("B", 1), rank("A", 1)]
    assert sorted(keys) == [rank("A", 1), rank("A", 5), rank("B", 1), rank("C", 0), rank(None, 0)]
    assert ranking.cheapest(["C", "B", "C"]) == "B" and ranking.cheapest([]) is None


def find_order() -> list[str]:
    """Three agents: cheap and busy (2 of 4 leased), dear and idle, cheap and idle."""
    pool = Pool()
    for agent_id, cost in (("cheap-busy", "A"), ("dear-idle", "C"), ("cheap-idle", "A")):
        pool.register(
            agent_id, capability("rag.search", "2.1.0", cost_class=cost, max_concurrency=4)
        )
    for _ in range(2):
        pool.lease("rag.search", agent_id="cheap-busy")
    return pool.found("rag.search")


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def pool_order(ledger: SqliteLedger) -> list[str]:
    """Two eligible pools: ``rag-a`` (cost class A agents, half its slots in use) and
    ``rag-c`` (class C, empty); the order the admitter tries them in."""
    admitter = Admitter(ledger, AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation))
    for pool_id in ("rag-a", "rag-c"):
        descriptor = DESCRIPTOR.model_copy(update={"pool_id": pool_id})
        assert admitter.publish_descriptor(descriptor, T0) is None
        ledger.set_capacity(pool_id, "model_slots", 2)
    assert isinstance(prepare(ledger, "held", "d", [("rag-a", "model_slots", 1)], 60, T0), Prepared)
    live = LiveCapacity(
        {
            ("rag-a", "rag.search"): (LiveOffer("2.1.0", 1, 4, "A"),),
            ("rag-c", "rag.search"): (LiveOffer("2.1.0", 1, 4, "C"),),
        }
    )
    return by_preference(["rag-c", "rag-a"], REQUIREMENTS, ledger.usage(), live)


def test_find_and_pool_choice_both_follow_the_one_ranking(ledger: SqliteLedger) -> None:
    assert find_order() == ["cheap-idle", "cheap-busy", "dear-idle"]
    assert pool_order(ledger) == ["rag-a", "rag-c"]  # cost class first, though rag-a is busier


def test_changing_the_ranking_function_changes_both(
    ledger: SqliteLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    def least_loaded_whatever_it_costs(cost_class: str | None, load: float) -> float:
        return load

    monkeypatch.setattr(ranking, "rank", least_loaded_whatever_it_costs)

    assert find_order() == ["dear-idle", "cheap-idle", "cheap-busy"]
    assert pool_order(ledger) == ["rag-c", "rag-a"]
