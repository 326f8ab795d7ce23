"""Test without a broker: an in-memory RabbitMQ stand-in and a clock that moves on command.

Run your agent, the real manager and a client in one event loop::

    from mesh.agent import AgentRuntime, AgentSettings
    from mesh.manager.journal import SqliteJournal
    from mesh.manager.service import ManagerService
    from mesh.manager.settings import ManagerSettings
    from mesh.producer import MeshClient
    from mesh.testing import FakeClock, InMemoryBroker, InMemoryTransport

    broker = InMemoryBroker()
    manager = ManagerService(
        ManagerSettings(namespace="test", ledger_url="sqlite::memory:", operator_user="ops"),
        transport=InMemoryTransport(broker, "manager"),
        journal=SqliteJournal(":memory:"),
        clock=FakeClock(),
    )
    await manager.start()
    runtime = AgentRuntime(MyAgent("my-1"), AgentSettings(namespace="test"),
                           InMemoryTransport(broker, "my-1"))
    await runtime.start()
    client = await MeshClient.connect(namespace="test", user_id="ops",  # may drain, too
                                      transport=InMemoryTransport(broker, "client"))
    outcome = await client.run_task("my.capability", {...})
    await client.drain("my-1")

:mod:`mesh.testing.memory` lists where the in-memory broker differs from RabbitMQ. The
project's own integration tests run against a real broker; ``tests/integration/
test_transport_contract.py`` runs one behavioural suite against both to keep this one honest.
"""

from mesh.testing.amqp_rules import topic_matches
from mesh.testing.broker import InMemoryBroker, InMemoryConsumer
from mesh.testing.broker_errors import (
    AccessRefused,
    BrokerRefused,
    DeliverySettleError,
    NotFound,
    PreconditionFailed,
    ResourceLocked,
    TransportClosed,
)
from mesh.testing.broker_state import QueuedMessage, QueueInfo
from mesh.testing.clock import FakeClock
from mesh.testing.memory import InMemoryTransport

__all__ = [
    "AccessRefused",
    "BrokerRefused",
    "DeliverySettleError",
    "FakeClock",
    "InMemoryBroker",
    "InMemoryConsumer",
    "InMemoryTransport",
    "NotFound",
    "PreconditionFailed",
    "QueueInfo",
    "QueuedMessage",
    "ResourceLocked",
    "TransportClosed",
    "topic_matches",
]
