"""How an agent runtime connects, registers and drains (:class:`AgentSettings`), who it is on
the wire (:class:`Identity`), and the one backoff its retries use."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mesh import constants as c
from mesh.backoff import Backoff
from mesh.logs import checked


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How an agent runtime connects, registers and drains."""

    amqp_url: str = c.DEFAULT_AMQP_URL
    namespace: str = c.DEFAULT_NAMESPACE
    registration_timeout_s: float = 5.0
    """How long one registration attempt waits for the manager's answer."""
    registration_backoff_cap_s: float = 10.0
    """The longest pause between registration attempts."""
    max_registration_attempts: int | None = None
    """Give up with :class:`RegistrationTimeoutError` after this many attempts (None: never)."""
    drain_timeout_s: float = 60.0
    """The longest wait for the manager's ``DrainComplete`` (and the task queue to empty)."""
    stop_timeout_s: float = 5.0
    """``drain_timeout_s`` for :meth:`AgentRuntime.stop`, which is a drain in a hurry."""
    shutdown_grace_s: float = 30.0
    """After the drain, how long in-flight tasks may still run before they are cancelled."""
    publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S
    result_publish_attempts: int = 3
    """Attempts to publish a result whose outcome was unknown before the task is requeued."""
    connect_timeout_s: float = 10.0
    http_host: str = "0.0.0.0"
    http_port: int | None = None
    """Serve ``/ready``, ``/healthz`` and ``/drain`` on this port (0: any free one; None: no)."""
    http_drain_deadline_s: float | None = None
    """When ``/drain`` answers at the latest (None: ``drain_timeout_s + shutdown_grace_s - 2``)."""
    lease_public_keys: tuple[Path, ...] = ()
    """The managers' lease public keys (``<lease key>.pub``). Set: every granted task must
    carry a valid invocation lease for its admission, checked at claim and before the result,
    and a result goes out at most once per lease (:mod:`mesh.leases`). Empty: not checked."""
    self_fence_after_s: float | None = None
    """A gap this long between two of our heartbeats fences out the tasks claimed before it
    (see the module doc). None: ``MISSED_HEARTBEATS_BEFORE_LOST`` intervals less half of one,
    matching a manager with the default rule; set it below a manager's own rule."""
    shared_topology: Literal["declare", "check"] = "declare"
    """``declare``: declare the namespace's shared exchanges (idempotent; needs configure
    permission on them). ``check``: only check they exist (passive declares) and declare
    nothing but the agent's own queues — for an agent whose broker user has exactly its own
    permissions (``mesh broker add-agent``; docs/security.md). Then the manager must have
    declared the topology first, else start fails with :class:`mesh.errors.TopologyMissing`."""
    liveness_probe_s: float | None = None
    """Probe the broker this often and reconnect when it stops answering (None: off). A
    handler that blocks the event loop for this long would be taken for a dead broker:
    keep it well above the longest synchronous stretch of your handlers."""
    open_tasks: bool = False
    """Run tasks that carry neither a grant nor a lease the manager issued to this agent — for
    a mesh without admission and leases (development). Off: such tasks are refused
    ``NOT_AUTHORIZED`` and dead-lettered (see the module doc; docs/security.md)."""
    manager_user: str | None = None
    """The managers' broker user. Control messages — answers to a registration, drain
    notices, requests to register again, lease notices, events — are taken only with this
    RabbitMQ-validated ``user_id`` (others are dead-lettered ``NOT_AUTHORIZED`` and counted:
    ``control_not_from_manager``), so a broker user that may publish to the agents or events
    exchange cannot drain an agent or make it drop its leases. None: the user that signed
    the acceptance of this agent's first registration (answering the incarnation it had just
    sent); if that acceptance is unsigned (an older manager), nothing is checked."""
    lease_notice_wait_s: float = 2.0
    """How long a lease-path task waits for the manager's word on its lease: the notice (sent
    before the producer gets the lease, so only a reordering makes one wait) or, from 0.25 s
    on, its answer to a ``LeaseStateRequest`` (a notice lost, e.g. just after a broker
    restart)."""


def backoff_delay(
    attempt: int, *, rng: random.Random, base_s: float = 0.5, cap_s: float = 10.0
) -> float:
    """The agent's retries (registration, result publishes): :mod:`mesh.backoff` with equal
    jitter — half of each step fixed and half random, so retries spread out but never
    collapse to 0."""
    return Backoff(base_s, cap_s, spread=0.5).delay_s(attempt, rng.random)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this runtime is on the wire: the agent, this process's incarnation, and the broker
    user it signs what it says about itself with (``None``: a transport handed in signs
    nothing)."""

    agent_id: str
    deployment: str
    incarnation: str
    user_id: str | None

    def extra(self, **more: Any) -> dict[str, Any]:
        """Log fields: the agent's identity and ``more`` (refused at once if reserved)."""
        return checked({"agent_id": self.agent_id, "incarnation": self.incarnation, **more})
