"""One refusal shape: every reply that says no reads as a Refusal (reason from the one enum,
detail, retry time where coming back can help); every reply that says yes reads as none."""

from __future__ import annotations

import pytest

from mesh.errors import AdmissionRefused
from mesh.wire import (
    AdmissionDecision,
    AdmissionReleaseReply,
    ErrorInfo,
    Message,
    Reason,
    Refusal,
    RegistrationRefused,
    TaskResult,
    refusal_of,
)

from .samples import GRANT, SAMPLES, T0

DEFERRED = AdmissionDecision(
    admission_id="adm-1", outcome="deferred", reason=Reason.CAPACITY, detail="full",
    retry_after_ms=250,
)  # fmt: skip
FAILED = TaskResult(
    task_id="t-1", agent_id="a-1", capability="calc.add", status="error",
    error=ErrorInfo(code=Reason.GRANT_INVALID, message="expired"), started_at=T0, finished_at=T0,
)  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (DEFERRED, Refusal(reason=Reason.CAPACITY, detail="full", retry_after_ms=250)),
        (
            AdmissionReleaseReply(
                admission_id="adm-1", released=False, reason=Reason.STALE_FENCE, detail="old"
            ),
            Refusal(reason=Reason.STALE_FENCE, detail="old"),
        ),
        (
            RegistrationRefused(
                agent_id="a-1", incarnation="i-1", reason=Reason.EPOCHS_UNSUPPORTED, detail="x"
            ),
            Refusal(reason=Reason.EPOCHS_UNSUPPORTED, detail="x"),
        ),
        (FAILED, Refusal(reason=Reason.GRANT_INVALID, detail="expired")),
        (Refusal(reason=Reason.NOT_AUTHORIZED), Refusal(reason=Reason.NOT_AUTHORIZED)),
    ],
)
def test_every_no_reads_as_one_refusal(reply: Message, expected: Refusal) -> None:
    assert refusal_of(reply) == expected


def test_every_yes_reads_as_none() -> None:
    admitted = AdmissionDecision(admission_id=GRANT.admission_id, outcome="admitted", grant=GRANT)
    assert refusal_of(admitted) is None
    assert refusal_of(AdmissionReleaseReply(admission_id="adm-1", released=True)) is None
    said_yes = [m for m in SAMPLES.values() if refusal_of(m) is None]
    assert len(said_yes) > 20  # the registrations, heartbeats, leases... of the samples


def test_the_sdks_admission_refusal_carries_the_same_shape() -> None:
    assert AdmissionRefused(DEFERRED).refusal == refusal_of(DEFERRED)
