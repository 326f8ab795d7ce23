"""``mesh conformance``: run an agent command against a manager of the kit's own and check it
speaks the protocol (docs/protocol.md).

The kit starts a manager in a namespace of its own on the given broker (an SQLite ledger and
journal in a temporary directory, the operator being the URL's user), then runs the agent
command — any language — telling it where through the environment:

==================  ===================================================
``MESH_AMQP_URL``   the broker
``MESH_NAMESPACE``  the kit's namespace (every exchange and queue name)
``AGENT_ID``        the agent's ID
``MESH_POOL``       the pool (deployment) it should join
``HEARTBEAT_INTERVAL_S``  the heartbeat interval to use
==================  ===================================================

It watches what the agent publishes (a queue of its own bound to the announce and heartbeat
exchanges for that agent ID), acts as producer and operator through :class:`MeshClient`, and
publishes hand-made tasks (forged grants) where a check needs them. Each check prints one
line, ``PASS`` or ``FAIL`` with what was seen, and the run ends with a summary; the exit code
is 1 if any check failed.

The agent must offer ``--capability`` (default ``test.echo``), accept ``--payload`` and
answer ``INPUT_SCHEMA_VIOLATION`` for ``--invalid-payload``; ``--slow-payload`` is a payload
its handler takes a second or more on (drain checks need tasks in flight). The defaults fit
``mesh agent echo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shlex
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jsonschema import Draft202012Validator

from mesh import constants as c
from mesh.core.pool import PoolSettings
from mesh.errors import MeshError, TopologyMissing
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient, TaskOutcome
from mesh.topology import names
from mesh.topology.specs import BindingSpec, Declarations, QueueArguments, QueueSpec, Topology
from mesh.transport import AmqpTransport, Delivery
from mesh.transport.addresses import first_url
from mesh.wire import (
    AgentRegistration,
    CapabilityRange,
    DrainNotice,
    Heartbeat,
    ReRegisterRequest,
    TaskRequirements,
    decode,
)
from mesh.wire.admission import CapabilityDescriptor, local_descriptor
from mesh.wire.models import AdmissionGrant, Lease, Refusal, Task, TaskResult

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
        self, grant: AdmissionGrant, payload: dict[str, Any], pool: str | None = None
    ) -> TaskResult:
        """A task under ``grant`` on a pool's queue (``pool``, default the grant's), as a
        producer sends it; its answer."""
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
            task, names.pool_task_key(pool), {c.H_ADMISSION_ID: grant.admission_id}, f"pool {pool}"
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


# ---- the checks ---------------------------------------------------------------------------------
Check = Callable[[Kit], Awaitable[str]]


async def registers_and_is_ready(kit: Kit) -> str:
    """The agent registers and, until the manager accepts it, neither heartbeats nor takes
    tasks from its queue (no manager runs yet: its registration waits in the announce queue);
    accepted, it is Ready."""
    assert kit.raw is not None
    await kit.start_agent()
    await kit.watch.until(
        lambda: bool(kit.watch.registrations) or kit.exited(), START_TIMEOUT_S, "registration"
    )
    expect(not kit.exited(), f"the agent exited with {kit.exit_code()} before registering")
    await asyncio.sleep(UNANSWERED_S)  # what it does while nobody answers
    expect(not kit.watch.heartbeats, "it heartbeats before its registration was accepted")
    consumers = await kit.raw.queue_consumers(kit.topology.agent_task_queue(kit.agent_id))
    expect(consumers == 0, "it consumes its task queue before its registration was accepted")
    await kit.start_manager()
    await kit.until_live(START_TIMEOUT_S)
    registration = kit.watch.registrations[-1]
    expect(registration.agent_id == kit.agent_id, f"registered as {registration.agent_id!r}")
    offered = {cap.name for cap in registration.capabilities}
    expect(kit.s.capability in offered, f"offers {sorted(offered)}, not {kit.s.capability}")
    expect(
        registration.heartbeat_interval_s >= c.MIN_HEARTBEAT_INTERVAL_S,
        f"heartbeat interval {registration.heartbeat_interval_s} s",
    )
    expect(not kit.watch.undecodable, f"undecodable messages: {kit.watch.undecodable[:2]}")
    return (
        f"registered {registration.agent_id} in pool {registration.deployment} with "
        f"{sorted(offered)}; no heartbeat and no task consumer in {UNANSWERED_S:g} s "
        "unanswered; Ready once accepted"
    )


async def refuses_a_short_heartbeat_interval(kit: Kit) -> str:
    """Told an interval below the minimum, the agent refuses to start (exits non-zero) or
    registers with at least the minimum; it never registers with the short one."""
    agent = await kit.start_agent(heartbeat_s=BELOW_MINIMUM_S)
    code = await agent.wait(START_TIMEOUT_S / 2)
    intervals = [r.heartbeat_interval_s for r in kit.watch.registrations]
    short = [i for i in intervals if i < c.MIN_HEARTBEAT_INTERVAL_S]
    expect(not short, f"told {BELOW_MINIMUM_S:g} s, it registered with {short[:1]} s")
    if code is None:
        expect(bool(intervals), f"told {BELOW_MINIMUM_S:g} s, it neither exited nor registered")
        return f"told {BELOW_MINIMUM_S:g} s, it registered with {intervals[0]:g} s"
    expect(code != 0, f"told {BELOW_MINIMUM_S:g} s, it exited 0 as if nothing were wrong")
    return f"told {BELOW_MINIMUM_S:g} s, it exited {code} without registering"


async def heartbeats_on_time(kit: Kit) -> str:
    await kit.watch.until(lambda: len(kit.watch.heartbeats) >= 3, 4 * HEARTBEAT_S, "3 heartbeats")
    beats = kit.watch.heartbeats
    seqs = [hb.seq for _, hb in beats]
    expect(all(b > a for a, b in itertools.pairwise(seqs)), f"seq not increasing: {seqs}")
    incarnation = kit.watch.registrations[-1].incarnation
    expect(
        all(hb.incarnation == incarnation for _, hb in beats),
        "a heartbeat of another incarnation",
    )
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(beats)]
    expect(all(gap <= HEARTBEAT_S * 1.5 for gap in gaps), f"gaps {[round(g, 1) for g in gaps]} s")
    return f"seq {seqs}, gaps {[round(g, 1) for g in gaps]} s (interval {HEARTBEAT_S:g} s)"


async def serves_the_lease_path(kit: Kit) -> str:
    assert kit.client is not None
    outcome = await kit.client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(outcome.result.agent_id == kit.agent_id, f"answered by {outcome.result.agent_id}")
    [offered] = [
        cap for cap in kit.watch.registrations[-1].capabilities if cap.name == kit.s.capability
    ]
    errors = sorted(
        e.message for e in Draft202012Validator(offered.output_schema).iter_errors(outcome.output)
    )
    expect(not errors, f"the output fails the capability's output_schema: {errors[:2]}")
    return f"run_task answered ok by {outcome.lease.agent_id}, output valid against its schema"


async def validates_task_input(kit: Kit) -> str:
    assert kit.client is not None
    try:
        await kit.client.run_task(
            kit.s.capability, kit.s.invalid_payload, timeout_s=ANSWER_TIMEOUT_S
        )
    except MeshError as exc:
        code = getattr(exc, "code", None)
        expect(code == "INPUT_SCHEMA_VIOLATION", f"answered {code or type(exc).__name__}")
        return "an invalid payload is answered INPUT_SCHEMA_VIOLATION"
    raise CheckFailed("an invalid payload was run")


async def serves_the_admission_path(kit: Kit) -> str:
    assert kit.client is not None
    registration = kit.watch.registrations[-1]
    if kit.descriptor is None:
        await kit.described_pool(registration)
    done = await kit.client.submit(kit.requirements(), kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(done.result.agent_id == kit.agent_id, f"answered by {done.result.agent_id}")
    return f"submit admitted to pool {registration.deployment} and answered ok"


async def _refused(kit: Kit, grant: AdmissionGrant, what: str, pool: str) -> str:
    """Send a task under ``grant`` to ``pool``'s queue: it must be refused, never run."""
    result = await kit.send_granted(grant, kit.s.payload, pool=pool)
    code = result.error.code.value if result.error else None
    expect(
        result.status == "error" and code == "GRANT_INVALID",
        f"{what} was answered {result.status} {code or ''}".rstrip(),
    )
    return f"{what}: GRANT_INVALID"


async def refuses_bad_grants(kit: Kit) -> str:
    """Foreign (another pool's), expired and revoked grants are refused at claim."""
    assert kit.client is not None
    good = await kit.grant()
    pool = good.pool_id
    seen = [
        await _refused(
            kit, good.model_copy(update={"pool_id": f"{pool}-other"}), "a foreign grant", pool
        ),
        await _refused(
            kit, good.model_copy(update={"expires_at": time.time() - 1}), "an expired grant", pool
        ),
    ]
    released = await kit.client.release_admission(good)
    expect(released.released, f"the kit could not release its grant: {released}")
    await asyncio.sleep(0.5)  # the revocation's way to the agent
    seen.append(await _refused(kit, good, "a revoked grant", pool))
    return "; ".join(seen)


async def judges_epochs(kit: Kit) -> str:
    """After a newer descriptor: an older-epoch grant is refused unless its admission is on
    the draining allowlist (ACTIVE when the epoch advanced), which is served."""
    draining = await kit.grant()
    await kit.described_pool(kit.watch.registrations[-1])  # a newer epoch: draining listed
    await asyncio.sleep(0.5)  # the announcement's way to the agent
    stale = draining.model_copy(update={"admission_id": f"conformance-{uuid.uuid4().hex[:12]}"})
    refused = await _refused(kit, stale, "an older-epoch grant", draining.pool_id)
    served = await kit.send_granted(draining, kit.s.payload)
    _expect_ok(served, "a grant on the draining allowlist was answered")
    return f"{refused}; a draining-allowlisted one of the old epoch served"


async def reregisters_when_asked(kit: Kit) -> str:
    assert kit.raw is not None
    before = len(kit.watch.registrations)
    await kit.raw.publish(
        kit.topology.agents_exchange,
        kit.agent_id,
        ReRegisterRequest(agent_id=kit.agent_id, reason="conformance kit asks"),
    )
    started = time.monotonic()
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    took = time.monotonic() - started
    await kit.until_live(START_TIMEOUT_S)
    return f"registered again {took:.1f} s after the request, Ready"


async def keeps_leases_when_handed_over(kit: Kit) -> str:
    """Its shard moved to another manager (``leases_kept``, the ``hand-over`` feature): it
    registers again and still serves a task under a lease it was told of before, though the
    registry it registers with does not know that lease — it was granted and stays valid.
    The kit plays both managers with its one: it forgets the agent and its leases, as a
    manager giving a shard back does, then asks. (An agent that forgets its leases here
    refuses tasks granted just before a hand-over.)"""
    assert kit.raw is not None and kit.client is not None and kit.manager is not None
    manager = kit.manager
    if c.FEATURE_HAND_OVER not in kit.watch.registrations[-1].features:
        raise CheckFailed(f"the agent does not list the {c.FEATURE_HAND_OVER!r} feature")
    lease = await kit.client.acquire(kit.s.capability)
    if isinstance(lease, Refusal):
        raise CheckFailed(f"the kit could not lease a slot: {lease.reason.value} {lease.detail}")
    await asyncio.sleep(0.5)  # the lease notice's way to the agent
    before = len(kit.watch.registrations)
    pool = kit.watch.registrations[-1].deployment
    manager.core.hand_over(lambda deployment: deployment == pool)
    await kit.raw.publish(
        kit.topology.agents_exchange,
        kit.agent_id,
        ReRegisterRequest(
            agent_id=kit.agent_id, reason="conformance kit: shard handed over", leases_kept=True
        ),
    )
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    await kit.until_live(START_TIMEOUT_S)
    expect(lease.lease_id not in manager.core.leases, "the kit's manager still knows the lease")
    result = await kit.send_leased(lease, kit.s.payload)
    _expect_ok(result, "a task under a lease granted before the hand-over was answered")
    return "registered again, and a task under a lease it was told of before ran"


async def takes_control_only_from_the_managers(kit: Kit) -> str:
    """A drain notice that does not carry the managers' (RabbitMQ-validated) ``user_id`` —
    anyone who may publish to the agents exchange could send one — is not obeyed: the agent
    keeps taking its pool's tasks."""
    assert kit.raw is not None
    unsigned = await AmqpTransport.connect(kit.s.amqp_url, name="conformance-unsigned")
    try:
        await unsigned.publish(
            kit.topology.agents_exchange,
            kit.agent_id,
            DrainNotice(agent_id=kit.agent_id, reason="conformance kit: not from a manager"),
        )
    finally:
        await unsigned.close()
    await asyncio.sleep(UNANSWERED_S)  # time to (wrongly) begin a drain
    served = await kit.send_granted(await kit.grant(), kit.s.payload)
    _expect_ok(served, "after an unsigned drain notice a pool task was answered")
    return "an unsigned drain notice left it serving, not draining"


FORGED_SEQ = 10**9


async def is_not_fooled_by_a_forged_heartbeat(kit: Kit) -> str:
    """A heartbeat forged in the agent's name — its live incarnation, ``seq`` 10^9 — is
    published on the heartbeat exchange. The manager bounds how far one heartbeat may move
    ``seq`` (docs/protocol.md), so the agent's own heartbeats must advance in steps it allows:
    two of them later they are still accepted, and the agent is Ready and serves."""
    assert kit.raw is not None and kit.manager is not None and kit.client is not None
    manager, agent_id = kit.manager, kit.agent_id
    record = manager.core.agents.get(agent_id)
    expect(record is not None, "the agent is not registered with the kit's manager")
    assert record is not None
    incarnation = kit.watch.registrations[-1].incarnation
    forged: list[Heartbeat] = []

    def real_beats() -> list[Heartbeat]:
        return [
            hb
            for _, hb in kit.watch.heartbeats
            if hb.agent_id == agent_id and hb.incarnation == incarnation and hb not in forged
        ]

    await kit.watch.until(lambda: bool(real_beats()), 2 * HEARTBEAT_S, "heartbeat of the agent")
    real = real_beats()
    forged.append(real[-1].model_copy(update={"seq": FORGED_SEQ, "sent_at": time.time()}))
    leaps = manager.core.counters["heartbeat_seq_leap"]
    await kit.raw.publish(
        kit.topology.heartbeat_exchange, names.heartbeat_key(agent_id), forged[0]
    )  # fmt: skip
    await kit.watch.until(
        lambda: manager.core.counters["heartbeat_seq_leap"] > leaps, HEARTBEAT_S, "the forgery"
    )
    seen = len(real)
    await kit.watch.until(
        lambda: len(real_beats()) >= seen + 2,
        3 * HEARTBEAT_S,
        "two more heartbeats of the agent",
    )
    await asyncio.sleep(0.5)  # the manager has taken the last one
    record = manager.core.agents.get(agent_id)
    expect(record is not None, "the agent was declared lost after a forged heartbeat")
    assert record is not None
    last_real = max(hb.seq for hb in real_beats())
    expect(
        record.last_heartbeat_seq == last_real,
        f"the manager's last accepted seq is {record.last_heartbeat_seq}, the agent's last "
        f"heartbeat says {last_real}: its heartbeats are refused (seq steps too large?)",
    )
    outcome = await kit.client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(outcome.result.agent_id == agent_id, f"answered by {outcome.result.agent_id}")
    return f"forged seq {FORGED_SEQ} refused; its own heartbeats up to seq {last_real} accepted"


async def consumes_a_replaced_pool_queue(kit: Kit) -> str:
    """The pool queue is deleted (an operator in the management UI) and declared again (as
    the manager does when it finds it gone): the broker cancelled the agent's consumer, and
    the agent must subscribe again — with no newer epoch to prompt it — and take the pool's
    tasks."""
    assert kit.raw is not None
    raw = kit.raw
    grant = await kit.grant()  # the pool is described: its queue exists
    queue = kit.topology.pool_task_queue(grant.pool_id)
    # Past any subscription the descriptor's announcement set off, so the one seen below is
    # the one the deletion must end.
    await asyncio.sleep(UNANSWERED_S)
    await kit.watch.until_async(
        lambda: _consumed(raw, queue), START_TIMEOUT_S, "consumer on the pool queue"
    )
    await raw.delete_queue(queue)
    deleted = time.monotonic()
    await asyncio.sleep(1.0)  # a while without the queue: a subscription now would fail
    await raw.declare(kit.topology.pool(grant.pool_id))
    await kit.watch.until_async(
        lambda: _consumed(raw, queue), POOL_BACK_S, "consumer on the declared-again pool queue"
    )
    took = time.monotonic() - deleted
    served = await kit.send_granted(await kit.grant(), kit.s.payload)
    _expect_ok(served, "a pool task after the queue came back was answered")
    return f"consumed the queue again {took:.1f} s after it was deleted; a task answered"


async def takes_nothing_before_its_restart_is_accepted(kit: Kit) -> str:
    """kill -9, and the same command again at once under the same agent ID (a container
    restarted under its pod name): the manager still counts the killed incarnation, so the
    new one's registration is deferred (``AGENT_ID_IN_USE``). Meanwhile the pool's epoch is
    announced (every 2 s here) on its control queue: it must consume neither its pool queue
    nor its task queue until the manager accepted *this* incarnation — then it serves (a task
    on the lease path)."""
    assert kit.raw is not None and kit.manager is not None and kit.agent is not None
    assert kit.client is not None
    raw, manager, client = kit.raw, kit.manager, kit.client
    # The pool described (its queue exists, its epoch announced every 2 s); no grant taken:
    # earlier checks may hold the pool's live slots until their grants expire.
    descriptor = kit.descriptor or await kit.described_pool(kit.watch.registrations[-1])
    pool_queue = kit.topology.pool_task_queue(descriptor.pool_id)
    old = manager.core.agents[kit.agent_id].incarnation
    kit.agent.signal(signal.SIGKILL)
    await kit.agent.wait(5.0)
    killed = time.monotonic()
    await kit.start_agent(same_id=True)
    await kit.watch.until(
        lambda: bool(kit.watch.registrations) or kit.exited(), START_TIMEOUT_S, "registration"
    )
    expect(not kit.exited(), f"the restarted agent exited with {kit.exit_code()}")
    await asyncio.sleep(UNANSWERED_S)  # deferred, and an epoch announcement or more heard
    still = manager.core.agents.get(kit.agent_id)
    expect(
        still is not None and still.incarnation == old,
        "the killed incarnation was gone before the check could look (the restart was slow)",
    )
    expect(
        await raw.queue_consumers(pool_queue) == 0,
        "it consumes its pool queue while its registration is deferred",
    )
    expect(
        await raw.queue_consumers(kit.topology.agent_task_queue(kit.agent_id)) == 0,
        "it consumes its task queue while its registration is deferred",
    )
    loss_s = manager.settings.pool.missed_heartbeats_before_lost * HEARTBEAT_S
    await kit.watch.until(
        lambda: (
            (a := manager.core.agents.get(kit.agent_id)) is not None
            and a.incarnation != old
            and a.state.value in ("Ready", "Busy")
        ),
        loss_s + START_TIMEOUT_S,
        "the new incarnation accepted once the killed one was lost",
    )
    took = time.monotonic() - killed
    served = await client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(served.lease.agent_id == kit.agent_id, f"served by {served.lease.agent_id}")
    return (
        f"deferred while the killed incarnation was live, consuming nothing; accepted "
        f"{took:.0f} s after the kill, then served"
    )


def _expect_ok(result: TaskResult, what: str) -> None:
    """``result`` is ok, else the check fails saying ``what`` was answered instead."""
    code = result.error.code.value if result.error else ""
    expect(result.status == "ok", f"{what} {result.status} {code}".rstrip())


async def _consumed(raw: AmqpTransport, queue: str) -> bool:
    try:
        return await raw.queue_consumers(queue) > 0
    except TopologyMissing:
        return False


async def fences_itself_after_a_silence(kit: Kit) -> str:
    """Frozen (SIGSTOP) with a task running until the manager declares it lost, then woken:
    the result of the task it claimed before the silence must not be delivered (its work
    may have moved on), and it registers again."""
    assert kit.client is not None and kit.manager is not None and kit.agent is not None
    manager, agent = kit.manager, kit.agent
    before = len(kit.watch.registrations)
    [held] = await _in_flight(kit, 1)
    leased_before = set(manager.core.agents[kit.agent_id].leases)
    agent.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        loss_s = manager.settings.pool.missed_heartbeats_before_lost * HEARTBEAT_S
        await kit.watch.until(
            lambda: kit.agent_id not in manager.core.agents,
            loss_s + 2 * HEARTBEAT_S,
            "loss of the frozen agent in the manager",
        )
        frozen_s = time.monotonic() - stopped
    finally:
        agent.signal(signal.SIGCONT)
        woke = time.time()
    done, _ = await asyncio.wait({held}, timeout=2 * HEARTBEAT_S)
    if done:
        outcome = held.exception() or held.result()
        # run_task leases again when the agent does not know its lease (UNKNOWN_LEASE): a
        # result then comes from a new run under a new lease, started after the agent woke.
        rerun = isinstance(outcome, TaskOutcome) and (
            outcome.lease.lease_id not in leased_before and outcome.result.started_at >= woke
        )
        expect(
            isinstance(outcome, BaseException) or rerun,
            "the result of a task claimed before the silence was delivered after the agent "
            "was declared lost",
        )
        what = (
            "withheld, then run again under a new lease"
            if rerun
            else f"answered {getattr(outcome, 'code', type(outcome).__name__)}, not delivered"
        )
    else:
        held.cancel()
        what = "withheld, not delivered"
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    await kit.until_live(START_TIMEOUT_S)
    return (
        f"frozen {frozen_s:.0f} s until declared lost; the task it held was {what}; "
        "registered again, Ready"
    )


async def _in_flight(kit: Kit, count: int) -> list[asyncio.Task[Any]]:
    """``count`` slow tasks on the lease path, started: wait until the agent holds them."""
    assert kit.client is not None and kit.manager is not None
    client, manager = kit.client, kit.manager
    calls = [
        asyncio.create_task(
            client.run_task(kit.s.capability, kit.s.slow_payload, timeout_s=ANSWER_TIMEOUT_S * 2)
        )
        for _ in range(count)
    ]
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        agent = manager.core.agents.get(kit.agent_id)
        if agent is not None and len(agent.leases) >= count:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # delivered and started
    return calls


async def _all_answered(calls: list[asyncio.Task[Any]], what: str) -> int:
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    expect(
        not failed,
        f"{len(failed)} of {len(calls)} tasks {what} failed: {failed[0] if failed else ''}",
    )
    return len(calls)


async def drains_on_request(kit: Kit) -> str:
    assert kit.client is not None
    calls = await _in_flight(kit, 2)
    accepted = await kit.client.drain(kit.agent_id, reason="conformance kit")
    expect(accepted.type == "mesh.drain-accepted.v1", f"the drain was refused: {accepted}")
    served = await _all_answered(calls, "in flight at the drain")
    assert kit.agent is not None
    code = await kit.agent.wait(ANSWER_TIMEOUT_S * 2)
    expect(code is not None, "still running after the drain completed")
    return f"{served} tasks in flight all answered; exited {code} after the drain"


async def drains_on_sigterm(kit: Kit) -> str:
    await kit.ready_agent()
    calls = await _in_flight(kit, 2)
    assert kit.agent is not None
    kit.agent.signal(signal.SIGTERM)
    served = await _all_answered(calls, "in flight at SIGTERM")
    code = await kit.agent.wait(ANSWER_TIMEOUT_S * 2)
    expect(code == 0, f"exit code {code} after SIGTERM (a drain ends with 0)")
    return f"{served} tasks in flight all answered; exited 0"


# (key, what it checks, the check), in the order they run: each leaves the agent as the
# next one needs it (the first starts it; the drains end it; the SIGTERM check starts a new one).
CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("register", "registers and is Ready after acceptance", registers_and_is_ready),
    ("heartbeats", "heartbeats on time with increasing seq", heartbeats_on_time),
    ("lease-path", "serves a task on the lease path", serves_the_lease_path),
    ("input-schema", "answers INPUT_SCHEMA_VIOLATION for an invalid payload", validates_task_input),
    ("admission-path", "serves a task on the admission path", serves_the_admission_path),
    ("grants", "refuses foreign, expired and revoked grants", refuses_bad_grants),
    ("epochs", "refuses an older-epoch grant, honours the draining allowlist", judges_epochs),
    ("reregister", "registers again when the manager asks", reregisters_when_asked),
    (
        "hand-over",
        "keeps its leases when handed to another manager",
        keeps_leases_when_handed_over,
    ),
    (
        "signed",
        "takes control messages only from the managers' user",
        takes_control_only_from_the_managers,
    ),
    (
        "pool-queue",
        "consumes its pool queue again once it is deleted and declared again",
        consumes_a_replaced_pool_queue,
    ),
    (
        "forged-heartbeat",
        "keeps being accepted after a heartbeat forged in its name",
        is_not_fooled_by_a_forged_heartbeat,
    ),
    (
        "restart",
        "takes nothing before its restart under the same ID is accepted",
        takes_nothing_before_its_restart_is_accepted,
    ),
    (
        "fence",
        "fences itself after a silence it was declared lost in",
        fences_itself_after_a_silence,
    ),
    ("drain", "drains on request without losing a task", drains_on_request),
    ("sigterm", "drains on SIGTERM without losing a task", drains_on_sigterm),
    (
        "short-interval",
        "refuses a heartbeat interval below the minimum",
        refuses_a_short_heartbeat_interval,
    ),
)
CHECK_KEYS = tuple(key for key, _, _ in CHECKS)


async def run(settings: KitSettings, out: Callable[[str], None] = print) -> list[CheckResult]:
    """Run every check in order, printing a line for each and a summary; the results."""
    with contextlib.ExitStack() as stack:
        work_dir = settings.work_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="mesh-conformance-"))
        )
        kit = Kit(settings, work_dir)
        out(f"conformance of: {settings.agent_cmd}")
        out(f"namespace {kit.namespace}, broker {_without_password(settings.amqp_url)}")
        results: list[CheckResult] = []
        await kit.open()
        try:
            for key, name, check in CHECKS:
                if settings.only and key != "register" and key not in settings.only:
                    continue
                started = time.monotonic()
                try:
                    detail = await check(kit)
                    result = CheckResult(key, name, True, detail)
                except CheckFailed as exc:
                    result = CheckResult(key, name, False, str(exc))
                except MeshError as exc:
                    result = CheckResult(key, name, False, f"{type(exc).__name__}: {exc}")
                result.detail += f" ({time.monotonic() - started:.1f} s)"
                results.append(result)
                out(result.line())
        finally:
            await kit.close()
        passed = sum(r.passed for r in results)
        out(
            f"{passed} of {len(results)} checks passed"
            + (
                ""
                if passed == len(results)
                else (f"; agent logs in {work_dir}" if settings.work_dir else "")
            )
        )
        return results


def _without_password(url: str) -> str:
    scheme, _, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
