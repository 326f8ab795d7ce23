"""docs/security.md's table "Who may send what", walked on the real broker: every request the
manager serves has a row, and every row is tried from a producer that is not the operator
(a broker user of its own) — refused where the table says so, answered where it does not.

The operator is the tests' broker user. The agent-to-manager rows are the agents' own and are
walked in ``test_identity.py``; tasks in ``test_one_pool.py``."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mesh.core.lifecycle import AgentState
from mesh.producer import MeshClient
from mesh.producer.client import _METHODS
from mesh.transport import AmqpTransport
from mesh.wire import (
    AdmissionReason,
    AdmissionReleaseReply,
    Lease,
    Message,
    Reason,
    Refusal,
)

from .harness import RawAgent, echo_capability, eventually, live_member, start_manager
from .test_admission import settings_for
from .test_backpressure import echo_descriptor, echo_requirements, tenant_url

SECURITY = Path(__file__).parents[2] / "docs" / "security.md"


def table() -> dict[str, tuple[str, str]]:
    """message type -> (who may send it, what anyone else gets), from the doc's table."""
    text = SECURITY.read_text(encoding="utf-8")
    section = text.split("## Who may send what", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`mesh."):
            continue
        message, where, who, refused = cells
        for kind in re.findall(r"`(mesh\.[a-z-]+\.v\d+)`", message):
            rows[f"{kind} {where}"] = (who, refused)
    return rows


ROWS = table()


def rpc_row(message_type: str) -> tuple[str, str]:
    (key,) = [k for k in ROWS if k.startswith(message_type + " ") and "rpc." in k]
    return ROWS[key]


def test_the_table_has_a_row_for_every_request_the_manager_serves() -> None:
    served = {cls.TYPE for cls in _METHODS}
    in_rpc_rows = {key.split()[0] for key in ROWS if "rpc." in key}
    assert served == in_rpc_rows


@pytest.fixture
async def mesh(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> AsyncIterator[dict[str, Any]]:
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path))
    user = f"tenant-{namespace}"[:60]
    management_api.ensure_user(user, "pw-" + user)
    operator = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    tenant = await MeshClient.connect(
        tenant_url(amqp_url, user, "pw-" + user), namespace=namespace, name="tenant"
    )
    raw = await AmqpTransport.connect(amqp_url, name="members")
    try:
        assert (await operator.publish_descriptor(echo_descriptor(8))).type.endswith("accepted.v1")
        await live_member(manager, raw, "echo-1", "echo", echo_capability("1.0.0", 8))
        victim = RawAgent(raw, manager.topology, "victim-1", deployment="other")
        await victim.start()
        await victim.register()
        victim.start_heartbeats()
        await eventually(lambda: "victim-1" in manager.core.agents, what="victim registered")
        yield {"manager": manager, "operator": operator, "tenant": tenant, "tenant_user": user}
    finally:
        await raw.close()
        await tenant.close()
        await operator.close()
        await manager.stop()
        management_api.delete_user(user)


def refused_as_not_authorized(reply: Message) -> bool:
    if isinstance(reply, Refusal):
        return reply.reason is Reason.NOT_AUTHORIZED
    if isinstance(reply, AdmissionReleaseReply):
        return not reply.released and reply.reason is AdmissionReason.NOT_AUTHORIZED
    return False


Probe = Callable[[dict[str, Any], MeshClient], Awaitable[Message]]


async def drain(m: dict[str, Any], who: MeshClient) -> Message:
    return await who.drain("victim-1", "who may drain?")


async def descriptor(m: dict[str, Any], who: MeshClient) -> Message:
    newer = echo_descriptor(8).model_copy(update={"descriptor_epoch": 4})
    return await who.request(newer)


async def shadow(m: dict[str, Any], who: MeshClient) -> Message:
    candidate = echo_descriptor(8).model_copy(update={"descriptor_epoch": 9})
    return await who.shadow_descriptor("echo", candidate)


async def revoke(m: dict[str, Any], who: MeshClient) -> Message:
    decision = await m["operator"].admit(echo_requirements())
    assert decision.grant is not None, decision
    return await who.revoke_admission(decision.admission_id, "who may revoke?")


async def admission_release(m: dict[str, Any], who: MeshClient) -> Message:
    decision = await m["operator"].admit(echo_requirements())  # the operator's own tenant
    assert decision.grant is not None, decision
    return await who.release_admission(decision.grant)


async def lease_release(m: dict[str, Any], who: MeshClient) -> Message:
    lease = await m["operator"].acquire("test.echo")
    assert isinstance(lease, Lease), lease
    return await who.release(lease.lease_id)


async def admit(m: dict[str, Any], who: MeshClient) -> Message:
    return await who.admit(echo_requirements(deadline=time.time() + 30))


async def acquire(m: dict[str, Any], who: MeshClient) -> Message:
    return await who.acquire("test.echo")


PROBES: dict[str, Probe] = {
    "mesh.drain-request.v1": drain,
    "mesh.capability-descriptor.v1": descriptor,
    "mesh.descriptor-shadow.v1": shadow,
    "mesh.admission-revoke.v1": revoke,
    "mesh.admission-release.v1": admission_release,
    "mesh.release-request.v1": lease_release,
    "mesh.admission-request.v1": admit,
    "mesh.acquire-request.v1": acquire,
}
READ_ONLY = {"mesh.find-request.v1", "mesh.status-request.v1", "mesh.explain-request.v1"}


def test_every_row_that_changes_state_has_a_probe() -> None:
    rpc_types = {key.split()[0] for key in ROWS if "rpc." in key}
    assert rpc_types - READ_ONLY == set(PROBES)
    assert all(rpc_row(t)[0].startswith("anyone") for t in READ_ONLY)


@pytest.mark.parametrize("message_type", sorted(PROBES))
async def test_the_table_holds_for(message_type: str, mesh: dict[str, Any]) -> None:
    who, anyone_else = rpc_row(message_type)
    probe = PROBES[message_type]
    from_tenant = await probe(mesh, mesh["tenant"])
    if message_type == "mesh.drain-request.v1":  # the refused drain changed nothing
        assert mesh["manager"].core.agents["victim-1"].state is AgentState.READY
        assert mesh["manager"].counters["not_authorized.mesh.drain-request.v1"] == 1
    if "NOT_AUTHORIZED" in anyone_else:
        assert refused_as_not_authorized(from_tenant), (message_type, from_tenant)
        from_operator = await probe(mesh, mesh["operator"])
        assert not refused_as_not_authorized(from_operator), (message_type, from_operator)
    else:
        assert who.startswith("any producer"), (message_type, who)
        assert not refused_as_not_authorized(from_tenant), (message_type, from_tenant)
