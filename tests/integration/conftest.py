"""Integration tests talk to a real RabbitMQ (see ``tests/conftest.py`` for where it comes from).

Every test collected under this directory is marked ``integration`` automatically, so
``pytest -m "not integration"`` runs only what needs no broker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a sub-directory's conftest still see every collected item: filter by path.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
