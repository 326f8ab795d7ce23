"""A three-node RabbitMQ cluster of the fault suite's own, from the installed server: three
:class:`~tests.faults.broker_node.BrokerNode` processes with their own names, ports and data
directories, one Erlang cookie, the second and third joined to the first
(``stop_app; reset; join_cluster; start_app``, as an operator does). About 3 x 150 MB.

==================  ============  ==============  ============
node                AMQP          management      distribution
==================  ============  ==============  ============
``mesh-c1@localhost``  ``5692``   ``15692``       ``25692``
``mesh-c2@localhost``  ``5693``   ``15693``       ``25693``
``mesh-c3@localhost``  ``5694``   ``15694``       ``25694``
==================  ============  ==============  ============

A node killed with ``kill -9`` and started again rejoins the cluster by itself (it remembers
its peers in its data directory), as in production.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .broker_node import BrokerNode

NODES = (
    ("mesh-c1@localhost", 5692, 15692, 25692),
    ("mesh-c2@localhost", 5693, 15693, 25693),
    ("mesh-c3@localhost", 5694, 15694, 25694),
)


class BrokerCluster:
    """Three joined nodes (see the module docstring)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            BrokerNode(
                workdir / name.split("@")[0],
                node_name=name,
                amqp_port=amqp,
                management_port=management,
                dist_port=dist,
            )
            for name, amqp, management, dist in NODES
        ]

    @property
    def amqp_urls(self) -> str:
        """Every node's URL, comma-separated: what the mesh's processes are given."""
        return ",".join(node.amqp_url for node in self.nodes)

    def start(self) -> float:
        """Start the three nodes and join the second and third to the first; the seconds it
        took."""
        started = time.monotonic()
        for node in self.nodes:
            node.start()
        first = self.nodes[0]
        for node in self.nodes[1:]:
            if first.node_name in self.running_nodes(node):
                continue  # joined already (a data directory of an earlier start)
            node.ctl("stop_app")
            node.ctl("reset")
            node.ctl("join_cluster", first.node_name)
            node.ctl("start_app")
            node._wait(lambda n=node: n.running, "the joined node to accept AMQP connections")
        self.wait_until_whole()
        return time.monotonic() - started

    def running_nodes(self, via: BrokerNode) -> set[str]:
        """The running nodes as ``via`` sees the cluster (``rabbitmqctl cluster_status``)."""
        status: dict[str, Any] = json.loads(via.ctl("cluster_status", "--formatter", "json"))
        return set(status.get("running_nodes", []))

    def queues(self) -> list[dict[str, Any]]:
        """Every queue as a running node lists it (depth, consumers, leader and members): what
        a failing test prints, to tell a full queue from one nobody consumes."""
        columns = ("name", "type", "messages", "messages_ready", "messages_unacknowledged")
        columns += ("consumers", "leader", "members")
        for node in self.nodes:
            if node.running:
                return list(json.loads(node.ctl("list_queues", *columns, "--formatter", "json")))
        return []

    def wait_until_whole(self, timeout_s: float = 90.0) -> None:
        """Until every node runs and sees the other two."""
        names = {node.node_name for node in self.nodes}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(n.running and self.running_nodes(n) == names for n in self.nodes):
                    return
            except AssertionError:
                pass  # rabbitmqctl on a node that is still starting
            if time.monotonic() > deadline:
                raise AssertionError("the cluster did not become whole again")
            time.sleep(0.5)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
