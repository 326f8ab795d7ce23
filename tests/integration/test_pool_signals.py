"""Pool signals on the real broker: a manager with its HTTP port, one live agent of pool
``echo`` offering 3 slots that takes no task, and a producer that fills it — 3 grants held
(2 of their tasks published to the pool queue, where nobody consumes them), then 2 requests
deferred for capacity. Every figure is read back, exactly, from ``GET /api/pools``, from
``GET /api/pools/echo`` (what KEDA reads), from the status RPC (``client.status()``) and from
``mesh status --json`` run as a subprocess; a client that does not list ``pool-signals`` gets
a reply without them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from unit.samples import DESCRIPTOR

from mesh.core.policy.settings import PressurePolicy
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.topology import Topology, names
from mesh.transport import AmqpTransport
from mesh.wire import AdmissionReason, StatusReply, StatusRequest, Task

from .harness import echo_capability, eventually, live_member, start_manager
from .test_admission import settings_for
from .test_backpressure import echo_descriptor, echo_requirements

SLOTS = 3  # the live agent's concurrency: the pool's live capacity
GRANTED, PUBLISHED, DEFERRED = 3, 2, 2
MODEL_SLOTS = 16


@dataclasses.dataclass
class Pool:
    manager: ManagerService
    producer: MeshClient
    url: str


@pytest.fixture
async def pool(amqp_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Pool]:
    admission = AdmissionPolicy(
        active_generation=DESCRIPTOR.policy_generation,
        grant_ttl_s=600,
        # Places in line kept for minutes: the CLI subprocess reads them seconds later.
        pressure=PressurePolicy(line_grace_s=600),
    )
    settings = settings_for(
        amqp_url,
        namespace,
        tmp_path,
        admission=admission,
        http_port=0,
        http_host="127.0.0.1",
        queue_poll_interval_s=0.2,
    )
    manager = await start_manager(settings)
    transport = await AmqpTransport.connect(amqp_url, name="echo-agent")
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        accepted = await producer.publish_descriptor(echo_descriptor(MODEL_SLOTS))
        assert accepted.type.endswith("accepted.v1")
        await live_member(manager, transport, "echo-1", "echo", echo_capability("1.0.0", SLOTS))
        assert manager.observer.web is not None
        yield Pool(manager, producer, manager.observer.web.url.rstrip("/"))
    finally:
        await producer.close()
        await transport.close()
        await manager.stop()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def mesh_status_json(amqp_url: str, namespace: str) -> dict[str, Any]:
    """``mesh status --json`` in a subprocess (the manager runs on this loop)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", "--amqp-url", amqp_url, "--namespace", namespace,
        "status", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    document: dict[str, Any] = orjson.loads(out)
    return document


async def publish_to_pool_queue(producer: MeshClient, topology: Topology, grant: Any) -> None:
    """A granted task, published to the pool's queue as ``submit`` does (nobody consumes)."""
    task = Task(
        task_id=uuid.uuid4().hex,
        capability="test.echo",
        payload={"text": "waiting"},
        deadline=time.time() + 600,
        submitted_at=time.time(),
        grant=grant,
    )
    await producer.transport.publish(
        topology.tasks_exchange,
        names.pool_task_key("echo"),
        task,
        reply_to=producer.reply_queue,
        correlation_id=task.task_id,
        persistent=True,
    )


EXPECTED = {
    "pool_id": "echo",
    "queued": PUBLISHED,
    "deferred": DEFERRED,
    "backlog": PUBLISHED + DEFERRED,
    "in_flight": GRANTED,
    "demand": GRANTED + DEFERRED,
    "live_capacity": SLOTS,
    "model_slots": MODEL_SLOTS,
    "agents": 1,
    "agents_ready": 1,
    "desired_replicas": None,  # no scaling policy for echo here
    "refusals": {"CAPACITY": DEFERRED},
    "refusals_total": {"CAPACITY": DEFERRED},
    "window_s": 60.0,
}


def check(signals: dict[str, Any], first_deferral: float) -> None:
    """Every figure exactly; the rates over the 60 s window; the wait within what it can be."""
    assert {k: signals[k] for k in EXPECTED} == EXPECTED
    assert signals["add_rate"] == pytest.approx((GRANTED + DEFERRED) / 60)
    assert signals["dispatch_rate"] == pytest.approx(GRANTED / 60)
    assert 0 <= signals["oldest_deferred_s"] <= time.time() - first_deferral + 1
    assert signals["oldest_wait_s"] >= signals["oldest_deferred_s"]


async def test_backlog_deferrals_and_in_flight_read_back_from_every_surface(
    pool: Pool, amqp_url: str, namespace: str, topology: Topology
) -> None:
    producer = pool.producer
    grants = []
    for _ in range(GRANTED):
        decision = await producer.admit(echo_requirements())
        assert decision.outcome == "admitted" and decision.grant is not None
        grants.append(decision.grant)
    for grant in grants[:PUBLISHED]:
        await publish_to_pool_queue(producer, topology, grant)
    first_deferral = time.time()
    for _ in range(DEFERRED):
        decision = await producer.admit(echo_requirements())
        assert decision.outcome == "deferred", decision
        assert decision.reason is AdmissionReason.CAPACITY

    async def settled() -> bool:  # the queue poll and the ledger's tick have caught up
        _, found = await get_json(f"{pool.url}/api/pools/echo")
        return bool(found["queued"] == PUBLISHED and found["in_flight"] == GRANTED)

    await eventually(settled, what="queue depth and grants held in /api/pools/echo")

    # The HTTP endpoint: every pool, and one pool (KEDA's valueLocation reads `demand`).
    status, every = await get_json(f"{pool.url}/api/pools")
    assert status == 200 and set(every["pools"]) == {"echo"}
    check(every["pools"]["echo"], first_deferral)
    status, one = await get_json(f"{pool.url}/api/pools/echo")
    assert status == 200 and one["manager_id"] == pool.manager.settings.manager_id
    check(one, first_deferral)
    status, missing = await get_json(f"{pool.url}/api/pools/nobody")
    assert status == 404 and "nobody" in missing["error"]

    # The status RPC, as the producer SDK asks for it.
    reply = await producer.status(agents_limit=0)
    assert reply.pool_signals is not None
    check(reply.pool_signals["echo"].model_dump(mode="json"), first_deferral)

    # `mesh status --json`.
    document = await mesh_status_json(amqp_url, namespace)
    check(document["pool_signals"]["echo"], first_deferral)

    # A client that predates the field (no `pool-signals` in x-mesh-features) is not sent it.
    older = await producer.request(StatusRequest(agents_offset=0, agents_limit=0))
    assert isinstance(older, StatusReply) and older.pool_signals is None

    # A release: one grant fewer in flight; the rates and refusals do not move.
    released = await producer.release_admission(grants[-1])
    assert released.released

    async def one_less() -> bool:
        _, found = await get_json(f"{pool.url}/api/pools/echo")
        return bool(found["in_flight"] == GRANTED - 1)

    await eventually(one_less, what="in_flight down by one after a release")
    _, after = await get_json(f"{pool.url}/api/pools/echo")
    assert (after["demand"], after["dispatch_rate"]) == (
        GRANTED - 1 + DEFERRED,
        pytest.approx(GRANTED / 60),
    )
