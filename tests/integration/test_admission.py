"""Admission over RabbitMQ: descriptors from the operator, decisions for producers, the ledger
behind them, and a manager restart in the middle."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from unit.samples import DESCRIPTOR
from unit.samples import REQUIREMENTS as SAMPLE_REQUIREMENTS

from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.wire import (
    AdmissionDecision,
    AdmissionReason,
    AdmissionRequest,
    CapabilityDescriptor,
    DescriptorAccepted,
    Reason,
    Refusal,
)

from .harness import eventually, live_member, manager_settings, offered, start_manager

# The sample's deadline is in 2023: wall-clock tests ask without one.
REQUIREMENTS = SAMPLE_REQUIREMENTS.model_copy(update={"deadline": None})


def fresh(descriptor: CapabilityDescriptor = DESCRIPTOR, **changes: Any) -> CapabilityDescriptor:
    now = time.time()
    health = descriptor.health.model_copy(update={"checked_at": now})
    return descriptor.model_copy(
        update={"issued_at": now - 60, "expires_at": now + 3600, "health": health, **changes}
    )


def settings_for(amqp_url: str, namespace: str, tmp_path: Path, **changes: Any) -> Any:
    base = manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url)
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
    return replace(base, **{"operator_user": "guest", "admission": policy, **changes})


RAG_AGENT = offered("rag.search", "2.1.0", max_concurrency=64)  # what DESCRIPTOR's pool runs


@pytest.fixture
async def admission_manager(
    amqp_url: str, namespace: str, tmp_path: Path
) -> AsyncIterator[ManagerService]:
    """A manager, and a live agent in the sample descriptor's pool (``rag-eu``): admission
    grants only what live agents can run."""
    service = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    await live_member(service, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
    yield service
    await transport.close()
    await service.stop()


@pytest.fixture
async def producer(
    amqp_url: str, namespace: str, admission_manager: ManagerService
) -> AsyncIterator[MeshClient]:
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    yield client
    await client.close()


async def test_an_operator_descriptor_then_an_admission_then_a_release(
    admission_manager: ManagerService, producer: MeshClient
) -> None:
    accepted = await producer.publish_descriptor(fresh())
    assert isinstance(accepted, DescriptorAccepted) and accepted.descriptor_epoch == 3

    decision = await producer.admit(REQUIREMENTS, admission_id="adm-1")
    assert decision.outcome == "admitted" and decision.grant is not None
    assert decision.grant.pool_id == "rag-eu"

    released = await producer.release_admission(decision.grant)
    assert released.released
    again = await producer.release_admission(decision.grant)  # a retry: the same answer
    assert (again.released, again.reason) == (True, None)
    assert "already released" in again.detail
    stale_fence = decision.grant.fence + 1000  # never issued
    stale = await producer.release_admission(
        decision.grant.model_copy(update={"fence": stale_fence})
    )
    assert (stale.released, stale.reason) == (False, AdmissionReason.STALE_FENCE)
    assert admission_manager.counters["admission.admitted"] == 1


async def test_a_release_retried_after_its_manager_died_answers_as_the_first_did(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """The manager applied the release and died before its answer reached the producer; the
    producer retries with the same admission and fence, and a new manager on the same ledger
    says ``released`` — not ``STALE_FENCE`` — and settles nothing twice."""
    settings = settings_for(amqp_url, namespace, tmp_path)
    first = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    try:
        await live_member(first, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
        await client.publish_descriptor(fresh())
        decision = await client.admit(REQUIREMENTS, admission_id="adm-retried")
        assert decision.grant is not None
        assert (await client.release_admission(decision.grant)).released  # applied ...
        await first.stop()  # ... and the manager is gone before the producer heard of it

        second = await start_manager(settings)
        try:
            retried = await client.release_admission(decision.grant)
            assert (retried.released, retried.reason) == (True, None)
            held = second.admitter.ledger.get("adm-retried")  # type: ignore[union-attr]
            assert held is not None and held.state == "RELEASED"
            log = second.admitter.ledger.log()  # type: ignore[union-attr]
            assert [e.event for e in log if e.admission_id == "adm-retried"].count("released") == 1
        finally:
            await second.stop()
    finally:
        await transport.close()
        await client.close()


async def test_a_descriptor_not_published_by_the_operator_is_refused(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    service = await start_manager(
        settings_for(amqp_url, namespace, tmp_path, operator_user="mesh-operator")
    )
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="not-the-operator")
    try:
        # Claiming more tools and classifications than any operator granted: refused, and
        # admissions that would need them stay impossible.
        spoofed = fresh(data_classifications=["public", "internal", "confidential", "restricted"])
        refusal = await client.publish_descriptor(spoofed)
        assert isinstance(refusal, Refusal) and refusal.reason is Reason.NOT_AUTHORIZED
        decision = await client.admit(REQUIREMENTS)
        assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.NO_ELIGIBLE_POOL)
    finally:
        await client.close()
        await service.stop()


async def test_the_same_admission_id_with_different_payloads_conflicts_over_the_wire(
    admission_manager: ManagerService, producer: MeshClient
) -> None:
    await producer.publish_descriptor(fresh())
    first = await producer.admit(REQUIREMENTS, admission_id="adm-dup")
    again = await producer.admit(REQUIREMENTS, admission_id="adm-dup")
    other = await producer.admit(
        REQUIREMENTS.model_copy(update={"estimated_tokens": 1}), admission_id="adm-dup"
    )

    assert first.outcome == "admitted" and again == first
    assert (other.outcome, other.reason) == ("rejected", AdmissionReason.CONFLICT)


async def test_a_descriptor_that_expires_denies_with_its_reason(
    admission_manager: ManagerService, producer: MeshClient
) -> None:
    await producer.publish_descriptor(fresh(expires_at=time.time() + 1.0))
    await asyncio.sleep(1.2)

    decision = await producer.admit(REQUIREMENTS)

    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.DESCRIPTOR_EXPIRED)


async def test_a_request_without_an_authenticated_producer_is_invalid(
    admission_manager: ManagerService, producer: MeshClient, topology: Topology
) -> None:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    correlation = uuid.uuid4().hex
    producer._pending[correlation] = fut
    await producer.transport.publish(  # no user_id
        topology.control_exchange,
        "rpc.admit",
        AdmissionRequest(admission_id="anon", requirements=REQUIREMENTS),
        reply_to=producer.reply_queue,
        correlation_id=correlation,
    )
    decision = await asyncio.wait_for(fut, 10)

    assert isinstance(decision, AdmissionDecision)
    assert (decision.outcome, decision.reason) == ("rejected", AdmissionReason.INVALID_REQUEST)


async def test_a_restarted_manager_recovers_every_active_reservation_and_never_double_grants(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    settings = settings_for(amqp_url, namespace, tmp_path)
    first = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    try:
        await live_member(first, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
        await client.publish_descriptor(fresh())
        grants = [await client.admit(REQUIREMENTS, admission_id=f"adm-{i}") for i in range(4)]
        assert [g.outcome for g in grants] == ["admitted"] * 4  # 4 sandboxes: all taken
        await first.stop()  # the manager goes away mid-stream

        second = await start_manager(settings)
        try:
            await client.publish_descriptor(fresh())  # the operator republishes after restart
            # The registry is in memory: the agent is asked to register again, and does.
            await eventually(lambda: "rag-eu-1" in second.core.agents, what="re-registration")
            replayed = await client.admit(REQUIREMENTS, admission_id="adm-0")
            assert replayed.grant == grants[0].grant  # recovered from the store
            extra = await client.admit(REQUIREMENTS, admission_id="adm-4")
            assert (extra.outcome, extra.reason) == ("deferred", AdmissionReason.CAPACITY)
            active = [r for r in second.admitter.ledger.active()]  # type: ignore[union-attr]
            assert sorted(r.admission_id for r in active) == [f"adm-{i}" for i in range(4)]
        finally:
            await second.stop()
    finally:
        await transport.close()
        await client.close()


async def test_explain_shows_the_decision_the_rules_and_the_reservation(
    admission_manager: ManagerService, producer: MeshClient
) -> None:
    from mesh.render import render_explain

    await producer.publish_descriptor(fresh())
    await producer.publish_descriptor(fresh(pool_id="rag-us", regions=["us-east-1"]))
    decision = await producer.admit(REQUIREMENTS, admission_id="adm-why")

    reply = await producer.explain("adm-why")

    assert reply.found and reply.decision == decision
    assert reply.eligibility is not None
    rules = {p["pool_id"]: p["rule"] for p in reply.eligibility["pools"]}
    assert rules == {"rag-eu": None, "rag-us": "region_allowed"}
    assert reply.reservation is not None and reply.reservation["state"] == "ACTIVE"
    text = render_explain(reply)
    assert "rag-us" in text and "region_allowed" in text and "fence" in text
    unknown = await producer.explain("never-seen")
    assert not unknown.found
