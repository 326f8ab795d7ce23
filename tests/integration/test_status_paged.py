"""``mesh status`` against a real manager: the summary by pool and state from the manager's
running tally, agent rows a page at a time, and an older client's request still answered
with every row (real broker, real manager, the real ``mesh`` process)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.transport import AmqpTransport
from mesh.wire import StatusReply, StatusRequest

from .harness import RawAgent, echo_capability, eventually

POOLS = {"alpha": 7, "beta": 5}  # 12 agents


async def mesh(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_summarises_by_pool_and_pages_agent_rows(
    manager: ManagerService, client: MeshClient, amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    transport = await AmqpTransport.connect(amqp_url, name="status-paged-agents")
    try:
        agents = [
            RawAgent(
                transport,
                manager.topology,
                f"{pool}-{n:02d}",
                deployment=pool,
                capabilities=[echo_capability()],
            )
            for pool, size in POOLS.items()
            for n in range(size)
        ]
        for agent in agents:
            await agent.start()
            await agent.register()
            agent.start_heartbeats()
        await eventually(lambda: len(manager.core.agents) == 12, what="12 registrations")

        base = ("--amqp-url", amqp_url, "--namespace", namespace, "status")
        code, out, err = await mesh(*base)
        assert code == 0, err
        assert out.splitlines()[0].endswith("· 12 agent(s): Ready 12")
        assert [line.split() for line in out.splitlines() if line.startswith(("alpha", "beta"))][
            :2
        ] == [["alpha", "7"], ["beta", "5"]]
        assert "(12 agent(s): list them with --agents, a page at a time)" in out
        assert "alpha-00" not in out  # no rows unless asked

        code, out, err = await mesh(*base, "--agents", "--offset", "5", "--limit", "4")
        assert code == 0, err
        rows = [
            line.split()[0] for line in out.splitlines() if line.startswith(("alpha-", "beta-"))
        ]
        assert rows == ["alpha-05", "alpha-06", "beta-00", "beta-01"]  # agent-ID order
        assert "(agents 6 to 9 of 12; next page: --offset 9)" in out

        code, out, err = await mesh(*base, "--agents", "--limit", "0")
        assert code == 2 and "from 1 to 5,000 rows a page" in err

        # An older client's request (no agents_limit): every row, and no summary fields.
        legacy = await client.request(StatusRequest())
        assert isinstance(legacy, StatusReply)
        assert len(legacy.agents) == 12 and legacy.agents_total is None
        assert legacy.pool_states is None and legacy.capability_loads is None

        paged = await client.status(agents_limit=0)
        assert paged.agents == [] and paged.agents_total == 12
        assert {p.pool_id: p.states for p in paged.pool_states or []} == {
            "alpha": {"Ready": 7},
            "beta": {"Ready": 5},
        }
        (load,) = paged.capability_loads or []
        assert (load.name, load.agents, load.taking_work) == ("test.echo", 12, 12)
    finally:
        for agent in agents:
            await agent.stop_heartbeats()
        await transport.close()
