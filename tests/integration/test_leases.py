"""Invocation leases over the real broker (issue 7): the manager signs one into every grant,
the attempt presents it at each consumption point — the agent's claim and result, and a tool
the handler calls — and every misuse is refused.

* A granted task runs; its handler presents the lease to a tool service (a once-only
  consumption point holding only the public key), which accepts it once.
* A replayed lease — the same task delivered again after its result went out — is refused
  at claim and never runs twice; the tool, shown the lease again, refuses it too.
* An expired lease (the manager's ``lease_ttl_s`` shorter than the grant) is refused at claim.
* A lease lifted from one admission and presented with another's grant, a lease with a field
  changed (wider tools), a grant without a lease — each refused at claim.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from unit.samples import DESCRIPTOR

from mesh.agent import Agent, AgentRuntime, AgentSettings, capability
from mesh.agent.context import current_task
from mesh.leases import ConsumptionPoint, LeaseVerifier, public_path
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.topology import Topology
from mesh.wire.models import TaskGrant

from .harness import start_manager
from .test_admission import settings_for
from .test_grant_enforcement import CALC, CALC_REQUIREMENTS, producer, refused_for, send

__all__ = ["producer"]  # the fixture, used by name

SCHEMA = {"type": "object"}


class ToolService:
    """A tool on the far side of a consumption point: it trusts the manager's public key
    and nothing the agent says."""

    def __init__(self, verifier: LeaseVerifier) -> None:
        self.point = ConsumptionPoint(verifier, "web-search")
        self.refusals: list[str] = []
        self.served = 0

    def search(self, lease: Any) -> bool:
        problem = (
            "no lease"
            if lease is None
            else self.point.consume(lease, now=time.time(), tool="web-search")
        )
        if problem is not None:
            self.refusals.append(problem)
            return False
        self.served += 1
        return True


class SearchingCalc(Agent):
    """Pool ``calc``: its handler calls the web-search tool with the task's lease."""

    deployment = "calc"
    tool: ToolService | None = None
    runs = 0

    # Two at a time: a test holds two grants at once, and grants need live slots.
    @capability(
        "math.evaluate",
        version="1.0.0",
        input_schema=SCHEMA,
        output_schema=SCHEMA,
        max_concurrency=2,
    )
    async def evaluate(self, payload: dict[str, Any]) -> dict[str, Any]:
        type(self).runs += 1
        assert self.tool is not None
        return {"searched": self.tool.search(current_task().lease)}


@pytest.fixture
async def leasing(
    amqp_url: str, namespace: str, tmp_path: Path, producer: MeshClient
) -> AsyncIterator[tuple[ManagerService, AgentRuntime, ToolService]]:
    key = tmp_path / "lease.pem"
    policy = AdmissionPolicy(
        active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60, lease_ttl_s=1.5
    )
    manager = await start_manager(
        settings_for(amqp_url, namespace, tmp_path, admission=policy, lease_key_file=key)
    )
    tool = ToolService(LeaseVerifier.from_files([public_path(key)]))
    SearchingCalc.tool, SearchingCalc.runs = tool, 0
    runtime = AgentRuntime(
        SearchingCalc("calc-leased", heartbeat_interval_s=5.0),
        AgentSettings(
            amqp_url=amqp_url, namespace=namespace, lease_public_keys=(public_path(key),)
        ),
    )
    try:
        await runtime.start()
        assert (await producer.publish_descriptor(CALC)).type == "mesh.descriptor-accepted.v1"
        yield manager, runtime, tool
    finally:
        await runtime.stop()
        await manager.stop()


async def granted(producer: MeshClient, admission_id: str) -> TaskGrant:
    decision = await producer.admit(CALC_REQUIREMENTS, admission_id=admission_id)
    assert decision.outcome == "admitted" and decision.grant is not None, decision
    assert decision.grant.lease is not None, "the manager signs a lease into the grant"
    return TaskGrant.from_grant(decision.grant)


async def test_a_lease_is_spent_once_at_each_consumption_point(
    leasing: tuple[ManagerService, AgentRuntime, ToolService],
    producer: MeshClient,
    topology: Topology,
) -> None:
    _, runtime, tool = leasing
    grant = await granted(producer, "adm-lease-1")
    assert grant.lease is not None
    assert (grant.lease.admission_id, grant.lease.fence) == ("adm-lease-1", grant.fence)
    assert grant.lease.tools == ["web-search"]  # what the requirements named, nothing more
    assert grant.lease.expires_at <= grant.expires_at

    first = await send(producer, topology, runtime.agent_id, grant)
    assert (first.status, first.output) == ("ok", {"searched": True}), first
    assert tool.served == 1

    # The same task again (a duplicate delivery after the result went out): refused at
    # claim, the handler does not run a second time.
    again = await send(producer, topology, runtime.agent_id, grant)
    assert refused_for(again, "lease replayed"), again
    assert SearchingCalc.runs == 1

    # The tool refuses the same lease shown again, whoever shows it.
    assert not tool.search(grant.lease)
    assert "replayed" in tool.refusals[-1]
    assert runtime.counters["grants_refused"] == 1


async def test_an_expired_lease_is_refused_at_claim(
    leasing: tuple[ManagerService, AgentRuntime, ToolService],
    producer: MeshClient,
    topology: Topology,
) -> None:
    _, runtime, tool = leasing
    grant = await granted(producer, "adm-lease-2")
    assert grant.lease is not None and grant.lease.expires_at < grant.expires_at  # lease_ttl_s
    await asyncio.sleep(max(0.0, grant.lease.expires_at - time.time()) + 0.05)

    late = await send(producer, topology, runtime.agent_id, grant)
    assert refused_for(late, "lease expired"), late
    assert SearchingCalc.runs == 0 and tool.served == 0


async def test_a_lifted_altered_or_missing_lease_is_refused_at_claim(
    leasing: tuple[ManagerService, AgentRuntime, ToolService],
    producer: MeshClient,
    topology: Topology,
) -> None:
    _, runtime, tool = leasing
    mine, other = await granted(producer, "adm-lease-3"), await granted(producer, "adm-lease-4")
    assert mine.lease is not None and other.lease is not None

    lifted = mine.model_copy(update={"lease": other.lease})
    result = await send(producer, topology, runtime.agent_id, lifted)
    assert refused_for(result, "lease is bound to admission 'adm-lease-4'"), result

    wider = mine.model_copy(
        update={"lease": mine.lease.model_copy(update={"tools": ["shell", "web-search"]})}
    )
    result = await send(producer, topology, runtime.agent_id, wider)
    assert refused_for(result, "signature does not verify"), result

    bare = mine.model_copy(update={"lease": None})
    result = await send(producer, topology, runtime.agent_id, bare)
    assert refused_for(result, "no invocation lease"), result

    assert SearchingCalc.runs == 0 and tool.served == 0
    assert runtime.counters["grants_refused"] == 3
    # The genuine pair still works.
    ok = await send(producer, topology, runtime.agent_id, mine)
    assert (ok.status, ok.output) == ("ok", {"searched": True}), ok
