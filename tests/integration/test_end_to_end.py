"""Manager, SDK agents and the producer helper together on the real broker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mesh.agent import Agent, AgentRuntime, AgentSettings
from mesh.errors import PublishNacked, TaskInputInvalid, TaskRefused, TaskTimeout
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.transport import AmqpTransport
from mesh.wire import Lease, LeaseNotice, Refusal
from mesh.wire.reasons import Reason

from .harness import echo_capability, eventually, live_member, manager_settings, start_manager

RuntimeFactory = Callable[..., Awaitable[AgentRuntime]]


@pytest.fixture
async def start_agent(amqp_url: str, namespace: str) -> AsyncIterator[RuntimeFactory]:
    runtimes: list[AgentRuntime] = []

    async def start(sample: str, agent_id: str, **settings: Any) -> AgentRuntime:
        agent: Agent = SAMPLES[sample](agent_id, heartbeat_interval_s=5.0)
        runtime = AgentRuntime(
            agent, AgentSettings(amqp_url=amqp_url, namespace=namespace, **settings)
        )
        await runtime.start()
        runtimes.append(runtime)
        return runtime

    yield start
    for runtime in reversed(runtimes):
        await runtime.stop()


async def test_tasks_run_on_the_cheapest_agent_that_offers_the_capability(
    client: MeshClient, start_agent: RuntimeFactory
) -> None:
    await start_agent("calc", "calc-a")
    await start_agent("textstats", "text-a")

    calc = await client.run_task("math.evaluate", {"expression": "6 * 7"}, version_spec=">=1,<2")
    stats = await client.run_task("text.stats", {"text": "one two two"}, version_spec="~=1.2")

    assert calc.output["value"] == 42
    assert calc.lease.agent_id == "calc-a"
    assert stats.output["words"] == 3
    assert stats.lease.agent_id == "text-a"


async def test_a_payload_that_violates_the_input_schema_is_a_typed_error_for_the_producer(
    client: MeshClient, start_agent: RuntimeFactory
) -> None:
    await start_agent("calc", "calc-strict")

    with pytest.raises(TaskInputInvalid) as caught:
        await client.run_task("math.evaluate", {"expr": "1 + 1"})

    assert caught.value.code == "INPUT_SCHEMA_VIOLATION"
    assert "expression" in caught.value.message
    # The slot was released: the next good task runs.
    assert (await client.run_task("math.evaluate", {"expression": "1+1"})).output["value"] == 2


async def test_a_task_whose_lease_notice_was_lost_asks_the_manager_and_runs(
    manager: ManagerService, client: MeshClient, start_agent: RuntimeFactory
) -> None:
    """A lease notice lost on its way (published while the agent's control queue was being
    declared again after a broker restart, as CI saw): the task, on the agent's own queue
    under a lease it was not told of, asks the manager, which tells it again — and it runs
    (it used to be refused NOT_AUTHORIZED after the wait)."""
    runtime = await start_agent("calc", "calc-deaf", open_tasks=False)
    told = runtime.credentials.on_lease_notice
    lost: list[LeaseNotice] = []

    def losing_notices_until_it_asks(notice: LeaseNotice) -> None:
        if runtime.counters["lease_state_asked"] == 0:
            lost.append(notice)  # as if never delivered
        else:
            told(notice)

    runtime.credentials.on_lease_notice = losing_notices_until_it_asks  # type: ignore[method-assign]

    outcome = await client.run_task("math.evaluate", {"expression": "6 * 7"})

    assert outcome.output["value"] == 42
    assert [n.lease_id for n in lost] == [outcome.lease.lease_id]
    assert runtime.counters["tasks_without_credentials"] == 0
    assert manager.counters["lease_state.live"] >= 1


async def test_a_task_under_a_lease_that_ended_is_refused_when_the_manager_says_so(
    manager: ManagerService, client: MeshClient, start_agent: RuntimeFactory
) -> None:
    runtime = await start_agent("calc", "calc-strict-lease", open_tasks=False)
    lease = await client.acquire("math.evaluate")
    assert isinstance(lease, Lease)
    await client.release(lease.lease_id)
    await eventually(lambda: lease.lease_id in runtime.credentials.ended, what="the end notice")
    runtime.credentials.ended.clear()  # the end notice forgotten: only the manager's answer is left

    asked = runtime.counters["lease_state_asked"]
    result = await client._send_and_wait(lease, {"expression": "1+1"}, time.time() + 10)
    assert result.error is not None and result.error.code == "UNKNOWN_LEASE"
    assert runtime.counters["lease_state_asked"] > asked
    assert manager.counters["lease_state.ended"] >= 1


async def test_draining_an_agent_with_tasks_in_flight_loses_none_of_them(
    manager: ManagerService, client: MeshClient, start_agent: RuntimeFactory
) -> None:
    runtime = await start_agent("echo", "echo-drain")
    tasks = [
        asyncio.create_task(client.run_task("test.echo", {"message": f"task {i}", "sleep_ms": 800}))
        for i in range(6)
    ]
    await eventually(
        lambda: manager.core.agents["echo-drain"].in_flight == 6, what="six leases held"
    )

    accepted = await client.drain("echo-drain", "test drain under load")
    assert getattr(accepted, "in_flight", None) == 6
    refused = await client.acquire("test.echo")
    assert getattr(refused, "reason", None) == "NO_AGENT_AVAILABLE"
    # run_task refuses the same way, and passes on the manager's hint of when to ask again.
    with pytest.raises(TaskRefused) as refused_task:
        await client.run_task("test.echo", {"message": "one more"}, timeout_s=5)
    assert refused_task.value.code == "NO_AGENT_AVAILABLE"
    hint = getattr(refused, "retry_after_ms", None)
    assert hint is not None and refused_task.value.retry_after_ms == hint

    results = await asyncio.gather(*tasks)
    assert sorted(r.output["message"] for r in results) == sorted(f"task {i}" for i in range(6))
    await asyncio.wait_for(runtime.stopped.wait(), 15)
    assert "echo-drain" not in manager.core.agents
    assert manager.core.counters["released"] == 6


async def test_after_a_manager_restart_agents_register_again_and_work_resumes(
    amqp_url: str, namespace: str, tmp_path: Path, start_agent: RuntimeFactory
) -> None:
    journal = tmp_path / "journal.sqlite3"
    first = await start_manager(manager_settings(namespace, journal, amqp_url=amqp_url))
    await start_agent("calc", "calc-survivor")
    await first.stop()

    second = await start_manager(manager_settings(namespace, journal, amqp_url=amqp_url))
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="e2e-after-restart")
    try:
        # The agent's next heartbeat (interval 5 s) reaches a manager that does not know it.
        await eventually(
            lambda: "calc-survivor" in second.core.agents, timeout_s=20, what="re-registration"
        )
        outcome = await client.run_task("math.evaluate", {"expression": "2 ** 10"})
        assert outcome.output["value"] == 1024
    finally:
        await client.close()
        await second.stop()


async def test_an_agent_whose_connection_is_cut_reconnects_and_keeps_serving(
    client: MeshClient, start_agent: RuntimeFactory, management_api: Any
) -> None:
    await start_agent("calc", "calc-cut")
    assert (await client.run_task("math.evaluate", {"expression": "1+2"})).output["value"] == 3

    assert await asyncio.to_thread(management_api.close_connections, "agent:calc-cut") >= 1

    async def serves() -> bool:
        try:
            outcome = await client.run_task("math.evaluate", {"expression": "3+4"}, timeout_s=2)
        except Exception:
            return False
        return outcome.output["value"] == 7

    await eventually(serves, timeout_s=30, what="the agent to serve again after reconnecting")


async def test_a_drain_that_outlasts_its_deadlines_answers_and_dead_letters_what_it_cannot_finish(
    manager: ManagerService,
    client: MeshClient,
    start_agent: RuntimeFactory,
    topology: Any,
) -> None:
    runtime = await start_agent(
        "echo", "echo-slow", drain_timeout_s=1.0, shutdown_grace_s=1.0, stop_timeout_s=1.0
    )
    tasks = [
        asyncio.create_task(
            client.run_task("test.echo", {"message": f"slow {i}", "sleep_ms": 8000}, timeout_s=30)
        )
        for i in range(3)
    ]
    await eventually(
        lambda: manager.core.agents["echo-slow"].in_flight == 3, what="three leases held"
    )

    await runtime.drain("test: deadlines shorter than the work")
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    # Nothing hangs until the producer's timeout and nothing vanishes: each task is answered
    # with AGENT_SHUTDOWN at once and kept in the dead-letter queue with that reason.
    assert [getattr(o, "code", o) for o in outcomes] == ["AGENT_SHUTDOWN"] * 3
    assert runtime.counters["tasks_given_up"] == 3
    reasons = []
    for _ in range(3):
        letter = await client.transport.get_one(topology.dead_letter_queue)
        assert letter is not None
        reasons.append(letter.headers["x-mesh-reason"])
    assert reasons == ["AGENT_SHUTDOWN"] * 3


async def test_a_full_agent_queue_is_waited_out_by_run_task_until_its_deadline(
    amqp_url: str, manager: ManagerService, client: MeshClient, management_api: Any
) -> None:
    """The agent's task queue refuses the task (full — or a channel RabbitMQ 3.10 keeps
    refusing after a queue leader's death): ``run_task`` sends the same task (one task ID)
    under a new lease after a pause, until its deadline; only then is ``QUEUE_FULL`` raised.
    Once the queue has room the task goes in."""
    transport = await AmqpTransport.connect(amqp_url, name="stuck-agent")
    try:
        member = await live_member(manager, transport, "stuck-1", "raw", echo_capability())
        queue = manager.topology.agent_task_queue(member.agent_id)
        for _ in range(20):  # nobody consumes it: fill it (a quorum queue takes one more)
            try:
                await transport.publish(manager.topology.tasks_exchange, member.agent_id, b"{}")
            except PublishNacked:
                break
        else:
            raise AssertionError(f"{queue} took 20 messages: not bounded")
        started = time.monotonic()
        with pytest.raises(TaskRefused) as refused:
            await client.run_task("test.echo", {"message": "waits"}, timeout_s=2)
        assert refused.value.code == "QUEUE_FULL"
        assert time.monotonic() - started >= 1.0  # waited (to the last pause that fits)
        retries = client.counters["run_task_queue_full_retries"]
        assert retries >= 2

        waiting = asyncio.create_task(client.run_task("test.echo", {"message": "in"}, timeout_s=4))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(management_api.purge_queue, queue)  # room again
        with pytest.raises(TaskTimeout):  # in the queue now; nobody runs it
            await waiting
        assert client.counters["run_task_queue_full_retries"] > retries
        assert await transport.queue_depth(queue) == 1
    finally:
        await transport.close()


async def test_an_acquire_answered_lease_gone_is_asked_anew(
    client: MeshClient, start_agent: RuntimeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request asked again after a reconnect (same correlation ID, so the same lease ID) can
    be answered UNKNOWN_LEASE: its first ask was granted, the grant could not be delivered
    (the reply queue gone with a node) and the manager released it at once. ``run_task``
    then asks anew — a new request, a new lease — instead of failing the call (it failed
    one call in a cluster run)."""
    await start_agent("calc", "calc-gone")
    real_acquire, answers = client.acquire, []

    async def first_one_gone(*args: Any, **kwargs: Any) -> Any:
        if not answers:
            answers.append("gone")
            return Refusal(
                reason=Reason.UNKNOWN_LEASE, detail="lease 'x' was already granted and has ended"
            )
        return await real_acquire(*args, **kwargs)

    monkeypatch.setattr(client, "acquire", first_one_gone)
    outcome = await client.run_task("math.evaluate", {"expression": "6 * 7"}, timeout_s=10)

    assert outcome.output["value"] == 42
    assert client.counters["acquire_lease_gone_retries"] == 1
