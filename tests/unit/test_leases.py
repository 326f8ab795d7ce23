"""Invocation leases (pure): signed by the manager's key, checked with its public key only.

Every refusal of :meth:`LeaseVerifier.check` and of a once-only :class:`ConsumptionPoint` is
shown here; the leases a real manager signs into real grants, and an agent's consumption
points, are exercised over the broker in tests/integration/test_leases.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mesh.leases import (
    ConsumptionPoint,
    LeaseKeyError,
    LeaseSigner,
    LeaseVerifier,
    load_public_key,
    public_path,
)
from mesh.wire import InvocationLease, decode_as, encode

NOW = 1_800_000_000.0
SIGNER = LeaseSigner.generate()
VERIFIER = LeaseVerifier([SIGNER.public_key])


def lease(**overrides: object) -> InvocationLease:
    fields: dict[str, object] = {
        "admission_id": "adm-1",
        "pool_id": "rag-eu",
        "fence": 7,
        "descriptor_epoch": 3,
        "tools": ["web-search", "calculator"],
        "issued_at": NOW,
        "expires_at": NOW + 60,
    }
    fields.update(overrides)
    return SIGNER.sign(**fields)  # type: ignore[arg-type]


def test_a_signed_lease_checks_out_for_its_own_admission_and_tools() -> None:
    held = lease()
    assert held.tools == ["calculator", "web-search"]  # sorted: one canonical form
    assert held.key_id == SIGNER.key_id and len(held.signature) == 86
    assert VERIFIER.check(held, now=NOW + 1) is None
    bound = {"admission_id": "adm-1", "fence": 7, "pool_id": "rag-eu"}
    assert VERIFIER.check(held, now=NOW + 1, tool="web-search", **bound) is None  # type: ignore[arg-type]


def test_it_survives_the_wire() -> None:
    held = lease()
    assert VERIFIER.check(decode_as(encode(held), InvocationLease), now=NOW) is None


@pytest.mark.parametrize(
    "change",
    [
        {"admission_id": "adm-2"},
        {"fence": 8},
        {"pool_id": "rag-us"},
        {"tools": ["web-search", "calculator", "shell"]},
        {"expires_at": NOW + 3600},
        {"lease_id": "another"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_any_altered_field_breaks_the_signature(change: dict[str, object]) -> None:
    forged = lease().model_copy(update=change)
    assert "signature does not verify" in (VERIFIER.check(forged, now=NOW) or "")


def test_a_lease_signed_by_another_key_is_refused() -> None:
    stranger = LeaseSigner.generate().sign(
        admission_id="adm-1", pool_id="rag-eu", fence=7, descriptor_epoch=3, tools=[],
        issued_at=NOW, expires_at=NOW + 60,
    )  # fmt: skip
    assert "unknown key" in (VERIFIER.check(stranger, now=NOW) or "")
    # ... and one that claims our key ID but carries another signature.
    claimed = stranger.model_copy(update={"key_id": SIGNER.key_id})
    assert "signature does not verify" in (VERIFIER.check(claimed, now=NOW) or "")


def test_an_expired_lease_is_refused() -> None:
    held = lease(expires_at=NOW + 5)
    assert VERIFIER.check(held, now=NOW + 4.9) is None
    assert "expired" in (VERIFIER.check(held, now=NOW + 5) or "")


@pytest.mark.parametrize(
    ("binding", "what"),
    [({"admission_id": "adm-2"}, "admission"), ({"fence": 8}, "fence"), ({"pool_id": "x"}, "pool")],
)
def test_a_lease_presented_for_another_admission_fence_or_pool_is_refused(
    binding: dict[str, object], what: str
) -> None:
    problem = VERIFIER.check(lease(), now=NOW, **binding)  # type: ignore[arg-type]
    assert problem is not None and f"bound to {what}" in problem


def test_a_tool_outside_the_lease_is_refused() -> None:
    assert "does not cover tool 'shell'" in (VERIFIER.check(lease(), now=NOW, tool="shell") or "")


def test_a_once_only_point_refuses_a_replay_and_a_reusable_one_does_not() -> None:
    held = lease()
    once = ConsumptionPoint(VERIFIER, "payments")
    assert once.consume(held, now=NOW) is None
    assert "replayed" in (once.consume(held, now=NOW + 1) or "")
    assert once.consume(lease(), now=NOW + 1) is None  # another lease: another attempt
    many = ConsumptionPoint(VERIFIER, "reads", once=False)
    assert many.consume(held, now=NOW) is None and many.consume(held, now=NOW) is None


def test_a_point_forgets_expired_leases_and_refuses_them_as_expired() -> None:
    point = ConsumptionPoint(VERIFIER, "writes")
    held = lease(expires_at=NOW + 5)
    assert point.consume(held, now=NOW) is None and point.consumed(held)
    assert point.consume(lease(), now=NOW + 6) is None  # sweeps the expired one
    assert not point.consumed(held)
    assert "expired" in (point.consume(held, now=NOW + 6) or "")


def test_a_consumption_given_back_may_happen_again() -> None:
    point, held = ConsumptionPoint(VERIFIER, "results"), lease()
    assert point.consume(held, now=NOW) is None
    point.give_back(held)  # the result could not be published: the task is requeued
    assert point.consume(held, now=NOW) is None


def test_the_key_file_is_created_private_with_its_public_key_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "lease.pem"
    signer = LeaseSigner.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = LeaseSigner.load_or_create(path)
    assert again.key_id == signer.key_id
    verifier = LeaseVerifier.from_files([public_path(path)])
    held = again.sign(
        admission_id="a", pool_id="p", fence=1, descriptor_epoch=1, tools=[],
        issued_at=NOW, expires_at=NOW + 1,
    )  # fmt: skip
    assert verifier.check(held, now=NOW) is None


def test_bad_key_files_are_one_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(LeaseKeyError, match="cannot read the lease key"):
        LeaseSigner.load_or_create(junk)
    with pytest.raises(LeaseKeyError, match="cannot read the lease public key"):
        load_public_key(tmp_path / "missing.pub")
    with pytest.raises(LeaseKeyError, match="at least one public key"):
        LeaseVerifier([])
