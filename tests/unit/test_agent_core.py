"""The agent's sans-I/O core: phases, heartbeats, self-fencing and grant knowledge, driven by
calls and times alone — no broker, no event loop, no clock."""

from __future__ import annotations

import pytest

from mesh import constants as c
from mesh.agent.core import PHASES, AgentCore
from mesh.errors import LocalProtocolError
from mesh.wire import Reason
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import Task, TaskGrant

from .samples import GRANT, T0

INTERVAL = 2.0


def core(**kwargs: object) -> AgentCore:
    return AgentCore("rag-1", "rag-eu", heartbeat_interval_s=INTERVAL, **kwargs)  # type: ignore[arg-type]


def task(**grant_changes: object) -> Task:
    grant = TaskGrant.from_grant(GRANT.model_copy(update=grant_changes))
    return Task(task_id="t-1", capability="rag.search", payload={}, grant=grant, submitted_at=T0)


def epoch_event(epoch: int, pool: str = "rag-eu", **detail: object) -> OrchestrationEvent:
    return OrchestrationEvent(
        at=T0,
        kind=c.EVENT_DESCRIPTOR_ACTIVE,
        detail={"pool_id": pool, "descriptor_epoch": epoch, "policy_generation": 7, **detail},
    )


def revoked_event(fence: int, **detail: object) -> OrchestrationEvent:
    return OrchestrationEvent(
        at=T0,
        kind=c.EVENT_GRANT_REVOKED,
        detail={"admission_id": GRANT.admission_id, "pool_id": "rag-eu", "fence": fence, **detail},
    )


def test_phases_move_only_as_the_table_allows() -> None:
    agent = core()
    for phase in ("starting", "running", "stopping", "stopped"):
        agent.advance(phase)  # type: ignore[arg-type]
    assert agent.phase == "stopped" and PHASES["stopped"] == frozenset()
    with pytest.raises(LocalProtocolError, match="stopped cannot be running"):
        agent.advance("running")
    with pytest.raises(LocalProtocolError, match="new cannot be running"):
        core().advance("running")  # never without starting
    never_started = core()
    never_started.advance("stopped")  # stop() before start(): allowed, and final
    assert never_started.phase == "stopped"


def test_each_heartbeat_takes_the_next_seq_and_reports_full_counts() -> None:
    agent = core()
    first = agent.heartbeat(
        "inc-1", in_flight={"rag.search": 2}, pool_in_flight={"rag.search": 1, "rag.answer": 0},
        draining=False, wall=T0,
    )  # fmt: skip
    second = agent.heartbeat("inc-1", in_flight={}, pool_in_flight={}, draining=True, wall=T0 + 2)
    assert (first.seq, second.seq) == (0, 1)
    assert first.pool_in_flight == {"rag.search": 1}  # zeros left out
    assert second.draining and second.sent_at == T0 + 2


def test_a_silence_the_manager_would_call_lost_fences_what_was_claimed_before_it() -> None:
    agent = core()
    assert agent.self_fence_after_s == c.MISSED_HEARTBEATS_BEFORE_LOST * INTERVAL - INTERVAL / 2
    assert agent.note_silence(1_000.0) is None  # never beaten yet: nothing to time
    agent.beat_sent(100.0)
    assert agent.note_silence(100.0 + agent.self_fence_after_s) is None  # within tolerance

    woke = 100.0 + agent.self_fence_after_s + 5
    assert agent.note_silence(woke) == pytest.approx(agent.self_fence_after_s + 5)
    assert agent.note_silence(woke + 1) is None  # one fence per silence
    assert agent.fenced(99.0) and agent.fenced(woke)  # claimed before it ended: withheld
    assert not agent.fenced(woke + 0.5)  # claimed after: delivered


def test_a_configured_self_fence_wins() -> None:
    assert core(self_fence_after_s=1.5).self_fence_after_s == 1.5


def test_an_epoch_announcement_is_kept_only_when_newer_and_for_this_pool() -> None:
    agent = core()
    seen = agent.on_event(epoch_event(3), pool_consumed=False)
    assert (seen.kind, seen.newer, seen.resubscribe) == ("epoch", True, True)
    again = agent.on_event(epoch_event(3), pool_consumed=True)
    assert (again.newer, again.resubscribe) == (False, False)
    assert agent.on_event(epoch_event(2), pool_consumed=True).newer is False
    assert agent.active_epoch == 3
    assert agent.on_event(epoch_event(9, pool="other"), pool_consumed=True).kind == "ignored"
    assert agent.active_epoch == 3


def test_the_grant_check_follows_what_the_feed_said() -> None:
    agent = core()
    now = T0 + 1
    assert agent.grant_problem(task(), now) is None
    assert "not this agent's pool" in (agent.grant_problem(task(pool_id="x"), now) or "")
    assert "expired" in (agent.grant_problem(task(), GRANT.expires_at) or "")

    agent.on_event(epoch_event(GRANT.descriptor_epoch + 1), pool_consumed=True)
    assert "draining allowlist" in (agent.grant_problem(task(), now) or "")
    allowlisted = epoch_event(GRANT.descriptor_epoch + 1, draining=[GRANT.admission_id])
    agent.on_event(allowlisted, pool_consumed=True)
    assert agent.grant_problem(task(), now) is None  # an older epoch's grant may finish

    seen = agent.on_event(revoked_event(GRANT.fence), pool_consumed=True)
    assert (seen.kind, seen.stop_running) == ("revoked", False)
    assert "revoked" in (agent.grant_problem(task(), now) or "")
    assert agent.grant_problem(task(fence=GRANT.fence + 1), now) is None  # a later fence


def test_an_evicted_grant_is_answered_evicted_and_its_handler_stopped() -> None:
    agent = core()
    seen = agent.on_event(revoked_event(GRANT.fence, evicted=True), pool_consumed=True)
    assert seen.stop_running and seen.evicted

    problem = agent.grant_problem(task(), T0 + 1)
    assert problem is not None
    refused = agent.refusal(task(), problem, "at claim", T0, T0 + 1)
    assert refused.error is not None and refused.error.code is Reason.EVICTED
    assert "resubmit" in refused.error.message

    plain = core().refusal(task(), "whatever", "at claim", T0, T0 + 1)
    assert plain.error is not None and plain.error.code is Reason.GRANT_INVALID


def test_a_security_revocation_stops_the_handler_and_says_why() -> None:
    agent = core()
    seen = agent.on_event(revoked_event(GRANT.fence, security="key leaked"), pool_consumed=True)
    assert seen.stop_running and not seen.evicted
    assert "for security: key leaked" in (agent.grant_problem(task(), T0 + 1) or "")
