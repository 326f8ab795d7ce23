"""The ledger against a simple in-memory model, driven by hypothesis (SQLite and PostgreSQL).

Random admission IDs (from a small set, so they collide), digests, items, capacities and TTLs;
time moves forward in whole seconds so expiry boundaries are hit exactly. After every step:

- PREPARING + ACTIVE never hold more than a counter's capacity, and the store's ``usage()``
  equals the model's;
- one decision per admission ID: the same digest replays the same reservation, another
  digest is a CONFLICT, and the store's reservations equal the model's;
- fences only increase: each new fence is above every fence seen before;
- RELEASED and EXPIRED are final (the model never leaves them, the store must match it);
- ``replay_log()`` rebuilds exactly the live states and fences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mesh.ledger import (
    HOLDING_STATES,
    TENANT_TOKENS_PREFIX,
    Item,
    LedgerReason,
    LedgerStore,
    Prepared,
    Refused,
    Reservation,
    ReservationState,
)
from mesh.ledger.model import normalize_items

from .conftest import LedgerFactory
from .helpers import ask, prepare, prepare_all

Key = tuple[str, str]
COUNTERS: list[Key] = [
    ("*", "tenant_tokens:acme"),
    ("*", "tenant_tokens:zeta"),
    ("p1", "model_slots"),
    ("p1", "sandboxes"),
    ("p1", "tool:search"),
    ("p2", "model_slots"),
]
UNCONFIGURED: Key = ("p2", "tool:none")  # never given a capacity: counts as 0
ADMISSION_IDS = [f"adm-{i}" for i in range(8)]
NEVER_PREPARED = "adm-never"
EXAMPLES = {"sqlite": 100, "postgres": 30}
STEPS = 30

# Seconds that pass before a call: time flows under every rule.
ELAPSE = st.sampled_from([0, 0, 0, 1, 3])
FENCE_CHOICES = st.sampled_from(["current", "current", "current", "stale", "bogus"])
items_strategy = st.lists(
    st.tuples(st.sampled_from([*COUNTERS * 4, UNCONFIGURED]), st.integers(1, 3)),
    min_size=1,
    max_size=3,
).map(lambda drawn: normalize_items((pool, resource, n) for (pool, resource), n in drawn))


@dataclass
class Held:
    digest: str
    items: tuple[Item, ...]
    state: ReservationState
    fence: int
    expires_at: float
    old_fences: list[int] = field(default_factory=list)


@dataclass
class Model:
    """What the ledger should hold: the contract, written as plainly as possible."""

    capacity: dict[Key, int] = field(default_factory=dict)
    reservations: dict[str, Held] = field(default_factory=dict)

    def used(self) -> dict[Key, int]:
        totals: dict[Key, int] = {}
        for held in self.reservations.values():
            if held.state in HOLDING_STATES:
                for pool_id, resource, amount in held.items:
                    totals[(pool_id, resource)] = totals.get((pool_id, resource), 0) + amount
        return totals

    def shortage(self, items: tuple[Item, ...]) -> LedgerReason | None:
        used = self.used()
        for pool_id, resource, amount in items:  # the store's order: sorted
            if used.get((pool_id, resource), 0) + amount > self.capacity.get(
                (pool_id, resource), 0
            ):
                if resource.startswith(TENANT_TOKENS_PREFIX):
                    return LedgerReason.TENANT_BUDGET
                return LedgerReason.CAPACITY
        return None

    def refusal(self, admission_id: str, fence: int, now: float, verb: str) -> LedgerReason | None:
        held = self.reservations.get(admission_id)
        if held is None:
            return LedgerReason.NOT_FOUND
        if held.fence != fence:
            return LedgerReason.STALE_FENCE
        if verb == "activate":
            fits = held.state is ReservationState.PREPARING and held.expires_at > now
        else:
            fits = held.state in HOLDING_STATES
        return None if fits else LedgerReason.STALE_FENCE


def describe(outcome: Prepared | Refused | Reservation) -> str:
    """A label for ``hypothesis.event``: what the rule ran into (shows the coverage)."""
    if isinstance(outcome, Refused):
        return f"refused {outcome.reason}" + (
            " (past ttl)" if "expired at" in outcome.detail else ""
        )
    if isinstance(outcome, Prepared):
        return "replayed" if outcome.replayed else "prepared"
    return outcome.state


class LedgerMachine(RuleBasedStateMachine):
    open_store: ClassVar[Callable[[], LedgerStore]]

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).open_store()
        self.model = Model()
        self.now = 1_000.0
        self.max_fence = 0

    def teardown(self) -> None:
        self.store.close()

    # ---- helpers -----------------------------------------------------------------------------
    def known_ids(self) -> st.SearchStrategy[str]:
        """Mostly an admission the ledger holds, sometimes a finished one or one it never saw."""
        known = sorted(self.model.reservations)
        holding = [i for i in known if self.model.reservations[i].state in HOLDING_STATES]
        return st.sampled_from([*holding * 4, *known, NEVER_PREPARED])

    def fence_for(self, admission_id: str, which: str) -> int:
        held = self.model.reservations.get(admission_id)
        if held is None or which == "bogus":
            return 10**12
        if which == "stale":
            return held.old_fences[-1] if held.old_fences else held.fence - 1
        return held.fence

    def saw_fence(self, fence: int) -> None:
        assert fence > self.max_fence, f"fence {fence} is not above {self.max_fence}"
        self.max_fence = fence

    def expect(self, got: Reservation, admission_id: str) -> None:
        held = self.model.reservations[admission_id]
        assert (got.admission_id, got.digest, got.items) == (admission_id, held.digest, held.items)
        assert (got.state, got.fence, got.expires_at) == (held.state, held.fence, held.expires_at)

    # ---- rules -------------------------------------------------------------------------------
    @initialize(
        capacities=st.lists(st.integers(0, 9), min_size=len(COUNTERS), max_size=len(COUNTERS))
    )
    def configure(self, capacities: list[int]) -> None:
        for (pool_id, resource), capacity in zip(COUNTERS, capacities, strict=True):
            self.store.set_capacity(pool_id, resource, capacity)
            self.model.capacity[(pool_id, resource)] = capacity

    @rule(counter=st.sampled_from(COUNTERS), headroom=st.integers(0, 4))
    def change_capacity(self, counter: Key, headroom: int) -> None:
        # Never below what is held, so "held <= capacity" stays a checkable invariant
        # (lowering below use is covered by the contract suite).
        capacity = self.model.used().get(counter, 0) + headroom
        self.store.set_capacity(*counter, capacity)
        self.model.capacity[counter] = capacity

    @rule(
        admission_id=st.sampled_from(ADMISSION_IDS),
        digest=st.sampled_from(["d1", "d2"]),
        items=items_strategy,
        ttl=st.integers(1, 8),
        elapse=ELAPSE,
    )
    def prepare(
        self, admission_id: str, digest: str, items: tuple[Item, ...], ttl: int, elapse: int
    ) -> None:
        self.now += elapse
        outcome = prepare(self.store, admission_id, digest, items, ttl, self.now)
        event(f"prepare: {describe(outcome)}")
        self.check_prepared(admission_id, digest, items, ttl, outcome, activated=False)

    @rule(
        calls=st.lists(
            st.tuples(
                st.sampled_from(ADMISSION_IDS),
                st.sampled_from(["d1", "d2"]),
                items_strategy,
                st.booleans(),
            ),
            min_size=1,
            max_size=4,
        ),
        ttl=st.integers(1, 8),
        elapse=ELAPSE,
    )
    def prepare_in_one_batch(
        self,
        calls: list[tuple[str, str, tuple[Item, ...], bool]],
        ttl: int,
        elapse: int,
    ) -> None:
        """Several reservations (some activated at once) decided in one batch, on one view
        and one apply, as the manager decides its batches."""
        self.now += elapse
        outcomes = prepare_all(
            self.store,
            [
                ask(a, d, items, ttl, self.now, activate_ttl_s=ttl + 1 if activate else None)
                for a, d, items, activate in calls
            ],
        )
        for (a, d, items, activate), outcome in zip(calls, outcomes, strict=True):
            event(f"batch prepare: {describe(outcome)}")
            self.check_prepared(a, d, items, ttl, outcome, activated=activate)

    def check_prepared(
        self,
        admission_id: str,
        digest: str,
        items: tuple[Item, ...],
        ttl: int,
        outcome: Prepared | Refused,
        *,
        activated: bool,
    ) -> None:
        existing = self.model.reservations.get(admission_id)
        if existing is not None and existing.digest != digest:
            assert isinstance(outcome, Refused) and outcome.reason is LedgerReason.CONFLICT
        elif existing is not None:
            assert isinstance(outcome, Prepared) and outcome.replayed, outcome
            self.expect(outcome.reservation, admission_id)
        elif (reason := self.model.shortage(items)) is not None:
            assert isinstance(outcome, Refused) and outcome.reason is reason, (outcome, reason)
        else:
            assert isinstance(outcome, Prepared) and not outcome.replayed, outcome
            self.saw_fence(outcome.reservation.fence)
            self.model.reservations[admission_id] = Held(
                digest,
                items,
                ReservationState.ACTIVE if activated else ReservationState.PREPARING,
                outcome.reservation.fence,
                self.now + ttl + (1 if activated else 0),
            )
            self.expect(outcome.reservation, admission_id)

    @precondition(lambda self: bool(self.model.reservations))
    @rule(data=st.data(), which=FENCE_CHOICES, ttl=st.integers(1, 8), elapse=ELAPSE)
    def activate(self, data: st.DataObject, which: str, ttl: int, elapse: int) -> None:
        self.now += elapse
        admission_id = data.draw(self.known_ids())
        fence = self.fence_for(admission_id, which)
        outcome = self.store.activate(admission_id, fence, ttl, self.now)
        event(f"activate: {describe(outcome)}")
        reason = self.model.refusal(admission_id, fence, self.now, "activate")
        if reason is not None:
            assert isinstance(outcome, Refused) and outcome.reason is reason, (outcome, reason)
            return
        held = self.model.reservations[admission_id]
        held.state, held.expires_at = ReservationState.ACTIVE, self.now + ttl
        assert isinstance(outcome, Reservation), outcome
        self.expect(outcome, admission_id)

    @precondition(lambda self: bool(self.model.reservations))
    @rule(data=st.data(), which=FENCE_CHOICES, elapse=ELAPSE)
    def release(self, data: st.DataObject, which: str, elapse: int) -> None:
        self.now += elapse
        admission_id = data.draw(self.known_ids())
        fence = self.fence_for(admission_id, which)
        outcome = self.store.release(admission_id, fence, self.now)
        event(f"release: {describe(outcome)}")
        reason = self.model.refusal(admission_id, fence, self.now, "release")
        if reason is not None:
            assert isinstance(outcome, Refused) and outcome.reason is reason, (outcome, reason)
            return
        self.model.reservations[admission_id].state = ReservationState.RELEASED
        assert isinstance(outcome, Reservation), outcome
        self.expect(outcome, admission_id)

    @rule(seconds=st.integers(0, 6))
    def advance_time(self, seconds: int) -> None:
        self.now += seconds

    @precondition(lambda self: bool(self.model.reservations))
    @rule()
    def expire_due(self) -> None:
        due = sorted(
            admission_id
            for admission_id, held in self.model.reservations.items()
            if held.state in HOLDING_STATES and held.expires_at <= self.now
        )
        expired = self.store.expire_due(self.now)
        event(f"expire_due: {len(expired) if len(expired) < 2 else 'several'} expired")
        assert sorted(r.admission_id for r in expired) == due
        for reservation in sorted(expired, key=lambda r: r.fence):
            self.saw_fence(reservation.fence)
            held = self.model.reservations[reservation.admission_id]
            held.old_fences.append(held.fence)
            held.state, held.fence = ReservationState.EXPIRED, reservation.fence
            self.expect(reservation, reservation.admission_id)

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def held_never_exceeds_capacity_and_usage_matches(self) -> None:
        model_used = self.model.used()
        for counter, amount in model_used.items():
            assert amount <= self.model.capacity.get(counter, 0), counter
        usage = self.store.usage()
        assert {key: used for key, (used, _) in usage.items() if used} == model_used
        assert {key: cap for key, (_, cap) in usage.items()} == self.model.capacity

    @invariant()
    def every_admission_has_one_decision(self) -> None:
        for admission_id in ADMISSION_IDS:
            got = self.store.get(admission_id)
            if admission_id in self.model.reservations:
                assert got is not None
                self.expect(got, admission_id)
            else:
                assert got is None
        holding = sorted(
            (i for i, h in self.model.reservations.items() if h.state in HOLDING_STATES),
            key=lambda i: self.model.reservations[i].fence,
        )
        assert [r.admission_id for r in self.store.active()] == holding

    @invariant()
    def the_log_replays_to_the_live_state(self) -> None:
        live = {i: (h.state, h.fence) for i, h in self.model.reservations.items()}
        assert self.store.replay_log() == live


def test_the_ledger_behaves_like_its_model(ledger_factory: LedgerFactory) -> None:
    class Machine(LedgerMachine):
        @staticmethod
        def open_store() -> LedgerStore:  # a new, empty ledger for every example
            return ledger_factory.open(ledger_factory.fresh())

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=EXAMPLES[ledger_factory.kind],
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
