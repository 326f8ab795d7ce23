"""Grant enforcement on the real broker: an SDK agent revalidates a task's admission grant at
claim and before its result, and hears the manager's revocations on the events exchange."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from unit.samples import DESCRIPTOR, REQUIREMENTS

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.wire import CapabilityRange, Message, Reason, TaskResult
from mesh.wire.models import RegistrationAccepted, Task, TaskGrant

from .harness import RawAgent, eventually, start_manager
from .test_admission import fresh, settings_for

CALC = fresh(
    DESCRIPTOR,
    pool_id="calc",
    capabilities=[CapabilityRange(name="math.evaluate", version_spec=">=1,<2")],
)
CALC_REQUIREMENTS = REQUIREMENTS.model_copy(
    update={
        "capability": CapabilityRange(name="math.evaluate", version_spec=">=1,<2"),
        "deadline": None,
        "allowed_fallbacks": [],
    }
)


async def started_manager(
    amqp_url: str, namespace: str, tmp_path: Path, grant_ttl_s: float
) -> ManagerService:
    policy = AdmissionPolicy(
        active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=grant_ttl_s
    )
    return await start_manager(settings_for(amqp_url, namespace, tmp_path, admission=policy))


def calc_runtime(amqp_url: str, namespace: str, agent_id: str) -> AgentRuntime:
    """The calc sample: its deployment, and so its pool, is ``calc``."""
    agent = SAMPLES["calc"](agent_id, heartbeat_interval_s=5.0)
    return AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))


@pytest.fixture
async def producer(amqp_url: str, namespace: str) -> AsyncIterator[MeshClient]:
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    yield client
    await client.close()


async def send(
    producer: MeshClient,
    topology: Topology,
    agent_id: str,
    grant: TaskGrant | None,
    expression: str = "6 * 7",
) -> TaskResult:
    """A ``math.evaluate`` task straight to the agent's task queue (:func:`send_task`)."""
    return await send_task(
        producer, topology, agent_id, grant, "math.evaluate", {"expression": expression}
    )


async def send_task(
    producer: MeshClient,
    topology: Topology,
    agent_id: str,
    grant: TaskGrant | None,
    capability: str,
    payload: dict[str, Any],
    timeout_s: float = 10.0,
    deadline_s: float | None = 10.0,
    *,
    lease_id: str | None = None,
    routing_key: str | None = None,
) -> TaskResult:
    """Send one task straight to the agent's task queue (or ``routing_key`` on the tasks
    exchange, e.g. ``pool.<pool>``), as ``MeshClient._send_and_wait`` does (a deadline
    ``deadline_s`` from now, if any), and wait ``timeout_s`` for its result."""
    task = Task(
        task_id=uuid.uuid4().hex,
        capability=capability,
        payload=payload,
        deadline=None if deadline_s is None else time.time() + deadline_s,
        submitted_at=time.time(),
        grant=grant,
        lease_id=lease_id,
    )
    fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
    producer._pending[task.task_id] = fut
    try:
        await producer.transport.publish(
            topology.tasks_exchange,
            routing_key or agent_id,
            task,
            reply_to=producer.reply_queue,
            correlation_id=task.task_id,
            persistent=True,
        )
        reply = await asyncio.wait_for(fut, timeout_s)
    finally:
        producer._pending.pop(task.task_id, None)
    assert isinstance(reply, TaskResult)
    return reply


def refused_for(result: TaskResult, words: str) -> bool:
    error = result.error
    return (
        result.status == "error"
        and result.output is None
        and error is not None
        and error.code is Reason.GRANT_INVALID
        and words in error.message
    )


async def test_a_grant_is_honoured_until_released_and_foreign_or_expired_grants_are_refused(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient, topology: Topology
) -> None:
    manager = await started_manager(amqp_url, namespace, tmp_path, grant_ttl_s=60)
    runtime = calc_runtime(amqp_url, namespace, "calc-granted")
    try:
        await runtime.start()
        assert (await producer.publish_descriptor(CALC)).type == "mesh.descriptor-accepted.v1"
        decision = await producer.admit(CALC_REQUIREMENTS, admission_id="adm-calc")
        assert decision.outcome == "admitted" and decision.grant is not None
        assert decision.grant.pool_id == "calc"
        grant = TaskGrant.from_grant(decision.grant)

        ok = await send(producer, topology, runtime.agent_id, grant)
        assert (ok.status, ok.output) == ("ok", {"value": 42, "expression": "6 * 7"})

        foreign = await send(
            producer, topology, runtime.agent_id, grant.model_copy(update={"pool_id": "rag-eu"})
        )
        assert refused_for(foreign, "not this agent's pool 'calc'"), foreign

        expired = await send(
            producer,
            topology,
            runtime.agent_id,
            grant.model_copy(update={"expires_at": time.time() - 1}),
        )
        assert refused_for(expired, "expired"), expired

        released = await producer.release_admission(decision.grant)
        assert released.released
        await eventually(
            lambda: runtime.revoked_fence("adm-calc") == grant.fence,
            what="the revocation reached the agent",
        )
        stale = await send(producer, topology, runtime.agent_id, grant)
        assert refused_for(stale, "revoked"), stale

        plain = await send(producer, topology, runtime.agent_id, None, "1 + 1")
        assert plain.status == "error" and plain.error is not None  # no credentials, no work
        assert plain.error.code is Reason.NOT_AUTHORIZED, plain.error
        assert runtime.counters["grants_refused"] == 3
        assert runtime.counters["tasks_without_credentials"] == 1
        assert runtime.counters["tasks_ok"] == 1  # the refused tasks never ran
        assert manager.counters["grants_revoked"] == 1
    finally:
        await runtime.stop()
        await manager.stop()


async def test_an_expired_reservation_revokes_its_grant_on_the_agent(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient, topology: Topology
) -> None:
    manager = await started_manager(amqp_url, namespace, tmp_path, grant_ttl_s=1.0)
    runtime = calc_runtime(amqp_url, namespace, "calc-expiring")
    try:
        await runtime.start()
        await producer.publish_descriptor(CALC)
        decision = await producer.admit(CALC_REQUIREMENTS, admission_id="adm-short")
        assert decision.grant is not None
        grant = TaskGrant.from_grant(decision.grant)

        # The sweep moves it to EXPIRED under a higher fence, which revokes the holder's fence.
        await eventually(
            lambda: (runtime.revoked_fence("adm-short") or 0) > grant.fence,
            what="the expiry revocation reached the agent",
        )
        assert manager.counters["admissions_expired"] == 1
        # Pretend the holder's clock is behind: the revocation alone refuses it.
        lenient = grant.model_copy(update={"expires_at": time.time() + 60})
        refused = await send(producer, topology, runtime.agent_id, lenient)
        assert refused_for(refused, "revoked"), refused
    finally:
        await runtime.stop()
        await manager.stop()


async def test_a_grant_from_an_older_epoch_is_refused_once_a_newer_one_is_active_unless_draining(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient, topology: Topology
) -> None:
    manager = await started_manager(amqp_url, namespace, tmp_path, grant_ttl_s=60)
    runtime = calc_runtime(amqp_url, namespace, "calc-epochs")
    try:
        await runtime.start()
        await producer.publish_descriptor(CALC)
        await eventually(
            lambda: runtime.active_epoch == CALC.descriptor_epoch,
            what="the agent heard its pool's epoch",
        )
        decision = await producer.admit(CALC_REQUIREMENTS, admission_id="adm-old-epoch")
        assert decision.grant is not None
        old = TaskGrant.from_grant(decision.grant)
        assert old.descriptor_epoch == CALC.descriptor_epoch
        ok = await send(producer, topology, runtime.agent_id, old)
        assert ok.status == "ok", ok

        newer = CALC.model_copy(update={"descriptor_epoch": CALC.descriptor_epoch + 1})
        assert (await producer.publish_descriptor(newer)).type == "mesh.descriptor-accepted.v1"
        await eventually(
            lambda: (
                runtime.active_epoch == newer.descriptor_epoch
                and runtime.draining_allowlist == {"adm-old-epoch"}
            ),
            what="the agent heard the new epoch and its draining allowlist",
        )
        # ACTIVE at the advance: it may finish under the old epoch (test_rollout.py has more).
        draining = await send(producer, topology, runtime.agent_id, old)
        assert draining.status == "ok", draining
        other = old.model_copy(update={"admission_id": "adm-not-draining"})
        stale = await send(producer, topology, runtime.agent_id, other)
        assert refused_for(stale, f"epoch {newer.descriptor_epoch}"), stale

        fresh_decision = await producer.admit(CALC_REQUIREMENTS, admission_id="adm-new-epoch")
        assert fresh_decision.grant is not None
        assert fresh_decision.grant.descriptor_epoch == newer.descriptor_epoch
        current = await send(
            producer, topology, runtime.agent_id, TaskGrant.from_grant(fresh_decision.grant)
        )
        assert current.status == "ok", current
        assert runtime.counters["grants_refused"] == 1
    finally:
        await runtime.stop()
        await manager.stop()


async def test_an_agent_that_starts_later_learns_the_epoch_from_the_periodic_announcement(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient
) -> None:
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation)
    settings = settings_for(amqp_url, namespace, tmp_path, admission=policy)
    manager = await start_manager(
        dataclasses.replace(settings, epoch_announce_interval_s=0.5, tick_interval_s=0.2)
    )
    runtime = calc_runtime(amqp_url, namespace, "calc-late")
    try:
        await producer.publish_descriptor(CALC)  # before the agent exists
        await runtime.start()
        await eventually(
            lambda: runtime.active_epoch == CALC.descriptor_epoch,
            what="the late agent heard the epoch",
        )
    finally:
        await runtime.stop()
        await manager.stop()


async def test_an_agent_knows_its_pools_epoch_once_it_is_accepted(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient
) -> None:
    """The registration's acceptance carries the pool's active epoch: a new agent judges
    older-epoch grants from its first task, not only after the next periodic announcement
    (here an hour away)."""
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation)
    settings = settings_for(amqp_url, namespace, tmp_path, admission=policy)
    manager = await start_manager(dataclasses.replace(settings, epoch_announce_interval_s=3600))
    runtime = calc_runtime(amqp_url, namespace, "calc-new")
    transport = await AmqpTransport.connect(amqp_url, name="older-agent")
    try:
        await producer.publish_descriptor(CALC)  # announced once, before the agent exists
        await runtime.start()

        assert runtime.active_epoch == CALC.descriptor_epoch  # at once: no waiting
        assert runtime.draining_allowlist == frozenset()

        # An agent that does not list the feature gets an acceptance it can read: without it.
        older = RawAgent(transport, manager.topology, "calc-older", deployment="calc")
        await older.start()
        await older.register()
        await eventually(lambda: older.received(RegistrationAccepted), what="older accepted")
        [accepted] = older.received(RegistrationAccepted)
        assert isinstance(accepted, RegistrationAccepted) and accepted.pool_epoch is None
    finally:
        await runtime.stop()
        await transport.close()
        await manager.stop()
