"""Producer SDK: the manager's client API and the run-a-task helper."""

from mesh.backoff import Backoff
from mesh.producer.client import MeshClient
from mesh.producer.retry import retry_delay_s, submit_delay_s
from mesh.producer.tasks import Submitted, TaskOutcome

__all__ = ["Backoff", "MeshClient", "Submitted", "TaskOutcome", "retry_delay_s", "submit_delay_s"]
