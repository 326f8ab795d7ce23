"""Backpressure on the real broker: the producer's ``submit``, the pool's bounded queue,
staged shedding under stair-step and pulse load, jittered retry times, tenant fairness.

Every test runs a real manager (SQLite ledger), real echo agents (pool ``echo``: the sample
sleeps ``sleep_ms`` and answers) and real producers; bounds are read from the broker's
management API and, exactly, by passive declares.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
from unit.samples import DESCRIPTOR

from mesh.agent import AgentRuntime, AgentSettings
from mesh.core.pressure import PressurePolicy, Stage
from mesh.errors import AdmissionRefused, PublishNacked, SubmitDeadlineExceeded
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.transport import AmqpTransport
from mesh.wire import AdmissionDecision, AdmissionReason, CapabilityRange, TaskRequirements
from mesh.wire.admission import ModelLimits

from .harness import echo_capability, eventually, live_member, start_manager
from .test_admission import fresh, settings_for

ECHO = CapabilityRange(name="test.echo", version_spec=">=1,<2")


def echo_descriptor(slots: int) -> Any:
    return fresh(
        DESCRIPTOR,
        pool_id="echo",
        capabilities=[ECHO],
        tools=[],
        model_limits=ModelLimits(context_tokens=8_000, max_output_tokens=1_000, slots=slots),
    )


def echo_requirements(service_class: str = "interactive", **changes: Any) -> TaskRequirements:
    return TaskRequirements(
        capability=ECHO,
        task_schema_version="1.0.0",
        result_schema_version="1.0.0",
        input_classifications=["internal"],
        estimated_tokens=10,
        estimated_duration_s=0.2,
        service_class=service_class,  # type: ignore[arg-type]
        **changes,
    )


@dataclass
class PoolMesh:
    manager: ManagerService
    producer: MeshClient
    agents: list[AgentRuntime]
    topology: Topology
    slots: int
    clients: list[MeshClient] = field(default_factory=list)

    @property
    def queue(self) -> str:
        return self.topology.pool_task_queue("echo")

    @property
    def bound(self) -> int:
        return self.topology.pool_queue_bound(self.slots)

    def ledger_holding(self) -> tuple[int, int, int]:
        """(model slots used, reservations holding them, capacity), read in one go."""
        assert self.manager.admitter is not None
        ledger = self.manager.admitter.ledger
        used, capacity = ledger.usage()[("echo", "model_slots")]
        holding = [r for r in ledger.active() if r.pool_id == "echo"]
        return used, len(holding), capacity

    async def client(self, amqp_url: str, name: str) -> MeshClient:
        client = await MeshClient.connect(amqp_url, namespace=self.topology.namespace, name=name)
        self.clients.append(client)
        return client


async def wait_for_bound(management_api: Any, queue: str, slots: int) -> dict[str, Any]:
    """The queue's policy bound, once the broker applies it (quorum queues take a moment)."""
    info: dict[str, Any] = {}

    def applied() -> bool:
        nonlocal info
        info = management_api.get_queue(queue)
        return (info.get("effective_policy_definition") or {}).get("max-length") == slots

    await eventually(applied, what=f"{queue} bounded at {slots} by its policy")
    return info


async def wait_until_enforced(
    management_api: Any, transport: AmqpTransport, mesh: PoolMesh, timeout_s: float = 15.0
) -> None:
    """Until the broker nacks a publish over the pool queue's bound, then empty the queue.

    The management API shows a policy's ``max-length`` as soon as the policy matches, but a
    quorum queue enforces it only once the change has gone through its Raft log, a moment
    later: a publish in between is accepted past the bound. Probing is the only view of the
    bound that is actually in force."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await transport.publish(mesh.topology.tasks_exchange, "pool.echo", b'{"probe": 1}')
        except PublishNacked:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{mesh.queue} took publishes past its bound for {timeout_s} s")
        await asyncio.sleep(0.05)
    management_api.purge_queue(mesh.queue)
    await eventually(
        lambda: _is_empty(transport, mesh.queue), what=f"{mesh.queue} empty after the probes"
    )


async def _is_empty(transport: AmqpTransport, queue: str) -> bool:
    return await transport.queue_depth(queue) == 0


@asynccontextmanager
async def pool_mesh(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    management_api: Any,
    *,
    slots: int,
    agents: int,
    members: int = 0,
    pressure: PressurePolicy | None = None,
) -> AsyncIterator[PoolMesh]:
    """A manager, a producer, ``agents`` SDK echo agents of pool ``echo``, and ``members``
    raw agents of the pool that register and heartbeat but never take a task (live capacity
    whose grants stay in the pool's queue: a stuck consumer)."""
    parts = urlsplit(management_api.base_url)
    amqp = urlsplit(amqp_url)
    policy = AdmissionPolicy(
        active_generation=DESCRIPTOR.policy_generation,
        grant_ttl_s=60,
        pressure=pressure or PressurePolicy(),
    )
    settings = dataclasses.replace(
        settings_for(amqp_url, namespace, tmp_path, admission=policy),
        management_url=f"{parts.scheme}://{amqp.username}:{amqp.password}@{parts.netloc}",
        queue_poll_interval_s=0.5,
    )
    manager = await start_manager(settings)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    runtimes = [
        AgentRuntime(
            SAMPLES["echo"](f"echo-{i}", heartbeat_interval_s=5.0),
            AgentSettings(amqp_url=amqp_url, namespace=namespace),
        )
        for i in range(agents)
    ]
    mesh = PoolMesh(manager, producer, runtimes, Topology(namespace=namespace), slots)
    raw = await AmqpTransport.connect(amqp_url, name="echo-members")
    try:
        for i in range(members):
            await live_member(manager, raw, f"echo-stuck-{i}", "echo", echo_capability("1.0.0", 8))
        accepted = await producer.publish_descriptor(echo_descriptor(slots))
        assert accepted.type == "mesh.descriptor-accepted.v1", accepted
        await wait_for_bound(management_api, mesh.queue, slots)
        await wait_until_enforced(management_api, raw, mesh)
        for runtime in runtimes:
            await runtime.start()
        for runtime in runtimes:
            await eventually(
                lambda r=runtime: r.counters["pool_subscriptions"] >= 1,  # type: ignore[misc]
                what=f"{runtime.agent_id} consumes the pool queue",
            )
        yield mesh
    finally:
        for runtime in runtimes:
            await runtime.stop()
        await raw.close()
        for client in mesh.clients:
            await client.close()
        await producer.close()
        await manager.stop()


# ---- the producer's one call ----------------------------------------------------------------
async def test_submit_admits_runs_on_the_pool_queue_and_settles(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=4, agents=1) as mesh:
        done = await mesh.producer.submit(echo_requirements(), {"message": "hi", "sleep_ms": 20})

        assert done.output == {"message": "hi", "slept_ms": 20}
        assert done.result.agent_id == "echo-0"
        grant = done.decision.grant
        assert grant is not None and grant.pool_id == "echo" and done.attempts == 1
        # Settled with what the work took: the slot is back, the service time measured.
        await eventually(lambda: mesh.ledger_holding() == (0, 0, 4), what="the slot is back")
        assert mesh.manager.admitter is not None
        board = mesh.manager.admitter.pressure.pools["echo"]
        assert board.mean_service_s() is not None and board.used == 0
        # The queue operators see: quorum, reject-publish, DLX, a fixed ceiling in its
        # arguments, and the policy that bounds it at the pool's slots.
        info = management_api.get_queue(mesh.queue)
        args = info["arguments"]
        assert args["x-queue-type"] == "quorum"
        assert args["x-max-length"] == mesh.topology.pool_queue_max_length
        assert args["x-overflow"] == "reject-publish"
        assert args["x-dead-letter-exchange"] == mesh.topology.dead_letter_exchange
        assert args["x-delivery-limit"] == 5
        assert info["policy"] == mesh.topology.pool_bound_policy("echo", 4).name
        assert info["effective_policy_definition"]["max-length"] == 4


async def test_a_deleted_pool_queue_is_declared_again_and_its_agents_take_tasks_from_it(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    # An operator deletes the pool queue (the management UI's "Delete"): RabbitMQ cancels the
    # agents' consumers. The manager finds it gone at its next poll and declares it again,
    # with its bound; the agents look for it until it is back, and tasks flow again.
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=4, agents=2) as mesh:
        before = [r.counters["pool_subscriptions"] for r in mesh.agents]
        management_api._delete(
            f"/api/queues/{management_api._q(management_api.vhost)}/{mesh.queue}"
        )
        await eventually(
            lambda: all(r.counters["pool_queue_lost"] == 1 for r in mesh.agents),
            what="the agents told their consumers were cancelled",
        )
        await eventually(
            lambda: mesh.manager.admission.counters["pool_queue_redeclared"] >= 1,
            what="the manager declares the queue again",
        )
        await eventually(
            lambda: all(
                r.counters["pool_subscriptions"] == b + 1
                for r, b in zip(mesh.agents, before, strict=True)
            ),
            what="the agents consume it again",
        )
        await wait_for_bound(management_api, mesh.queue, mesh.slots)
        done = await mesh.producer.submit(echo_requirements(), {"message": "back", "sleep_ms": 0})
        assert done.output == {"message": "back", "slept_ms": 0}


async def test_a_full_pool_queue_nacks_the_producer_and_every_grant_is_given_back(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """The ledger keeps the queue below its bound; tasks published around it (here by hand)
    fill it; then a granted task is nacked: ``QUEUE_FULL``, the grant settled, retried until
    the deadline, which raises with the last reason code. Nothing is dropped silently."""
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=2, agents=0, members=1
    ) as mesh:
        transport = mesh.producer.transport
        accepted = 0
        with pytest.raises(PublishNacked):
            for i in range(10):
                await transport.publish(
                    mesh.topology.tasks_exchange, "pool.echo", f'{{"stray": {i}}}'.encode()
                )
                accepted += 1
        # The policy's max-length is the 2 slots; the quorum queue takes one more, never two.
        assert accepted == mesh.bound == 3
        assert await transport.queue_depth(mesh.queue) == mesh.bound

        # Retried until the deadline, which raises with the last reason code — or, when the
        # last retry leaves less time than the work takes, the manager rejects it
        # DEADLINE_UNREACHABLE (a rejection: AdmissionRefused, as submit documents).
        with pytest.raises((SubmitDeadlineExceeded, AdmissionRefused)) as raised:
            await mesh.producer.submit(
                echo_requirements(), {"message": "late", "sleep_ms": 0}, timeout_s=1.5
            )

        if isinstance(raised.value, SubmitDeadlineExceeded):
            assert raised.value.last_reason == "QUEUE_FULL"
            assert raised.value.attempts >= 2
        else:
            reason = raised.value.decision.reason
            assert reason is not None and reason.value == "DEADLINE_UNREACHABLE", reason
        assert mesh.producer.counters["queue_full"] >= 2
        # Every nacked grant is settled; the last release may land just after the deadline
        # cut the attempt short, so wait for the ledger's state rather than for a time.
        await eventually(
            lambda: mesh.ledger_holding() == (0, 0, 2), what="every nacked grant settled"
        )
        assert await transport.queue_depth(mesh.queue) == mesh.bound  # the bound held
        assert (
            management_api.wait_for_queue(mesh.queue, "messages", mesh.bound)["messages"]
            == mesh.bound
        )


async def stuff(transport: AmqpTransport, topology: Topology, limit: int = 50) -> int:
    """Publish stray tasks to pool ``echo`` until the broker nacks one; how many it took."""
    for i in range(limit):
        try:
            await transport.publish(topology.tasks_exchange, "pool.echo", b'{"stray": %d}' % i)
        except PublishNacked:
            return i
    raise AssertionError(f"the pool queue took {limit} tasks without a nack")


async def test_a_changed_capacity_moves_the_queues_bound_without_a_new_queue(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """A descriptor of a new epoch with other slots changes the pool queue's policy, not the
    queue: the manager answers, keeps its connection, and the broker bounds the same queue
    at the new slots (RabbitMQ 3.10 answered the old delete-and-redeclare of an empty quorum
    queue with 540 NOT_IMPLEMENTED, which closed the manager's connection)."""
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=2, agents=0, members=1
    ) as mesh:
        before = management_api.get_queue(mesh.queue)
        bigger = fresh(echo_descriptor(5), descriptor_epoch=echo_descriptor(2).descriptor_epoch + 1)

        answer = await mesh.producer.publish_descriptor(bigger)

        assert answer.type == "mesh.descriptor-accepted.v1", answer
        after = await wait_for_bound(management_api, mesh.queue, 5)
        assert after["arguments"] == before["arguments"]
        assert mesh.manager.counters["reconnects"] == 0
        assert mesh.manager.counters["pool_queue_declare_failed"] == 0
        transport = mesh.producer.transport
        assert await stuff(transport, mesh.topology) == mesh.topology.pool_queue_bound(5) == 6

        # And back down: the queue holds 6, the new bound is 3; nothing is dropped, new
        # publishes are nacked until it drains below the bound.
        smaller = fresh(echo_descriptor(3), descriptor_epoch=bigger.descriptor_epoch + 1)
        assert (await mesh.producer.publish_descriptor(smaller)).type == (
            "mesh.descriptor-accepted.v1"
        )
        await wait_for_bound(management_api, mesh.queue, 3)
        assert await stuff(transport, mesh.topology) == 0
        assert await transport.queue_depth(mesh.queue) == 6
        assert mesh.manager.counters["reconnects"] == 0


async def test_a_deferred_request_keeps_its_place_in_line_against_a_newcomer(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """Over the broker: the pool is full, ``first`` is deferred with position 1; a grant
    ends and a newcomer asks before ``first`` comes back — it is deferred behind it (the
    room is held for the head of the line), and ``first`` is then admitted."""
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=2, agents=0, members=1
    ) as mesh:
        holds = [
            await mesh.producer.admit(echo_requirements(), admission_id=f"hold-{i}")
            for i in range(2)
        ]
        assert all(h.outcome == "admitted" for h in holds)
        first = await mesh.producer.admit(echo_requirements(), admission_id="first")
        assert (first.outcome, first.position) == ("deferred", 1), first
        grant = holds[0].grant
        assert grant is not None
        released = await mesh.producer.release_admission(grant)
        assert released.released

        newcomer = await mesh.producer.admit(echo_requirements(), admission_id="newcomer")
        again = await mesh.producer.admit(echo_requirements(), admission_id="first")

        assert (newcomer.outcome, newcomer.reason, newcomer.position) == (
            "deferred",
            AdmissionReason.CAPACITY,
            2,
        ), newcomer
        assert again.outcome == "admitted", again


async def test_a_place_in_line_outlives_the_manager_that_gave_it(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """The pool is full and ``first`` is deferred with position 1; the manager stops and a
    new one starts on the same ledger. A grant ends and a newcomer asks before ``first``
    comes back: the new manager rebuilt its line from the ledger's deferrals, so the newcomer
    is deferred behind ``first`` (position 2), and ``first`` is then admitted. (With the line
    in memory alone, the newcomer took the slot.)"""
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
    settings = settings_for(
        amqp_url, namespace, tmp_path, admission=policy, admission_capacity="descriptor"
    )
    manager = await start_manager(settings)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    try:
        accepted = await producer.publish_descriptor(echo_descriptor(2))
        assert accepted.type == "mesh.descriptor-accepted.v1", accepted
        holds = [
            await producer.admit(echo_requirements(), admission_id=f"hold-{i}") for i in range(2)
        ]
        assert all(h.outcome == "admitted" for h in holds), holds
        first = await producer.admit(echo_requirements(), admission_id="first")
        assert (first.outcome, first.position) == ("deferred", 1), first

        await manager.stop()
        manager = await start_manager(settings)
        assert manager.counters["line_places_recovered"] == 1
        grant = holds[0].grant
        assert grant is not None
        assert (await producer.release_admission(grant)).released

        newcomer = await producer.admit(echo_requirements(), admission_id="newcomer")
        again = await producer.admit(echo_requirements(), admission_id="first")
        assert (newcomer.outcome, newcomer.reason, newcomer.position) == (
            "deferred",
            AdmissionReason.CAPACITY,
            2,
        ), newcomer
        assert again.outcome == "admitted", again
    finally:
        await producer.close()
        await manager.stop()


# ---- load: stair steps and pulses ----------------------------------------------------------
@dataclass
class Seen:
    """What the producers saw: every grant and every refusal, by service class."""

    admitted: list[tuple[float, str]] = field(default_factory=list)  # (when, class)
    refused: list[tuple[float, str, AdmissionDecision]] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)

    def classes_refused(self, since: float = 0.0, until: float = float("inf")) -> set[str]:
        return {c for t, c, _ in self.refused if since <= t < until}

    def first_refusal(self, service_class: str) -> float | None:
        times = [t for t, c, _ in self.refused if c == service_class]
        return min(times) if times else None


async def closed_loop(
    client: MeshClient,
    service_class: str,
    until: float,
    seen: Seen,
    *,
    sleep_ms: int = 250,
    tenant: str = "",
) -> None:
    """One producer: submit, await, submit again, until ``until``; record everything."""

    def on_deferred(decision: AdmissionDecision) -> bool:
        seen.refused.append((time.monotonic(), service_class, decision))
        return time.monotonic() < until

    while time.monotonic() < until:
        try:
            await client.submit(
                echo_requirements(service_class),
                {"message": tenant or service_class, "sleep_ms": sleep_ms},
                timeout_s=5.0,
                on_deferred=on_deferred,
            )
            seen.admitted.append((time.monotonic(), service_class))
        except AdmissionRefused as exc:
            if exc.decision.outcome == "rejected":
                seen.refused.append((time.monotonic(), service_class, exc.decision))
        except SubmitDeadlineExceeded:
            pass
        except Exception as exc:  # recorded: the test fails on any
            seen.failures.append(exc)
            return


@dataclass
class Watch:
    """Samples the pool queue (management API and passive declares) and the ledger."""

    depths_api: list[int] = field(default_factory=list)
    depths_amqp: list[int] = field(default_factory=list)
    ledger: list[tuple[int, int, int]] = field(default_factory=list)


async def watch(mesh: PoolMesh, management_api: Any, stop: asyncio.Event, w: Watch) -> None:
    transport = mesh.producer.transport
    last_api = 0.0
    while not stop.is_set():
        w.depths_amqp.append(await transport.queue_depth(mesh.queue))
        w.ledger.append(mesh.ledger_holding())
        if time.monotonic() - last_api >= 0.5:
            last_api = time.monotonic()
            info = await asyncio.to_thread(management_api.get_queue, mesh.queue)
            w.depths_api.append(int(info.get("messages", 0)))
        await asyncio.sleep(0.05)


def assert_conserved(w: Watch, mesh: PoolMesh) -> None:
    assert w.ledger, "the ledger was never sampled"
    for used, holding, capacity in w.ledger:
        assert used == holding <= capacity == mesh.slots, (used, holding, capacity)
    assert max(w.depths_amqp) <= mesh.bound
    assert w.depths_api and max(w.depths_api) <= mesh.bound


def assert_every_refusal_says_why_and_when(seen: Seen) -> None:
    assert not seen.failures, seen.failures
    for _, _, decision in seen.refused:
        assert decision.reason is not None
        if decision.outcome == "deferred":
            assert decision.retry_after_ms is not None and decision.retry_after_ms > 0
        else:  # rejected: only when coming back cannot help
            assert decision.reason.value == "DEADLINE_UNREACHABLE", decision


async def test_stair_step_load_sheds_speculative_first_and_keeps_interactive_flowing(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """Three steps of closed-loop producers per class (1, 3, then 8 each) on a 10-slot pool
    served by two agents (16 in all: the pool's slots are the limit)."""
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=10, agents=2) as mesh:
        clients = [await mesh.client(amqp_url, f"stair-{i}") for i in range(3)]
        seen, w, stop = Seen(), Watch(), asyncio.Event()
        watcher = asyncio.create_task(watch(mesh, management_api, stop, w))
        steps: list[tuple[float, float]] = []
        for per_class in (1, 3, 8):
            start = time.monotonic()
            until = start + 4.0
            await asyncio.gather(
                *(
                    closed_loop(clients[i % 3], cls, until, seen)
                    for cls in ("interactive", "batch", "speculative")
                    for i in range(per_class)
                )
            )
            steps.append((start, time.monotonic()))
        stop.set()
        await watcher

        print("\nstair-step:", summary(seen, steps), "stages:", stage_entries(mesh))
        assert_every_refusal_says_why_and_when(seen)
        assert_conserved(w, mesh)
        await eventually(lambda: mesh.ledger_holding() == (0, 0, 10), what="all settled")
        # Step one is light: nothing refused.
        assert not seen.classes_refused(*steps[0])
        # Speculative work is refused first, then batch; interactive is never shed.
        first_spec, first_batch = seen.first_refusal("speculative"), seen.first_refusal("batch")
        assert first_spec is not None
        assert first_batch is None or first_spec <= first_batch
        shed_interactive = [
            d for _, c, d in seen.refused if c == "interactive" and d.reason.value == "SHED"
        ]
        assert not shed_interactive
        # Interactive work flowed in every step, and most under the heaviest.
        for since, until in steps:
            assert any(since <= t < until and c == "interactive" for t, c in seen.admitted)
        last = [c for t, c in seen.admitted if t >= steps[2][0]]
        assert last.count("interactive") > last.count("speculative")
        # The stages were entered in order, each with its time, in the journal.
        entered = stage_entries(mesh)
        order = [s for s in ("SHED_SPECULATIVE", "PAUSE_BATCH", "TIGHTEN") if s in entered]
        assert order[:1] == ["SHED_SPECULATIVE"]
        assert [entered[s] for s in order] == sorted(entered[s] for s in order)


def summary(seen: Seen, steps: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Per step and class: grants, and refusals by reason (printed: the run's record)."""
    out = []
    for since, until in steps:
        row: dict[str, Any] = {}
        for cls in ("interactive", "batch", "speculative"):
            reasons: dict[str, int] = {}
            for t, c, d in seen.refused:
                if c == cls and since <= t < until and d.reason is not None:
                    reasons[d.reason.value] = reasons.get(d.reason.value, 0) + 1
            granted = sum(1 for t, c in seen.admitted if c == cls and since <= t < until)
            row[cls] = {"granted": granted, **reasons}
        out.append(row)
    return out


def stage_entries(mesh: PoolMesh) -> dict[str, float]:
    """When the pool first entered each stage, from the manager's journal."""
    journal = mesh.manager._journal
    assert journal is not None
    first: dict[str, float] = {}
    for entry in journal.query(kinds=["pressure_stage"], limit=None):
        if entry.detail.get("pool_id") == "echo":
            first.setdefault(str(entry.detail["to"]), entry.at)
    return first


async def test_pulses_of_load_are_shed_and_the_pool_recovers_between_them(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=6, agents=1) as mesh:
        client = await mesh.client(amqp_url, "pulse")
        seen, w, stop = Seen(), Watch(), asyncio.Event()
        watcher = asyncio.create_task(watch(mesh, management_api, stop, w))
        assert mesh.manager.admitter is not None
        board = mesh.manager.admitter.pressure
        for _pulse in range(3):
            until = time.monotonic() + 2.5
            await asyncio.gather(
                *(
                    closed_loop(client, cls, until, seen, sleep_ms=150)
                    for cls in ("interactive", "speculative")
                    for _ in range(12)
                )
            )
            await eventually(lambda: mesh.ledger_holding()[0] == 0, what="the pulse drained")
            # Recovered between pulses: the stage steps down once the pool stayed below its
            # lowered thresholds for the minimum dwell (it holds still, never flaps).
            await eventually(
                lambda: board.pools["echo"].stage is Stage.NORMAL,
                timeout_s=10,
                what="the stage back to NORMAL",
            )
        stop.set()
        await watcher

        assert_every_refusal_says_why_and_when(seen)
        assert_conserved(w, mesh)
        assert "speculative" in seen.classes_refused()
        admitted = [c for _, c in seen.admitted]
        assert admitted.count("interactive") > admitted.count("speculative")
        assert len(stage_entries(mesh)) >= 2  # up and back down, journaled


# ---- retry times ----------------------------------------------------------------------------
async def refused_retry_instants(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any, policy: PressurePolicy
) -> list[float]:
    """Fill a 2-slot pool, then let 80 producers ask at once; when would each come back?"""
    async with pool_mesh(
        amqp_url, namespace, tmp_path, management_api, slots=2, agents=0, members=1,
        pressure=policy,
    ) as mesh:  # fmt: skip
        for i in range(2):
            held = await mesh.producer.admit(echo_requirements(), admission_id=f"hold-{i}")
            assert held.outcome == "admitted"
        clients = [await mesh.client(amqp_url, f"crowd-{i}") for i in range(4)]

        async def one(i: int) -> float:
            decision = await clients[i % 4].admit(echo_requirements(), timeout_s=20)
            assert decision.outcome == "deferred" and decision.reason is not None
            assert decision.retry_after_ms is not None
            return time.monotonic() + decision.retry_after_ms / 1000

        return list(await asyncio.gather(*(one(i) for i in range(80))))


def largest_cluster(instants: list[float], window_s: float) -> float:
    """The largest share of ``instants`` inside any one window of ``window_s``."""
    ordered = sorted(instants)
    best, j = 0, 0
    for i, start in enumerate(ordered):
        while j < len(ordered) and ordered[j] < start + window_s:
            j += 1
        best = max(best, j - i)
    return best / len(ordered)


async def test_refused_producers_are_told_to_come_back_at_spread_out_times(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> None:
    """Statistical, over the broker: 80 producers refused together come back spread out (no
    100 ms window holds more than 10 % of them); the constant retry time of the shedding-off
    baseline, measured the same way, sends nearly all of them back at once."""
    spread = await refused_retry_instants(
        amqp_url, namespace, tmp_path / "on", management_api, PressurePolicy()
    )
    try:
        constant = await refused_retry_instants(
            amqp_url, namespace + "-off", tmp_path / "off", management_api,
            PressurePolicy(enabled=False),
        )  # fmt: skip
    finally:  # the namespace fixture cleans up only its own prefix
        management_api.delete_prefixed(namespace + "-off.")

    assert largest_cluster(spread, 0.1) <= 0.10, sorted(spread)
    assert statistics.pstdev(spread) > 0.1
    assert largest_cluster(constant, 0.1) >= 0.5  # the guard: this is what synchronised is


# ---- fairness between tenants ----------------------------------------------------------------
def tenant_url(amqp_url: str, user: str, password: str) -> str:
    parts = urlsplit(amqp_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user)}:{quote(password)}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def tenant_run(
    clients: dict[str, MeshClient],
    workers: dict[str, int],
    seconds: float,
    think_s: dict[str, float],
) -> dict[str, list[float]]:
    """Interactive producers per tenant, each waiting ``think_s`` between tasks; each
    tenant's completion latencies (first ask to result, retries included)."""
    latencies: dict[str, list[float]] = {t: [] for t in workers}
    until = time.monotonic() + seconds

    async def worker(tenant: str) -> None:
        while time.monotonic() < until:
            asked = time.monotonic()
            granted: list[float] = []

            def on_deferred(_: AdmissionDecision) -> bool:
                return time.monotonic() < until

            try:
                await clients[tenant].submit(
                    echo_requirements("interactive"),
                    {"message": tenant, "sleep_ms": 1000},
                    timeout_s=6.0,
                    on_deferred=on_deferred,
                )
            except (AdmissionRefused, SubmitDeadlineExceeded):
                continue
            granted.append(time.monotonic())
            latencies[tenant].append(granted[0] - asked)
            await asyncio.sleep(think_s.get(tenant, 0.0))

    await asyncio.gather(*(worker(t) for t, n in workers.items() for _ in range(n)))
    return latencies


@pytest.fixture
def tenants(management_api: Any) -> Iterator[tuple[str, ...]]:
    """Three producer tenants, each a broker user of its own, deleted afterwards."""
    names = ("tenant-a", "tenant-b", "tenant-c")
    for name in names:
        management_api.ensure_user(name, "pw-" + name)
    try:
        yield names
    finally:
        for name in names:
            management_api.delete_user(name)


async def test_one_tenants_burst_does_not_starve_the_others(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any, tenants: tuple[str, ...]
) -> None:
    """Tenants b and c each keep 2 producers busy; then tenant a bursts with 24. The bound:
    b's and c's completed rate stays at least 0.7x what it was alone, and their median time
    to completion at most 1.5x. The skew (a's share of grants over its fair share) is printed."""
    async with pool_mesh(amqp_url, namespace, tmp_path, management_api, slots=8, agents=1) as mesh:
        clients = {
            t: await MeshClient.connect(
                tenant_url(amqp_url, t, "pw-" + t), namespace=namespace, name=t
            )
            for t in tenants
        }
        mesh.clients.extend(clients.values())
        quiet = {"tenant-b": 2, "tenant-c": 2}
        # The quiet tenants pause between tasks (their slots free up now and then); the burst
        # asks again the moment a task ends — the pattern that starves others without shares.
        think = {"tenant-b": 0.3, "tenant-c": 0.3}
        alone = await tenant_run(clients, quiet, 6.0, think)
        burst = await tenant_run(clients, {**quiet, "tenant-a": 24}, 6.0, think)

        report = fairness_report(alone, burst)
        print("\nfairness:", report)
        for tenant in quiet:
            assert report[tenant]["rate_ratio"] >= 0.7, report
            assert report[tenant]["median_ratio"] <= 1.5, report
        assert report["tenant-a"]["completed"] > 0  # the burst was served too
        await eventually(lambda: mesh.ledger_holding() == (0, 0, 8), what="all settled")


def fairness_report(
    alone: dict[str, list[float]], burst: dict[str, list[float]]
) -> dict[str, dict[str, float]]:
    total = sum(len(v) for v in burst.values())
    report: dict[str, dict[str, float]] = {}
    for tenant, latencies in burst.items():
        before = alone.get(tenant, [])
        report[tenant] = {
            "completed": len(latencies),
            "share": round(len(latencies) / total, 3) if total else 0.0,
            "rate_ratio": round(len(latencies) / len(before), 2) if before else float("nan"),
            "median_ratio": (
                round(statistics.median(latencies) / statistics.median(before), 2)
                if before and latencies
                else float("nan")
            ),
        }
    fair = 1 / len(burst)
    report["skew"] = {"burst_share_over_fair": round(report["tenant-a"]["share"] / fair, 2)}
    return report


# ---- fallbacks across regions ----------------------------------------------------------------
async def test_a_cross_region_fallback_is_granted_over_the_broker_only_when_the_task_allows_it(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """Primary ``eu`` (one slot, eu-west-1) and a named fallback ``us`` (us-east-1). Once the
    primary is full, a task that names no region may not move to the US (CAPACITY, with a
    retry time); one that lists us-east-1 among its regions may, and its grant says so."""
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
    manager = await start_manager(settings_for(amqp_url, namespace, tmp_path, admission=policy))
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="regions")
    raw = await AmqpTransport.connect(amqp_url, name="region-members")
    try:
        for pool_id in ("eu", "us"):
            await live_member(manager, raw, f"{pool_id}-1", pool_id, echo_capability("1.0.0", 4))
        limits = ModelLimits(context_tokens=8_000, max_output_tokens=1_000, slots=1)
        for pool_id, region in (("eu", "eu-west-1"), ("us", "us-east-1")):
            pool = fresh(
                DESCRIPTOR, pool_id=pool_id, capabilities=[ECHO], tools=[], regions=[region],
                model_limits=limits,
            )  # fmt: skip
            assert (await client.publish_descriptor(pool)).type == "mesh.descriptor-accepted.v1"

        first = await client.admit(echo_requirements(allowed_fallbacks=["us"]))
        assert first.grant is not None and first.grant.pool_id == "eu"

        stay = await client.admit(echo_requirements(allowed_fallbacks=["us"]))
        assert stay.outcome == "deferred" and stay.reason is not None
        assert stay.reason.value == "CAPACITY" and stay.retry_after_ms is not None

        move = await client.admit(
            echo_requirements(allowed_fallbacks=["us"], regions=["eu-west-1", "us-east-1"])
        )
        assert move.grant is not None
        assert (move.grant.pool_id, move.grant.fallback_for) == ("us", "eu")
    finally:
        await raw.close()
        await client.close()
        await manager.stop()
