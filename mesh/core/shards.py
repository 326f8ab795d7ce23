"""Which shard a pool belongs to, and which manager should own each shard.

How it works. With several managers, the registry is split into ``shard_count`` shards by
pool (docs/architecture.md, "Several managers"). A pool's shard is a pure function of its
name, the same in every language: CRC-32 (ISO-HDLC, as ``zlib.crc32`` and every CRC library
compute it) of the pool ID's UTF-8 bytes, modulo the shard count. An agent computes it to
route its announcements; a manager to know what it owns.

Ownership itself lives in a lease table (:mod:`mesh.ledger.shard_leases`). This module only
says who *should* own what: :func:`balanced_owners` is a deterministic function of the live
managers and the current owners, so every manager that reads the same lease table computes the
same target and acts only on its own part of it — it takes the free shards targeted to it and
gives back the ones targeted elsewhere. No manager decides for another, and no two can both
take a shard: taking one is a conditional write on its lease.

The target is balanced — each live manager gets ``shard_count // managers`` shards or one more —
and moves as little as possible: a manager keeps the shards it owns up to its share, and only
the surplus and the shards of managers that are gone change hands. Which managers get the
extra shard of an uneven split is decided by ID order, so it is the same everywhere.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mesh.ledger.shared_live import MAX_SHARDS as MAX_SHARDS  # checked by the lease store too
from mesh.ledger.shared_live import check_shard_count as check_shard_count


def shard_of(pool_id: str, shard_count: int) -> int:
    """The shard of ``pool_id``: CRC-32 of its UTF-8 bytes modulo ``shard_count``."""
    return zlib.crc32(pool_id.encode()) % check_shard_count(shard_count)


def balanced_owners(
    shard_count: int, live_managers: Sequence[str], owners: Mapping[int, str | None]
) -> dict[int, str]:
    """The owner each shard should have: balanced over ``live_managers``, keeping today's
    owners (``owners``: shard → its live lease holder, or ``None``) where the balance allows.

    Empty when no manager is live. Pure and deterministic: the same inputs give the same
    answer in every manager."""
    check_shard_count(shard_count)
    managers = sorted(set(live_managers))
    if not managers:
        return {}
    base, extra = divmod(shard_count, len(managers))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(managers)}
    target: dict[int, str] = {}
    for shard in range(shard_count):  # keep what live managers own, up to their quota
        owner = owners.get(shard)
        if owner in quota and quota[owner] > 0:
            target[shard] = owner
            quota[owner] -= 1
    wanting = iter([m for m in managers for _ in range(quota[m])])
    for shard in range(shard_count):  # the rest, in shard order, to whoever is below quota
        if shard not in target:
            target[shard] = next(wanting)
    return target


@dataclass(frozen=True, slots=True)
class ShardMoves:
    """What one manager should do to reach the balanced target."""

    take: tuple[int, ...]  # targeted to it and free (no live holder): take their leases
    give_back: tuple[int, ...]  # it holds them, the target names another: release them
    wait_for: tuple[int, ...]  # targeted to it, still held by another: that one gives back


def moves_for(
    manager_id: str,
    shard_count: int,
    live_managers: Sequence[str],
    owners: Mapping[int, str | None],
) -> ShardMoves:
    """:func:`balanced_owners`, seen from ``manager_id``."""
    target = balanced_owners(shard_count, [*live_managers, manager_id], owners)
    take, give_back, wait_for = [], [], []
    for shard in range(shard_count):
        holder, wanted = owners.get(shard), target[shard]
        if wanted == manager_id and holder is None:
            take.append(shard)
        elif wanted == manager_id and holder != manager_id:
            wait_for.append(shard)
        elif holder == manager_id and wanted != manager_id:
            give_back.append(shard)
    return ShardMoves(tuple(take), tuple(give_back), tuple(wait_for))


@dataclass(slots=True)
class ShardKeeper:
    """What one manager holds (shard → fence), and what it should do next.

    Fed with what the lease table answered: :meth:`renewed` with the leases a renewal kept
    (any other it held is lost — it must stop acting on those at once), :meth:`plan` with a
    fresh read of the table, :meth:`took` and :meth:`gave_back` with the outcome of each move.
    """

    manager_id: str
    shard_count: int
    held: dict[int, int]

    @classmethod
    def new(cls, manager_id: str, shard_count: int) -> ShardKeeper:
        return cls(manager_id, check_shard_count(shard_count), {})

    def renewed(self, kept: Mapping[int, int]) -> tuple[int, ...]:
        """The shards lost since the last renewal (held, not kept), forgotten from now on."""
        lost = tuple(s for s in sorted(self.held) if kept.get(s) != self.held[s])
        for shard in lost:
            del self.held[shard]
        return lost

    def plan(self, live_managers: Sequence[str], owners: Mapping[int, str | None]) -> ShardMoves:
        """The moves toward the balanced target, from a read of the lease table."""
        return moves_for(self.manager_id, self.shard_count, live_managers, owners)

    def took(self, shard: int, fence: int) -> None:
        self.held[shard] = fence

    def gave_back(self, shard: int) -> None:
        self.held.pop(shard, None)

    def owns(self, shard: int) -> bool:
        return shard in self.held
