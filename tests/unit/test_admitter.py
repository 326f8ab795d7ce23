"""The admission path on a real (SQLite) ledger: eligibility, reservation, external grants,
activation, idempotency, compensation and expiry. No broker: the manager calls the same code."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from ledger.helpers import prepare

from mesh.ledger.model import TENANT_POOL, Refused
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.admission import AdmissionPolicy, Admitter
from mesh.wire import AdmissionReason, AdmissionRequest, CapabilityRange, TaskRequirements

from .samples import DESCRIPTOR, REQUIREMENTS, T0

POLICY = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)


@dataclass
class Grantor:
    """An external resource that says yes ``capacity`` times, and keeps count."""

    name: str
    capacity: int = 100
    held: dict[str, str] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def request(self, admission_id: str, pool_id: str, ttl_s: float, now: float) -> str | None:
        self.requests.append(admission_id)
        if admission_id in self.held:
            return self.held[admission_id]
        if len(self.held) >= self.capacity:
            return None
        self.held[admission_id] = f"{self.name}:{admission_id}"
        return self.held[admission_id]

    def release(self, admission_id: str, grant_id: str) -> None:
        assert self.held.pop(admission_id) == grant_id


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteLedger]:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def admitter(ledger: SqliteLedger, *grantors: Grantor) -> Admitter:
    a = Admitter(ledger, POLICY, grantors)
    assert a.publish_descriptor(DESCRIPTOR, T0) is None
    return a


def request(admission_id: str, **changes: object) -> AdmissionRequest:
    reqs = REQUIREMENTS.model_copy(update=changes) if changes else REQUIREMENTS
    return AdmissionRequest(admission_id=admission_id, requirements=reqs)


def used(ledger: SqliteLedger) -> dict[tuple[str, str], int]:
    return {key: u for key, (u, _) in ledger.usage().items() if u}


def grant_pairs(a: Admitter, count: int) -> list[tuple[str, int]]:
    """``(admission ID, fence)`` of ``count`` grants, adm-0, adm-1, …, made at T0."""
    grants = [a.admit(request(f"adm-{i}"), "tenant-a", T0).grant for i in range(count)]
    assert all(g is not None for g in grants)
    return [(g.admission_id, g.fence) for g in grants if g is not None]


@contextmanager
def transactions_of(store: SqliteLedger) -> Iterator[list[bool]]:
    """Every transaction the store runs meanwhile, as ``write`` flags, in order."""
    real_transaction, transactions = store._transaction, []

    def counted(work, *, write, retry=True):  # type: ignore[no-untyped-def]
        transactions.append(write)
        return real_transaction(work, write=write, retry=retry)

    store._transaction = counted  # type: ignore[method-assign]
    try:
        yield transactions
    finally:
        store._transaction = real_transaction  # type: ignore[method-assign]


def test_an_eligible_request_is_admitted_with_a_grant_that_reserves_the_whole_chain(
    ledger: SqliteLedger,
) -> None:
    decision = admitter(ledger).admit(request("adm-1"), "tenant-a", T0)

    assert decision.outcome == "admitted" and decision.grant is not None
    assert (decision.grant.pool_id, decision.grant.descriptor_epoch) == ("rag-eu", 3)
    assert used(ledger) == {
        ("rag-eu", "model_slots"): 1,
        ("rag-eu", "sandboxes"): 1,
        ("rag-eu", "tool:web-search"): 2,
        (TENANT_POOL, "tenant_tokens:tenant-a"): 12_000,
    }
    assert ledger.get("adm-1").state == "ACTIVE"  # type: ignore[union-attr]


def test_the_same_admission_id_and_payload_returns_the_same_decision(ledger: SqliteLedger) -> None:
    a = admitter(ledger)
    first = a.admit(request("adm-1"), "tenant-a", T0)
    again = a.admit(request("adm-1"), "tenant-a", T0 + 1)

    assert again == first
    assert used(ledger)[("rag-eu", "model_slots")] == 1  # nothing taken twice


def test_the_same_admission_id_with_another_payload_is_an_immediate_conflict(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    a.admit(request("adm-1"), "tenant-a", T0)

    other = a.admit(request("adm-1", estimated_tokens=99), "tenant-a", T0)
    other_tenant = a.admit(request("adm-1"), "tenant-b", T0)

    assert (other.outcome, other.reason) == ("rejected", AdmissionReason.CONFLICT)
    assert other_tenant.reason is AdmissionReason.CONFLICT


def test_an_expired_descriptor_denies_with_its_own_reason(ledger: SqliteLedger) -> None:
    a = admitter(ledger)

    decision = a.admit(request("adm-late"), "tenant-a", DESCRIPTOR.expires_at + 1)

    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.DESCRIPTOR_EXPIRED)
    assert used(ledger) == {}
    record = a.explain("adm-late")
    assert record is not None and record["eligibility"]["eligible"] == []


def test_a_stale_epoch_denies_once_a_newer_descriptor_is_active(ledger: SqliteLedger) -> None:
    a = admitter(ledger)
    newer = DESCRIPTOR.model_copy(update={"descriptor_epoch": 4})
    assert a.publish_descriptor(newer, T0) is None
    assert a.publish_descriptor(DESCRIPTOR, T0) is not None  # an older epoch cannot come back

    decision = a.admit(request("adm-2"), "tenant-a", T0)
    assert decision.grant is not None and decision.grant.descriptor_epoch == 4


def test_a_requirement_the_descriptor_does_not_allow_is_never_admitted(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    secret: TaskRequirements = REQUIREMENTS.model_copy(
        update={"input_classifications": ["restricted"]}
    )

    decision = a.admit(AdmissionRequest(admission_id="adm-x", requirements=secret), "t", T0)

    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.NO_ELIGIBLE_POOL)
    assert "classification_allowed" in decision.detail


def test_a_batch_that_finds_no_pool_reads_descriptors_only_when_a_newer_one_is_stored(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    nobody = CapabilityRange(name="nobody.offers")
    reads: list[object] = []
    real = ledger.descriptors

    def counted(known=None):  # type: ignore[no-untyped-def]
        reads.append(known)
        return real(known)

    ledger.descriptors = counted  # type: ignore[method-assign]
    first = a.admit_batch([(request("adm-x", capability=nobody), "tenant-a")], T0)
    assert first.decisions[0].reason is AdmissionReason.NO_ELIGIBLE_POOL
    assert reads == []  # the view showed nothing newer than what this admitter holds

    # Another manager stores a newer epoch: the next such batch loads it (one read).
    newer = DESCRIPTOR.model_copy(update={"descriptor_epoch": 4})
    assert ledger.save_descriptor("rag-eu", 4, newer.model_dump_json())
    again = a.admit_batch([(request("adm-y", capability=nobody), "tenant-a")], T0)
    assert again.decisions[0].reason is AdmissionReason.NO_ELIGIBLE_POOL
    assert len(reads) == 1 and a.active_epochs == {"rag-eu": 4}


def test_capacity_is_never_granted_twice(ledger: SqliteLedger) -> None:
    a = admitter(ledger)  # 4 sandboxes: the tightest counter for this request
    decisions = [a.admit(request(f"adm-{i}"), "tenant-a", T0) for i in range(6)]

    outcomes = [d.outcome for d in decisions]
    assert outcomes == ["admitted"] * 4 + ["deferred"] * 2
    assert decisions[-1].reason is AdmissionReason.CAPACITY
    assert decisions[-1].retry_after_ms is not None
    assert used(ledger)[("rag-eu", "sandboxes")] == 4


def test_a_tenant_over_budget_is_deferred_with_that_reason(ledger: SqliteLedger) -> None:
    a = admitter(ledger)
    a.set_tenant_budget("tenant-a", 20_000)

    assert a.admit(request("adm-1"), "tenant-a", T0).outcome == "admitted"
    second = a.admit(request("adm-2"), "tenant-a", T0)

    assert (second.outcome, second.reason) == ("deferred", AdmissionReason.TENANT_BUDGET)
    assert a.admit(request("adm-3"), "tenant-b", T0).outcome == "admitted"  # not b's budget


def test_failure_after_only_some_external_grants_compensates_everything(
    ledger: SqliteLedger,
) -> None:
    gpu, quota = Grantor("a-gpu"), Grantor("b-quota", capacity=0)  # b refuses every request
    a = admitter(ledger, quota, gpu)

    decision = a.admit(request("adm-1"), "tenant-a", T0)

    assert (decision.outcome, decision.reason) == (
        "deferred",
        AdmissionReason.EXTERNAL_GRANT_FAILED,
    )
    assert gpu.requests == ["adm-1"] and quota.requests == ["adm-1"]  # fixed order: a, then b
    assert gpu.held == {}  # compensated
    assert used(ledger) == {}  # counters conserved
    assert ledger.get("adm-1") is None  # nothing reserved: the reservation is never written
    assert a.admit(request("adm-1"), "tenant-a", T0).reason == AdmissionReason.EXTERNAL_GRANT_FAILED


def test_external_grants_are_part_of_the_grant(ledger: SqliteLedger) -> None:
    gpu = Grantor("gpu")
    decision = admitter(ledger, gpu).admit(request("adm-1"), "tenant-a", T0)

    assert decision.grant is not None
    assert decision.grant.grant_ids[-1] == "gpu:adm-1"


def test_release_settles_and_a_stale_holder_cannot_release_after_expiry(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    first = a.admit(request("adm-1"), "tenant-a", T0)
    assert first.grant is not None
    old_fence = first.grant.fence

    expired = a.expire(T0 + POLICY.grant_ttl_s + 1)
    assert [r.admission_id for r in expired] == ["adm-1"]
    assert expired[0].fence > old_fence

    late = a.release("adm-1", old_fence, T0 + 100)
    assert (late.released, late.reason) == (False, AdmissionReason.STALE_FENCE)
    assert used(ledger) == {}  # given back once, by the expiry

    second = a.admit(request("adm-2"), "tenant-a", T0 + 100)
    assert second.grant is not None
    done = a.release("adm-2", second.grant.fence, T0 + 101)
    assert done.released and used(ledger) == {}


def test_releases_that_arrive_together_are_settled_in_one_transaction_as_one_by_one(
    tmp_path: Path,
) -> None:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    a = admitter(store)
    fences = [fence for _, fence in grant_pairs(a, 3)]
    with transactions_of(store) as transactions:
        settled = a.settle_many(
            [
                ("adm-0", fences[0]),
                ("adm-1", fences[1] + 99),
                ("adm-2", fences[2]),
                ("adm-0", fences[0]),
            ],  # a stale fence, and a retried release in the same batch
            T0 + 1,
        )
    assert transactions.count(True) == 1  # one write transaction for all four (then reads)
    assert [(r.released, now, pool) for r, now, pool in settled] == [
        (True, True, DESCRIPTOR.pool_id),
        (False, False, None),
        (True, True, DESCRIPTOR.pool_id),
        (True, False, None),  # already released at that fence: answered the same, once
    ]
    assert settled[1][0].reason == AdmissionReason.STALE_FENCE
    assert set(a.core.grants.held) == {"adm-1"}  # only the stale holder's grant is still counted
    assert used(store) != {}  # and still holds its share
    assert a.release("adm-1", fences[1], T0 + 2).released
    assert used(store) == {}
    store.close()


def test_a_failed_release_batch_is_settled_again_one_by_one(tmp_path: Path) -> None:
    from mesh.errors import StoreError

    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    a = admitter(store)
    releases = grant_pairs(a, 2)
    real_batch = store.batch

    def failing(work):  # type: ignore[no-untyped-def]
        def then_fail():  # type: ignore[no-untyped-def]
            work()  # both released ...
            raise StoreError("deadlock detected")  # ... and rolled back

        return real_batch(then_fail)

    store.batch = failing  # type: ignore[method-assign]
    try:
        settled = a.settle_many(releases, T0 + 1)
    finally:
        store.batch = real_batch  # type: ignore[method-assign]
    assert [(r.released, now) for r, now, _ in settled] == [(True, True), (True, True)]
    assert used(store) == {}
    assert not a.core.grants.held  # the pressure board heard of each release once it was kept
    store.close()


def test_releases_that_come_with_a_batch_are_settled_in_its_one_transaction(
    tmp_path: Path,
) -> None:
    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    a = admitter(store)
    releases = grant_pairs(a, 2)
    with transactions_of(store) as transactions:
        batch = a.admit_batch(
            [(request("adm-2"), "tenant-a")], T0 + 1, releases=[*releases, ("adm-9", 1)]
        )
    assert transactions.count(True) == 1  # the decision and the releases: one commit
    assert [d.outcome for d in batch.decisions] == ["admitted"]
    assert not isinstance(batch.settled, Exception)
    assert [(r.released, now, pool) for r, now, pool in batch.settled] == [
        (True, True, DESCRIPTOR.pool_id),
        (True, True, DESCRIPTOR.pool_id),
        (False, False, None),  # never granted: refused as release() refuses it
    ]
    assert set(a.core.grants.held) == {"adm-2"}  # the released grants no longer counted
    (granted,) = batch.decisions
    assert granted.grant is not None and used(store) != {}  # adm-2's share, only:
    assert a.release("adm-2", granted.grant.fence, T0 + 2).released
    assert used(store) == {}
    store.close()


def test_after_a_restart_the_same_request_gets_its_grant_back_from_the_ledger(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        first = admitter(store).admit(request("adm-1"), "tenant-a", T0)

    with SqliteLedger(path) as reopened:
        again = admitter(reopened).admit(request("adm-1"), "tenant-a", T0 + 1)
        assert again.grant == first.grant
        assert used(reopened)[("rag-eu", "model_slots")] == 1


def test_a_deferred_request_retried_with_the_same_id_is_admitted_once_capacity_frees(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    grants = [a.admit(request(f"adm-{i}"), "tenant-a", T0).grant for i in range(4)]
    deferred = a.admit(request("adm-late"), "tenant-a", T0)
    assert deferred.outcome == "deferred"

    assert grants[0] is not None
    a.release("adm-0", grants[0].fence, T0 + 1)
    retried = a.admit(request("adm-late"), "tenant-a", T0 + 2)  # same ID, as told to retry

    assert retried.outcome == "admitted"
    assert used(ledger)[("rag-eu", "sandboxes")] == 4


def test_descriptors_live_in_the_ledger_so_a_restarted_or_second_manager_has_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        admitter(store)  # publishes DESCRIPTOR (epoch 3)

    with SqliteLedger(path) as reopened:
        fresh = Admitter(reopened, POLICY)
        assert fresh.load_descriptors() == 1
        assert fresh.active_epochs == {"rag-eu": 3}
        assert fresh.admit(request("adm-1"), "tenant-a", T0).outcome == "admitted"
        # An older epoch can never replace the stored one, whoever publishes it.
        older = DESCRIPTOR.model_copy(update={"descriptor_epoch": 2})
        assert Admitter(reopened, POLICY).publish_descriptor(older, T0) is not None


def test_a_second_manager_admits_at_once_into_a_pool_another_just_described(
    tmp_path: Path,
) -> None:
    # Two managers on one ledger: the second has not ticked since the first accepted the
    # descriptor. It reads the ledger's descriptors before rejecting NO_ELIGIBLE_POOL.
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as first_store, SqliteLedger(path) as second_store:
        second = Admitter(second_store, POLICY)
        assert second.load_descriptors() == 0  # nothing described yet
        admitter(first_store)  # the first accepts DESCRIPTOR

        decided = second.admit_batch([(request("adm-1"), "tenant-a")], T0)

        assert [d.outcome for d in decided.decisions] == ["admitted"]
        assert second.active_epochs == {"rag-eu": 3}
        assert decided.records[0] is not None
        # A request no descriptor covers is still rejected (after one read of the ledger).
        other = request("adm-2", input_classifications=["restricted"])
        (rejected,) = second.admit_batch([(other, "tenant-a")], T0).decisions
        assert rejected.reason is AdmissionReason.NO_ELIGIBLE_POOL


def test_a_retry_finishes_an_admission_whose_manager_stopped_between_prepare_and_activate(
    ledger: SqliteLedger,
) -> None:
    from mesh.ledger.model import Prepared
    from mesh.wire import requirement_digest

    a = admitter(ledger)
    digest = requirement_digest(REQUIREMENTS, "tenant-a")
    prepared = prepare(ledger, "adm-1", digest, [("rag-eu", "model_slots", 1)], 10, T0)
    assert isinstance(prepared, Prepared)  # PREPARING, and then the manager died

    retried = a.admit(request("adm-1"), "tenant-a", T0 + 1)

    assert retried.outcome == "admitted" and retried.grant is not None
    assert ledger.get("adm-1").state == "ACTIVE"  # type: ignore[union-attr]
    assert used(ledger)[("rag-eu", "model_slots")] == 1  # nothing taken twice


# ---- group commit and recorded decisions ---------------------------------------------------
def test_a_batch_is_decided_in_order_in_one_transaction(ledger: SqliteLedger) -> None:
    a = admitter(ledger)
    pairs = [(request(f"adm-{i}"), "tenant-a") for i in range(6)]
    pairs.append((request("adm-0", estimated_tokens=1), "tenant-a"))  # reused ID, other payload

    decisions = a.admit_many(pairs, T0)

    assert [d.admission_id for d in decisions] == [p[0].admission_id for p in pairs]
    assert [d.outcome for d in decisions] == ["admitted"] * 4 + ["deferred"] * 2 + ["rejected"]
    assert decisions[-1].reason is AdmissionReason.CONFLICT
    assert used(ledger)[("rag-eu", "model_slots")] == 4


def test_a_failed_batch_is_decided_again_one_by_one_and_its_external_grants_released(
    tmp_path: Path,
) -> None:
    from mesh.errors import StoreError

    store = SqliteLedger(tmp_path / "ledger.sqlite3")
    grantor = Grantor("gpu")
    a = admitter(store, grantor)
    real_batch = store.batch
    calls: list[int] = []

    def failing_batch(work):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            return real_batch(work)

        def then_fail():  # type: ignore[no-untyped-def]
            work()  # every decision made, grants taken ...
            raise StoreError("deadlock detected")  # ... and the transaction rolled back

        return real_batch(then_fail)

    store.batch = failing_batch  # type: ignore[method-assign]
    try:
        decisions = a.admit_many([(request(f"adm-{i}"), "tenant-a") for i in range(3)], T0)
    finally:
        store.close()

    assert [d.outcome for d in decisions] == ["admitted"] * 3
    # The eligibility snapshot went down with the failed batch and was stored again.
    assert len(snapshot_rows(tmp_path / "ledger.sqlite3")) == 1
    with SqliteLedger(tmp_path / "ledger.sqlite3") as reopened:
        explained = Admitter(reopened, POLICY).explain("adm-2")
    assert explained is not None and explained["eligibility"] is not None
    assert len(calls) == 4  # the failed batch, then one transaction per request
    assert sorted(grantor.held) == ["adm-0", "adm-1", "adm-2"]  # each held once, none leaked
    assert grantor.requests.count("adm-0") == 2  # asked again after the failed batch


def test_a_request_whose_own_transaction_fails_is_deferred_as_ledger_unavailable(
    ledger: SqliteLedger,
) -> None:
    from mesh.errors import StoreError

    a = admitter(ledger)

    def broken(work):  # type: ignore[no-untyped-def]
        raise StoreError("disk I/O error")

    ledger.batch = broken  # type: ignore[method-assign]
    (decision,) = a.admit_many([(request("adm-1"), "tenant-a")], T0)

    assert decision.outcome == "deferred"
    assert decision.reason is AdmissionReason.LEDGER_UNAVAILABLE
    assert decision.retry_after_ms and "retry with the same admission ID" in decision.detail


def test_decisions_and_their_eligibility_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    other_region = request("adm-x", regions=["us-east-1"])
    with SqliteLedger(path) as store:
        a = admitter(store)
        admitted = a.admit(request("adm-1"), "tenant-a", T0)
        refused = a.admit(other_region, "tenant-a", T0)
        before = a.explain("adm-x")

    with SqliteLedger(path) as reopened:
        fresh = Admitter(reopened, POLICY)  # empty cache: everything comes from the ledger
        assert fresh.explain("adm-x") == before
        assert before is not None and before["eligibility"]["pools"][0]["rule"] == "region_allowed"
        assert fresh.explain("adm-1")["decision"] == admitted.model_dump(mode="json")  # type: ignore[index]
        # The same request gets exactly the recorded grant, external IDs and epoch included.
        assert fresh.admit(request("adm-1"), "tenant-a", T0 + 5) == admitted
        again = fresh.admit(other_region, "tenant-a", T0 + 5)
        assert (again.outcome, again.reason) == (refused.outcome, refused.reason)


def snapshot_rows(path: Path) -> list[tuple[str, str]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT ref, body FROM ledger_eligibility").fetchall()
    finally:
        conn.close()


def test_decisions_with_the_same_verdicts_share_one_stored_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        a = admitter(store)
        a.admit_many([(request(f"adm-{n}"), "tenant-a") for n in range(5)], T0)
        a.admit(request("adm-5"), "tenant-a", T0 + 1)  # later: the same verdicts
        a.admit(request("adm-x", regions=["us-east-1"]), "tenant-a", T0 + 2)  # other verdicts
        records = {n: a.recorded(n) for n in ("adm-0", "adm-5", "adm-x")}

    rows = snapshot_rows(path)
    assert len(rows) == 2  # one per distinct set of verdicts, not one per decision
    refs = {n: r.eligibility_ref for n, r in records.items() if r is not None}
    assert refs["adm-0"] == refs["adm-5"] != refs["adm-x"]
    assert {ref for ref, _ in rows} == set(refs.values())
    # Each record keeps its own time; the snapshot has none.
    assert [records[n].eligibility["now"] for n in ("adm-0", "adm-5")] == [T0, T0 + 1]  # type: ignore[union-attr,index]
    assert all("now" not in body for _, body in rows)


def test_refusals_for_an_expired_descriptor_share_one_snapshot_too(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        a = Admitter(store, POLICY)
        short = DESCRIPTOR.model_copy(update={"expires_at": T0 + 10})
        assert a.publish_descriptor(short, T0) is None
        refused = [a.admit(request(f"adm-{n}"), "tenant-a", T0 + 20 + n) for n in range(3)]
        assert [d.reason for d in refused] == [AdmissionReason.DESCRIPTOR_EXPIRED] * 3
        assert a.eligibility_cache.hits == 2  # an expired descriptor stays expired
    (only,) = snapshot_rows(path)
    assert f"expired at {T0 + 10!r}" in only[1] and "now" not in orjson.loads(only[1])


def test_a_record_of_the_earlier_format_with_its_eligibility_inline_still_explains(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        admitted = admitter(store).admit(request("adm-1"), "tenant-a", T0)
        explained = Admitter(store, POLICY).explain("adm-1")  # read back from the ledger
    assert explained is not None
    # Rewrite the stored record as the earlier version wrote it: the eligibility in full.
    conn = sqlite3.connect(path)
    (text,) = conn.execute("SELECT record FROM ledger_decision").fetchone()
    record = orjson.loads(text)
    del record["eligibility_ref"], record["evaluated_at"]
    record["eligibility"] = explained["eligibility"]
    conn.execute("UPDATE ledger_decision SET record = ?", (orjson.dumps(record).decode(),))
    conn.commit()
    conn.close()

    with SqliteLedger(path) as reopened:
        fresh = Admitter(reopened, POLICY)
        assert fresh.explain("adm-1") == explained
        assert fresh.admit(request("adm-1"), "tenant-a", T0 + 5) == admitted  # idempotent


def test_a_missing_or_damaged_snapshot_leaves_the_eligibility_unknown_not_the_decision(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.sqlite3"
    with SqliteLedger(path) as store:
        admitted = admitter(store).admit(request("adm-1"), "tenant-a", T0)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE ledger_eligibility SET body = '{\"pools\": []}'")  # not its ref
    conn.commit()

    with SqliteLedger(path) as reopened:
        explained = Admitter(reopened, POLICY).explain("adm-1")
    assert explained is not None and explained["eligibility"] is None
    assert explained["decision"] == admitted.model_dump(mode="json")
    assert "a stored eligibility snapshot is damaged" in caplog.text

    conn.execute("DELETE FROM ledger_eligibility")
    conn.commit()
    conn.close()
    with SqliteLedger(path) as reopened:
        fresh = Admitter(reopened, POLICY)
        explained = fresh.explain("adm-1")
        assert explained is not None and explained["eligibility"] is None
        assert fresh.admit(request("adm-1"), "tenant-a", T0 + 5) == admitted
    assert "names an eligibility snapshot the ledger lacks" in caplog.text


def test_the_decision_cache_is_bounded(
    ledger: SqliteLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mesh.core import decision_memory

    monkeypatch.setattr(decision_memory, "DECISION_CACHE_SIZE", 3)
    a = admitter(ledger)
    for i in range(4):
        a.admit(request(f"adm-{i}"), "tenant-a", T0)

    assert list(a.decisions) == ["adm-1", "adm-2", "adm-3"]
    assert a.explain("adm-0") is not None  # evicted from memory, still in the ledger


def test_a_run_is_held_to_its_share_once_the_pool_is_tight(ledger: SqliteLedger) -> None:
    """The run ID travels from the requirements to the pressure board, scoped by tenant."""
    a = admitter(ledger)
    slots = DESCRIPTOR.model_limits.slots  # 16: TIGHTEN from 15 slots in use

    def run_request(admission_id: str, run_id: str | None) -> AdmissionRequest:
        return request(
            admission_id, required_tools=[], needs_sandbox=False, deadline=None, run_id=run_id
        )

    assert a.admit(run_request("narrow-0", "narrow"), "tenant-a", T0).outcome == "admitted"
    decisions = [a.admit(run_request(f"fan-{i}", "wide"), "tenant-a", T0) for i in range(14)]
    assert all(d.outcome == "admitted" for d in decisions)  # 15 of 16: tight from here

    capped = a.admit(run_request("fan-14", "wide"), "tenant-a", T0)  # share 8 of 2 runs
    assert capped.outcome == "deferred" and capped.reason is AdmissionReason.RUN_CONCURRENCY
    assert capped.retry_after_ms is not None
    # The other run of the same tenant is below its share; run-less work is not held by runs.
    assert a.admit(run_request("narrow-1", "narrow"), "tenant-a", T0).outcome == "admitted"
    assert used(ledger)[(DESCRIPTOR.pool_id, "model_slots")] == slots


def test_advancing_an_epoch_releases_what_is_not_active_and_drains_what_is(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    active = a.admit(request("adm-active"), "tenant-a", T0)
    assert active.outcome == "admitted" and active.grant is not None
    # A reservation still PREPARING (a manager waiting on external grants, say).
    items = [("rag-eu", "model_slots", 1)]
    preparing = prepare(ledger, "adm-preparing", "sha256:x", items, 10.0, T0, pool_id="rag-eu")
    assert not isinstance(preparing, Refused)
    assert a.draining_allowlist("rag-eu", T0) is None  # no advance yet: nothing to say

    newer = DESCRIPTOR.model_copy(update={"descriptor_epoch": DESCRIPTOR.descriptor_epoch + 1})
    assert a.publish_descriptor(newer, T0 + 1) is None

    held = ledger.get("adm-preparing")
    assert held is not None and held.state == "RELEASED"
    assert a.draining_allowlist("rag-eu", T0 + 1) == ["adm-active"]
    later = a.admit(request("adm-later"), "tenant-a", T0 + 2)
    assert later.grant is not None and later.grant.descriptor_epoch == newer.descriptor_epoch

    assert a.release("adm-active", active.grant.fence, T0 + 3).released
    assert a.draining_allowlist("rag-eu", T0 + 3) == []


def test_a_draining_grant_leaves_the_allowlist_when_it_expires(ledger: SqliteLedger) -> None:
    a = admitter(ledger)
    active = a.admit(request("adm-1"), "tenant-a", T0)
    assert active.grant is not None
    newer = DESCRIPTOR.model_copy(update={"descriptor_epoch": DESCRIPTOR.descriptor_epoch + 1})
    assert a.publish_descriptor(newer, T0 + 1) is None
    assert a.draining_allowlist("rag-eu", T0 + 1) == ["adm-1"]
    assert a.draining_allowlist("rag-eu", active.grant.expires_at) == []


def test_a_shadow_descriptor_is_evaluated_and_recorded_but_decides_nothing(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    assert a.admit(request("adm-0"), "tenant-a", T0).outcome == "admitted"
    assert "shadow" not in (a.recorded("adm-0").eligibility or {})  # no shadow: no cost

    # The candidate next epoch drops the web-search tool the requests need.
    candidate = DESCRIPTOR.model_copy(
        update={
            "descriptor_epoch": DESCRIPTOR.descriptor_epoch + 1,
            "tools": [t for t in DESCRIPTOR.tools if t.name != "web-search"],
        }
    )
    stale = DESCRIPTOR.model_copy(update={"descriptor_epoch": DESCRIPTOR.descriptor_epoch})
    assert "not newer than the active" in (a.set_shadow(stale, T0) or "")
    assert a.set_shadow(candidate, T0) is None

    decision = a.admit(request("adm-1"), "tenant-a", T0 + 1)
    assert decision.outcome == "admitted" and decision.grant is not None  # live decides
    assert decision.grant.descriptor_epoch == DESCRIPTOR.descriptor_epoch
    record = a.recorded("adm-1")
    assert record is not None and record.eligibility is not None
    assert record.eligibility["shadow"] == {
        "eligible": [],
        "pools": [
            {
                "pool_id": "rag-eu",
                "descriptor_epoch": candidate.descriptor_epoch,
                "live": None,
                "shadow": "tools_allowed",
            }
        ],
        "agree": False,
    }
    assert a.active_epochs["rag-eu"] == DESCRIPTOR.descriptor_epoch  # nothing moved

    a.shadows.pop("rag-eu")
    a.admit(request("adm-2"), "tenant-a", T0 + 2)
    assert "shadow" not in (a.recorded("adm-2").eligibility or {})


def test_the_pressure_board_is_fed_the_counters_as_they_are_when_it_is_fed(
    ledger: SqliteLedger,
) -> None:
    """A usage snapshot read before a batch committed would set the board's utilisation below
    the grants it counts itself; observe() without one reads the counters then and there."""
    a = admitter(ledger)
    stale = ledger.usage()  # as a tick read it, before the grants below committed
    for i in range(3):
        assert a.admit(request(f"adm-{i}"), "tenant-a", T0).outcome == "admitted"

    a.observe(T0 + 1, stale)
    assert a.pressure.pools[DESCRIPTOR.pool_id].used == 0  # what the stale snapshot says
    a.observe(T0 + 2)
    assert a.pressure.pools[DESCRIPTOR.pool_id].used == 3  # what the ledger holds now


def test_the_loop_reads_the_pressure_pools_from_a_copy_the_admitter_made(
    ledger: SqliteLedger,
) -> None:
    a = admitter(ledger)
    assert a.pools_seen == {}  # nothing observed yet
    a.observe(T0)
    seen = a.pools_seen
    assert set(seen) == set(a.pressure.pools) == {DESCRIPTOR.pool_id}
    assert seen is not a.pressure.pools  # a pool added later does not change what it reads
    a.pressure.pool("another")
    assert set(seen) == {DESCRIPTOR.pool_id}


def test_a_grant_given_again_for_the_same_request_is_marked_replayed(
    tmp_path: Path,
) -> None:
    """A request the ledger already granted (a producer's retry, or a redelivery to another
    manager on the same ledger) gets the same grant, marked replayed: the manager journals
    it so instead of as a second grant."""
    with SqliteLedger(tmp_path / "shared.sqlite3") as store:
        first, second = admitter(store), admitter(store)
        granted = first.admit_batch([(request("adm-1"), "tenant-a")], T0)
        assert granted.replayed == frozenset()
        again = second.admit_batch(
            [(request("adm-1"), "tenant-a"), (request("adm-2"), "tenant-a")], T0 + 1
        )
        assert again.decisions[0] == granted.decisions[0]
        assert again.replayed == {"adm-1"}  # adm-2 granted afresh: not a replay
        assert again.decisions[1].outcome == "admitted"
        assert first.admit_batch([(request("adm-1"), "tenant-a")], T0 + 2).replayed == {"adm-1"}
