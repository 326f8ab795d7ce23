"""The one preference order: which agent ``find`` returns first, and which pool admission tries
first.

Both paths rank candidates by :func:`rank`: the cheapest cost class first, then the least
loaded. For an agent the load is its in-flight count on the capability (the one count of work);
for a pool it is the share of its model slots in use. Changing the order means changing this
function (and its test): the capability index buckets agents by their rank and walks the
buckets in ascending order, and the admitter sorts eligible pools by it.
"""

from __future__ import annotations

COST_CLASSES = ("A", "B", "C")
_CLASS_STEP = 1e9  # above any load: an agent's in-flight count, a pool's share in use
# Cost class -> the start of its range of ranks; unknown (a pool whose agents' cost class is
# not known) after C.
_COST_BASE = {cost: n * _CLASS_STEP for n, cost in enumerate(COST_CLASSES)}
_UNKNOWN_COST = len(COST_CLASSES) * _CLASS_STEP

Rank = float
"""One number, lowest first: the capability index keys its buckets by it and sorts them on
every ``find``, which a float does faster than a tuple."""


def rank(cost_class: str | None, load: float) -> Rank:
    """A sort key, lowest first: cost class A < B < C < unknown, then ``load`` ascending."""
    return _COST_BASE.get(cost_class or "", _UNKNOWN_COST) + load


def cheapest(cost_classes: list[str]) -> str | None:
    """The cost class that ranks first among ``cost_classes`` (``None`` for none)."""
    return min(cost_classes, key=lambda c: rank(c, 0.0), default=None)
