"""A clock that moves only when the test says so.

:class:`FakeClock` meets :class:`mesh.manager.clock.Clock` (``now() -> Instant``), so
``ManagerService(settings, clock=FakeClock())`` runs the manager on test time: heartbeat loss
and lease expiry happen when the test calls :meth:`FakeClock.advance`, never because the
machine was slow. :meth:`FakeClock.monotonic` is the same time as a plain ``() -> float``
function, the shape :class:`~mesh.testing.InMemoryBroker` takes for message and queue TTLs, so
one clock can drive both.
"""

from __future__ import annotations

from mesh.core.events import Instant

DEFAULT_WALL = 1_800_000_000.0
"""Where wall time starts by default (Unix seconds; January 2027): fixed, so logs repeat."""


class FakeClock:
    """Monotonic and wall time that advance together, only through :meth:`advance`."""

    def __init__(self, *, mono: float = 0.0, wall: float = DEFAULT_WALL) -> None:
        self._mono = mono
        self._wall = wall

    def now(self) -> Instant:
        """The current moment (what :class:`mesh.manager.clock.Clock` asks for)."""
        return Instant(self._mono, self._wall)

    def monotonic(self) -> float:
        """The monotonic reading alone, in seconds: pass ``clock.monotonic`` where a
        ``Callable[[], float]`` is wanted (``InMemoryBroker(clock=fake.monotonic)``)."""
        return self._mono

    def advance(self, seconds: float) -> Instant:
        """Move time forward by ``seconds`` (never backward) and return the new moment."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._mono += seconds
        self._wall += seconds
        return self.now()

    def __repr__(self) -> str:
        return f"FakeClock(mono={self._mono!r}, wall={self._wall!r})"
