"""One manager in its own OS process, for tests that race or kill managers.

Run as ``python manager_process.py CONFIG_JSON`` (not a test module; pytest does not collect
it). CONFIG_JSON holds ``amqp_url``, ``namespace``, ``manager_id``, ``journal_path``, ``dsn``,
``schema``, ``active_generation``, ``grant_ttl_s`` and ``operator_user``.

The manager is a plain :class:`~mesh.manager.service.ManagerService`; the only thing this
script adds is the ledger, a :class:`~mesh.ledger.PostgresLedger` in the test's own schema
(``ManagerSettings.ledger_url`` has no way to name a schema), and an ``on_log`` hook that
prints every journal entry as one JSON line on stdout, so the test sees which process
accepted a descriptor and which decided each admission::

    {"event": "ready", "manager_id": "m-a", "pid": 1234}
    {"event": "log", "manager_id": "m-a", "kind": "admission", "agent_id": "", "detail": {...}}
    {"event": "stopped", "manager_id": "m-a"}

SIGTERM or SIGINT stops it cleanly; SIGKILL is what the crash tests send.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from mesh.core.pool import PoolSettings
from mesh.ledger import PostgresLedger
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.wire import OrchestrationEvent


def emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line, sort_keys=True) + "\n")
    sys.stdout.flush()


async def main(config: dict[str, Any]) -> None:
    manager_id = config["manager_id"]
    settings = ManagerSettings(
        amqp_url=config["amqp_url"],
        namespace=config["namespace"],
        journal_path=Path(config["journal_path"]),
        manager_id=manager_id,
        tick_interval_s=0.2,
        pool=PoolSettings(min_heartbeat_interval_s=0.5, reregister_backoff_s=0.5),
        ledger_url=config["dsn"],  # informative only: the ledger below is passed in
        admission=AdmissionPolicy(
            active_generation=config["active_generation"], grant_ttl_s=config["grant_ttl_s"]
        ),
        operator_user=config["operator_user"],
        # Several managers share the ledger and each sees only the agents that registered
        # with it (the registry is not sharded yet), so the descriptors alone bound admission.
        admission_capacity="descriptor",
    )
    ledger = PostgresLedger(config["dsn"], schema=config["schema"], application_name=manager_id)

    def on_log(event: OrchestrationEvent) -> None:
        emit(
            {
                "event": "log",
                "manager_id": manager_id,
                "kind": event.kind,
                "agent_id": event.agent_id,
                "reason": event.reason,
                "detail": event.detail,
            }
        )

    service = ManagerService(settings, ledger=ledger, on_log=on_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    emit({"event": "ready", "manager_id": manager_id, "pid": os.getpid()})
    try:
        await stop.wait()
    finally:
        await service.stop()
        ledger.close()  # the service does not close a ledger it was given
        emit({"event": "stopped", "manager_id": manager_id})


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
