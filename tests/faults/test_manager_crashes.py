"""The manager killed (SIGKILL) at random points of an admission stream, again and again.

Each of :data:`ROUNDS` rounds starts a fresh manager process on the same PostgreSQL ledger
(``tests/integration/manager_process.py``), publishes the pool's descriptor, and runs a stream
of admissions — fresh IDs, retries of IDs from earlier rounds, and releases of grants made
before — then kills the process after a random delay (seeded: the same points every run),
with requests still in flight. After every kill:

* the state rebuilt from the ledger's append-only log (``replay_log``) equals the last
  committed state (every reservation's state and fence in the store);
* no fence was ever reused: every grant any process made, and every fence in the log, is
  unique, and a reservation's fences only grow;
* the pool was never over-granted: the slots held equal the ACTIVE reservations' and never
  exceed the capacity;
* every grant a producer was told about is in the store, ACTIVE or RELEASED by that producer,
  with the fence it was told; a retried ID gets the same grant back, never a second one.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from integration.test_admission_competition import (
    POOL,
    REQUIREMENTS,
    Managers,
    descriptor,
    publish_to_every_manager,
)

from mesh.ledger import PostgresLedger, ReservationState
from mesh.producer import MeshClient
from mesh.wire import AdmissionDecision, AdmissionGrant

ROUNDS = 4
CAPACITY = 6
STREAM = 40  # admissions asked per round
SANDBOXES = (POOL, "sandboxes")


def check_ledger(ledger: PostgresLedger, told: dict[str, AdmissionGrant]) -> None:
    """The invariants above, on the store as it is now."""
    log = ledger.log()
    rows = {a: ledger.get(a) for a in {entry.admission_id for entry in log}}
    state = {a: (r.state, r.fence) for a, r in rows.items() if r is not None}
    assert ledger.replay_log() == state, "the log does not rebuild the committed state"

    per_admission: dict[str, list[int]] = {}
    for entry in log:
        per_admission.setdefault(entry.admission_id, []).append(entry.fence)
    for admission_id, fences in per_admission.items():
        assert fences == sorted(fences), f"{admission_id}: a fence went down: {fences}"
    owners = Counter(f for fences in per_admission.values() for f in set(fences))
    reused = {fence: n for fence, n in owners.items() if n > 1}
    assert not reused, f"fences used by more than one admission: {reused}"

    active = [r for r in rows.values() if r is not None and r.state is ReservationState.ACTIVE]
    used, capacity = ledger.usage()[SANDBOXES]
    assert used == len(active) <= capacity == CAPACITY, (used, len(active), capacity)

    for admission_id, grant in told.items():
        row = rows.get(admission_id)
        assert row is not None, f"{admission_id} was granted but the store has no reservation"
        assert row.fence == grant.fence, f"{admission_id}: told fence {grant.fence}, {row}"
        assert row.state in (ReservationState.ACTIVE, ReservationState.RELEASED), row


async def test_a_manager_killed_at_random_points_keeps_the_ledger_consistent(
    managers: Managers, producers: list[MeshClient], ledger: PostgresLedger
) -> None:
    client = producers[0]
    rng = random.Random(1234)
    told: dict[str, AdmissionGrant] = {}  # admission ID -> the grant a producer was told
    released: set[str] = set()
    pending: list[asyncio.Task[AdmissionDecision]] = []
    releasing: list[asyncio.Task[object]] = []
    decisions = answered = 0
    for round_no in range(ROUNDS + 1):
        # A new manager answers what the killed one left in flight (requests it had not
        # acknowledged are redelivered to it), then takes this round's stream.
        (proc,) = await managers.start(f"m-{round_no}")
        await publish_to_every_manager(client, [proc], descriptor(CAPACITY))
        for decision in await asyncio.gather(*pending):
            answered += 1
            if decision.grant is not None:
                earlier = told.setdefault(decision.admission_id, decision.grant)
                assert earlier.fence == decision.grant.fence, "a retried ID got a second grant"
        await asyncio.gather(*releasing)
        check_ledger(ledger, told)
        if round_no == ROUNDS:
            break

        fresh = [f"r{round_no}-{n:02d}" for n in range(STREAM)]
        retried = rng.sample(sorted(told), k=min(5, len(told)))
        to_release = [told[a] for a in sorted(told) if a not in released][:2]
        released.update(g.admission_id for g in to_release)
        pending = [
            asyncio.create_task(client.admit(REQUIREMENTS, admission_id=a, timeout_s=60))
            for a in fresh + retried
        ]
        releasing = [
            asyncio.create_task(client.release_admission(g, actual_duration_s=0.1))
            for g in to_release
        ]
        await asyncio.sleep(rng.uniform(0.05, 0.6))  # the random point
        await proc.kill()
        decisions += len(proc.decisions)
        check_ledger(ledger, told)  # what the kill left behind

    print(
        f"{ROUNDS} kills, {decisions} decisions logged by the killed managers, {answered} "
        f"answers, {len(told)} grants told ({len(released)} released), "
        f"log of {len(ledger.log())} entries"
    )
    assert decisions > 0 and told
