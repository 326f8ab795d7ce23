"""Two schedulers in two OS processes race on one ledger: capacity is never granted twice.

Each scheduler is a fresh Python interpreter (``subprocess``) with its own connection, like
two manager processes sharing a PostgreSQL ledger (or, for SQLite, one file on one host).
Both open the ledger, report ready, and start together on a signal; each takes a reservation
the manager's way (:mod:`tests.ledger.helpers`: read a view, decide, apply) and activates it,
for its list of admissions, and prints what it won. The parent then
counts: exactly as many grants as there are units, no admission granted twice, and every
counter equal to what the ACTIVE reservations hold.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mesh.ledger import LedgerStore, ReservationState

from .conftest import LedgerFactory

ATTEMPTS = 200  # per scheduler
NOW = 1_000.0
TIME_BUDGET_S = 30.0

SCHEDULER = r"""
import json, sys
from mesh.errors import StoreError
from mesh.ledger import PostgresLedger, Prepared, Refused, Reservation, SqliteLedger

config = json.loads(sys.argv[1])
sys.path.insert(0, config["tests"])
from ledger.helpers import ask, prepare, prepare_all

if config["kind"] == "postgres":
    ledger = PostgresLedger(config["dsn"], schema=config["where"], application_name=config["name"])
else:
    ledger = SqliteLedger(config["where"])
print("ready", flush=True)
sys.stdin.readline()  # the start signal: both schedulers race from here

won, replayed, activated, refused, not_activated = [], [], [], {}, {}
failed_batches = 0


def count(outcome):
    if isinstance(outcome, Refused):
        refused[outcome.reason] = refused.get(outcome.reason, 0) + 1
        return
    (replayed if outcome.replayed else won).append(outcome.reservation.admission_id)
    if outcome.reservation.state == "ACTIVE" and not outcome.replayed:
        activated.append(outcome.reservation.admission_id)


size = config.get("batch", 0)
for at in range(0, len(config["requests"]) if size else 0, size or 1):
    # As the manager's admitter: one batch (one view, one apply), and after a failed one each
    # request again in a transaction of its own.
    chunk = config["requests"][at : at + size]
    try:
        outcomes = prepare_all(
            ledger, [ask(a, d, items, 60.0, config["now"], activate_ttl_s=60.0)
                     for a, d, items in chunk])
    except StoreError:
        failed_batches += 1
        outcomes = [prepare(ledger, a, d, items, 60.0, config["now"], activate_ttl_s=60.0)
                    for a, d, items in chunk]
    for outcome in outcomes:
        count(outcome)
for admission_id, digest, items in [] if size else config["requests"]:
    prepared = prepare(ledger, admission_id, digest, items, 60.0, config["now"])
    if isinstance(prepared, Refused):
        refused[prepared.reason] = refused.get(prepared.reason, 0) + 1
        continue
    (replayed if prepared.replayed else won).append(admission_id)
    active = ledger.activate(admission_id, prepared.reservation.fence, 60.0, config["now"])
    if isinstance(active, Reservation):
        activated.append(admission_id)
    else:
        not_activated[active.reason] = not_activated.get(active.reason, 0) + 1
ledger.close()
print(json.dumps({"won": won, "replayed": replayed, "activated": activated,
                  "refused": refused, "not_activated": not_activated,
                  "failed_batches": failed_batches}), flush=True)
"""

Request = tuple[str, str, list[tuple[str, str, int]]]


def race(
    factory: LedgerFactory, *request_lists: list[Request], batch: int = 0
) -> list[dict[str, Any]]:
    """Run one scheduler process per request list, started together; their reports. With
    ``batch``, each decides its requests ``batch`` at a time, one batch each."""
    procs = []
    for n, requests in enumerate(request_lists):
        config = {
            "kind": factory.kind,
            "dsn": factory.dsn,
            "where": factory.main,
            "name": f"scheduler-{n}",
            "now": NOW,
            "requests": requests,
            "batch": batch,
            "tests": str(Path(__file__).resolve().parent.parent),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCHEDULER, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            if proc.stdout.readline().strip() != "ready":
                proc.kill()
                raise AssertionError(f"a scheduler did not start: {proc.communicate()[1]}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=TIME_BUDGET_S * 2)
            assert proc.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def held_by_active(ledger: LedgerStore) -> dict[tuple[str, str], int]:
    held: Counter[tuple[str, str]] = Counter()
    for reservation in ledger.active():
        assert reservation.state is ReservationState.ACTIVE
        for pool_id, resource, amount in reservation.items:
            held[(pool_id, resource)] += amount
    return dict(held)


def assert_counters_conserved(ledger: LedgerStore) -> None:
    usage = ledger.usage()
    assert {k: used for k, (used, _) in usage.items() if used} == held_by_active(ledger)
    assert all(used <= capacity for used, capacity in usage.values())
    assert ledger.replay_log() == {r.admission_id: (r.state, r.fence) for r in ledger.active()}, (
        "every admission in the log is ACTIVE, and nothing else was logged"
    )


def granted(reports: list[dict[str, Any]]) -> list[str]:
    return [admission_id for report in reports for admission_id in report["activated"]]


@pytest.mark.timeout(120)
def test_two_schedulers_never_both_win_the_last_unit(
    ledger_factory: LedgerFactory, ledger: LedgerStore
) -> None:
    ledger.set_capacity("pool-a", "model_slots", 50)
    requests = {
        who: [(f"{who}-{i}", "d", [("pool-a", "model_slots", 1)]) for i in range(ATTEMPTS)]
        for who in ("a", "b")
    }

    started = time.monotonic()
    reports = race(ledger_factory, requests["a"], requests["b"])
    took = time.monotonic() - started

    winners = granted(reports)
    assert len(winners) == len(set(winners)) == 50, [len(r["activated"]) for r in reports]
    assert sum(r["refused"].get("CAPACITY", 0) for r in reports) == 2 * ATTEMPTS - 50
    assert ledger.usage()[("pool-a", "model_slots")] == (50, 50)
    assert sorted(r.admission_id for r in ledger.active()) == sorted(winners)
    assert_counters_conserved(ledger)
    assert took < TIME_BUDGET_S


@pytest.mark.timeout(120)
def test_competing_multi_resource_requests_take_all_or_nothing(
    ledger_factory: LedgerFactory, ledger: LedgerStore
) -> None:
    # The tenant budget binds (30 grants of 10 tokens); pool counters have room to spare, and
    # every other request also needs a tool nobody has, so it must take nothing at all.
    ledger.set_capacity("*", "tenant_tokens:acme", 300)
    ledger.set_capacity("pool-a", "model_slots", 100)
    ledger.set_capacity("pool-a", "sandboxes", 100)
    ledger.set_capacity("pool-a", "tool:search", 100)
    shapes = {
        "a": [
            ("*", "tenant_tokens:acme", 10),
            ("pool-a", "model_slots", 1),
            ("pool-a", "sandboxes", 1),
        ],
        "b": [
            ("*", "tenant_tokens:acme", 10),
            ("pool-a", "model_slots", 2),
            ("pool-a", "tool:search", 1),
        ],
    }
    missing = ("pool-a", "tool:unlicensed", 1)
    requests = {
        who: [
            (f"{who}-{i}", "d", shape if i % 2 == 0 else [*shape, missing]) for i in range(ATTEMPTS)
        ]
        for who, shape in shapes.items()
    }

    reports = race(ledger_factory, requests["a"], requests["b"])

    winners = granted(reports)
    assert len(winners) == len(set(winners)) == 30
    assert all(int(w.split("-")[1]) % 2 == 0 for w in winners), "a request without its tool won"
    won = Counter(w.split("-")[0] for w in winners)
    assert ledger.usage() == {
        ("*", "tenant_tokens:acme"): (300, 300),
        ("pool-a", "model_slots"): (won["a"] + 2 * won["b"], 100),
        ("pool-a", "sandboxes"): (won["a"], 100),
        ("pool-a", "tool:search"): (won["b"], 100),
    }
    assert_counters_conserved(ledger)


@pytest.mark.timeout(120)
def test_two_schedulers_admitting_the_same_ids_decide_each_once(
    ledger_factory: LedgerFactory, ledger: LedgerStore
) -> None:
    # Both schedulers receive the same 200 admissions (redelivered requests, say), each in its
    # own shuffled order: every admission is decided once, by whoever gets there first, and
    # the other scheduler is told the same decision.
    ledger.set_capacity("pool-a", "model_slots", 50)
    requests: list[Request] = [
        (f"adm-{i}", f"digest-{i}", [("pool-a", "model_slots", 1)]) for i in range(ATTEMPTS)
    ]
    first, second = random.Random(1).sample(requests, k=ATTEMPTS), requests[::-1]

    reports = race(ledger_factory, first, second)

    fresh = [a for r in reports for a in r["won"]]
    winners = granted(reports)
    assert len(fresh) == len(set(fresh)) == 50
    assert len(winners) == len(set(winners)) == 50
    assert set(winners) == set(fresh)
    assert set(reports[0]["replayed"]) == set(reports[1]["won"])
    assert set(reports[1]["replayed"]) == set(reports[0]["won"])
    assert ledger.usage()[("pool-a", "model_slots")] == (50, 50)
    assert_counters_conserved(ledger)


@pytest.mark.timeout(120)
def test_two_schedulers_deciding_in_batches_never_both_win_a_unit(
    ledger_factory: LedgerFactory, ledger: LedgerStore
) -> None:
    # As two managers' group commits: each takes 16 requests per batch (counters read once,
    # taken at the end by the batch's total). On PostgreSQL the batches interleave: a
    # counter moved under a batch fails it and its requests are decided again one by one.
    ledger.set_capacity("pool-a", "model_slots", 60)
    ledger.set_capacity("pool-a", "sandboxes", 45)

    def requests(tag: str) -> list[Request]:
        return [
            (
                f"{tag}-{i}",
                f"digest-{tag}-{i}",
                [("pool-a", "model_slots", 1)] + ([("pool-a", "sandboxes", 1)] if i % 2 else []),
            )
            for i in range(ATTEMPTS)
        ]

    shared = requests("both")[:40]  # the same 40 admissions reach both schedulers, too
    reports = race(ledger_factory, requests("a") + shared, shared[::-1] + requests("b"), batch=16)

    winners = granted(reports)
    assert len(winners) == len(set(winners)) == 60  # every slot granted once, no more
    replayed = [a for r in reports for a in r["replayed"]]
    assert set(replayed) <= set(winners) & {a for a, _, _ in shared}
    assert ledger.usage()[("pool-a", "model_slots")] == (60, 60)
    used_sandboxes = ledger.usage()[("pool-a", "sandboxes")][0]
    assert used_sandboxes == sum(1 for a in winners if int(a.rsplit("-", 1)[1]) % 2)
    assert_counters_conserved(ledger)
    print(f"failed batches (decided again one by one): {[r['failed_batches'] for r in reports]}")
