"""Helpers for integration tests: a manager in-process, and a "raw" agent that speaks the
wire protocol by hand (what an agent in another language would do)."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mesh import constants as c
from mesh.core.pool import PoolSettings
from mesh.errors import MeshError
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.scaler.local import LocalProcessScaler, sample_command
from mesh.topology import Topology, names
from mesh.transport import AmqpTransport, Delivery
from mesh.wire import (
    AgentRegistration,
    Capability,
    Heartbeat,
    Message,
    ReRegisterRequest,
    decode,
    encode,
)

# Tests shorten the heartbeat rule (3 x 0.5 s) so loss is seen in seconds, not 30 s.
FAST_POOL = PoolSettings(min_heartbeat_interval_s=0.5, reregister_backoff_s=0.5)


def manager_settings(namespace: str, journal: Path, **overrides: Any) -> ManagerSettings:
    base: dict[str, Any] = {
        "namespace": namespace,
        "journal_path": journal,
        "ledger_url": f"sqlite:{journal.parent / 'ledger.sqlite3'}",
        "manager_id": f"test-{namespace}",
        "tick_interval_s": 0.2,
        "pool": FAST_POOL,
    }
    base.update(overrides)
    # The tests' broker user is the operator: tests drain agents and publish descriptors
    # with it (a test of who may do that makes a user of its own).
    base.setdefault(
        "operator_user", urllib.parse.urlsplit(base.get("amqp_url", "")).username or "guest"
    )
    return ManagerSettings(**base)


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    timeout_s: float = 15.0,
    what: str = "condition",
    poll_s: float = 0.1,
) -> None:
    """Poll ``check`` every ``poll_s`` until it is true; fail with ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)


def echo_capability(version: str = "1.0.0", max_concurrency: int = 2) -> Capability:
    return offered("test.echo", version, max_concurrency)


def offered(name: str, version: str, max_concurrency: int) -> Capability:
    """A capability as an agent offers it (any object in, any object out)."""
    return Capability(
        name=name,
        version=version,
        input_schema={"type": "object"},
        output_schema={"type": "object"},
        max_concurrency=max_concurrency,
        cost_class="C",
    )


class RawAgent:
    """Registers and heartbeats by publishing wire messages; records what the manager says."""

    def __init__(
        self,
        transport: AmqpTransport,
        topology: Topology,
        agent_id: str,
        *,
        interval_s: float = 0.5,
        capabilities: list[Capability] | None = None,
        deployment: str = "raw",
        user_id: str | None = None,
        features: list[str] | None = None,
        answers_reregister: bool = False,
    ) -> None:
        self.transport = transport
        self.topology = topology
        self.agent_id = agent_id
        self.incarnation = uuid.uuid4().hex
        self.interval_s = interval_s
        self.deployment = deployment
        self.capabilities = capabilities or [echo_capability()]
        self.inbox: list[Message] = []
        self.seq = 0
        self.user_id = user_id  # signs registrations and heartbeats (RabbitMQ validates it)
        # By default it does not report pool work (no ``work-reports``): its drains complete
        # on its leases alone.
        self.features = [c.FEATURE_DESCRIPTOR_EPOCHS] if features is None else features
        self._beating: asyncio.Task[None] | None = None
        self.answers_reregister = answers_reregister  # registers again when asked to
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.transport.declare(self.topology.agent(self.agent_id, 8))
        await self.transport.consume(
            self.topology.agent_control_queue(self.agent_id), self._on_control, no_ack=True
        )

    async def _on_control(self, delivery: Delivery) -> None:
        message = decode(delivery.body)
        self.inbox.append(message)
        if self.answers_reregister and isinstance(message, ReRegisterRequest):
            task = asyncio.create_task(self.register())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def received(self, cls: type[Message]) -> list[Message]:
        return [m for m in self.inbox if isinstance(m, cls)]

    async def register(self) -> None:
        reg = AgentRegistration(
            agent_id=self.agent_id,
            incarnation=self.incarnation,
            deployment=self.deployment,
            capabilities=self.capabilities,
            heartbeat_interval_s=self.interval_s,
            features=self.features,
        )
        await self.publish_announce("register", encode(reg))

    async def publish_announce(self, verb: str, body: bytes) -> None:
        await self.transport.publish(
            self.topology.announce_exchange,
            names.agent_announce_key(self.agent_id, verb),
            body,
            user_id=self.user_id,
        )

    async def heartbeat(self) -> None:
        self.seq += 1
        hb = Heartbeat(
            agent_id=self.agent_id,
            incarnation=self.incarnation,
            seq=self.seq,
            sent_at=time.time(),
        )
        await self.transport.publish_fast(
            self.topology.heartbeat_exchange,
            names.heartbeat_key(self.agent_id),
            encode(hb),
            user_id=self.user_id,
        )

    def start_heartbeats(self) -> None:
        async def beat() -> None:
            while True:
                try:
                    await self.heartbeat()
                except MeshError:  # the transport closed under it: the test is over
                    return
                await asyncio.sleep(self.interval_s)

        self._beating = asyncio.create_task(beat())

    async def stop_heartbeats(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
            self._beating = None


async def live_member(
    manager: ManagerService,
    transport: AmqpTransport,
    agent_id: str,
    pool: str,
    capability: Capability,
) -> RawAgent:
    """A registered, heartbeating agent of ``pool`` offering ``capability``: live capacity
    for admission tests whose subject is not the agents (it registers again after a manager
    restart, and takes no task: what is granted to it stays in the pool's queue)."""
    agent = RawAgent(
        transport,
        manager.topology,
        agent_id,
        deployment=pool,
        capabilities=[capability],
        answers_reregister=True,
    )
    await agent.start()
    await agent.register()
    agent.start_heartbeats()
    await eventually(
        lambda: agent_id in manager.core.agents, what=f"{agent_id} registered in pool {pool}"
    )
    return agent


def management_url(management_api: Any, amqp_url: str) -> str:
    """The management API's URL with the broker user's credentials in it (as the manager's
    ``--management-url`` and ``mesh broker`` take it)."""
    parts = urllib.parse.urlsplit(amqp_url)
    credentials = f"{parts.username or 'guest'}:{parts.password or 'guest'}"
    api = urllib.parse.urlsplit(management_api.base_url)
    return api._replace(netloc=f"{credentials}@{api.netloc}").geturl()


async def start_manager(settings: ManagerSettings) -> ManagerService:
    manager = ManagerService(settings)
    await manager.start()
    return manager


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_agent_scaler(
    namespace: str,
    amqp_url: str,
    log_dir: Path,
    *,
    heartbeat_s: float,
    drain_timeout_s: float,
    termination_grace_s: float,
) -> tuple[LocalProcessScaler, dict[str, int]]:
    """A local scaler of ``mesh agent`` processes that each serve ``/ready`` on a free port
    of their own, and the port of each agent it starts (filled in as it starts them)."""
    ports: dict[str, int] = {}
    extra = ["--drain-timeout", str(drain_timeout_s)]
    sample = sample_command(namespace, amqp_url, heartbeat_s, extra_args=extra)

    def command_for(deployment: str, agent_id: str) -> list[str]:
        ports[agent_id] = free_port()
        http = ["--http-host", "127.0.0.1", "--http-port", str(ports[agent_id])]
        return [*sample(deployment, agent_id), *http]

    scaler = LocalProcessScaler(
        command_for,
        log_dir=log_dir,
        env={"MESH_LOG_FORMAT": "text"},
        termination_grace_s=termination_grace_s,
    )
    return scaler, ports
