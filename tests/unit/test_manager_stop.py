"""Stopping the manager waits for what its tick left running on the ledger thread before it
closes the connections that work uses (closing one under a running WAL checkpoint crashed the
test process with SIGSEGV once)."""

from __future__ import annotations

import asyncio
import threading
import time

from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.testing import FakeClock, InMemoryBroker, InMemoryTransport


class SlowJournal(SqliteJournal):
    """A journal whose checkpoint takes a while, on whatever thread calls it."""

    def __init__(self) -> None:
        super().__init__(":memory:")
        self.events: list[str] = []
        self.checkpointing = threading.Event()

    def maintain(self) -> None:
        self.checkpointing.set()
        time.sleep(0.3)
        self.events.append("checkpoint done")

    def close(self) -> None:
        self.events.append("closed")
        super().close()


async def test_stop_waits_for_a_checkpoint_the_cancelled_tick_left_running() -> None:
    journal = SlowJournal()
    manager = ManagerService(
        ManagerSettings(namespace="stop", tick_interval_s=0.01, ledger_url="sqlite::memory:"),
        transport=InMemoryTransport(InMemoryBroker(), "manager"),
        journal=journal,
        clock=FakeClock(),
    )
    await manager.start()
    await asyncio.to_thread(journal.checkpointing.wait, 5)  # a tick is in the checkpoint now

    await manager.stop()

    assert journal.events[:2] == ["checkpoint done", "closed"]
