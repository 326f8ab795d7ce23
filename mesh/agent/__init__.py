"""Agent SDK: declare capabilities on an :class:`Agent`, run it with :class:`AgentRuntime`.

A minimal agent::

    class Upper(Agent):
        deployment = "upper"

        @capability("text.upper", version="1.0.0",
                    input_schema={...}, output_schema={...}, max_concurrency=4)
        async def upper(self, payload: dict[str, Any]) -> dict[str, Any]:
            return {"text": payload["text"].upper()}

    await run_agent(Upper(), AgentSettings(), stop_event)

The runtime registers the agent and waits for the manager's acceptance,
heartbeats, validates every payload and result against the capability's
schemas, and drains gracefully. With ``AgentSettings(http_port=...)`` it serves
``/ready``, ``/healthz`` and ``/drain`` (:class:`AgentHttpServer`) for Kubernetes probes
and the preStop hook. :func:`process_task` is the per-task logic on
its own, for tests without a broker. Inside a handler, :func:`current_task` gives the task's
deadline and allowed degradations, and records a degradation applied (``TaskResult.degradations``).
"""

from mesh.agent.base import Agent, BoundCapability, CapabilitySpec, capability
from mesh.agent.context import DegradationNotAllowed, TaskContext, current_task
from mesh.agent.effects import EffectOutcomeUnknown, once
from mesh.agent.errors import RegistrationRefusedError, RegistrationTimeoutError
from mesh.agent.http import AgentHttpServer, HttpServerError
from mesh.agent.processing import process_task
from mesh.agent.runtime import AgentRuntime, run_agent
from mesh.agent.settings import AgentSettings, backoff_delay
from mesh.transport.ports import Transport as AgentTransport

__all__ = [
    "Agent",
    "AgentHttpServer",
    "AgentRuntime",
    "AgentSettings",
    "AgentTransport",
    "BoundCapability",
    "CapabilitySpec",
    "DegradationNotAllowed",
    "EffectOutcomeUnknown",
    "HttpServerError",
    "RegistrationRefusedError",
    "RegistrationTimeoutError",
    "TaskContext",
    "backoff_delay",
    "capability",
    "current_task",
    "once",
    "process_task",
    "run_agent",
]
