"""Producer SDK: the manager's client API and the run-a-task helper."""

from mesh.backoff import Backoff
from mesh.producer.client import MeshClient, Submitted, TaskOutcome
from mesh.producer.retry import retry_delay_s, submit_delay_s

__all__ = ["Backoff", "MeshClient", "Submitted", "TaskOutcome", "retry_delay_s", "submit_delay_s"]
