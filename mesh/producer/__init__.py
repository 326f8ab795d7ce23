"""Producer SDK: the manager's client API and the run-a-task helper."""

from mesh.producer.client import MeshClient, TaskOutcome

__all__ = ["MeshClient", "TaskOutcome"]
