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
_COST_RANK = {cost: n for n, cost in enumerate(COST_CLASSES)}
_UNKNOWN_COST = len(COST_CLASSES)  # a pool whose agents' cost class is not known: after C

Rank = tuple[int, float]


def rank(cost_class: str | None, load: float) -> Rank:
    """A sort key, lowest first: cost class A < B < C < unknown, then ``load`` ascending."""
    return (_COST_RANK.get(cost_class, _UNKNOWN_COST) if cost_class else _UNKNOWN_COST, load)


def cheapest(cost_classes: list[str]) -> str | None:
    """The cost class that ranks first among ``cost_classes`` (``None`` for none)."""
    return min(cost_classes, key=lambda c: rank(c, 0.0), default=None)
