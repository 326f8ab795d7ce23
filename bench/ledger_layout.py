"""How the SQLite ledger's table layout and the shape of admission IDs change what a commit
writes: in-core admissions (``Admitter.admit_many``, 16 per commit, as ``admission.py``'s
part B) for each kind of admission ID, on a file in today's layout and on one whose
reservation and decision tables are ``WITHOUT ROWID`` (the earlier layout). Prints µs per
decision and the WAL frames (pages) a commit writes, by table. The four combinations take
turns, one run each per round, and a combination's µs is the median of its rounds: this
machine's speed drifts over minutes, so combinations timed one after the other would
compare phases, not layouts.

Run: ``.venv/bin/python bench/ledger_layout.py`` (about a minute). No broker needed. Each
frame is two ``pwrite`` calls (its header and its page), and on this machine those are most
of a commit's cost, so frames per commit is the number to read; µs per decision follow.
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from admission import in_core  # this directory: the same admissions as admission.py's part B
from report import Report, add_json_argument

from mesh.gc_tuning import tune_gc
from mesh.ids import new_admission_id
from mesh.ledger.sqlite import EARLIER_ID_TABLES, SqliteLedger

COUNT, WARMUP, BATCH, ROUNDS = 3_000, 200, 16, 7
WAL_HEADER, FRAME_HEADER, PAGE = 32, 24, 4096


ID_KINDS: dict[str, Callable[[], str]] = {
    "time-ordered (SDK)": new_admission_id,
    "random (UUIDv4)": lambda: uuid.uuid4().hex,
}


def frames_by_table(path: Path, last_commits: int) -> tuple[float, dict[str, float]]:
    """WAL frames per commit over the last ``last_commits`` commits, in all and by table."""
    wal = (path.parent / (path.name + "-wal")).read_bytes()
    conn = sqlite3.connect(path)
    try:
        owner = dict(conn.execute("SELECT pageno, name FROM dbstat").fetchall())
    finally:
        conn.close()
    commits: list[collections.Counter[str]] = []
    current: collections.Counter[str] = collections.Counter()
    for offset in range(WAL_HEADER, len(wal) - FRAME_HEADER + 1, FRAME_HEADER + PAGE):
        page, commit_size = struct.unpack(">II", wal[offset : offset + 8])
        current["(header page)" if page == 1 else owner.get(page, "(freed)")] += 1
        if commit_size:  # the last frame of a commit
            commits.append(current)
            current = collections.Counter()
    tail = commits[-last_commits:]
    totals: collections.Counter[str] = collections.Counter()
    for commit in tail:
        totals.update(commit)
    per_table = {name: n / len(tail) for name, n in totals.most_common()}
    return sum(per_table.values()), per_table


def measure(layout: str, kind: str, path: Path) -> tuple[float, float, dict[str, float]]:
    """One run on a fresh file: µs a decision, and frames a commit (all, by table)."""
    if layout == "earlier":
        with sqlite3.connect(path) as conn:
            conn.executescript(EARLIER_ID_TABLES)
    with SqliteLedger(path) as ledger:
        result = in_core(kind, ledger, COUNT, WARMUP, BATCH, ID_KINDS[kind])
        # The WAL holds every commit of the run (it is never checkpointed here).
        frames, tables = frames_by_table(path, last_commits=COUNT // BATCH // 2)
    return result.seconds / result.decisions * 1e6, frames, tables


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    report = Report("ledger_layout")
    print(f"process {tune_gc()}")
    print(
        f"{COUNT:,} admissions after {WARMUP} warm-up ones, {BATCH} per commit; µs/decision: "
        f"median of {ROUNDS} rounds; frames: per commit over the second half of a run\n"
    )
    layouts = {"current": "rowid (today's)", "earlier": "WITHOUT ROWID (earlier)"}
    combinations = [(layout, kind) for layout in layouts for kind in ID_KINDS]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in combinations}
    frames: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-layout-") as tmp:
        for round_ in range(ROUNDS):
            for n, (layout, kind) in enumerate(combinations):
                path = Path(tmp) / f"{round_}-{n}.sqlite3"
                us, per_commit, tables = measure(layout, kind, path)
                times[(layout, kind)].append(us)
                frames[(layout, kind)] = (per_commit, tables)
    print(f"   {'layout':<30}{'admission IDs':<22}{'µs/decision':>12}{'frames/commit':>15}")
    for layout, kind in combinations:
        per_commit, tables = frames[(layout, kind)]
        us = statistics.median(times[(layout, kind)])
        print(f"   {layouts[layout]:<30}{kind:<22}{us:>12.1f}{per_commit:>15.1f}")
        shares = ", ".join(f"{name} {n:.1f}" for name, n in tables.items())
        print(f"   {'':<30}{'':<22}   {shares}")
        report.figure(
            layout=layout,
            admission_ids=kind,
            value=us,
            unit="µs per decision (median of rounds)",
            frames_per_commit=per_commit,
            frames_by_table=tables,
        )
    return report.finish(started, args.json)  # no targets: a diagnosis, not a check


if __name__ == "__main__":
    sys.exit(main())
