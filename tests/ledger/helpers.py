"""Taking reservations the way the manager does, for tests that need some in the ledger.

The manager never asks the store to "prepare" a reservation: it reads a view of the ledger
(``read_for_decision``), decides against it, and has the store ``apply`` the operations —
a :class:`~mesh.ledger.model.Reserve` per fresh reservation, whose counters the store takes
by conditional increments (a counter that moved under the batch fails it: ``StaleView``).
:func:`prepare_all` does exactly that for a batch of plain reservation requests; the
decision is the ledger's rule, and nothing more: an ID already reserved replays (same
digest) or is a CONFLICT (another), and a request takes all of its items or none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mesh.core.batch import Batch
from mesh.errors import StoreError
from mesh.ledger import LedgerReason, LedgerStore, Prepared, Refused, Reservation
from mesh.ledger.model import (
    Item,
    LedgerView,
    ReservationState,
    Reserve,
    check_ttl,
    default_pool,
    normalize_items,
)

ATTEMPTS = 100
"""How many times :func:`prepare` decides a request again while the ledger changes under it
(another process): as a producer retries the same admission ID, which is always safe."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One reservation request: hold ``items`` PREPARING until ``now + ttl_s`` — or, with
    ``activate_ttl_s``, ACTIVE at once until ``now + activate_ttl_s``."""

    admission_id: str
    digest: str
    items: tuple[Item, ...]
    ttl_s: float
    now: float
    pool_id: str
    activate_ttl_s: float | None = None
    descriptor_epoch: int | None = None


def ask(
    admission_id: str,
    digest: str,
    items: Iterable[tuple[str, str, int]],
    ttl_s: float,
    now: float,
    *,
    pool_id: str | None = None,
    activate_ttl_s: float | None = None,
    descriptor_epoch: int | None = None,
) -> Ask:
    """An :class:`Ask`, checked as the store checks its calls (misuse raises
    :class:`~mesh.errors.LocalProtocolError`); items in the ledger's one order."""
    check_ttl(ttl_s, now)
    if activate_ttl_s is not None:
        check_ttl(activate_ttl_s, now)
    wanted = normalize_items(items)
    pool = pool_id if pool_id is not None else default_pool(wanted)
    return Ask(admission_id, digest, wanted, ttl_s, now, pool, activate_ttl_s, descriptor_epoch)


def prepare(
    ledger: LedgerStore,
    admission_id: str,
    digest: str,
    items: Iterable[tuple[str, str, int]],
    ttl_s: float,
    now: float,
    *,
    pool_id: str | None = None,
    activate_ttl_s: float | None = None,
    descriptor_epoch: int | None = None,
) -> Prepared | Refused:
    """Take every item (all or nothing) in a batch of its own, decided on a fresh view again
    while another writer changes the ledger under it."""
    request = ask(
        admission_id, digest, items, ttl_s, now,
        pool_id=pool_id, activate_ttl_s=activate_ttl_s, descriptor_epoch=descriptor_epoch,
    )  # fmt: skip
    for attempt in range(1, ATTEMPTS + 1):
        try:
            (outcome,) = prepare_all(ledger, [request])
            return outcome
        except StoreError:
            if attempt == ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def prepare_all(ledger: LedgerStore, requests: Sequence[Ask]) -> list[Prepared | Refused]:
    """Decide ``requests`` in order in one batch — one view, one ``apply`` — as the manager's
    admitter decides its batches. Raises what the batch raised (then nothing was kept)."""

    def work() -> list[Prepared | Refused]:
        ids = [request.admission_id for request in requests]
        view = ledger.read_for_decision(ids, fences=len(requests))
        outcomes, ops = decide(view, requests)
        ledger.apply(ops)
        return outcomes

    return ledger.batch(work)


def decide(
    view: LedgerView, requests: Sequence[Ask]
) -> tuple[list[Prepared | Refused], list[Reserve]]:
    """Each request's outcome against ``view`` (and the requests before it), and the
    :class:`Reserve` operations of those that take their items."""
    batch = Batch(view, dict(view.counters), list(view.fences))  # the core's own counting
    known: dict[str, Reservation] = dict(view.reservations)
    fences = iter(view.fences)
    outcomes: list[Prepared | Refused] = []
    ops: list[Reserve] = []
    for request in requests:
        existing = known.get(request.admission_id)
        if existing is not None:
            outcomes.append(_known(existing, request))
            continue
        short = batch.take(request.items)  # all of its items or none
        if short is not None:
            outcomes.append(short)
            continue
        active = request.activate_ttl_s is not None
        reservation = Reservation(
            request.admission_id, request.digest, request.pool_id,
            ReservationState.ACTIVE if active else ReservationState.PREPARING, next(fences),
            request.items, request.now + (request.activate_ttl_s or request.ttl_s),
            request.now, request.now, request.descriptor_epoch,
        )  # fmt: skip
        known[request.admission_id] = reservation
        ops.append(Reserve(reservation))
        outcomes.append(Prepared(reservation, replayed=False))
    return outcomes, ops


def _known(existing: Reservation, request: Ask) -> Prepared | Refused:
    """The answer to a request for an admission ID that already has a reservation."""
    if existing.digest != request.digest:
        return Refused(
            LedgerReason.CONFLICT,
            f"admission {request.admission_id!r} is already reserved for requirement digest "
            f"{existing.digest!r}, not {request.digest!r}",
        )
    return Prepared(existing, replayed=True)
