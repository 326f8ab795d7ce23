"""agent-mesh: a control plane for fleets of AI agents that talk over RabbitMQ.

Packages: :mod:`mesh.wire` (the wire contract), :mod:`mesh.topology`,
:mod:`mesh.core` (the sans-I/O manager brain), :mod:`mesh.transport`
(aio-pika), :mod:`mesh.manager`, :mod:`mesh.agent` (agent SDK),
:mod:`mesh.producer` (client API and producer helper).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
