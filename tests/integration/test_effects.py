"""Effects at most once over the real broker: a granted task delivered again (as a broker
redelivers after a lost ack) is answered from the record of the agent that answered it, and
on another agent sharing the effect log it runs its handler but not its effect; a
redelivered task whose admission the ledger settled already is not run by an agent that
started after the release; and a silence the manager did not count as lost keeps a finished
result."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from mesh.agent import Agent, AgentRuntime, AgentSettings, capability, current_task, once
from mesh.agent.effects import SqliteEffectLog
from mesh.samples import SAMPLES
from mesh.topology import names
from mesh.transport import AmqpTransport, Delivery
from mesh.wire import Task, TaskResult, decode_as

from .harness import eventually
from .test_backpressure import echo_requirements, pool_mesh

OBJECT = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"}


class Charger(Agent):
    """Pool ``echo``'s capability, with a side effect: one charge per task."""

    deployment = "echo"

    def __init__(self, agent_id: str, log: SqliteEffectLog, charges: list[str]) -> None:
        super().__init__(agent_id, heartbeat_interval_s=5.0)
        self.effects = log
        self.charges = charges  # every charge made, by any agent sharing the list
        self.seen: list[tuple[str, int]] = []

    @capability("test.echo", version="1.0.0", input_schema=OBJECT, output_schema=OBJECT)
    async def charge(self, payload: dict[str, Any]) -> dict[str, Any]:
        task = current_task()
        self.seen.append((task.idempotency_key, task.attempt))

        async def effect() -> str:
            self.charges.append(task.idempotency_key)
            return f"receipt-{len(self.charges)}"

        return {"receipt": await once("charge", effect, log=self.effects)}


async def test_a_task_delivered_twice_charges_once(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """The same task three times: to the agent that answered it (answered from its record,
    the handler not run), then — that agent gone — to another agent sharing its effect log
    (the handler runs, the effect does not: its recorded receipt comes back)."""
    charges: list[str] = []
    log_path = tmp_path / "effects.sqlite3"
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=4, agents=0) as mesh:
        agent = Charger("charger-1", SqliteEffectLog(log_path), charges)
        runtime = AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))
        await runtime.start()
        other: AgentRuntime | None = None
        raw = await AmqpTransport.connect(amqp_url, name="duplicates")
        try:
            decision = await mesh.producer.admit(echo_requirements())
            assert decision.grant is not None, decision
            task = Task(
                task_id=uuid.uuid4().hex,
                capability="test.echo",
                payload={"card": "4242"},
                deadline=time.time() + 30,
                submitted_at=time.time(),
                grant=decision.grant,
            )
            reply_queue = await raw.declare_reply_queue(f"{namespace}.replies")
            results: list[TaskResult] = []

            async def on_reply(delivery: Delivery) -> None:
                results.append(decode_as(delivery.body, TaskResult))

            await raw.consume(reply_queue, on_reply, no_ack=True)

            async def deliver(n: int) -> None:  # the same task, as a redelivery brings it
                await raw.publish(
                    mesh.topology.tasks_exchange,
                    names.pool_task_key("echo"),
                    task,
                    reply_to=reply_queue,
                    correlation_id=task.task_id,
                )
                await eventually(lambda: len(results) >= n, what=f"result {n}")

            await deliver(1)
            await deliver(2)
            assert runtime.counters["tasks_answered_again"] == 1
            assert len(agent.seen) == 1  # the handler ran once on charger-1
            await runtime.stop()
            second = Charger("charger-2", SqliteEffectLog(log_path), charges)
            other = AgentRuntime(second, AgentSettings(amqp_url=amqp_url, namespace=namespace))
            await other.start()
            await deliver(3)

            assert [r.status for r in results] == ["ok"] * 3
            assert [r.output for r in results] == [{"receipt": "receipt-1"}] * 3
            key = f"admission:{decision.grant.admission_id}"
            assert charges == [key]  # one charge in all
            assert second.seen == [(key, 1)]  # its handler ran, and once() answered it
        finally:
            await raw.close()
            await runtime.stop()
            if other is not None:
                await other.stop()


async def test_a_silence_the_manager_did_not_count_as_lost_keeps_the_finished_result(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """The agent's own clock says it was silent past its self-fence (here set to 1 s, while
    a 2.5 s task blocks its next heartbeat, which is due only every 5 s), but the manager,
    whose window is 15 s, never declared it lost: the agent asks, hears it is registered,
    and delivers the result — the task runs once (it used to be withheld and run again)."""
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=4, agents=0) as mesh:
        runtime = AgentRuntime(
            SAMPLES["echo"]("echo-quiet", heartbeat_interval_s=5.0),
            AgentSettings(amqp_url=amqp_url, namespace=namespace, self_fence_after_s=1.0),
        )
        await runtime.start()
        try:
            done = await mesh.producer.submit(
                echo_requirements(), {"message": "once", "sleep_ms": 2500}, timeout_s=20
            )

            assert done.output == {"message": "once", "slept_ms": 2500}
            assert runtime.counters["silences"] == 1
            assert runtime.counters["silences_survived"] == 1
            assert runtime.counters["results_fenced"] == 0
            assert runtime.counters["tasks_ok"] == 1  # run once, not withheld and run again
            assert mesh.manager.counters["standing.registered"] == 1
        finally:
            await runtime.stop()


async def test_a_redelivered_task_of_a_settled_admission_is_not_run_by_an_agent_started_since(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """A consumer takes two granted tasks and dies before acking them (its connection
    closes: the broker requeues them, marked redelivered); meanwhile one admission was
    released — its task answered, as far as the producer knows. An agent started after the
    release never heard its revocation: it asks the ledger about each redelivered task, runs
    the task whose admission is still ACTIVE, and refuses the settled one at claim. (A
    member that never consumes gives the pool its live capacity.)"""
    charges: list[str] = []
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=4, agents=0, members=1
    ) as mesh:
        granted = [await mesh.producer.admit(echo_requirements()) for _ in range(2)]
        settled, active = (decision.grant for decision in granted)
        assert settled is not None and active is not None, granted
        watcher = await AmqpTransport.connect(amqp_url, name="replies")
        runtime: AgentRuntime | None = None
        try:
            reply_queue = await watcher.declare_reply_queue(f"{namespace}.replies-kept")
            results: list[TaskResult] = []

            async def on_reply(delivery: Delivery) -> None:
                results.append(decode_as(delivery.body, TaskResult))

            await watcher.consume(reply_queue, on_reply, no_ack=True)
            task_of: dict[str, str] = {}  # admission ID -> task ID
            raw = await AmqpTransport.connect(amqp_url, name="dies-before-ack")
            try:
                for grant in (settled, active):
                    task = Task(
                        task_id=uuid.uuid4().hex,
                        capability="test.echo",
                        payload={"card": "4242"},
                        deadline=time.time() + 30,
                        submitted_at=time.time(),
                        grant=grant,
                    )
                    task_of[grant.admission_id] = task.task_id
                    await raw.publish(
                        mesh.topology.tasks_exchange,
                        names.pool_task_key("echo"),
                        task,
                        reply_to=reply_queue,
                        correlation_id=task.task_id,
                    )
                taken: list[Delivery] = []

                async def take(delivery: Delivery) -> None:
                    taken.append(delivery)  # and never acked

                await raw.consume(mesh.queue, take, prefetch=2)
                await eventually(lambda: len(taken) == 2, what="both tasks taken")
                released = await mesh.producer.release_admission(settled)
                assert released.released, released
            finally:
                await raw.close()  # unacked: both go back to the pool queue, redelivered

            agent = Charger("charger-late", SqliteEffectLog(tmp_path / "fx.sqlite3"), charges)
            runtime = AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))
            await runtime.start()
            await eventually(lambda: len(results) == 2, what="both redelivered tasks answered")
            await asyncio.sleep(0.5)  # nothing else comes

            by_task = {r.task_id: r for r in results}
            refused = by_task[task_of[settled.admission_id]]
            assert refused.status == "error" and refused.error is not None, refused
            assert refused.error.code.value == "GRANT_INVALID"
            assert "settled in the ledger already (RELEASED" in refused.error.message
            assert by_task[task_of[active.admission_id]].status == "ok"
            key = f"admission:{active.admission_id}"
            assert [k for k, _ in agent.seen] == [key]  # the settled one never ran
            assert charges == [key]
            assert runtime.counters["tasks_settled_before_claim"] == 1
            assert mesh.manager.counters["admission_state.released"] == 1
            assert mesh.manager.counters["admission_state.active"] == 1
        finally:
            await watcher.close()
            if runtime is not None:
                await runtime.stop()
