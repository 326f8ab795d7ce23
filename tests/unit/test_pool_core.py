"""The pool core driven with events and a fake clock: events in, commands out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mesh import constants as c
from mesh.core import (
    AgentState,
    AppendLog,
    Command,
    ConnectionLost,
    ConnectionRestored,
    FenceAgent,
    InvalidVersionSpec,
    PoolCore,
    PoolSettings,
    Reply,
    SendToAgent,
)
from mesh.core.registration import fingerprint
from mesh.wire import (
    DrainAccepted,
    DrainComplete,
    DrainNotice,
    FindReply,
    Lease,
    Reason,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    Released,
    ReRegisterRequest,
)

from .builders import (
    FakeClock,
    Pool,
    announcements,
    capability,
    log_entries,
    reply,
    sent,
    transitions,
)


@pytest.fixture
def pool() -> Pool:
    return Pool()


def refusal_reason(result: Lease | Refusal) -> Reason:
    assert isinstance(result, Refusal), f"expected a refusal, got {result}"
    return result.reason


def in_flight(pool: Pool, agent_id: str, name: str = "calc.add") -> int:
    return pool.core.agents[agent_id].slots[name].in_flight


# ---- registration ----------------------------------------------------------------------------


def test_a_registration_moves_the_agent_through_registering_to_ready(pool: Pool) -> None:
    out = pool.register("calc-1", capability("calc.add", "1.0.0"))

    assert transitions(out) == [
        ("Spawning", "Registering", "registered"),
        ("Registering", "Ready", "ready"),
    ]
    assert all(e.agent_id == "calc-1" and e.at == pool.clock.now().wall for e in log_entries(out))
    assert sent(out, RegistrationAccepted) == [
        ("calc-1", RegistrationAccepted(agent_id="calc-1", incarnation="inc-1"))
    ]
    assert pool.state("calc-1") is AgentState.READY
    assert pool.found() == ["calc-1"]


def test_the_acceptance_is_sent_only_after_ready_is_logged(pool: Pool) -> None:
    out = pool.register("calc-1")

    ready_at = next(
        i for i, cmd in enumerate(out) if isinstance(cmd, AppendLog) and cmd.entry.kind == "ready"
    )
    accepted_at = next(
        i
        for i, cmd in enumerate(out)
        if isinstance(cmd, SendToAgent) and isinstance(cmd.message, RegistrationAccepted)
    )
    assert ready_at < accepted_at


def test_a_registration_announces_every_capability_it_offers(pool: Pool) -> None:
    out = pool.register("calc-1", capability("calc.add"), capability("text.stats", "0.3.0"))

    assert [(a.capability, a.agent_id, a.entry.kind) for a in announcements(out)] == [
        ("calc.add", "calc-1", "capability_available"),
        ("text.stats", "calc-1", "capability_available"),
    ]
    assert pool.found("text.stats") == ["calc-1"]


@pytest.mark.parametrize("interval", [0.5, 1.0, 4.99])
def test_a_heartbeat_interval_below_five_seconds_is_refused_with_the_reason(
    pool: Pool, interval: float
) -> None:
    out = pool.register("calc-1", heartbeat_interval_s=interval)

    [(agent_id, refused)] = sent(out, RegistrationRefused)
    assert agent_id == "calc-1"
    assert refused.reason is Reason.HEARTBEAT_INTERVAL_TOO_SHORT
    assert f"heartbeat_interval_s={interval:g}" in refused.detail
    assert "minimum of 5 s" in refused.detail
    assert "evicts healthy agents" in refused.detail
    assert not sent(out, RegistrationAccepted)
    # Through the lifecycle table: Spawning -> Registering -> Terminated, nothing kept.
    moves = [(e.kind, e.from_state, e.to_state) for e in log_entries(out)]
    assert moves == [
        ("registered", "Spawning", "Registering"),
        ("refused", "Registering", "Terminated"),
    ]
    assert log_entries(out)[-1].reason == "HEARTBEAT_INTERVAL_TOO_SHORT"
    assert "calc-1" not in pool.core.agents
    assert "calc.add" not in pool.core.index
    assert pool.found() == []


def test_a_heartbeat_interval_of_exactly_five_seconds_is_accepted(pool: Pool) -> None:
    out = pool.register("calc-1", heartbeat_interval_s=5.0)

    assert sent(out, RegistrationAccepted)
    assert pool.state("calc-1") is AgentState.READY


def test_a_repeated_registration_of_the_same_incarnation_is_acked_again_without_new_state(
    pool: Pool,
) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    pool.lease()

    again = pool.register("calc-1", capability(max_concurrency=2))

    assert again == [
        SendToAgent("calc-1", RegistrationAccepted(agent_id="calc-1", incarnation="inc-1"))
    ]
    assert pool.state("calc-1") is AgentState.BUSY
    assert in_flight(pool, "calc-1") == 1
    assert pool.core.index.versions("calc.add") == ["1.0.0"]


def test_a_verified_new_incarnation_replaces_the_old_one_and_drops_its_leases(
    pool: Pool,
) -> None:
    """With identities on, the broker vouches that the agent itself registered again (a
    restart): the new incarnation replaces the live one at once."""
    pool.register("calc-1", capability("calc.add", "1.0.0"), incarnation="inc-1")
    old_lease = pool.lease()

    out = pool.register(
        "calc-1", capability("calc.add", "2.0.0"), incarnation="inc-2", identity_verified=True
    )

    assert transitions(out) == [
        ("Busy", "Terminated", "terminated"),
        ("Spawning", "Registering", "registered"),
        ("Registering", "Ready", "ready"),
    ]
    assert log_entries(out, "version_drift") == []  # the old version left before the new came
    assert sent(out, RegistrationAccepted) == [
        ("calc-1", RegistrationAccepted(agent_id="calc-1", incarnation="inc-2"))
    ]
    assert pool.core.agents["calc-1"].incarnation == "inc-2"
    assert pool.core.index.versions("calc.add") == ["2.0.0"]
    assert pool.found(version_spec="<2") == []
    assert pool.found(version_spec=">=2") == ["calc-1"]
    assert in_flight(pool, "calc-1") == 0
    assert refusal_reason_of_release(pool, old_lease.lease_id) is Reason.UNKNOWN_LEASE


def test_an_unverified_new_incarnation_never_displaces_a_live_agent(pool: Pool) -> None:
    """With identities off anyone can claim an agent ID: a forged registration (1,000
    slots) is refused while the registered incarnation is live, with the time until it
    would be declared lost, and changes nothing; once that one is lost, the ID is free."""
    pool.register("calc-1", capability("calc.add", "1.0.0"), incarnation="inc-1")
    lease = pool.lease()
    pool.clock.advance(4.0)

    out = pool.register(
        "calc-1", capability("calc.add", "1.0.0", max_concurrency=1000), incarnation="forged"
    )

    assert transitions(out) == []
    [(to, refusal)] = sent(out, RegistrationRefused)
    assert to == "calc-1" and refusal.incarnation == "forged"
    assert refusal.reason is Reason.AGENT_ID_IN_USE
    assert refusal.retry_after_ms == 26_000  # 3 x 10 s window, 4 s of it gone
    assert "--agent-identity on" in refusal.detail
    [entry] = log_entries(out, "registration_refused")
    assert entry.reason == "AGENT_ID_IN_USE"
    # The live incarnation is what lets a publisher speak for the agent with identities off:
    # neither the refusal (read by whoever consumes the ID's control queue) nor the journal
    # and events feed carry it, only its fingerprint.
    assert "inc-1" not in refusal.detail and "inc-1" not in str(entry.detail)
    assert entry.detail == {
        "incarnation": fingerprint("forged"),
        "live_incarnation": fingerprint("inc-1"),
    }
    assert pool.core.agents["calc-1"].incarnation == "inc-1"
    assert pool.core.counters["registration_incarnation_live"] == 1
    assert in_flight(pool, "calc-1") == 1  # its lease stands
    assert refusal_reason_of_release(pool, "no-such") is Reason.UNKNOWN_LEASE
    assert not isinstance(reply(pool.release(lease.lease_id)), Refusal)

    pool.clock.advance(30.0)
    pool.tick()  # inc-1 is declared lost
    again = pool.register("calc-1", capability("calc.add", "1.0.0"), incarnation="forged")
    assert sent(again, RegistrationAccepted) == [
        ("calc-1", RegistrationAccepted(agent_id="calc-1", incarnation="forged"))
    ]


def refusal_reason_of_release(pool: Pool, lease_id: str) -> Reason:
    answer = reply(pool.release(lease_id))
    assert isinstance(answer, Refusal), answer
    return answer.reason


def test_a_deregistration_from_an_old_incarnation_is_ignored(pool: Pool) -> None:
    pool.register("calc-1", incarnation="inc-2")

    assert pool.deregister("calc-1", incarnation="inc-1") == []
    assert pool.state("calc-1") is AgentState.READY


# ---- find: ordering ----------------------------------------------------------------------------


def test_find_returns_cost_class_a_before_b_before_c(pool: Pool) -> None:
    pool.register("dear", capability(cost_class="C"))
    pool.register("middling", capability(cost_class="B"))
    pool.register("cheap", capability(cost_class="A"))

    assert pool.found() == ["cheap", "middling", "dear"]
    assert pool.found(limit=1) == ["cheap"]
    assert pool.lease().agent_id == "cheap"


def test_within_a_cost_class_the_least_loaded_agent_comes_first(pool: Pool) -> None:
    pool.register("first", capability(max_concurrency=3))
    pool.register("second", capability(max_concurrency=3))
    pool.register("dear", capability(cost_class="B", max_concurrency=3))
    assert pool.found() == ["first", "second", "dear"]

    pool.lease(agent_id="first")
    assert pool.found() == ["second", "first", "dear"]

    pool.lease(agent_id="second")
    pool.lease(agent_id="second")
    # A cheaper agent with two tasks still beats an idle dearer one.
    assert pool.found() == ["first", "second", "dear"]
    assert [c.in_flight for c in pool.core.find_by_capability("calc.add")] == [1, 2, 0]


def test_the_least_loaded_agent_comes_first_whatever_order_loads_changed_in(pool: Pool) -> None:
    pool.register("x", capability(max_concurrency=2))
    pool.register("y", capability(max_concurrency=2))
    lease_x = pool.lease(agent_id="x")
    pool.lease(agent_id="y")  # both at load 1

    pool.release(lease_x.lease_id)  # x back to load 0, after load 1 was seen

    assert pool.found() == ["x", "y"]
    assert pool.lease().agent_id == "x"


def test_load_counts_the_leases_of_every_capability_an_agent_offers(pool: Pool) -> None:
    pool.register("multi", capability("calc.add", max_concurrency=2), capability("text.stats"))
    pool.register("single", capability("calc.add", max_concurrency=2))
    assert pool.found() == ["multi", "single"]

    pool.lease("text.stats", agent_id="multi")

    assert pool.found() == ["single", "multi"]


def test_a_limited_find_is_the_head_of_the_full_answer_at_every_limit(pool: Pool) -> None:
    for n, cost_class in enumerate("ABCABCAB"):
        pool.register(f"agent-{n}", capability(cost_class=cost_class, max_concurrency=3))
    pool.lease(agent_id="agent-0")
    pool.lease(agent_id="agent-3")
    pool.lease(agent_id="agent-3")
    everything = pool.found()
    assert len(everything) == 8

    for limit in range(1, 10):
        assert pool.found(limit=limit) == everything[:limit]


def test_find_reports_a_capability_s_own_load_after_work_moved_between_capabilities(
    pool: Pool,
) -> None:
    pool.register(
        "multi",
        capability("calc.add", max_concurrency=3),
        capability("text.stats", max_concurrency=3),
        features=(c.FEATURE_WORK_REPORTS,),
    )
    pool.heartbeat("multi", pool_in_flight={"calc.add": 1})

    pool.heartbeat("multi", pool_in_flight={"text.stats": 1})  # the agent's load stays 1

    assert [a.in_flight for a in pool.core.find_by_capability("calc.add")] == [0]
    assert [a.in_flight for a in pool.core.find_by_capability("text.stats")] == [1]


def test_an_unnamed_acquire_takes_the_best_match(pool: Pool) -> None:
    pool.register("dear", capability(cost_class="B", max_concurrency=2))
    pool.register("cheap", capability(cost_class="A", max_concurrency=1))

    assert pool.lease().agent_id == "cheap"
    assert pool.lease().agent_id == "dear"  # cheap is full now
    assert pool.lease().agent_id == "dear"
    assert refusal_reason(pool.acquire()) is Reason.NO_AGENT_AVAILABLE


def test_a_find_request_is_answered_with_summaries_in_order(pool: Pool) -> None:
    pool.register("dear", capability(cost_class="C", version="1.1.0"))
    pool.register("cheap", capability(cost_class="A", version="1.0.0", max_concurrency=5))

    answer = reply(pool.find_commands(limit=10))

    assert isinstance(answer, FindReply)
    assert [(a.agent_id, a.version, a.cost_class, a.max_concurrency) for a in answer.agents] == [
        ("cheap", "1.0.0", "A", 5),
        ("dear", "1.1.0", "C", 1),
    ]


def test_an_empty_find_is_a_normal_answer(pool: Pool) -> None:
    answer = reply(pool.find_commands("nobody.offers"))

    assert answer == FindReply(agents=[])


# ---- find: version specs -------------------------------------------------------------------


@pytest.fixture
def versions_pool(pool: Pool) -> Pool:
    for agent_id, version in [
        ("v1-4", "1.4.0"),
        ("v2-0", "2.0.0"),
        ("v2-5", "2.5.1"),
        ("v3-0", "3.0.0"),
    ]:
        pool.register(agent_id, capability("rag.search", version))
    return pool


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (">=0", {"v1-4", "v2-0", "v2-5", "v3-0"}),
        (">=2,<3", {"v2-0", "v2-5"}),
        (">=2.0,<3", {"v2-0", "v2-5"}),
        ("==1.4.0", {"v1-4"}),
        ("~=2.5", {"v2-5"}),
        ("!=3.0.0", {"v1-4", "v2-0", "v2-5"}),
        (">=3", {"v3-0"}),
        ("<1", set()),
        (">=4", set()),
    ],
)
def test_find_keeps_only_the_versions_the_spec_allows(
    versions_pool: Pool, spec: str, expected: set[str]
) -> None:
    found = versions_pool.found("rag.search", spec)

    assert set(found) == expected
    assert len(found) == len(expected)


def test_acquire_honours_the_version_spec(versions_pool: Pool) -> None:
    lease = versions_pool.lease("rag.search", version_spec=">=2,<2.5")
    nothing_left = versions_pool.acquire("rag.search", version_spec=">=2,<2.5")
    wrong_version = versions_pool.acquire("rag.search", agent_id="v3-0", version_spec="<3")

    assert (lease.agent_id, lease.version) == ("v2-0", "2.0.0")
    assert refusal_reason(nothing_left) is Reason.NO_AGENT_AVAILABLE
    assert refusal_reason(wrong_version) is Reason.CAPABILITY_NOT_OFFERED


@pytest.mark.parametrize("spec", ["not a spec", ">>2", "2.0", "=>1", ">=1 <2"])
def test_an_invalid_version_spec_is_refused_with_its_own_reason(pool: Pool, spec: str) -> None:
    pool.register("calc-1")

    named = pool.acquire(agent_id="calc-1", version_spec=spec)
    unnamed = pool.acquire(version_spec=spec)
    unknown_name = pool.acquire("nobody.offers", version_spec=spec)
    find_answer = reply(pool.find_commands(version_spec=spec))

    assert refusal_reason(named) is Reason.INVALID_VERSION_SPEC
    assert refusal_reason(unnamed) is Reason.INVALID_VERSION_SPEC
    assert refusal_reason(unknown_name) is Reason.INVALID_VERSION_SPEC
    assert isinstance(find_answer, Refusal)
    assert find_answer.reason is Reason.INVALID_VERSION_SPEC
    assert spec in find_answer.detail
    with pytest.raises(InvalidVersionSpec):
        pool.core.find_by_capability("calc.add", spec)
    assert in_flight(pool, "calc-1") == 0


# ---- acquire / release: in-flight gating ---------------------------------------------------


def test_acquire_and_release_move_the_busy_label(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))

    first = pool.acquire_commands()
    second = pool.acquire_commands()
    assert transitions(first) == [("Ready", "Busy", "acquired")]
    assert transitions(second) == [("Busy", "Busy", "acquired")]
    [entry] = log_entries(first)
    assert entry.capability == "calc.add"
    assert entry.detail == {"lease_id": "lease-0"}

    one_back = pool.release("lease-0")
    all_back = pool.release("lease-1")
    assert transitions(one_back) == [("Busy", "Busy", "released")]
    assert transitions(all_back) == [("Busy", "Ready", "released")]
    assert reply(all_back) == Released(lease_id="lease-1")
    assert pool.state("calc-1") is AgentState.READY


def test_an_agent_with_room_stays_findable_and_acquirable_while_busy(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=3))

    leases = [pool.lease(agent_id="calc-1")]
    assert pool.state("calc-1") is AgentState.BUSY
    assert pool.found() == ["calc-1"]

    leases.append(pool.lease(agent_id="calc-1"))
    assert pool.state("calc-1") is AgentState.BUSY
    assert pool.found() == ["calc-1"]

    leases.append(pool.lease())
    assert in_flight(pool, "calc-1") == 3


def test_a_full_agent_is_neither_found_nor_acquirable(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    pool.lease()
    pool.lease()

    assert pool.found() == []
    assert refusal_reason(pool.acquire(agent_id="calc-1")) is Reason.AGENT_AT_CAPACITY
    assert refusal_reason(pool.acquire()) is Reason.NO_AGENT_AVAILABLE
    assert in_flight(pool, "calc-1") == 2


def test_a_release_makes_a_full_agent_available_again(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    first = pool.lease()
    pool.lease()

    pool.release(first.lease_id)

    assert pool.state("calc-1") is AgentState.BUSY
    assert pool.found() == ["calc-1"]
    assert pool.lease().agent_id == "calc-1"


def test_a_full_capability_does_not_block_another_capability_of_the_same_agent(
    pool: Pool,
) -> None:
    pool.register("multi", capability("calc.add"), capability("text.stats", max_concurrency=2))
    pool.lease("calc.add")

    assert pool.found("calc.add") == []
    assert pool.found("text.stats") == ["multi"]
    assert pool.lease("text.stats").agent_id == "multi"


def test_a_refused_acquire_changes_nothing(pool: Pool) -> None:
    pool.register("calc-1")
    pool.lease()

    out = pool.acquire_commands(agent_id="calc-1")

    assert log_entries(out) == []
    assert isinstance(reply(out), Refusal)
    assert in_flight(pool, "calc-1") == 1
    assert len(pool.core.leases) == 1


def test_an_acquire_repeated_with_the_same_lease_id_does_not_take_a_second_slot(
    pool: Pool,
) -> None:
    # A redelivered request reaches the core again with the same lease ID.
    pool.register("calc-1", capability(max_concurrency=2))
    first = pool.acquire(lease_id="lease-x")

    again = pool.acquire_commands(lease_id="lease-x")

    assert isinstance(first, Lease)
    assert log_entries(again) == []
    answer = reply(again)
    assert answer.model_dump()["lease"] == first.model_dump()
    assert in_flight(pool, "calc-1") == 1
    pool.release("lease-x")
    assert in_flight(pool, "calc-1") == 0
    assert pool.state("calc-1") is AgentState.READY


# ---- acquire: refusals -----------------------------------------------------------------------


def test_acquiring_an_unknown_agent_is_refused(pool: Pool) -> None:
    result = pool.acquire(agent_id="ghost")

    assert refusal_reason(result) is Reason.UNKNOWN_AGENT
    assert isinstance(result, Refusal)
    assert "ghost" in result.detail


def test_acquiring_a_capability_nobody_offers_is_refused(pool: Pool) -> None:
    pool.register("calc-1")

    assert refusal_reason(pool.acquire("nobody.offers")) is Reason.UNKNOWN_CAPABILITY


def test_acquiring_a_draining_agent_is_refused(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    pool.lease()
    pool.drain("calc-1")

    assert refusal_reason(pool.acquire(agent_id="calc-1")) is Reason.AGENT_DRAINING
    assert refusal_reason(pool.acquire()) is Reason.NO_AGENT_AVAILABLE


def test_acquiring_a_terminated_agent_is_refused(pool: Pool) -> None:
    pool.register("calc-1")
    pool.deregister("calc-1")

    assert refusal_reason(pool.acquire(agent_id="calc-1")) is Reason.AGENT_TERMINATED


def test_acquiring_a_capability_the_named_agent_does_not_offer_is_refused(pool: Pool) -> None:
    pool.register("calc-1", capability("calc.add"))
    pool.register("text-1", capability("text.stats"))

    result = pool.acquire("text.stats", agent_id="calc-1")

    assert refusal_reason(result) is Reason.CAPABILITY_NOT_OFFERED


def test_acquiring_a_full_named_agent_is_refused_with_its_load(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=1))
    pool.lease()

    result = pool.acquire(agent_id="calc-1")

    assert refusal_reason(result) is Reason.AGENT_AT_CAPACITY
    assert isinstance(result, Refusal)
    assert "1/1" in result.detail


def test_releasing_an_unknown_lease_is_refused(pool: Pool) -> None:
    out = pool.release("never-granted")

    answer = reply(out)
    assert isinstance(answer, Refusal)
    assert answer.reason is Reason.UNKNOWN_LEASE
    assert "never-granted" in answer.detail
    assert log_entries(out) == []


def test_releasing_a_lease_twice_is_refused_the_second_time(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    lease = pool.lease()
    pool.lease()

    first = pool.release(lease.lease_id)
    second = pool.release(lease.lease_id)

    assert reply(first) == Released(lease_id=lease.lease_id)
    answer = reply(second)
    assert isinstance(answer, Refusal)
    assert answer.reason is Reason.UNKNOWN_LEASE
    assert log_entries(second) == []
    assert in_flight(pool, "calc-1") == 1
    assert pool.state("calc-1") is AgentState.BUSY


# ---- drain -----------------------------------------------------------------------------------


def test_a_drain_with_work_in_flight_waits_for_the_last_release(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    first, second = pool.lease(), pool.lease()

    out = pool.drain("calc-1")
    assert transitions(out) == [("Busy", "Draining", "draining")]
    [(to, notice)] = sent(out, DrainNotice)
    assert (to, notice.agent_id) == ("calc-1", "calc-1")
    assert sent(out, DrainComplete) == []
    assert reply(out) == DrainAccepted(agent_id="calc-1", in_flight=2)
    assert pool.state("calc-1") is AgentState.DRAINING
    assert pool.found() == []

    out = pool.release(first.lease_id)
    assert transitions(out) == [("Draining", "Draining", "released")]
    assert sent(out, DrainComplete) == []
    assert pool.state("calc-1") is AgentState.DRAINING

    out = pool.release(second.lease_id)
    assert reply(out) == Released(lease_id=second.lease_id)
    assert transitions(out) == [
        ("Draining", "Draining", "released"),
        ("Draining", "Terminated", "terminated"),
    ]
    assert sent(out, DrainComplete) == [("calc-1", DrainComplete(agent_id="calc-1"))]
    assert "calc-1" not in pool.core.agents
    assert "calc.add" not in pool.core.index
    assert refusal_reason(pool.acquire(agent_id="calc-1")) is Reason.AGENT_TERMINATED


def test_a_drain_with_nothing_in_flight_terminates_at_once(pool: Pool) -> None:
    pool.register("calc-1")

    out = pool.drain("calc-1")

    assert transitions(out) == [
        ("Ready", "Draining", "draining"),
        ("Draining", "Terminated", "terminated"),
    ]
    notices = [
        type(cmd.message)
        for cmd in out
        if isinstance(cmd, SendToAgent) and cmd.agent_id == "calc-1"
    ]
    assert notices == [DrainNotice, DrainComplete]
    assert reply(out) == DrainAccepted(agent_id="calc-1", in_flight=0)
    assert "calc-1" not in pool.core.agents


def test_draining_an_agent_twice_changes_nothing_the_second_time(pool: Pool) -> None:
    pool.register("calc-1")
    pool.lease()
    pool.drain("calc-1")

    again = pool.drain("calc-1")

    assert again == [Reply(DrainAccepted(agent_id="calc-1", in_flight=1))]


def test_draining_an_unknown_or_terminated_agent_is_refused(pool: Pool) -> None:
    pool.register("calc-1")
    pool.deregister("calc-1")

    unknown = reply(pool.drain("ghost"))
    terminated = reply(pool.drain("calc-1"))

    assert isinstance(unknown, Refusal)
    assert unknown.reason is Reason.UNKNOWN_AGENT
    assert isinstance(terminated, Refusal)
    assert terminated.reason is Reason.AGENT_TERMINATED


def test_a_lease_expiring_on_a_draining_agent_completes_the_drain() -> None:
    pool = Pool()
    pool.register("calc-1")
    pool.lease(ttl_s=5)
    pool.drain("calc-1")

    out = pool.run_for(5, heartbeats=["calc-1"])

    assert [e.reason for e in log_entries(out, "released")] == ["lease expired"]
    assert sent(out, DrainComplete) == [("calc-1", DrainComplete(agent_id="calc-1"))]
    assert "calc-1" not in pool.core.agents


# ---- heartbeats and liveness ---------------------------------------------------------------


class CountingAgents(dict[str, Any]):
    """The registry's agent table, counting the lookups and walks a tick makes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.looked_up = 0
        self.walks = 0

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up += 1
        return super().get(key, default)

    def values(self) -> Any:
        self.walks += 1
        return super().values()


def test_a_tick_looks_only_at_the_agents_whose_liveness_deadline_came_due() -> None:
    """Loss detection costs what comes due, not the fleet: 20,000 agents that beat on time
    cost a tick nothing until their first deadline (as of registration) passes; then each
    is looked at once per loss window (and queued again), and a silent one is lost on time."""
    pool = Pool()
    pool.core = PoolCore(pool.settings)  # the checked core recounts the tally every event
    for n in range(20_000):
        pool.register(f"a-{n:05d}", capability("calc.add", "1.0.0"))
    agents = pool.core.registry.agents = CountingAgents(pool.core.agents)
    beating = [a for a in agents if a != "a-00007"]
    for _ in range(29):  # 29 s of heartbeats (every agent beats every second here, cheaply)
        pool.clock.advance(1.0)
        for agent_id in beating:
            pool.core.agents[agent_id].last_seen = pool.clock.now().mono
        pool.tick()
    assert (agents.looked_up, agents.walks) == (0, 0)  # the first deadlines are at 30 s
    pool.clock.advance(1.5)
    for agent_id in beating:
        pool.core.agents[agent_id].last_seen = pool.clock.now().mono
    out = pool.tick()
    assert [e.agent_id for e in log_entries(out, "lost")] == ["a-00007"]
    # Each looked at once (and the lost one's removal looks it up again); none walked.
    looked = agents.looked_up
    assert 20_000 <= looked <= 20_005 and agents.walks == 0
    pool.clock.advance(1.0)
    pool.tick()
    assert agents.looked_up == looked  # queued again a window ahead: nothing due now


def test_an_agent_silent_for_three_intervals_is_lost_and_never_found_again(pool: Pool) -> None:
    pool.register("old", capability("calc.add", "1.0.0"))
    pool.register("new", capability("calc.add", "2.0.0"))

    quiet = pool.run_for(30, heartbeats=["new"])
    assert log_entries(quiet, "lost") == []
    assert pool.state("old") is AgentState.READY

    out = pool.run_for(1, heartbeats=["new"])
    [lost] = log_entries(out, "lost")
    assert (lost.agent_id, lost.from_state, lost.to_state) == ("old", "Ready", "Terminated")
    assert lost.reason == "no heartbeat for 31.0 s"
    assert [(a.capability, a.agent_id, a.entry.kind) for a in announcements(out)] == [
        ("calc.add", "old", "capability_withdrawn")
    ]
    # ... and cut off the broker, so what it still holds is requeued now.
    assert [c for c in out if isinstance(c, FenceAgent)] == [
        FenceAgent("old", "inc-1", lost.reason)
    ]
    assert "old" not in pool.core.agents

    later = pool.run_for(100, heartbeats=["new"])
    assert log_entries(later, "lost") == []
    for spec in (">=0", "==1.0.0", "<2", ">=2", "~=1.0"):
        assert "old" not in pool.found(version_spec=spec)
    assert pool.found() == ["new"]
    assert pool.core.index.versions("calc.add") == ["2.0.0"]
    assert refusal_reason(pool.acquire(agent_id="old")) is Reason.AGENT_TERMINATED


def test_a_busy_agent_that_goes_silent_is_lost_with_its_leases(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    lease = pool.lease()

    out = pool.run_for(31)

    assert transitions(out) == [("Busy", "Terminated", "lost")]
    assert pool.core.leases == {}
    assert refusal_reason_of_release(pool, lease.lease_id) is Reason.UNKNOWN_LEASE


def test_only_a_lost_agent_is_cut_off_the_broker_not_one_that_leaves(pool: Pool) -> None:
    pool.register("leaving")
    out = pool.deregister("leaving")
    assert "leaving" not in pool.core.agents
    assert [c for c in out if isinstance(c, FenceAgent)] == []


def test_heartbeats_keep_an_agent_alive_indefinitely(pool: Pool) -> None:
    pool.register("calc-1")

    out = pool.run_for(200, step=10, heartbeats=["calc-1"])

    assert log_entries(out, "lost") == []
    assert pool.state("calc-1") is AgentState.READY


def test_heartbeat_jitter_inside_the_window_does_not_evict(pool: Pool) -> None:
    pool.register("calc-1", heartbeat_interval_s=10)

    out = []
    for gap in (12.0, 29.5, 3.0, 25.0, 30.0, 0.5, 28.0):
        out += pool.run_for(gap, step=0.5)
        out += pool.heartbeat("calc-1")

    assert log_entries(out, "lost") == []
    assert pool.state("calc-1") is AgentState.READY


def test_the_loss_window_scales_with_the_agents_own_interval(pool: Pool) -> None:
    pool.register("fast", heartbeat_interval_s=5)
    pool.register("slow", heartbeat_interval_s=20)

    out = pool.run_for(16)
    assert [e.agent_id for e in log_entries(out, "lost")] == ["fast"]

    out = pool.run_for(45)
    assert [e.agent_id for e in log_entries(out, "lost")] == ["slow"]


def test_a_heartbeat_from_an_unknown_agent_asks_it_to_re_register_at_a_limited_rate(
    pool: Pool,
) -> None:
    first = pool.heartbeat("stranger")
    assert sent(first, ReRegisterRequest) == [
        ("stranger", ReRegisterRequest(agent_id="stranger", reason="unknown agent"))
    ]

    muted = []
    for _ in range(4):
        pool.clock.advance(1.0)
        muted += pool.heartbeat("stranger")
    assert muted == []

    pool.clock.advance(1.0)  # 5 s after the first request
    assert len(sent(pool.heartbeat("stranger"), ReRegisterRequest)) == 1


def test_a_heartbeat_from_another_incarnation_neither_displaces_nor_keeps_alive_the_agent(
    pool: Pool,
) -> None:
    pool.register("calc-1", incarnation="inc-2")

    out: list[Command] = []
    for _ in range(31):
        pool.clock.advance(1.0)
        out += pool.heartbeat("calc-1", incarnation="inc-1")  # a zombie of the old process
        out += pool.tick()

    # The zombie was never invited to re-register (it would replace the live one) ...
    assert sent(out, ReRegisterRequest) == []
    assert pool.core.counters["heartbeat_other_incarnation"] == 31
    # ... and its beats did not count for the registered incarnation, which went silent.
    assert [e.agent_id for e in log_entries(out, "lost")] == ["calc-1"]


def test_a_lost_agent_that_heartbeats_again_is_asked_to_re_register(pool: Pool) -> None:
    pool.register("calc-1")
    pool.run_for(31)

    out = pool.heartbeat("calc-1")

    assert len(sent(out, ReRegisterRequest)) == 1
    assert "calc-1" not in pool.core.agents
    assert pool.found() == []


def test_a_lost_agent_comes_back_by_registering_again(pool: Pool) -> None:
    pool.register("calc-1")
    pool.run_for(31)

    out = pool.register("calc-1", incarnation="inc-1")

    assert sent(out, RegistrationAccepted)
    assert pool.found() == ["calc-1"]


def test_a_stale_heartbeat_sequence_number_is_ignored(pool: Pool) -> None:
    pool.register("calc-1")
    pool.run_for(20)
    pool.heartbeat("calc-1", seq=5)  # t = 20

    pool.run_for(9)
    assert pool.heartbeat("calc-1", seq=3) == []  # t = 29, stale: does not count
    pool.run_for(1)
    pool.heartbeat("calc-1", seq=5)  # t = 30, a duplicate: does not count either

    out = pool.run_for(21)  # t = 51: 31 s after the last fresh heartbeat
    assert [e.agent_id for e in log_entries(out, "lost")] == ["calc-1"]
    assert pool.core.counters["heartbeat_stale"] == 2


def test_one_forged_heartbeat_cannot_make_the_real_ones_stale(pool: Pool) -> None:
    """A heartbeat with the live incarnation and ``seq`` = 10^9 (the incarnation can leak)
    is ignored: one message may move ``seq`` only as far as an honest agent's heartbeats can
    get in the time since the last one. The real agent's next heartbeats still count."""
    pool.register("calc-1")
    pool.heartbeat("calc-1", seq=1)
    pool.run_for(5)
    assert pool.heartbeat("calc-1", seq=10**9) == []
    for seq in range(2, 10):  # the real agent, every 5 s for 40 s
        pool.run_for(5)
        pool.heartbeat("calc-1", seq=seq)
    assert pool.core.counters["heartbeat_stale"] == 0
    assert pool.state("calc-1") is AgentState.READY
    assert pool.core.counters["heartbeat_seq_leap"] == 1
    # An honest leap (a burst of work reports lost over 25 s) is within the bound.
    pool.run_for(25)
    pool.heartbeat("calc-1", seq=3_000)
    assert pool.core.counters["heartbeat_seq_leap"] == 1
    assert pool.core.agents["calc-1"].last_heartbeat_seq == 3_000


def test_a_newer_heartbeat_sequence_number_counts(pool: Pool) -> None:
    pool.register("calc-1")
    pool.run_for(20)
    pool.heartbeat("calc-1", seq=5)
    pool.run_for(9)
    pool.heartbeat("calc-1", seq=6)  # t = 29

    out = pool.run_for(22)  # t = 51: only 22 s after the last heartbeat

    assert log_entries(out, "lost") == []


def test_a_long_gap_between_ticks_does_not_evict_everyone() -> None:
    pool = Pool()
    for agent_id in ("a", "b", "c"):
        pool.register(agent_id)
    pool.run_for(2)

    pool.clock.advance(120)  # the manager process was stopped for two minutes
    out = pool.tick()

    [stalled] = log_entries(out, "manager_stalled")
    assert "120.0 s" in stalled.reason
    assert log_entries(out, "lost") == []
    assert sorted(pool.core.agents) == ["a", "b", "c"]

    # The window restarts; it does not become immunity.
    out = pool.run_for(30, heartbeats=["a"])
    assert log_entries(out, "lost") == []
    out = pool.run_for(1, heartbeats=["a"])
    assert sorted(e.agent_id for e in log_entries(out, "lost")) == ["b", "c"]


def test_silence_while_the_manager_has_lost_the_broker_evicts_nobody() -> None:
    pool = Pool()
    for agent_id in ("a", "b"):
        pool.register(agent_id)
    pool.run_for(2)

    pool.core.handle(ConnectionLost(), pool.clock.now())
    out = pool.run_for(60)  # ticks keep coming, heartbeats cannot
    assert log_entries(out, "lost") == []

    out = pool.core.handle(ConnectionRestored(), pool.clock.now())
    [restored] = log_entries(out, "connection_restored")
    assert "liveness windows restarted" in restored.reason
    # Back to normal: a fresh window, then the 3-miss rule applies again.
    out = pool.run_for(30, heartbeats=["a"])
    assert log_entries(out, "lost") == []
    out = pool.run_for(1, heartbeats=["a"])
    assert [e.agent_id for e in log_entries(out, "lost")] == ["b"]


# ---- lease expiry ------------------------------------------------------------------------------


def test_a_lease_past_its_ttl_gives_its_slot_back() -> None:
    pool = Pool()
    pool.register("calc-1")
    lease = pool.lease(ttl_s=5)

    assert pool.run_for(4, heartbeats=["calc-1"]) == []
    assert pool.found() == []

    out = pool.run_for(1, heartbeats=["calc-1"])
    [released] = log_entries(out, "released")
    assert (released.from_state, released.to_state, released.reason) == (
        "Busy",
        "Ready",
        "lease expired",
    )
    assert released.detail == {"lease_id": lease.lease_id}
    assert pool.found() == ["calc-1"]
    assert refusal_reason_of_release(pool, lease.lease_id) is Reason.UNKNOWN_LEASE


def test_a_lease_without_a_ttl_gets_the_default_one() -> None:
    pool = Pool(settings=PoolSettings(default_lease_ttl_s=20))
    pool.register("calc-1")
    lease = pool.lease()
    assert lease.expires_in_s == 20

    assert log_entries(pool.run_for(19, heartbeats=["calc-1"]), "released") == []
    assert len(log_entries(pool.run_for(1, heartbeats=["calc-1"]), "released")) == 1


def test_a_released_lease_does_not_expire_later() -> None:
    pool = Pool()
    pool.register("calc-1", capability(max_concurrency=2))
    lease = pool.lease(ttl_s=5)
    pool.release(lease.lease_id)
    pool.lease(ttl_s=60)

    out = pool.run_for(10, heartbeats=["calc-1"])

    assert log_entries(out, "released") == []
    assert in_flight(pool, "calc-1") == 1


# ---- index pruning on every removal path ---------------------------------------------------


def _deregister(pool: Pool) -> None:
    pool.deregister("calc-1")


def _lose(pool: Pool) -> None:
    pool.run_for(31, heartbeats=[a for a in pool.core.agents if a != "calc-1"])


def _drain_idle(pool: Pool) -> None:
    pool.drain("calc-1")


def _drain_busy(pool: Pool) -> None:
    lease = pool.lease()
    pool.drain("calc-1")
    pool.release(lease.lease_id)


def _replace(pool: Pool) -> None:
    pool.register("calc-1", capability("text.stats"), incarnation="inc-2", identity_verified=True)


REMOVAL_PATHS: dict[str, Callable[[Pool], None]] = {
    "deregister": _deregister,
    "lost": _lose,
    "drain": _drain_idle,
    "drain-with-work-in-flight": _drain_busy,
    "replaced-incarnation": _replace,
}


@pytest.mark.parametrize("remove", REMOVAL_PATHS.values(), ids=REMOVAL_PATHS.keys())
def test_every_removal_path_prunes_the_index(pool: Pool, remove: Callable[[Pool], None]) -> None:
    pool.register("calc-1", capability("calc.add", "1.0.0", max_concurrency=2))
    assert "calc.add" in pool.core.index

    remove(pool)

    assert "calc.add" not in pool.core.index
    assert "calc.add" not in pool.core.index.names()
    assert pool.core.index.versions("calc.add") == []
    assert pool.found() == []
    assert refusal_reason(pool.acquire()) is Reason.UNKNOWN_CAPABILITY


@pytest.mark.parametrize("remove", REMOVAL_PATHS.values(), ids=REMOVAL_PATHS.keys())
def test_a_removal_keeps_versions_other_agents_still_offer(
    pool: Pool, remove: Callable[[Pool], None]
) -> None:
    pool.register("other", capability("calc.add", "2.0.0"))
    pool.register("calc-1", capability("calc.add", "1.0.0", max_concurrency=2))

    remove(pool)

    assert pool.core.index.versions("calc.add") == ["2.0.0"]
    assert pool.found(version_spec="<2") == []


def test_a_version_stays_indexed_until_its_last_agent_leaves(pool: Pool) -> None:
    pool.register("one", capability("calc.add", "1.0.0"))
    pool.register("two", capability("calc.add", "1.0.0"))

    pool.deregister("one")
    assert pool.core.index.versions("calc.add") == ["1.0.0"]
    assert pool.found() == ["two"]

    pool.deregister("two")
    assert "calc.add" not in pool.core.index


def test_a_handover_forgets_the_leaving_pools_agents_quietly_and_keeps_the_rest(
    pool: Pool,
) -> None:
    # Several managers: a shard moved to another manager; its pools' agents register there.
    pool.register("calc-1", capability("calc.add", "1.0.0", max_concurrency=2), deployment="a")
    pool.register("calc-2", capability("calc.add", "2.0.0", max_concurrency=2), deployment="b")
    held = pool.lease(agent_id="calc-1")
    live_before = pool.core.live_capacity(pool.clock.now())
    assert live_before.free("a", "calc.add") == 1

    assert [a.agent_id for a in pool.core.hand_over(lambda deployment: deployment == "a")] == [
        "calc-1"
    ]

    assert set(pool.core.agents) == {"calc-2"}
    assert pool.found() == ["calc-2"]
    assert pool.core.index.versions("calc.add") == ["2.0.0"]
    assert pool.core.tally.agents == 1 and set(pool.core.tally.pools()) == {"b"}
    live = pool.core.live_capacity(pool.clock.now())
    assert live.free("a", "calc.add") == 0 and live.free("b", "calc.add") == 2
    assert pool.core.counters["handed_over"] == 1 and pool.core.counters["terminated"] == 0
    assert held.lease_id not in pool.core.leases
    # Nothing told to anyone (it is alive: no fence, no withdrawn capability, no lifecycle
    # event), and a later heartbeat of it asks it to register again.
    assert any(
        isinstance(cmd, SendToAgent) and isinstance(cmd.message, ReRegisterRequest)
        for cmd in pool.heartbeat("calc-1")
    )
    assert pool.core.hand_over(lambda deployment: deployment == "a") == []


# ---- version drift -----------------------------------------------------------------------------


def test_a_second_and_third_active_version_each_warn_but_a_repeated_version_does_not(
    pool: Pool,
) -> None:
    def drift(out: list[Command]) -> list[list[str]]:
        return [list(e.detail["versions"]) for e in log_entries(out, "version_drift")]

    assert drift(pool.register("a", capability("calc.add", "1.0.0"))) == []
    assert drift(pool.register("b", capability("calc.add", "1.0.0"))) == []
    assert drift(pool.register("c", capability("calc.add", "2.0.0"))) == [["1.0.0", "2.0.0"]]
    assert drift(pool.register("d", capability("calc.add", "1.10.0"))) == [
        ["1.0.0", "1.10.0", "2.0.0"]
    ]
    assert drift(pool.register("e", capability("calc.add", "2.0.0"))) == []
    assert drift(pool.register("f", capability("text.stats", "9.0.0"))) == []


def test_a_version_drift_warning_names_the_capability_and_its_versions(pool: Pool) -> None:
    pool.register("a", capability("rag.search", "2.1.0"))

    out = pool.register("b", capability("rag.search", "3.0.0"))

    [entry] = log_entries(out, "version_drift")
    assert entry.capability == "rag.search"
    assert "2.1.0" in entry.reason and "3.0.0" in entry.reason
    assert entry.at == pool.clock.now().wall


def test_a_version_that_left_and_came_back_warns_again(pool: Pool) -> None:
    pool.register("a", capability("calc.add", "1.0.0"))
    pool.register("b", capability("calc.add", "2.0.0"))
    pool.deregister("b")

    out = pool.register("b", capability("calc.add", "2.0.0"), incarnation="inc-2")

    assert len(log_entries(out, "version_drift")) == 1


# ---- status ----------------------------------------------------------------------------------


def test_status_lists_every_agent_with_its_state_and_load() -> None:
    clock = FakeClock()
    pool = Pool(clock=clock)
    pool.register("calc-1", capability(max_concurrency=3))
    pool.register("text-1", capability("text.stats"))
    pool.lease()
    clock.advance(4)
    pool.heartbeat("text-1")
    clock.advance(1)

    status = {s.agent_id: s for s in pool.core.status(clock.now())}

    assert (status["calc-1"].state, status["calc-1"].in_flight) == ("Busy", 1)
    assert status["calc-1"].last_heartbeat_age_s is None
    assert status["calc-1"].registered_age_s == 5
    assert [(c.name, c.in_flight, c.max_concurrency) for c in status["calc-1"].capabilities] == [
        ("calc.add", 1, 3)
    ]
    assert (status["text-1"].state, status["text-1"].last_heartbeat_age_s) == ("Ready", 1)


def test_a_redelivered_acquire_after_its_lease_ended_does_not_take_a_new_slot(pool: Pool) -> None:
    pool.register("calc-1", capability(max_concurrency=2))
    lease = pool.acquire(lease_id="req-1")
    assert isinstance(lease, Lease)
    pool.release("req-1")

    again = pool.acquire(lease_id="req-1")  # the same request, delivered a second time

    assert isinstance(again, Refusal) and again.reason is Reason.UNKNOWN_LEASE
    assert pool.core.agents["calc-1"].in_flight == 0


def test_a_capability_offered_only_in_other_versions_is_not_offered_not_busy(pool: Pool) -> None:
    pool.register("calc-1", capability(version="1.4.0"))

    refusal = pool.acquire(version_spec=">=2")

    # Retrying cannot help here, unlike NO_AGENT_AVAILABLE.
    assert isinstance(refusal, Refusal) and refusal.reason is Reason.CAPABILITY_NOT_OFFERED
    assert "1.4.0" in refusal.detail
