"""Roll-out and roll-back safety (issue 7): who may join a described pool, and taking a grant
back for a security reason.

* An agent that does not say it checks descriptor epochs (``features`` lacks
  ``descriptor-epochs``: an SDK from before epochs) cannot join a pool that has a descriptor:
  it would run tasks of a retired epoch. It is refused ``EPOCHS_UNSUPPORTED``; a pool without a
  descriptor still takes it, and an agent that says so joins the described pool.
* A security revocation (``mesh admission revoke``, operator only) releases the admission at
  its current fence and tells the pool: the running attempt is cancelled at once and answered
  ``GRANT_INVALID`` (not ``EVICTED``: it is not to be resubmitted), the same grant is refused
  at claim afterwards, and anyone but the operator is refused ``NOT_AUTHORIZED``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.journal import SqliteJournal
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport.amqp import AmqpTransport
from mesh.wire import AdmissionReason, Message, Reason, RegistrationAccepted, RegistrationRefused
from mesh.wire.models import TaskGrant, TaskResult

from .harness import RawAgent, echo_capability, eventually, live_member, start_manager
from .test_admission import settings_for
from .test_backpressure import echo_descriptor, echo_requirements
from .test_grant_enforcement import send_task


async def registered(agent: RawAgent) -> Message:
    await agent.register()
    await eventually(
        lambda: agent.received(RegistrationAccepted) or agent.received(RegistrationRefused),
        what=f"an answer to {agent.agent_id}",
    )
    return (agent.received(RegistrationAccepted) or agent.received(RegistrationRefused))[0]


async def test_an_agent_that_does_not_check_epochs_cannot_join_a_described_pool(
    amqp_url: str, namespace: str, tmp_path: Path, topology: Topology
) -> None:
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    transport = await AmqpTransport.connect(amqp_url, name="rollout-raw")
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    try:
        accepted = await client.publish_descriptor(echo_descriptor(4))
        assert accepted.type == "mesh.descriptor-accepted.v1", accepted
        old = RawAgent(transport, topology, "old-sdk-1", deployment="echo", features=[])
        await old.start()
        refusal = await registered(old)
        assert isinstance(refusal, RegistrationRefused), refusal
        assert refusal.reason is Reason.EPOCHS_UNSUPPORTED
        assert "descriptor-epochs" in refusal.detail
        assert "old-sdk-1" not in manager.core.agents
        assert manager.counters[f"registration_refused.{Reason.EPOCHS_UNSUPPORTED}"] == 1

        undescribed = RawAgent(transport, topology, "old-sdk-2", deployment="raw", features=[])
        await undescribed.start()
        assert isinstance(await registered(undescribed), RegistrationAccepted)

        current = RawAgent(transport, topology, "new-sdk-1", deployment="echo")
        await current.start()
        assert isinstance(await registered(current), RegistrationAccepted)
    finally:
        await client.close()
        await transport.close()
        await manager.stop()


async def send_echo(
    client: MeshClient, topology: Topology, agent_id: str, grant: TaskGrant, sleep_ms: int
) -> TaskResult:
    """An echo task that sleeps ``sleep_ms``, straight to the agent with ``grant``."""
    payload = {"message": "hi", "sleep_ms": sleep_ms}
    return await send_task(
        client, topology, agent_id, grant, "test.echo", payload, timeout_s=20.0, deadline_s=None
    )


def echo_runtime(amqp_url: str, namespace: str, agent_id: str) -> AgentRuntime:
    """The echo sample (pool ``echo``) on its own connection."""
    return AgentRuntime(
        SAMPLES["echo"](agent_id, heartbeat_interval_s=5.0),
        AgentSettings(amqp_url=amqp_url, namespace=namespace),
    )


async def test_a_security_revocation_cancels_the_running_attempt_and_refuses_its_grant(
    amqp_url: str, namespace: str, tmp_path: Path, topology: Topology
) -> None:
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    runtime = echo_runtime(amqp_url, namespace, "echo-revoked")
    try:
        await runtime.start()
        assert (await client.publish_descriptor(echo_descriptor(4))).type.endswith("accepted.v1")
        decision = await client.admit(echo_requirements(), admission_id="adm-revoked")
        assert decision.outcome == "admitted" and decision.grant is not None
        grant = TaskGrant.from_grant(decision.grant)

        started = time.monotonic()
        running = asyncio.create_task(send_echo(client, topology, runtime.agent_id, grant, 20_000))
        await eventually(lambda: "adm-revoked" in runtime.tasks.running, what="the attempt running")
        reply = await client.revoke_admission("adm-revoked", "credential leaked")
        assert reply.released, reply
        result = await running
        assert time.monotonic() - started < 10, "cancelled, not run to its 20 s end"
        assert result.status == "error" and result.error is not None
        assert result.error.code is Reason.GRANT_INVALID  # not EVICTED: not to be resubmitted
        assert "revoked for security (credential leaked)" in result.error.message

        again = await send_echo(client, topology, runtime.agent_id, grant, 0)
        assert again.error is not None and again.error.code is Reason.GRANT_INVALID
        assert "for security: credential leaked" in again.error.message
        held = manager.admitter.ledger.get("adm-revoked") if manager.admitter else None
        assert held is not None and held.state == "RELEASED"
        assert manager.counters["admissions_revoked"] == 1

        twice = await client.revoke_admission("adm-revoked", "again")
        assert not twice.released and twice.reason is AdmissionReason.NOT_FOUND
    finally:
        await runtime.stop()
        await client.close()
        await manager.stop()


async def test_only_the_operator_may_revoke(amqp_url: str, namespace: str, tmp_path: Path) -> None:
    settings = replace(settings_for(amqp_url, namespace, tmp_path), operator_user="somebody")
    manager = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="not-operator")
    try:
        reply = await client.revoke_admission("adm-any", "trying")
        assert not reply.released and reply.reason is AdmissionReason.NOT_AUTHORIZED
        assert manager.counters["revoke_not_authorized"] == 1
    finally:
        await client.close()
        await manager.stop()


async def test_advancing_the_epoch_drains_the_active_attempts_and_admits_only_under_the_new(
    amqp_url: str, namespace: str, tmp_path: Path, topology: Topology
) -> None:
    settings = replace(settings_for(amqp_url, namespace, tmp_path), epoch_announce_interval_s=0.5)
    manager = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    runtime = echo_runtime(amqp_url, namespace, "echo-epochs")
    try:
        await runtime.start()
        old = echo_descriptor(4)
        assert (await client.publish_descriptor(old)).type.endswith("accepted.v1")
        await eventually(lambda: runtime.active_epoch == old.descriptor_epoch, what="epoch")
        before = await client.admit(echo_requirements(), admission_id="adm-before")
        assert before.grant is not None and before.grant.descriptor_epoch == old.descriptor_epoch
        pinned = TaskGrant.from_grant(before.grant)

        new = old.model_copy(update={"descriptor_epoch": old.descriptor_epoch + 1})
        assert (await client.publish_descriptor(new)).type.endswith("accepted.v1")
        await eventually(
            lambda: (
                runtime.active_epoch == new.descriptor_epoch
                and runtime.draining_allowlist == {"adm-before"}
            ),
            what="the new epoch and its draining allowlist at the agent",
        )
        journal = SqliteJournal(tmp_path / "journal.sqlite3")
        try:
            advance = [e for e in journal.tail(50) if e.kind == "descriptor"][-1]
        finally:
            journal.close()
        assert advance.detail["draining"] == ["adm-before"]  # journaled: mesh log
        # The attempt pinned to the old epoch continues: it is on the allowlist.
        ok = await send_echo(client, topology, runtime.agent_id, pinned, 0)
        assert ok.status == "ok", ok
        # An old-epoch grant of an admission not on it is refused.
        stray = pinned.model_copy(update={"admission_id": "adm-stray"})
        refused = await send_echo(client, topology, runtime.agent_id, stray, 0)
        assert refused.error is not None and refused.error.code is Reason.GRANT_INVALID
        assert "draining allowlist" in refused.error.message
        # Every new phase is admitted under the current epoch.
        after = await client.admit(echo_requirements(), admission_id="adm-after")
        assert after.grant is not None and after.grant.descriptor_epoch == new.descriptor_epoch
        # Released, the pinned admission leaves the allowlist (announced every 0.5 s here).
        assert (await client.release_admission(before.grant)).released
        await eventually(lambda: runtime.draining_allowlist == frozenset(), what="drained")
    finally:
        await runtime.stop()
        await client.close()
        await manager.stop()


async def test_shadow_routing_records_what_a_candidate_epoch_would_change_and_enforces_nothing(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    transport = await AmqpTransport.connect(amqp_url, name="echo-agent")
    try:
        await live_member(manager, transport, "echo-1", "echo", echo_capability())
        live = echo_descriptor(4)
        assert (await client.publish_descriptor(live)).type.endswith("accepted.v1")
        # The candidate narrows the classifications: "internal" input would be filtered.
        candidate = live.model_copy(
            update={
                "descriptor_epoch": live.descriptor_epoch + 1,
                "data_classifications": ["public"],
            }
        )
        shadowed = await client.shadow_descriptor("echo", candidate)
        assert shadowed.type.endswith("accepted.v1"), shadowed

        decision = await client.admit(echo_requirements(), admission_id="adm-shadowed")
        assert decision.outcome == "admitted" and decision.grant is not None
        assert decision.grant.descriptor_epoch == live.descriptor_epoch  # live decided
        explained = await client.explain("adm-shadowed")
        assert explained.eligibility is not None
        shadow = explained.eligibility["shadow"]
        assert shadow["agree"] is False
        assert shadow["pools"] == [
            {
                "pool_id": "echo",
                "descriptor_epoch": candidate.descriptor_epoch,
                "live": None,
                "shadow": "classification_allowed",
            }
        ]
        metric = manager.observer.metrics.registry.get_sample_value(
            "mesh_shadow_verdicts_total", {"pool": "echo", "agreement": "differ"}
        )
        assert metric == 1.0

        removed = await client.shadow_descriptor("echo", None)
        assert removed.type.endswith("accepted.v1")
        await client.admit(echo_requirements(), admission_id="adm-plain")
        plain = await client.explain("adm-plain")
        assert plain.eligibility is not None and "shadow" not in plain.eligibility
    finally:
        await client.close()
        await transport.close()
        await manager.stop()
