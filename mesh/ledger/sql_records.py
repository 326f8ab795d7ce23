"""What admission keeps in the ledger besides reservations: decisions, snapshots, descriptors.

A decision record is the latest decision about an admission ID (digest, outcome, JSON), kept
unless one is stored for another digest; an eligibility snapshot is kept once under its
content address; a pool's descriptor is kept unless a newer epoch is stored. These rows never
touch a counter, so their SQL lives apart from the reservations'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mesh.ledger.model import DecisionRow
from mesh.ledger.sql_rows import Db, Tables, chunks, flat


class Records:
    """The SQL of decision records, eligibility snapshots and descriptors."""

    def __init__(self, tables: Tables) -> None:
        self._t = tables

    # ---- decisions ------------------------------------------------------------------------
    def upsert_decisions(self, db: Db, rows: Sequence[tuple[object, ...]]) -> int:
        """Write decision rows; a row for an ID stored with another digest is not kept. Returns
        how many were kept."""
        t, kept = self._t.decision, 0
        for chunk in chunks(rows, 100):
            kept += db.changed(  # a row whose digest differs is not updated: not counted
                f"INSERT INTO {t} (admission_id, digest, outcome, decided_at, record) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk))
                + " ON CONFLICT (admission_id) DO UPDATE SET outcome = excluded.outcome,"
                " decided_at = excluded.decided_at, record = excluded.record"
                f" WHERE {t}.digest = excluded.digest",
                flat(chunk),
            )
        return kept

    def decisions(self, db: Db, ids: Sequence[str]) -> dict[str, DecisionRow]:
        found: dict[str, DecisionRow] = {}
        for chunk in chunks(ids, 500):
            for a, d, o, at, r in db.execute(
                f"SELECT admission_id, digest, outcome, decided_at, record FROM {self._t.decision}"
                f" WHERE admission_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            ):
                found[str(a)] = DecisionRow(str(a), str(d), str(o), float(at), str(r))
        return found

    def deferred_since(self, db: Db, since: float) -> list[DecisionRow]:
        # Served by the partial index on decided_at over the deferred rows alone.
        rows = db.execute(
            f"SELECT admission_id, digest, outcome, decided_at, record FROM {self._t.decision}"
            " WHERE outcome = 'deferred' AND decided_at >= ? ORDER BY decided_at",
            (since,),
        )
        return [DecisionRow(str(a), str(d), str(o), float(t), str(r)) for a, d, o, t, r in rows]

    # ---- eligibility snapshots -----------------------------------------------------------
    def insert_snapshots(self, db: Db, rows: Sequence[tuple[object, ...]]) -> None:
        for chunk in chunks(rows, 100):
            db.execute(
                f"INSERT INTO {self._t.eligibility} (ref, body) VALUES "
                + ", ".join(["(?, ?)"] * len(chunk))
                + " ON CONFLICT (ref) DO NOTHING",
                flat(chunk),
            )

    def eligibility(self, db: Db, ref: str) -> str | None:
        rows = db.execute(f"SELECT body FROM {self._t.eligibility} WHERE ref = ?", (ref,))
        return str(rows[0][0]) if rows else None

    # ---- descriptors -----------------------------------------------------------------------
    def save_descriptor(self, db: Db, pool_id: str, epoch: int, body: str) -> None:
        t = self._t.descriptor
        db.execute(
            f"INSERT INTO {t} (pool_id, epoch, body) VALUES (?, ?, ?)"
            f" ON CONFLICT (pool_id) DO UPDATE SET epoch = excluded.epoch, body = excluded.body"
            f" WHERE excluded.epoch >= {t}.epoch",
            (pool_id, epoch, body),
        )

    def descriptor_epoch(self, db: Db, pool_id: str) -> int | None:
        rows = db.execute(f"SELECT epoch FROM {self._t.descriptor} WHERE pool_id = ?", (pool_id,))
        return int(rows[0][0]) if rows else None

    def descriptors(self, db: Db, known: Mapping[str, int] | None) -> list[tuple[str, int, str]]:
        table = self._t.descriptor
        if known is None:
            rows = db.execute(f"SELECT pool_id, epoch, body FROM {table} ORDER BY pool_id")
        else:
            # Epochs first (a few bytes a pool), bodies only of the newer ones.
            newer = [p for p, epoch in self.epochs(db).items() if epoch > known.get(p, 0)]
            rows = []
            for chunk in chunks(sorted(newer), 500):
                rows += db.execute(
                    f"SELECT pool_id, epoch, body FROM {table}"
                    f" WHERE pool_id IN ({', '.join('?' * len(chunk))}) ORDER BY pool_id",
                    chunk,
                )
        return [(str(p), int(e), str(b)) for p, e, b in rows]

    def epochs(self, db: Db) -> dict[str, int]:
        """Every stored descriptor's epoch, by pool."""
        rows: list[tuple[Any, ...]] = db.execute(f"SELECT pool_id, epoch FROM {self._t.descriptor}")
        return {str(pool): int(epoch) for pool, epoch in rows}
