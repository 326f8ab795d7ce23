"""What every fault test counts, and the invariants it ends on.

A test publishes work under business IDs (a task ID, an admission ID) through
:meth:`Tally.publish`, which files each attempt under exactly one outcome:

* **confirmed** — the broker confirmed it (it is the broker's now);
* **nacked** — the broker refused it, or returned it as unroutable (it is not the broker's);
* **unknown** — no answer within the publish timeout, or the connection broke mid-publish
  (it may or may not be enqueued: a producer retries it under the same business ID).

Consumers report every delivery (:meth:`Tally.delivered`, redeliveries included), every
applied effect (:meth:`Tally.applied`: an ID is *consumed* once its effect is applied) and
every dead-lettered message (:meth:`Tally.dead_lettered`). At the end :meth:`Tally.check`
asserts:

* ``confirmed + nacked + unknown == attempted`` (every attempt has exactly one outcome);
* **lost = 0**: every confirmed ID was consumed (its effect applied) or dead-lettered;
* **unexpected = 0**: nothing consumed that was never published, nor anything whose every
  attempt was refused;
* **at most one effect per ID** (redeliveries are fine; applying one twice is not).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mesh.errors import PublishNacked, PublishTimeout, PublishUnroutable, TransportError


@dataclass
class Tally:
    attempted: int = 0
    confirmed: int = 0
    nacked: int = 0
    unknown: int = 0
    confirmed_ids: set[str] = field(default_factory=set)
    nacked_ids: set[str] = field(default_factory=set)
    unknown_ids: set[str] = field(default_factory=set)
    deliveries: Counter[str] = field(default_factory=Counter)  # redeliveries included
    dead: dict[str, str] = field(default_factory=dict)  # ID -> reason
    effects: Counter[str] = field(default_factory=Counter)
    slowest_publish_s: float = 0.0

    async def publish(self, business_id: str, attempt: Callable[[], Awaitable[None]]) -> str:
        """Run one publish attempt and file its outcome; returns it."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.attempted += 1
        try:
            await attempt()
        except (PublishNacked, PublishUnroutable):
            outcome = "nacked"
        except (PublishTimeout, TransportError):  # BrokerUnavailable is a TransportError
            outcome = "unknown"
        else:
            outcome = "confirmed"
        finally:
            self.slowest_publish_s = max(self.slowest_publish_s, loop.time() - started)
        if outcome == "confirmed":
            self.confirmed += 1
            self.confirmed_ids.add(business_id)
        elif outcome == "nacked":
            self.nacked += 1
            self.nacked_ids.add(business_id)
        else:
            self.unknown += 1
            self.unknown_ids.add(business_id)
        return outcome

    def delivered(self, business_id: str) -> None:
        self.deliveries[business_id] += 1

    def dead_lettered(self, business_id: str, reason: str) -> None:
        self.dead[business_id] = reason

    def applied(self, business_id: str) -> bool:
        """Apply an effect once: True the first time for this ID (the caller applies it)."""
        self.effects[business_id] += 1
        return self.effects[business_id] == 1

    # ---- the invariants --------------------------------------------------------------------
    @property
    def lost(self) -> set[str]:
        return self.confirmed_ids - set(self.effects) - set(self.dead)

    @property
    def unexpected(self) -> set[str]:
        seen = set(self.deliveries) | set(self.effects) | set(self.dead)
        return seen - self.confirmed_ids - self.unknown_ids

    @property
    def applied_twice(self) -> dict[str, int]:
        return {key: n for key, n in self.effects.items() if n > 1}

    def report(self) -> str:
        redelivered = sum(n - 1 for n in self.deliveries.values())
        return (
            f"attempted {self.attempted}: confirmed {self.confirmed}, nacked/returned "
            f"{self.nacked}, unknown {self.unknown}; consumed {len(self.effects)} unique "
            f"({sum(self.deliveries.values())} deliveries, {redelivered} of them again), "
            f"dead-lettered {len(self.dead)}, effects "
            f"{sum(self.effects.values())}; lost {len(self.lost)}, "
            f"unexpected {len(self.unexpected)}; slowest publish {self.slowest_publish_s:.2f} s"
        )

    def check(self) -> None:
        print(self.report())  # in the test's captured output: the counts behind a pass
        assert self.confirmed + self.nacked + self.unknown == self.attempted, self.report()
        assert not self.lost, f"lost: {sorted(self.lost)[:20]} ({self.report()})"
        assert not self.unexpected, f"unexpected: {sorted(self.unexpected)[:20]}"
        assert not self.applied_twice, f"applied more than once: {self.applied_twice}"
