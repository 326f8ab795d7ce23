"""Admission on the live registry: a pool grants at most what its live agents can run and its
descriptor allows, and nothing without a live agent. A real (SQLite) ledger, no broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.core import LiveCapacity, LiveOffer
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.wire import AdmissionReason, AdmissionRequest

from .samples import DESCRIPTOR, REQUIREMENTS, T0

POLICY = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
POOL = DESCRIPTOR.pool_id  # rag-eu: rag.search >=2.0,<3, 16 model slots


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


@pytest.fixture
def admitter(ledger: SqliteLedger) -> Admitter:
    a = Admitter(ledger, POLICY, rand=lambda: 0.0)
    assert a.publish_descriptor(DESCRIPTOR, T0) is None
    return a


def live(*offers: tuple[str, int, int], version: int = 1, **retry_s: float) -> LiveCapacity:
    """rag.search offers of the pool as (version, agents, free)."""
    entries = tuple(LiveOffer(v, agents, free, "B") for v, agents, free in offers)
    return LiveCapacity({(POOL, "rag.search"): entries} if entries else {}, retry_s, version)


def request(admission_id: str) -> AdmissionRequest:
    # No sandbox and no tools: only model slots, live slots and tokens bound it.
    reqs = REQUIREMENTS.model_copy(
        update={"needs_sandbox": False, "required_tools": [], "allowed_fallbacks": []}
    )
    return AdmissionRequest(admission_id=admission_id, requirements=reqs)


def live_slots(ledger: SqliteLedger) -> tuple[int, int]:
    return ledger.usage()[(POOL, "live_slots:rag.search")]


def test_a_pool_without_a_live_agent_is_not_admissible_and_says_so(admitter: Admitter) -> None:
    decision = admitter.admit(request("a-1"), "tenant-a", T0, live())

    assert (decision.outcome, decision.reason) == ("deferred", AdmissionReason.NO_LIVE_AGENT)
    assert "no live agent" in decision.detail
    assert decision.retry_after_ms == POLICY.pressure.retry_default_ms
    assert admitter.ledger.get("a-1") is None  # nothing reserved


def test_the_retry_time_comes_from_the_pending_scale_up(admitter: Admitter) -> None:
    decision = admitter.admit(request("a-1"), "tenant-a", T0, live(**{POOL: 12.5}))
    assert decision.retry_after_ms == 12_500


def test_no_live_agent_past_the_deadline_is_a_rejection_at_once(admitter: Admitter) -> None:
    # REQUIREMENTS' deadline is T0 + 300
    decision = admitter.admit(request("a-1"), "tenant-a", T0, live(**{POOL: 400.0}))
    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.DEADLINE_UNREACHABLE)


def test_an_agent_outside_the_task_or_descriptor_range_is_not_a_live_agent(
    admitter: Admitter,
) -> None:
    # the task wants >=2.1, the descriptor allows >=2.0,<3
    for version in ("2.0.5", "3.0.0"):
        decision = admitter.admit(request(f"a-{version}"), "t", T0, live((version, 3, 3)))
        assert decision.reason is AdmissionReason.NO_LIVE_AGENT, version


def test_grants_never_pass_the_live_figure_below_the_descriptors(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    view = live(("2.1.0", 2, 3))
    decisions = admitter.admit_many([(request(f"a-{i}"), "t") for i in range(5)], T0, view)

    assert [d.outcome for d in decisions] == ["admitted"] * 3 + ["deferred"] * 2
    assert {d.reason for d in decisions[3:]} == {AdmissionReason.CAPACITY}
    assert live_slots(ledger) == (3, 3)
    assert ledger.usage()[(POOL, "model_slots")] == (3, 16)


def test_only_the_versions_the_descriptor_covers_count_towards_live_capacity(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    view = live(("2.1.0", 1, 2), ("3.1.0", 4, 8))  # 3.x is outside the descriptor's range
    admitter.admit(request("a-1"), "t", T0, view)
    assert live_slots(ledger) == (1, 2)


def test_the_descriptor_still_bounds_a_pool_with_more_live_capacity(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    view = live(("2.1.0", 40, 80))
    decisions = admitter.admit_many([(request(f"a-{i}"), "t") for i in range(20)], T0, view)
    assert sum(d.outcome == "admitted" for d in decisions) == 16  # model_limits.slots


def test_shrinking_live_capacity_revokes_nothing_and_stops_new_grants(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    admitter.admit_many([(request(f"a-{i}"), "t") for i in range(3)], T0, live(("2.1.0", 3, 3)))
    shrunk = live(("2.1.0", 1, 1), version=2)  # two agents drained

    refused = admitter.admit(request("a-3"), "t", T0 + 1, shrunk)

    assert refused.reason is AdmissionReason.CAPACITY
    assert [ledger.get(f"a-{i}").state for i in range(3)] == ["ACTIVE"] * 3  # type: ignore[union-attr]
    assert live_slots(ledger) == (3, 1)
    for i in range(3):  # room again only once the held grants fall below the live figure
        grant = admitter.admit(request(f"a-{i}"), "t", T0 + 1, shrunk).grant
        assert grant is not None  # the same admission ID: the grant it holds
        assert admitter.release(grant.admission_id, grant.fence, T0 + 2).released
        assert admitter.admit(request(f"b-{i}"), "t", T0 + 2, shrunk).outcome == "deferred"
    # The room is a-3's: it waited longest (first in the pool's line), b-2 waits behind it.
    assert admitter.admit(request("a-3"), "t", T0 + 2, shrunk).outcome == "admitted"


def test_capacity_and_no_live_agent_deferrals_are_capacity_misses(admitter: Admitter) -> None:
    admitter.admit(request("a-1"), "t", T0, live(("2.1.0", 1, 1)))
    admitter.admit(request("a-2"), "t", T0, live(("2.1.0", 1, 1)))  # full
    admitter.admit(request("a-3"), "t", T0, live(version=2))  # gone

    assert admitter.drain_misses() == [(POOL, "CAPACITY"), (POOL, "NO_LIVE_AGENT")]
    assert admitter.drain_misses() == []


def test_the_live_figure_is_written_between_admissions_too(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    admitter.sync_live(live(("2.1.0", 2, 5)), T0)
    assert live_slots(ledger) == (0, 5)

    admitter.sync_live(live(version=2), T0)
    assert live_slots(ledger) == (0, 0)


def test_without_a_live_view_the_descriptor_alone_decides(
    admitter: Admitter, ledger: SqliteLedger
) -> None:
    """``admission_capacity="descriptor"`` (several managers on one ledger): no live-slot
    counter is taken, and a pool with no registered agent is admitted as before."""
    decision = admitter.admit(request("a-1"), "t", T0)
    assert decision.outcome == "admitted"
    assert (POOL, "live_slots:rag.search") not in ledger.usage()
