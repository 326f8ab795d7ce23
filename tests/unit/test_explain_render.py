"""``mesh explain``'s text, from replies built by hand: every pool, every time, every state."""

from __future__ import annotations

import re
from datetime import datetime

from mesh.core.eligibility import check_eligibility
from mesh.render import render_explain
from mesh.wire import AdmissionDecision, AdmissionReason, ExplainReply

from .samples import DESCRIPTOR, GRANT, REQUIREMENTS, T0

NOW = T0 + 10


def record() -> dict[str, object]:
    stale = DESCRIPTOR.model_copy(update={"pool_id": "rag-old", "descriptor_epoch": 2})
    far = DESCRIPTOR.model_copy(update={"pool_id": "rag-us", "regions": ["us-east-1"]})
    return check_eligibility(
        REQUIREMENTS,
        "tenant-a",
        {"rag-eu": DESCRIPTOR, "rag-old": stale, "rag-us": far},
        active_epochs={"rag-eu": 3, "rag-old": 3},
        active_generation=7,
        now=NOW - 4,  # decided 4 s before the explain
    ).to_record()


def local(at: float) -> str:
    return datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds")


def test_every_pool_is_shown_with_its_epochs_generation_and_verdict() -> None:
    reply = ExplainReply(
        admission_id="adm-1",
        found=True,
        decision=AdmissionDecision(admission_id="adm-1", outcome="admitted", grant=GRANT),
        eligibility=record(),
        reservation={
            "state": "ACTIVE",
            "fence": 41,
            "pool_id": "rag-eu",
            "created_at": T0,
            "expires_at": T0 + 120,
            "items": [["rag-eu", "model_slots", 1], ["*", "tenant_tokens:tenant-a", 12000]],
        },
    )

    text = render_explain(reply, now=NOW)
    lines = text.splitlines()

    assert lines[0] == "admission adm-1"
    assert "  outcome      admitted" in lines
    assert (
        "  grant        pool rag-eu · descriptor epoch 3 · policy generation 7 · fence 41" in lines
    )
    assert f"  decided at   {local(NOW - 4)} (4.0 s ago)" in lines
    assert f"  grant until  {local(GRANT.expires_at)} (in 110.0 s)" in lines
    assert re.search(r"\b1\d{9}\b", text) is None  # times as times, never raw epoch seconds
    assert "  pools        3 considered, 1 eligible: rag-eu" in lines
    rows = {
        line.split()[0]: line for line in text.split("VERDICT\n")[1].split("\n\n")[0].splitlines()
    }
    assert rows["rag-eu"].split() == ["rag-eu", "3", "3", "7", "eligible"]
    assert rows["rag-old"].split()[:5] == ["rag-old", "2", "3", "7", "epoch_current"]
    assert rows["rag-old"].endswith("— descriptor epoch 2, active epoch 3")
    assert rows["rag-us"].split()[:5] == ["rag-us", "3", "-", "7", "region_allowed"]
    assert "  reservation  ACTIVE · fence 41 · pool rag-eu" in lines
    assert f"    created    {local(T0)} (10.0 s ago)" in lines
    assert f"    expires    {local(T0 + 120)} (in 110.0 s)" in lines
    assert "    items      rag-eu/model_slots 1 · */tenant_tokens:tenant-a 12000" in lines


def test_a_pool_under_another_policy_generation_is_marked() -> None:
    rec = record()
    rec["pools"][0]["policy_generation"] = 6  # type: ignore[index]

    text = render_explain(ExplainReply(admission_id="a", found=True, eligibility=rec))

    assert "rag-eu" in text and "6≠7" in text


def test_a_refusal_shows_its_reason_detail_and_retry_hint_and_no_reservation() -> None:
    decision = AdmissionDecision(
        admission_id="adm-2",
        outcome="deferred",
        reason=AdmissionReason.CAPACITY,
        detail="rag-eu/model_slots: 16 of 16 used",
        retry_after_ms=1000,
        allowed_degradations=["less_retrieval"],
    )

    text = render_explain(
        ExplainReply(admission_id="adm-2", found=True, decision=decision, eligibility=record())
    )

    assert "  outcome      deferred CAPACITY" in text
    assert "  detail       rag-eu/model_slots: 16 of 16 used" in text
    assert "  retry after  1000 ms" in text
    assert "  degradations less_retrieval" in text
    assert "  reservation  none" in text


def test_a_released_or_expired_reservation_says_when_if_the_reply_tells() -> None:
    base = {"fence": 44, "pool_id": "rag-eu", "created_at": T0, "expires_at": T0 + 120}

    released = render_explain(
        ExplainReply(
            admission_id="a",
            found=True,
            reservation={**base, "state": "RELEASED", "updated_at": T0 + 30},
        )
    )
    unknown = render_explain(
        ExplainReply(admission_id="a", found=True, reservation={**base, "state": "RELEASED"})
    )
    expired = render_explain(
        ExplainReply(admission_id="a", found=True, reservation={**base, "state": "EXPIRED"})
    )

    assert f"    released   {local(T0 + 30)}" in released
    assert "    released   (time not in the reply)" in unknown
    assert f"    expired    {local(T0 + 120)}" in expired
    assert "no decision is recorded" in expired


def test_an_unknown_admission_says_so() -> None:
    text = render_explain(ExplainReply(admission_id="nope", found=False))

    assert text == "no admission 'nope' is known to this manager or its ledger"


def test_long_lines_wrap_under_their_column() -> None:
    decision = AdmissionDecision(
        admission_id="adm-3",
        outcome="rejected",
        reason=AdmissionReason.NO_ELIGIBLE_POOL,
        detail=", ".join(f"pool-{i}: region_allowed" for i in range(12)),
    )

    text = render_explain(ExplainReply(admission_id="adm-3", found=True, decision=decision))

    detail = [line for line in text.splitlines() if "pool-" in line]
    assert len(detail) > 1 and all(len(line) <= 100 for line in detail)
    assert all(line.startswith(" " * 15) for line in detail[1:])


def test_a_shadow_evaluation_is_shown_after_the_pools() -> None:
    eligibility = record()
    eligibility["shadow"] = {
        "eligible": [],
        "pools": [
            {"pool_id": "rag-eu", "descriptor_epoch": 4, "live": None, "shadow": "tools_allowed"}
        ],
        "agree": False,
    }
    reply = ExplainReply(admission_id="adm-1", found=True, eligibility=eligibility)

    lines = render_explain(reply, now=NOW).splitlines()

    at = lines.index("  shadow       with the shadow descriptors eligibility would be DIFFERENT:")
    assert lines[at + 1] == "    rag-eu epoch 4: live eligible → shadow tools_allowed"
