"""The manager scales a Deployment through KubernetesScaler, end to end.

The manager runs on the real broker; agents are RawAgents whose IDs are pod names and whose
``deployment`` is the Deployment's; capacity misses are real acquire requests from a MeshClient.
The official ``kubernetes`` client talks to the fake API server (tests/k8s/fake_api.py), and the
tests assert the exact mutating requests it received: verb, path and patch body. The manager may
read the scale (GET) as often as it likes; every other request is listed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from integration.harness import (  # tests/ is on sys.path: the shared integration harness
    FAST_POOL,
    RawAgent,
    echo_capability,
    eventually,
    manager_settings,
)
from kubernetes import client as k8s

from mesh.core.scaling import ScalingPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.scaler.kubernetes import KubernetesScaler
from mesh.topology import Topology
from mesh.wire import Lease, Reason, Refusal, RegistrationAccepted

from .fake_api import FakeKubernetesApi

pytestmark = pytest.mark.integration

K8S_NS = "mesh-agents"
DEPLOYMENT = "calc"
CAPABILITY = "test.echo"
SCALE = f"/apis/apps/v1/namespaces/{K8S_NS}/deployments/{DEPLOYMENT}/scale"
COST = {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}}


def pod(name: str) -> str:
    return f"/api/v1/namespaces/{K8S_NS}/pods/{name}"


def scale_patch(replicas: int) -> tuple[str, str, Any]:
    return ("PATCH", SCALE, {"spec": {"replicas": replicas}})


def cost_patch(name: str) -> tuple[str, str, Any]:
    return ("PATCH", pod(name), COST)


def mutations(fake: FakeKubernetesApi) -> list[tuple[str, str, Any]]:
    """Every request but reads of the scale, as (verb, path, body), in arrival order."""
    others = [r for r in fake.requests if (r.method, r.path) != ("GET", SCALE)]
    assert all(r.method in ("PATCH", "DELETE") for r in others), [r.shape for r in others]
    return [r.shape for r in others]


class PodAgent(RawAgent):
    """A RawAgent that runs in a pod of ``deployment``: its agent ID is the pod's name."""


@dataclass
class Mesh:
    """A manager scaling ``calc`` through the fake API, a client, and agents in ``calc`` pods."""

    fake: FakeKubernetesApi
    manager: ManagerService
    client: MeshClient
    new_agent: Callable[..., Awaitable[PodAgent]]
    agents: dict[str, PodAgent] = field(default_factory=dict)

    async def register(self, agent_id: str, *, max_concurrency: int = 1) -> PodAgent:
        """Start a pod for ``agent_id`` and have it register and heartbeat until Ready."""
        if not self.fake.has_pod(agent_id, namespace=K8S_NS):
            self.fake.add_pod(agent_id, deployment=DEPLOYMENT, namespace=K8S_NS)
        agent = await self.new_agent(agent_id, max_concurrency)
        self.agents[agent_id] = agent
        await agent.register()
        agent.start_heartbeats()
        await eventually(
            lambda: bool(agent.received(RegistrationAccepted)), what=f"{agent_id} accepted"
        )
        return agent

    async def lease(self, agent_id: str | None = None) -> Lease:
        granted = await self.client.acquire(CAPABILITY, agent_id=agent_id)
        assert isinstance(granted, Lease), granted
        return granted

    async def misses(self, count: int) -> float:
        """``count`` concurrent acquires that find no free slot; returns how long they took."""
        started = time.monotonic()
        replies = await asyncio.gather(*(self.client.acquire(CAPABILITY) for _ in range(count)))
        took = time.monotonic() - started
        assert all(
            isinstance(r, Refusal) and r.reason is Reason.NO_AGENT_AVAILABLE for r in replies
        ), {type(r).__name__ for r in replies}
        return took

    async def scale_patches(self) -> list[tuple[str, str, Any]]:
        return [m for m in mutations(self.fake) if m[1] == SCALE]


MeshFactory = Callable[..., Awaitable[Mesh]]


@pytest.fixture
async def start_mesh(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    fake_k8s: FakeKubernetesApi,
    k8s_api_client: k8s.ApiClient,
    transport_factory: Any,
    topology: Topology,
) -> AsyncIterator[MeshFactory]:
    """``await start_mesh(policy, replicas=N)``: the Deployment exists with N replicas, and a
    manager with that scaling policy runs with a KubernetesScaler on the fake API."""
    started: list[tuple[ManagerService, MeshClient]] = []

    async def new_agent(agent_id: str, max_concurrency: int) -> PodAgent:
        agent = PodAgent(
            await transport_factory(suffix=agent_id),
            topology,
            agent_id,
            deployment=DEPLOYMENT,
            capabilities=[echo_capability(max_concurrency=max_concurrency)],
        )
        await agent.start()
        return agent

    async def start(policy: ScalingPolicy, *, replicas: int) -> Mesh:
        fake_k8s.add_deployment(DEPLOYMENT, replicas=replicas, namespace=K8S_NS)
        settings = manager_settings(
            namespace,
            tmp_path / "journal.sqlite3",
            amqp_url=amqp_url,
            pool=replace(FAST_POOL, scaling=(policy,)),
        )
        manager = ManagerService(
            settings, scaler=KubernetesScaler(K8S_NS, api_client=k8s_api_client)
        )
        await manager.start()
        client = await MeshClient.connect(amqp_url, namespace=namespace, name=f"client:{namespace}")
        started.append((manager, client))
        return Mesh(fake_k8s, manager, client, new_agent)

    yield start
    for manager, client in reversed(started):
        await client.close()
        await manager.stop()


def policy(**overrides: Any) -> ScalingPolicy:
    base: dict[str, Any] = {
        "deployment": DEPLOYMENT,
        "capabilities": (CAPABILITY,),
        "min_replicas": 1,
        "max_replicas": 10,
        "window_s": 2.0,
        "scale_down_idle_s": 300.0,
    }
    base.update(overrides)
    return ScalingPolicy(**base)


async def past_window(p: ScalingPolicy) -> None:
    """Long enough for a window opened now to close, and the tick after it to act."""
    await asyncio.sleep(p.window_s + 1.0)


async def test_a_burst_of_100_capacity_misses_in_one_window_is_one_scale_patch(
    start_mesh: MeshFactory,
) -> None:
    p = policy()
    mesh = await start_mesh(p, replicas=1)
    await mesh.register("calc-0")
    await mesh.lease()  # calc-0's only slot: from now on every acquire is a capacity miss

    took = await mesh.misses(100)
    assert took < p.window_s, f"the burst took {took:.2f} s, longer than the window"

    await eventually(lambda: len(mutations(mesh.fake)) >= 1, what="a scale patch")
    await past_window(p)
    assert mutations(mesh.fake) == [scale_patch(2)]
    assert mesh.fake.replicas(DEPLOYMENT, namespace=K8S_NS) == 2


async def test_replicas_started_but_not_registered_hold_back_the_next_scale_up(
    start_mesh: MeshFactory,
) -> None:
    p = policy()
    mesh = await start_mesh(p, replicas=1)
    await mesh.register("calc-0")
    await mesh.lease()
    await mesh.misses(10)
    await eventually(lambda: len(mutations(mesh.fake)) >= 1, what="the first scale patch")
    assert mutations(mesh.fake) == [scale_patch(2)]

    # The new pod has started but its agent has not registered: it is pending capacity.
    mesh.fake.add_pod("calc-1", deployment=DEPLOYMENT, namespace=K8S_NS)
    await mesh.misses(10)
    await past_window(p)
    await mesh.misses(10)
    await past_window(p)
    assert mutations(mesh.fake) == [scale_patch(2)]

    # It registers; once its slot is taken too, misses go on and the next patch comes.
    await mesh.register("calc-1")
    await mesh.lease()
    await mesh.misses(10)
    await eventually(lambda: len(mutations(mesh.fake)) >= 2, what="the second scale patch")
    await past_window(p)
    assert mutations(mesh.fake) == [scale_patch(2), scale_patch(3)]


async def test_a_lost_agents_pod_is_deleted_exactly_once(start_mesh: MeshFactory) -> None:
    mesh = await start_mesh(policy(), replicas=2)
    await mesh.register("calc-0")
    lost = await mesh.register("calc-1")

    await lost.stop_heartbeats()  # 3 x 0.5 s of silence and the manager declares it lost

    await eventually(lambda: len(mutations(mesh.fake)) >= 1, what="the pod's deletion")
    await asyncio.sleep(3.0)  # several more ticks, and as many heartbeat rules, go by
    assert mutations(mesh.fake) == [("DELETE", pod("calc-1"), None)]
    assert not mesh.fake.has_pod("calc-1", namespace=K8S_NS)
    assert mesh.fake.has_pod("calc-0", namespace=K8S_NS)


async def test_scale_down_removes_only_idle_agents_never_one_with_work_in_flight(
    start_mesh: MeshFactory,
) -> None:
    p = policy(window_s=1.0, scale_down_idle_s=1.5)
    mesh = await start_mesh(p, replicas=4)
    busy = {}
    for agent_id in ("calc-0", "calc-1"):  # each holds a lease at once: never idle
        await mesh.register(agent_id, max_concurrency=2)
        busy[agent_id] = await mesh.lease(agent_id)
    await mesh.register("calc-2", max_concurrency=2)  # idle the longest
    await mesh.register("calc-3", max_concurrency=2)

    await eventually(lambda: len(mutations(mesh.fake)) >= 4, what="two scale-downs")
    await asyncio.sleep(3 * p.window_s)  # nothing else is idle: no third one
    assert mutations(mesh.fake) == [
        cost_patch("calc-2"),
        scale_patch(3),
        cost_patch("calc-3"),
        scale_patch(2),
    ]
    assert mesh.fake.pod_annotations("calc-0", namespace=K8S_NS) == {}
    assert mesh.fake.pod_annotations("calc-1", namespace=K8S_NS) == {}

    # Once calc-0's work is done and it has been idle long enough, it may go too.
    released = await mesh.client.release(busy["calc-0"].lease_id)
    assert not isinstance(released, Refusal), released
    await eventually(lambda: len(mutations(mesh.fake)) >= 6, what="the third scale-down")
    await asyncio.sleep(2 * p.window_s)  # min_replicas=1: calc-1 stays
    assert mutations(mesh.fake)[4:] == [cost_patch("calc-0"), scale_patch(1)]
    assert mesh.fake.pod_annotations("calc-1", namespace=K8S_NS) == {}
