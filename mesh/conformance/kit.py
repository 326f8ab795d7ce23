"""The kit: a manager in a namespace of its own, the agent command run as a process, and a
watch on what the agent publishes; what every check is given (:class:`Kit`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mesh import constants as c
from mesh.core.pool import PoolSettings
from mesh.errors import MeshError
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.topology import names
from mesh.topology.specs import BindingSpec, Declarations, QueueArguments, QueueSpec, Topology
from mesh.transport import AmqpTransport, Delivery
from mesh.transport.addresses import first_url
from mesh.wire import (
    AgentRegistration,
    CapabilityRange,
    Heartbeat,
    TaskRequirements,
    decode,
)
from mesh.wire.admission import CapabilityDescriptor, local_descriptor
from mesh.wire.models import AdmissionGrant, Lease, Task, TaskResult

HEARTBEAT_S = 5.0  # what the agent is told to use: the least the protocol allows
BELOW_MINIMUM_S = 1.0  # what the "refuses a short interval" check tells it
START_TIMEOUT_S = 30.0
UNANSWERED_S = 3.0  # how long the first registration goes unanswered (no manager yet)
ANSWER_TIMEOUT_S = 15.0
# How soon after its pool queue is back an agent must consume it again (the SDK looks at
# doubling intervals up to 5 s).
POOL_BACK_S = 10.0


@dataclass(frozen=True)
class KitSettings:
    """What ``mesh conformance`` is told."""

    agent_cmd: str
    amqp_url: str = c.DEFAULT_AMQP_URL
    pool: str = "echo"
    capability: str = "test.echo"
    payload: dict[str, Any] = field(default_factory=lambda: {"message": "conformance"})
    invalid_payload: dict[str, Any] = field(default_factory=lambda: {"message": 42})
    slow_payload: dict[str, Any] = field(
        default_factory=lambda: {"message": "slow", "sleep_ms": 1500}
    )
    namespace: str = ""  # "": a fresh one per run
    work_dir: Path | None = None  # None: a temporary directory
    only: tuple[str, ...] = ()  # check keys (CHECK_KEYS) to run; "register" always runs


@dataclass
class CheckResult:
    key: str
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  [{self.key}] {self.name}: {self.detail}"


class CheckFailed(Exception):
    """A check saw something the protocol does not allow (the message says what)."""


def expect(condition: bool, why: str) -> None:
    if not condition:
        raise CheckFailed(why)


# ---- watching the agent -------------------------------------------------------------------------
class Watch:
    """The registrations and heartbeats the agent publishes, read from a queue of the kit's
    own bound next to the manager's (what does not decode is kept as ``undecodable``)."""

    def __init__(self) -> None:
        self.registrations: list[AgentRegistration] = []
        self.heartbeats: list[tuple[float, Heartbeat]] = []  # (received, heartbeat)
        self.undecodable: list[str] = []
        self.changed = asyncio.Event()

    async def on_message(self, delivery: Delivery) -> None:
        try:
            message = decode(delivery.body)
        except MeshError as exc:
            self.undecodable.append(str(exc))
            return
        if isinstance(message, AgentRegistration):
            self.registrations.append(message)
        elif isinstance(message, Heartbeat):
            self.heartbeats.append((time.monotonic(), message))
        self.changed.set()

    async def until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckFailed(f"no {what} within {timeout_s:g} s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.5))

    async def until_async(
        self, check: Callable[[], Awaitable[bool]], timeout_s: float, what: str
    ) -> None:
        """:meth:`until` for a check that asks the broker (polled every 0.2 s)."""
        deadline = time.monotonic() + timeout_s
        while not await check():
            if time.monotonic() >= deadline:
                raise CheckFailed(f"no {what} within {timeout_s:g} s")
            await asyncio.sleep(0.2)


class AgentProcess:
    """One run of the agent command."""

    def __init__(self, cmd: str, env: dict[str, str], log: Path) -> None:
        self.cmd, self.env, self.log = cmd, env, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        out = self.log.open("ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *shlex.split(self.cmd),
                env=self.env,
                stdout=out,
                stderr=out,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            out.close()

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        return None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def stop(self) -> None:
        self.signal(signal.SIGTERM)
        if await self.wait(10) is None:
            self.signal(signal.SIGKILL)
            await self.wait(5)


# ---- the kit ------------------------------------------------------------------------------------
class Kit:
    """A manager, a producer, a watch on the agent, and the checks."""

    def __init__(self, settings: KitSettings, work_dir: Path) -> None:
        self.s = settings
        self.work_dir = work_dir
        self.namespace = settings.namespace or f"conformance-{uuid.uuid4().hex[:8]}"
        self.topology = Topology(namespace=self.namespace)
        self.operator = urlsplit(first_url(settings.amqp_url)).username or "guest"
        self.agent_ids: list[str] = []  # every agent ID the kit ran
        self.manager: ManagerService | None = None
        self.client: MeshClient | None = None
        self.raw: AmqpTransport | None = None
        self.reply_queue = ""
        self.results: dict[str, asyncio.Future[TaskResult]] = {}
        self.answer_headers: dict[str, dict[str, Any]] = {}  # by task ID
        self.agent: AgentProcess | None = None
        self.agent_id = ""
        self.watch = Watch()
        self.runs = 0
        self.descriptor: CapabilityDescriptor | None = None

    # -- set-up and tear-down -------------------------------------------------------------
    async def open(self) -> None:
        """The broker side: the kit's producer and its watch. The manager starts in the first
        check, after the agent has registered (:func:`registers_and_is_ready`)."""
        self.client = await MeshClient.connect(
            self.s.amqp_url, namespace=self.namespace, name="conformance-producer"
        )
        # Signed as the managers' user (the kit's manager runs as the same): what the kit
        # publishes to the agent in a manager's place is taken as the manager's.
        self.raw = await AmqpTransport.connect(self.s.amqp_url, name="conformance-watch", sign=True)
        self.reply_queue = await self.raw.declare_reply_queue(
            names.reply_queue(self.namespace, "conformance", uuid.uuid4().hex[:8])
        )
        await self.raw.consume(self.reply_queue, self._on_result, no_ack=True)
        # The manager's queues, so a registration waits in the announce queue for it.
        await self.raw.declare(self.topology.manager())

    async def start_manager(self) -> None:
        settings = ManagerSettings(
            amqp_url=self.s.amqp_url,
            namespace=self.namespace,
            journal_path=self.work_dir / "journal.sqlite3",
            ledger_url=f"sqlite:{self.work_dir / 'ledger.sqlite3'}",
            manager_id="conformance-kit",
            tick_interval_s=0.2,
            pool=PoolSettings(),
            operator_user=self.operator,
            admission=AdmissionPolicy(grant_ttl_s=60),
            epoch_announce_interval_s=2.0,
        )
        self.manager = ManagerService(settings)
        await self.manager.start()

    async def close(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
        if self.client is not None:
            await self.client.close()
        if self.manager is not None:
            await self.manager.stop()
        if self.raw is not None:
            with contextlib.suppress(MeshError, TimeoutError):
                await self._clean_up(self.raw)
            await self.raw.close()

    async def _clean_up(self, transport: AmqpTransport) -> None:
        """Delete what the run left on the broker: the namespace's queues and exchanges."""
        made = self.topology.manager() + self.topology.shared()
        if self.descriptor is not None:
            made = made + self.topology.pool(self.descriptor.pool_id)
        for agent_id in self.agent_ids:
            made = made + self.topology.agent_queues(agent_id, 1)
        await transport.delete_declared(made)

    async def _on_result(self, delivery: Delivery) -> None:
        waiting = self.results.get(delivery.correlation_id or "")
        if waiting is None or waiting.done():
            return
        try:
            message = decode(delivery.body)
        except MeshError as exc:
            waiting.set_exception(CheckFailed(f"an answer that does not decode: {exc}"))
            return
        if isinstance(message, TaskResult):
            self.answer_headers[message.task_id] = dict(delivery.headers)
            waiting.set_result(message)
        else:
            waiting.set_exception(CheckFailed(f"answered a task with {message.type}"))

    async def start_agent(
        self, heartbeat_s: float = HEARTBEAT_S, *, same_id: bool = False
    ) -> AgentProcess:
        """A new run of the agent command under a new agent ID (``same_id``: the last one,
        as a container restarted under its pod name), watched."""
        if self.agent is not None:
            await self.agent.stop()
        self.runs += 1
        if not same_id:
            self.agent_id = f"conformance-{self.runs}-{uuid.uuid4().hex[:6]}"
            self.agent_ids.append(self.agent_id)
        self.watch = Watch()
        assert self.raw is not None
        # A watch queue of this run's own (the same agent ID may run again: a restart).
        queue = f"{self.namespace}.conformance.watch.{self.agent_id}.{self.runs}"
        await self.raw.declare(
            Declarations(
                queues=(
                    QueueSpec(
                        queue,
                        durable=False,
                        exclusive=True,
                        auto_delete=True,
                        arguments=QueueArguments(max_length=10_000),
                    ),
                ),
                bindings=(
                    BindingSpec(
                        queue, self.topology.announce_exchange, f"{c.RK_AGENT}.{self.agent_id}.*"
                    ),
                    BindingSpec(
                        queue, self.topology.heartbeat_exchange, names.heartbeat_key(self.agent_id)
                    ),
                ),
            )
        )
        await self.raw.consume(queue, self.watch.on_message, no_ack=True)
        env = {
            **os.environ,
            "MESH_AMQP_URL": self.s.amqp_url,
            "MESH_NAMESPACE": self.namespace,
            "AGENT_ID": self.agent_id,
            "MESH_POOL": self.s.pool,
            "HEARTBEAT_INTERVAL_S": f"{heartbeat_s:g}",
        }
        self.agent = AgentProcess(self.s.agent_cmd, env, self.work_dir / f"{self.agent_id}.log")
        await self.agent.start()
        return self.agent

    async def ready_agent(self) -> AgentRegistration:
        """Start the agent and wait until the manager holds it Ready."""
        await self.start_agent()
        await self.watch.until(
            lambda: bool(self.watch.registrations) or self.exited(),
            START_TIMEOUT_S,
            "registration",
        )
        expect(not self.exited(), f"the agent exited with {self.exit_code()} before registering")
        await self.until_live(START_TIMEOUT_S)
        return self.watch.registrations[-1]

    def exited(self) -> bool:
        return self.agent is not None and self.agent.returncode is not None

    def exit_code(self) -> int | None:
        return None if self.agent is None else self.agent.returncode

    async def until_live(self, timeout_s: float) -> None:
        assert self.manager is not None
        manager = self.manager
        await self.watch.until(
            lambda: (
                (a := manager.core.agents.get(self.agent_id)) is not None
                and a.state.value in ("Ready", "Busy")
            ),
            timeout_s,
            "Ready state in the manager",
        )

    async def described_pool(self, registration: AgentRegistration) -> CapabilityDescriptor:
        """Publish (once per run, newer each time) a descriptor for the agent's pool."""
        assert self.client is not None
        now = time.time()
        epoch = (self.descriptor.descriptor_epoch + 1) if self.descriptor else int(now)
        descriptor = local_descriptor(
            registration.deployment,
            CapabilityRange(name=self.s.capability, version_spec=">=0"),
            epoch=epoch,
            issued_by=self.operator,
            now=now,
            policy_generation=AdmissionPolicy().active_generation,
            ttl_s=3600,
        )
        reply = await self.client.publish_descriptor(descriptor)
        expect(reply.type == "mesh.descriptor-accepted.v1", f"the kit's descriptor: {reply}")
        self.descriptor = descriptor
        return descriptor

    def requirements(self) -> TaskRequirements:
        return TaskRequirements(
            capability=CapabilityRange(name=self.s.capability, version_spec=">=0"),
            task_schema_version="1.0.0",
            result_schema_version="1.0.0",
            input_classifications=["internal"],
            estimated_tokens=10,
            estimated_duration_s=1.0,
            service_class="interactive",
        )

    async def grant(self) -> AdmissionGrant:
        assert self.client is not None
        if self.descriptor is None:
            await self.described_pool(self.watch.registrations[-1])
        decision = await self.client.admit(self.requirements())
        expect(decision.grant is not None, f"the kit could not admit a task: {decision.detail}")
        assert decision.grant is not None
        return decision.grant

    async def send_granted(
        self,
        grant: AdmissionGrant,
        payload: dict[str, Any],
        pool: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> TaskResult:
        """A task under ``grant`` on a pool's queue (``pool``, default the grant's), as a
        producer sends it, with ``headers`` besides the admission ID; its answer (the
        answer's own headers: ``answer_headers[task_id]``)."""
        assert self.raw is not None
        pool = pool or grant.pool_id
        task = Task(
            task_id=uuid.uuid4().hex,
            capability=self.s.capability,
            payload=payload,
            deadline=time.time() + ANSWER_TIMEOUT_S,
            submitted_at=time.time(),
            grant=grant,
        )
        return await self._send(
            task,
            names.pool_task_key(pool),
            {**(headers or {}), c.H_ADMISSION_ID: grant.admission_id},
            f"pool {pool}",
        )

    async def send_leased(self, lease: Lease, payload: dict[str, Any]) -> TaskResult:
        """A task under ``lease`` to its agent, as a producer sends it; its answer."""
        task = Task(
            task_id=uuid.uuid4().hex,
            capability=lease.capability,
            lease_id=lease.lease_id,
            payload=payload,
            deadline=time.time() + ANSWER_TIMEOUT_S,
            submitted_at=time.time(),
        )
        return await self._send(
            task, lease.agent_id, {c.H_LEASE_ID: lease.lease_id}, f"lease {lease.lease_id}"
        )

    async def _send(self, task: Task, key: str, headers: dict[str, Any], what: str) -> TaskResult:
        assert self.raw is not None
        answer: asyncio.Future[TaskResult] = asyncio.get_running_loop().create_future()
        self.results[task.task_id] = answer
        try:
            await self.raw.publish(
                self.topology.tasks_exchange,
                key,
                task,
                reply_to=self.reply_queue,
                correlation_id=task.task_id,
                headers=headers,
                persistent=True,
            )
            try:
                return await asyncio.wait_for(answer, ANSWER_TIMEOUT_S)
            except TimeoutError:
                raise CheckFailed(
                    f"no answer to a task within {ANSWER_TIMEOUT_S:g} s ({what})"
                ) from None
        finally:
            self.results.pop(task.task_id, None)
