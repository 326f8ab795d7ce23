"""Batches written behind (PostgreSQL): the admitter decides a batch while the server is still
writing the one before it (``Admitter.admit_begin``), on a view laid over with that batch's
moves. These tests hold it to the answers one batch at a time gives, and to keeping nothing
of a batch whose writes fail — nor of the batch decided on top of it, which is decided again.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from unit.samples import DESCRIPTOR, REQUIREMENTS, T0

from mesh.ledger import Item, PostgresLedger, Reservation, ReservationState, SqliteLedger
from mesh.ledger.model import Reserve
from mesh.manager.admission import AdmissionPolicy, Admitted, Admitter, Ticket
from mesh.wire import AdmissionRequest

from .conftest import schema_name
from .test_ledger_contract import assert_conserved

pytestmark = pytest.mark.integration

POLICY = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
SANDBOXES = ("rag-eu", "sandboxes")  # the descriptor's 4 sandboxes: 4 grants at a time


@pytest.fixture
def ledgers(postgres_dsn: str, request: pytest.FixtureRequest) -> Iterator[list[PostgresLedger]]:
    """Two fresh ledgers of the test's own: one decided one batch at a time, one pipelined."""
    schemas = [schema_name(request.node.name) for _ in range(2)]
    opened = [PostgresLedger(postgres_dsn, schema=schema) for schema in schemas]
    yield opened
    for store in opened:
        store.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def admitter(ledger: PostgresLedger | SqliteLedger) -> Admitter:
    a = Admitter(ledger, POLICY)
    assert a.publish_descriptor(DESCRIPTOR, T0) is None
    return a


def batch_of(*ids: str) -> list[tuple[AdmissionRequest, str]]:
    """Requests ``ids``, the tenants taking turns."""
    return [
        (AdmissionRequest(admission_id=i, requirements=REQUIREMENTS), f"tenant-{n % 2}")
        for n, i in enumerate(ids)
    ]


def answers(admitted: Admitted) -> list[tuple[str, str, str | None, int | None]]:
    return [
        (d.admission_id, d.outcome, d.reason.value if d.reason else None,
         d.grant.fence if d.grant else None)
        for d in admitted.decisions
    ]  # fmt: skip


def grant_at(admission_id: str, fence: int) -> Reservation:
    return Reservation(
        admission_id, f"d-{admission_id}", "pool-a", ReservationState.ACTIVE, fence,
        (Item("pool-a", "model_slots", 1),), T0 + 60, T0, T0, 1,
    )  # fmt: skip


def holdings(a: Admitter) -> int:
    return sum(p.used for p in a.core.pressure.pools.values())


def test_batches_written_behind_get_the_answers_of_one_batch_at_a_time(
    ledgers: list[PostgresLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full pool (4 grants at a time) with grants released two batches after they were
    # made: each batch decided behind sees the one before it taken and its releases given
    # back, as it would have one batch at a time — the same outcomes, fences and counters,
    # and none decided again (a view laid over wrongly would fail the ledger's own check).
    serial, piped = admitter(ledgers[0]), admitter(ledgers[1])
    decided_again: list[object] = []
    monkeypatch.setattr(piped, "admit_batch", lambda *args, **kw: decided_again.append(args))
    plan = [[f"b{b}-{i}" for i in range(3)] for b in range(12)]

    def due(done: list[Admitted], b: int) -> list[tuple[str, int]]:
        """The grants made two batches before batch ``b``, given back with it."""
        if b < 2:
            return []
        grants = [d.grant for d in done[b - 2].decisions if d.grant is not None]
        return [(g.admission_id, g.fence) for g in grants]

    one_at_a_time: list[Admitted] = []
    for b, ids in enumerate(plan):
        one_at_a_time.append(
            serial.admit_batch(batch_of(*ids), T0 + b, releases=due(one_at_a_time, b))
        )
    laid_over = []  # per view read on top of a batch: it did not hold that batch yet
    read_view_after = ledgers[1].read_view_after

    def watched(*args: object) -> object:
        view, seen = read_view_after(*args)  # type: ignore[arg-type]
        laid_over.append(args[2] is not None and not seen)
        return view, seen

    monkeypatch.setattr(ledgers[1], "read_view_after", watched)
    behind: list[Admitted] = []
    tickets: list[Ticket] = []
    for b, ids in enumerate(plan):
        while len(behind) < b - 1:  # the grants due now are known once their batch is done
            behind.append(piped.admit_finish(tickets.pop(0)))
        tickets.append(piped.admit_begin(batch_of(*ids), T0 + b, releases=due(behind, b)))
        while tickets and tickets[0].result is not None:
            behind.append(tickets.pop(0).result)  # type: ignore[arg-type]
    behind += [piped.admit_finish(t) for t in tickets]

    assert decided_again == [] and any(laid_over)  # (each view is read while the writes run)
    assert [answers(a) for a in behind] == [answers(a) for a in one_at_a_time]
    assert [len(a.settled) for a in behind] == [len(a.settled) for a in one_at_a_time]  # type: ignore[arg-type]
    outcomes = {o for a in one_at_a_time for _, o, _, _ in answers(a)}
    assert outcomes == {"admitted", "deferred"}  # the pool was full at times
    assert ledgers[1].usage() == ledgers[0].usage()
    assert holdings(piped) == holdings(serial) == len(ledgers[1].active())
    assert_conserved(ledgers[1])


def test_a_batch_whose_writes_fail_is_decided_again_and_so_is_the_one_on_top(
    ledgers: list[PostgresLedger], postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer takes the pool's last sandboxes while the first batch's writes wait on
    # its lock: those writes fail as stale. The batch decided on top of them assumed they
    # were kept — its view laid over with them, the release they carry already ended on the
    # pressure board. The board is put back, both batches are decided again on what the
    # ledger holds, and nothing of either failed attempt is kept.
    store, a = ledgers[1], admitter(ledgers[1])
    (held,) = [d.grant for d in a.admit_batch(batch_of("held"), T0).decisions if d.grant]
    assert held is not None and holdings(a) == 1
    redone_with: list[int] = []  # the board's holdings as each batch is decided again
    admit_batch = a.admit_batch

    def again(*args: object, **kwargs: object) -> Admitted:
        redone_with.append(holdings(a))
        return admit_batch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(a, "admit_batch", again)
    schema = store.schema
    with psycopg.connect(postgres_dsn) as other:  # a transaction, left open below
        other.execute(
            f'SELECT used FROM "{schema}".ledger_capacity'
            " WHERE pool_id = 'rag-eu' AND resource = 'sandboxes' FOR UPDATE"
        )
        releases = [(held.admission_id, held.fence)]
        first = a.admit_begin(batch_of("first-0", "first-1"), T0 + 1, releases=releases)
        assert first.result is None and first.written is not None  # its writes wait on the lock
        other.execute(
            f'UPDATE "{schema}".ledger_capacity SET used = capacity'
            " WHERE pool_id = 'rag-eu' AND resource = 'sandboxes'"
        )
        other.commit()  # the pool is now full: the first batch's takes no longer fit
        second = a.admit_begin(batch_of("second-0"), T0 + 2)

    done = a.admit_finish(first)
    assert second.result is not None  # decided again, one batch at a time
    assert redone_with == [1, 0]  # the first again with the grant it releases on the board
    assert [o for _, o, _, _ in answers(done)] == ["deferred", "deferred"]
    assert done.settled and done.settled[0][0].released  # type: ignore[index]
    # The release gave a sandbox back after the first batch was decided; the two deferred
    # requests of that batch wait in line for it, ahead of the second batch's.
    (decision,) = second.result.decisions
    assert decision.outcome == "deferred" and decision.position == 3, decision.detail
    assert store.active() == [] and holdings(a) == 0
    assert store.usage()[SANDBOXES][0] == store.usage()[SANDBOXES][1] - 1


def test_the_batch_on_top_sees_the_releases_below_on_the_pressure_board(
    ledgers: list[PostgresLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Who holds how much of a pool decides fair shares: the batch decided on top sees the
    # grants released below already ended, as it would one batch at a time.
    a = admitter(ledgers[1])
    granted = [d.grant for d in a.admit_batch(batch_of("a-0", "a-1"), T0).decisions if d.grant]
    releases = [(g.admission_id, g.fence) for g in granted if g is not None]
    assert len(releases) == 2
    seen: list[int] = []
    decide = a.core.decide

    def watching(*args: object, **kwargs: object) -> object:
        seen.append(holdings(a))
        return decide(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(a.core, "decide", watching)
    below = a.admit_begin(batch_of("b-0"), T0 + 1, releases=releases)
    top = a.admit_begin(batch_of("c-0"), T0 + 2)
    a.admit_finish(below), a.admit_finish(top)

    assert below.written is not None and top.written is not None  # both written behind
    assert seen == [2, 1]  # on top: a-0 and a-1 released, b-0 held
    assert holdings(a) == 2 == len(ledgers[1].active())


def test_a_view_that_already_holds_the_batch_below_does_not_count_it_twice(
    ledgers: list[PostgresLedger],
) -> None:
    # The next view may be read after the batch below committed (its witness decision is in
    # it): its counters already hold that batch's takes, and are not laid over again.
    a = admitter(ledgers[1])
    first = a.admit_begin(batch_of("first-0", "first-1"), T0)
    assert first.written is not None
    first.written.result()  # committed before the next view is read
    second = a.admit_begin(batch_of("second-0", "second-1", "second-2"), T0 + 1)
    done = [a.admit_finish(first), a.admit_finish(second)]

    outcomes = [o for d in done for _, o, _, _ in answers(d)]
    assert outcomes == ["admitted", "admitted", "admitted", "admitted", "deferred"]
    assert ledgers[1].usage()[SANDBOXES][0] == 4
    assert_conserved(ledgers[1])


def test_a_batch_naming_an_admission_of_the_batch_below_waits_for_its_commit(
    ledgers: list[PostgresLedger],
) -> None:
    # The same admission ID again while its first request is being written: the answer must
    # be the recorded one, so that batch is decided once the one below has committed.
    a = admitter(ledgers[1])
    first = a.admit_begin(batch_of("adm-1"), T0)
    again = a.admit_begin(batch_of("adm-1"), T0 + 1)

    assert first.result is not None and again.result is not None  # waited, then decided
    assert answers(again.result) == answers(first.result)
    assert ledgers[1].usage()[SANDBOXES][0] == 1


def test_a_store_that_cannot_write_behind_answers_at_once(tmp_path: object) -> None:
    store = SqliteLedger(f"{tmp_path}/ledger.sqlite3")
    try:
        a = admitter(store)
        ticket = a.admit_begin(batch_of("adm-1", "adm-2"), T0)
        assert ticket.result is not None and ticket.written is None
        assert a.admit_finish(ticket) is ticket.result
        assert [o for _, o, _, _ in answers(ticket.result)] == ["admitted", "admitted"]
    finally:
        store.close()


def test_fences_come_from_a_block_drawn_ahead_and_a_superseding_fence_is_higher(
    ledgers: list[PostgresLedger], postgres_dsn: str
) -> None:
    # A view draws a block of fences (one WAL flush for many batches); the next batches take
    # theirs from it. Another manager on the same ledger draws past the block, so fences of
    # different admissions interleave — but each is handed out once, a batch's ascend, and
    # the fence an expiry gives a grant is drawn later, so it is higher than the grant's.
    a, other = ledgers[1], PostgresLedger(postgres_dsn, schema=ledgers[1].schema)
    try:
        first = a.read_for_decision(["x-1", "x-2"], fences=2).fences
        theirs = other.read_for_decision(["y-1"], fences=1).fences
        second = a.read_for_decision(["x-3", "x-4"], fences=2).fences
    finally:
        other.close()

    assert list(first) == sorted(first) and list(second) == sorted(second)
    assert second[0] == first[-1] + 1  # from the block: no new draw
    assert theirs[0] > second[-1]  # the other manager drew past the block
    a.set_capacity("pool-a", "model_slots", 1)
    granted = grant_at("x-3", second[0])
    a.apply([Reserve(granted)])
    (expired,) = a.expire_due(granted.expires_at)
    assert expired.fence > max(theirs)  # superseding fences come later from the sequence
