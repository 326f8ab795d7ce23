"""A manager that cannot start says why, and only that: its HTTP port in use fails the start
before it consumes anything, what was started is stopped, and no "lost the broker" warning
comes first (the connection closing is its own doing)."""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

import pytest

from mesh.errors import MeshError
from mesh.manager.service import ManagerService

from .harness import manager_settings


async def test_a_busy_http_port_fails_the_start_with_that_error_alone(
    amqp_url: str, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        settings = dataclasses.replace(
            manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url),
            http_port=port,
            http_host="127.0.0.1",
        )
        manager = ManagerService(settings)
        with pytest.raises(MeshError, match="cannot listen"):
            await manager.start()

    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "lost the broker" in m], messages
    assert "manager stopped" in messages  # what it had started, it stopped
    assert manager.counters["received.mesh.status-request.v1"] == 0
    await manager.stop()  # a second stop (the caller's finally) does nothing
