"""Integration tests talk to a real RabbitMQ (see ``tests/conftest.py`` for where it comes from).

Every test collected under this directory is marked ``integration`` automatically, so
``pytest -m "not integration"`` runs only what needs no broker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.manager.service import ManagerService
from mesh.producer import MeshClient

from .harness import manager_settings, start_manager

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a sub-directory's conftest still see every collected item: filter by path.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
async def manager(amqp_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[ManagerService]:
    """A manager in this test's namespace, with the short test heartbeat rule and a journal in
    ``tmp_path / "journal.sqlite3"``."""
    service = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    )
    yield service
    await service.stop()


@pytest.fixture
async def client(
    amqp_url: str, namespace: str, manager: ManagerService, request: pytest.FixtureRequest
) -> AsyncIterator[MeshClient]:
    """A client of that manager, its connection named after the test."""
    mesh_client = await MeshClient.connect(
        amqp_url, namespace=namespace, name=f"client:{request.node.name}"[:100]
    )
    yield mesh_client
    await mesh_client.close()
