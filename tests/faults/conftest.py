"""The fault suite (issue 7): the mesh under broker kills, frozen processes, network faults and
bad input, each test ending on the invariants of :mod:`tests.faults.accounting`.

Every test collected under this directory is marked ``faults`` (and ``integration``: they need
the real broker), so ``pytest -m faults`` runs the suite alone and ``pytest -m "not faults"``
everything else. Destructive broker tests never touch the shared broker on 5672: they start
their own node (:mod:`tests.faults.broker_node`) on its own ports and data directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Manager processes on a PostgreSQL ledger of the test's own (``managers``, ``pg_schema``,
# ``ledger``, ``producers``): the fixtures of the two-manager competition tests, shared here.
from integration.test_admission_competition import (  # noqa: F401 - fixtures, used by name
    ledger,
    managers,
    pg_schema,
    producers,
)

from .broker_node import BrokerNode, node_unavailable_reason

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def fault_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerNode]:
    """A RabbitMQ node of the suite's own (ports 5682/25682/15682), started once per session
    and left running between tests; the ``node`` fixture restarts it
    after a test that killed it."""
    reason = node_unavailable_reason()
    if reason is not None:
        pytest.fail(reason)  # never a skip: a fault suite that did not run is a red build
    node = BrokerNode(tmp_path_factory.mktemp("fault-broker"))
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def node(fault_broker: BrokerNode) -> Iterator[BrokerNode]:
    """The suite's node, up and without alarms when the test starts and when it ends. (Not
    ``broker``: that is the shared broker of ``tests/conftest.py``, which ``amqp_url`` and
    ``namespace``'s clean-up rest on.)"""
    fault_broker.ensure_running()
    yield fault_broker
    fault_broker.clear_alarms()
    fault_broker.ensure_running()
