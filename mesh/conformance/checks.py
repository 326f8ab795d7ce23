"""The checks, one function each, in the order they run (:data:`CHECKS`): each is given the
:class:`~mesh.conformance.kit.Kit`, returns what it saw, or raises
:class:`~mesh.conformance.kit.CheckFailed` saying what went wrong."""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from jsonschema import Draft202012Validator

from mesh import constants as c
from mesh.conformance.kit import (
    ANSWER_TIMEOUT_S,
    BELOW_MINIMUM_S,
    HEARTBEAT_S,
    POOL_BACK_S,
    START_TIMEOUT_S,
    UNANSWERED_S,
    CheckFailed,
    Kit,
    expect,
)
from mesh.errors import MeshError, TopologyMissing
from mesh.producer import TaskOutcome
from mesh.topology import names
from mesh.transport import AmqpTransport
from mesh.wire import (
    DrainNotice,
    Heartbeat,
    ReRegisterRequest,
)
from mesh.wire.models import AdmissionGrant, Refusal, TaskResult

# ---- the checks ---------------------------------------------------------------------------------
Check = Callable[[Kit], Awaitable[str]]


async def registers_and_is_ready(kit: Kit) -> str:
    """The agent registers and, until the manager accepts it, neither heartbeats nor takes
    tasks from its queue (no manager runs yet: its registration waits in the announce queue);
    accepted, it is Ready."""
    assert kit.raw is not None
    await kit.start_agent()
    await kit.watch.until(
        lambda: bool(kit.watch.registrations) or kit.exited(), START_TIMEOUT_S, "registration"
    )
    expect(not kit.exited(), f"the agent exited with {kit.exit_code()} before registering")
    await asyncio.sleep(UNANSWERED_S)  # what it does while nobody answers
    expect(not kit.watch.heartbeats, "it heartbeats before its registration was accepted")
    consumers = await kit.raw.queue_consumers(kit.topology.agent_task_queue(kit.agent_id))
    expect(consumers == 0, "it consumes its task queue before its registration was accepted")
    await kit.start_manager()
    await kit.until_live(START_TIMEOUT_S)
    registration = kit.watch.registrations[-1]
    expect(registration.agent_id == kit.agent_id, f"registered as {registration.agent_id!r}")
    offered = {cap.name for cap in registration.capabilities}
    expect(kit.s.capability in offered, f"offers {sorted(offered)}, not {kit.s.capability}")
    expect(
        registration.heartbeat_interval_s >= c.MIN_HEARTBEAT_INTERVAL_S,
        f"heartbeat interval {registration.heartbeat_interval_s} s",
    )
    expect(not kit.watch.undecodable, f"undecodable messages: {kit.watch.undecodable[:2]}")
    return (
        f"registered {registration.agent_id} in pool {registration.deployment} with "
        f"{sorted(offered)}; no heartbeat and no task consumer in {UNANSWERED_S:g} s "
        "unanswered; Ready once accepted"
    )


async def refuses_a_short_heartbeat_interval(kit: Kit) -> str:
    """Told an interval below the minimum, the agent refuses to start (exits non-zero) or
    registers with at least the minimum; it never registers with the short one."""
    agent = await kit.start_agent(heartbeat_s=BELOW_MINIMUM_S)
    code = await agent.wait(START_TIMEOUT_S / 2)
    intervals = [r.heartbeat_interval_s for r in kit.watch.registrations]
    short = [i for i in intervals if i < c.MIN_HEARTBEAT_INTERVAL_S]
    expect(not short, f"told {BELOW_MINIMUM_S:g} s, it registered with {short[:1]} s")
    if code is None:
        expect(bool(intervals), f"told {BELOW_MINIMUM_S:g} s, it neither exited nor registered")
        return f"told {BELOW_MINIMUM_S:g} s, it registered with {intervals[0]:g} s"
    expect(code != 0, f"told {BELOW_MINIMUM_S:g} s, it exited 0 as if nothing were wrong")
    return f"told {BELOW_MINIMUM_S:g} s, it exited {code} without registering"


async def heartbeats_on_time(kit: Kit) -> str:
    await kit.watch.until(lambda: len(kit.watch.heartbeats) >= 3, 4 * HEARTBEAT_S, "3 heartbeats")
    beats = kit.watch.heartbeats
    seqs = [hb.seq for _, hb in beats]
    expect(all(b > a for a, b in itertools.pairwise(seqs)), f"seq not increasing: {seqs}")
    incarnation = kit.watch.registrations[-1].incarnation
    expect(
        all(hb.incarnation == incarnation for _, hb in beats),
        "a heartbeat of another incarnation",
    )
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(beats)]
    expect(all(gap <= HEARTBEAT_S * 1.5 for gap in gaps), f"gaps {[round(g, 1) for g in gaps]} s")
    return f"seq {seqs}, gaps {[round(g, 1) for g in gaps]} s (interval {HEARTBEAT_S:g} s)"


async def serves_the_lease_path(kit: Kit) -> str:
    assert kit.client is not None
    outcome = await kit.client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(outcome.result.agent_id == kit.agent_id, f"answered by {outcome.result.agent_id}")
    [offered] = [
        cap for cap in kit.watch.registrations[-1].capabilities if cap.name == kit.s.capability
    ]
    errors = sorted(
        e.message for e in Draft202012Validator(offered.output_schema).iter_errors(outcome.output)
    )
    expect(not errors, f"the output fails the capability's output_schema: {errors[:2]}")
    return f"run_task answered ok by {outcome.lease.agent_id}, output valid against its schema"


async def validates_task_input(kit: Kit) -> str:
    assert kit.client is not None
    try:
        await kit.client.run_task(
            kit.s.capability, kit.s.invalid_payload, timeout_s=ANSWER_TIMEOUT_S
        )
    except MeshError as exc:
        code = getattr(exc, "code", None)
        expect(code == "INPUT_SCHEMA_VIOLATION", f"answered {code or type(exc).__name__}")
        return "an invalid payload is answered INPUT_SCHEMA_VIOLATION"
    raise CheckFailed("an invalid payload was run")


async def serves_the_admission_path(kit: Kit) -> str:
    assert kit.client is not None
    registration = kit.watch.registrations[-1]
    if kit.descriptor is None:
        await kit.described_pool(registration)
    done = await kit.client.submit(kit.requirements(), kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(done.result.agent_id == kit.agent_id, f"answered by {done.result.agent_id}")
    return f"submit admitted to pool {registration.deployment} and answered ok"


# A trace context as a traced producer sends it (W3C Trace Context: version, trace ID, the
# sender's span ID, flags "sampled"), and a vendor's tracestate entry.
KIT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
KIT_TRACEPARENT = f"00-{KIT_TRACE_ID}-00f067aa0ba902b7-01"
KIT_TRACESTATE = "kit=conformance"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


async def carries_the_trace_context(kit: Kit) -> str:
    """A task's ``traceparent`` and ``tracestate`` (docs/protocol.md, "Trace context") come
    back on its result: the same trace ID (an agent that traces puts its own span's ID in
    it, one that does not copies it unchanged) and the same ``tracestate``, so the producer's
    trace does not break at the agent."""
    assert kit.client is not None
    grant = await kit.grant()
    try:
        sent = {c.H_TRACEPARENT: KIT_TRACEPARENT, c.H_TRACESTATE: KIT_TRACESTATE}
        result = await kit.send_granted(grant, kit.s.payload, headers=sent)
        _expect_ok(result, "a task with a trace context was answered")
    finally:
        await kit.client.release_admission(grant)
    headers = kit.answer_headers.pop(result.task_id, {})
    carried = headers.get(c.H_TRACEPARENT)
    expect(carried is not None, "the result carries no traceparent header")
    found = TRACEPARENT.match(str(carried))
    expect(found is not None, f"the result's traceparent {carried!r} is not W3C's format")
    assert found is not None
    expect(found.group(1) == KIT_TRACE_ID, f"the result is on trace {found.group(1)}")
    state = headers.get(c.H_TRACESTATE)
    expect(str(state) == KIT_TRACESTATE, f"the result's tracestate is {state!r}")
    return f"the result carried trace {KIT_TRACE_ID[:8]}… and its tracestate on"


async def _refused(kit: Kit, grant: AdmissionGrant, what: str, pool: str) -> str:
    """Send a task under ``grant`` to ``pool``'s queue: it must be refused, never run."""
    result = await kit.send_granted(grant, kit.s.payload, pool=pool)
    code = result.error.code.value if result.error else None
    expect(
        result.status == "error" and code == "GRANT_INVALID",
        f"{what} was answered {result.status} {code or ''}".rstrip(),
    )
    return f"{what}: GRANT_INVALID"


async def refuses_bad_grants(kit: Kit) -> str:
    """Foreign (another pool's), expired and revoked grants are refused at claim."""
    assert kit.client is not None
    good = await kit.grant()
    pool = good.pool_id
    seen = [
        await _refused(
            kit, good.model_copy(update={"pool_id": f"{pool}-other"}), "a foreign grant", pool
        ),
        await _refused(
            kit, good.model_copy(update={"expires_at": time.time() - 1}), "an expired grant", pool
        ),
    ]
    released = await kit.client.release_admission(good)
    expect(released.released, f"the kit could not release its grant: {released}")
    await asyncio.sleep(0.5)  # the revocation's way to the agent
    seen.append(await _refused(kit, good, "a revoked grant", pool))
    return "; ".join(seen)


async def judges_epochs(kit: Kit) -> str:
    """After a newer descriptor: an older-epoch grant is refused unless its admission is on
    the draining allowlist (ACTIVE when the epoch advanced), which is served."""
    draining = await kit.grant()
    await kit.described_pool(kit.watch.registrations[-1])  # a newer epoch: draining listed
    await asyncio.sleep(0.5)  # the announcement's way to the agent
    stale = draining.model_copy(update={"admission_id": f"conformance-{uuid.uuid4().hex[:12]}"})
    refused = await _refused(kit, stale, "an older-epoch grant", draining.pool_id)
    served = await kit.send_granted(draining, kit.s.payload)
    _expect_ok(served, "a grant on the draining allowlist was answered")
    return f"{refused}; a draining-allowlisted one of the old epoch served"


async def reregisters_when_asked(kit: Kit) -> str:
    assert kit.raw is not None
    before = len(kit.watch.registrations)
    await kit.raw.publish(
        kit.topology.agents_exchange,
        kit.agent_id,
        ReRegisterRequest(agent_id=kit.agent_id, reason="conformance kit asks"),
    )
    started = time.monotonic()
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    took = time.monotonic() - started
    await kit.until_live(START_TIMEOUT_S)
    return f"registered again {took:.1f} s after the request, Ready"


async def keeps_leases_when_handed_over(kit: Kit) -> str:
    """Its shard moved to another manager (``leases_kept``, the ``hand-over`` feature): it
    registers again and still serves a task under a lease it was told of before, though the
    registry it registers with does not know that lease — it was granted and stays valid.
    The kit plays both managers with its one: it forgets the agent and its leases, as a
    manager giving a shard back does, then asks. (An agent that forgets its leases here
    refuses tasks granted just before a hand-over.)"""
    assert kit.raw is not None and kit.client is not None and kit.manager is not None
    manager = kit.manager
    if c.FEATURE_HAND_OVER not in kit.watch.registrations[-1].features:
        raise CheckFailed(f"the agent does not list the {c.FEATURE_HAND_OVER!r} feature")
    lease = await kit.client.acquire(kit.s.capability)
    if isinstance(lease, Refusal):
        raise CheckFailed(f"the kit could not lease a slot: {lease.reason.value} {lease.detail}")
    await asyncio.sleep(0.5)  # the lease notice's way to the agent
    before = len(kit.watch.registrations)
    pool = kit.watch.registrations[-1].deployment
    manager.core.hand_over(lambda deployment: deployment == pool)
    await kit.raw.publish(
        kit.topology.agents_exchange,
        kit.agent_id,
        ReRegisterRequest(
            agent_id=kit.agent_id, reason="conformance kit: shard handed over", leases_kept=True
        ),
    )
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    await kit.until_live(START_TIMEOUT_S)
    expect(lease.lease_id not in manager.core.leases, "the kit's manager still knows the lease")
    result = await kit.send_leased(lease, kit.s.payload)
    _expect_ok(result, "a task under a lease granted before the hand-over was answered")
    return "registered again, and a task under a lease it was told of before ran"


async def takes_control_only_from_the_managers(kit: Kit) -> str:
    """A drain notice that does not carry the managers' (RabbitMQ-validated) ``user_id`` —
    anyone who may publish to the agents exchange could send one — is not obeyed: the agent
    keeps taking its pool's tasks."""
    assert kit.raw is not None
    unsigned = await AmqpTransport.connect(kit.s.amqp_url, name="conformance-unsigned")
    try:
        await unsigned.publish(
            kit.topology.agents_exchange,
            kit.agent_id,
            DrainNotice(agent_id=kit.agent_id, reason="conformance kit: not from a manager"),
        )
    finally:
        await unsigned.close()
    await asyncio.sleep(UNANSWERED_S)  # time to (wrongly) begin a drain
    served = await kit.send_granted(await kit.grant(), kit.s.payload)
    _expect_ok(served, "after an unsigned drain notice a pool task was answered")
    return "an unsigned drain notice left it serving, not draining"


FORGED_SEQ = 10**9


async def is_not_fooled_by_a_forged_heartbeat(kit: Kit) -> str:
    """A heartbeat forged in the agent's name — its live incarnation, ``seq`` 10^9 — is
    published on the heartbeat exchange. The manager bounds how far one heartbeat may move
    ``seq`` (docs/protocol.md), so the agent's own heartbeats must advance in steps it allows:
    two of them later they are still accepted, and the agent is Ready and serves."""
    assert kit.raw is not None and kit.manager is not None and kit.client is not None
    manager, agent_id = kit.manager, kit.agent_id
    record = manager.core.agents.get(agent_id)
    expect(record is not None, "the agent is not registered with the kit's manager")
    assert record is not None
    incarnation = kit.watch.registrations[-1].incarnation
    forged: list[Heartbeat] = []

    def real_beats() -> list[Heartbeat]:
        return [
            hb
            for _, hb in kit.watch.heartbeats
            if hb.agent_id == agent_id and hb.incarnation == incarnation and hb not in forged
        ]

    await kit.watch.until(lambda: bool(real_beats()), 2 * HEARTBEAT_S, "heartbeat of the agent")
    real = real_beats()
    forged.append(real[-1].model_copy(update={"seq": FORGED_SEQ, "sent_at": time.time()}))
    leaps = manager.core.counters["heartbeat_seq_leap"]
    await kit.raw.publish(
        kit.topology.heartbeat_exchange, names.heartbeat_key(agent_id), forged[0]
    )  # fmt: skip
    await kit.watch.until(
        lambda: manager.core.counters["heartbeat_seq_leap"] > leaps, HEARTBEAT_S, "the forgery"
    )
    seen = len(real)
    await kit.watch.until(
        lambda: len(real_beats()) >= seen + 2,
        3 * HEARTBEAT_S,
        "two more heartbeats of the agent",
    )
    await asyncio.sleep(0.5)  # the manager has taken the last one
    record = manager.core.agents.get(agent_id)
    expect(record is not None, "the agent was declared lost after a forged heartbeat")
    assert record is not None
    last_real = max(hb.seq for hb in real_beats())
    expect(
        record.last_heartbeat_seq == last_real,
        f"the manager's last accepted seq is {record.last_heartbeat_seq}, the agent's last "
        f"heartbeat says {last_real}: its heartbeats are refused (seq steps too large?)",
    )
    outcome = await kit.client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(outcome.result.agent_id == agent_id, f"answered by {outcome.result.agent_id}")
    return f"forged seq {FORGED_SEQ} refused; its own heartbeats up to seq {last_real} accepted"


async def consumes_a_replaced_pool_queue(kit: Kit) -> str:
    """The pool queue is deleted (an operator in the management UI) and declared again (as
    the manager does when it finds it gone): the broker cancelled the agent's consumer, and
    the agent must subscribe again — with no newer epoch to prompt it — and take the pool's
    tasks."""
    assert kit.raw is not None
    raw = kit.raw
    grant = await kit.grant()  # the pool is described: its queue exists
    queue = kit.topology.pool_task_queue(grant.pool_id)
    # Past any subscription the descriptor's announcement set off, so the one seen below is
    # the one the deletion must end.
    await asyncio.sleep(UNANSWERED_S)
    await kit.watch.until_async(
        lambda: _consumed(raw, queue), START_TIMEOUT_S, "consumer on the pool queue"
    )
    await raw.delete_queue(queue)
    deleted = time.monotonic()
    await asyncio.sleep(1.0)  # a while without the queue: a subscription now would fail
    await raw.declare(kit.topology.pool(grant.pool_id))
    await kit.watch.until_async(
        lambda: _consumed(raw, queue), POOL_BACK_S, "consumer on the declared-again pool queue"
    )
    took = time.monotonic() - deleted
    served = await kit.send_granted(await kit.grant(), kit.s.payload)
    _expect_ok(served, "a pool task after the queue came back was answered")
    return f"consumed the queue again {took:.1f} s after it was deleted; a task answered"


async def takes_nothing_before_its_restart_is_accepted(kit: Kit) -> str:
    """kill -9, and the same command again at once under the same agent ID (a container
    restarted under its pod name): the manager still counts the killed incarnation, so the
    new one's registration is deferred (``AGENT_ID_IN_USE``). Meanwhile the pool's epoch is
    announced (every 2 s here) on its control queue: it must consume neither its pool queue
    nor its task queue until the manager accepted *this* incarnation — then it serves (a task
    on the lease path)."""
    assert kit.raw is not None and kit.manager is not None and kit.agent is not None
    assert kit.client is not None
    raw, manager, client = kit.raw, kit.manager, kit.client
    # The pool described (its queue exists, its epoch announced every 2 s); no grant taken:
    # earlier checks may hold the pool's live slots until their grants expire.
    descriptor = kit.descriptor or await kit.described_pool(kit.watch.registrations[-1])
    pool_queue = kit.topology.pool_task_queue(descriptor.pool_id)
    old = manager.core.agents[kit.agent_id].incarnation
    kit.agent.signal(signal.SIGKILL)
    await kit.agent.wait(5.0)
    killed = time.monotonic()
    await kit.start_agent(same_id=True)
    await kit.watch.until(
        lambda: bool(kit.watch.registrations) or kit.exited(), START_TIMEOUT_S, "registration"
    )
    expect(not kit.exited(), f"the restarted agent exited with {kit.exit_code()}")
    await asyncio.sleep(UNANSWERED_S)  # deferred, and an epoch announcement or more heard
    still = manager.core.agents.get(kit.agent_id)
    expect(
        still is not None and still.incarnation == old,
        "the killed incarnation was gone before the check could look (the restart was slow)",
    )
    expect(
        await raw.queue_consumers(pool_queue) == 0,
        "it consumes its pool queue while its registration is deferred",
    )
    expect(
        await raw.queue_consumers(kit.topology.agent_task_queue(kit.agent_id)) == 0,
        "it consumes its task queue while its registration is deferred",
    )
    loss_s = manager.settings.pool.missed_heartbeats_before_lost * HEARTBEAT_S
    await kit.watch.until(
        lambda: (
            (a := manager.core.agents.get(kit.agent_id)) is not None
            and a.incarnation != old
            and a.state.value in ("Ready", "Busy")
        ),
        loss_s + START_TIMEOUT_S,
        "the new incarnation accepted once the killed one was lost",
    )
    took = time.monotonic() - killed
    served = await client.run_task(kit.s.capability, kit.s.payload, timeout_s=ANSWER_TIMEOUT_S)
    expect(served.lease.agent_id == kit.agent_id, f"served by {served.lease.agent_id}")
    return (
        f"deferred while the killed incarnation was live, consuming nothing; accepted "
        f"{took:.0f} s after the kill, then served"
    )


def _expect_ok(result: TaskResult, what: str) -> None:
    """``result`` is ok, else the check fails saying ``what`` was answered instead."""
    code = result.error.code.value if result.error else ""
    expect(result.status == "ok", f"{what} {result.status} {code}".rstrip())


async def _consumed(raw: AmqpTransport, queue: str) -> bool:
    try:
        return await raw.queue_consumers(queue) > 0
    except TopologyMissing:
        return False


async def fences_itself_after_a_silence(kit: Kit) -> str:
    """Frozen (SIGSTOP) with a task running until the manager declares it lost, then woken:
    the result of the task it claimed before the silence must not be delivered (its work
    may have moved on), and it registers again."""
    assert kit.client is not None and kit.manager is not None and kit.agent is not None
    manager, agent = kit.manager, kit.agent
    before = len(kit.watch.registrations)
    [held] = await _in_flight(kit, 1)
    leased_before = set(manager.core.agents[kit.agent_id].leases)
    agent.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        loss_s = manager.settings.pool.missed_heartbeats_before_lost * HEARTBEAT_S
        await kit.watch.until(
            lambda: kit.agent_id not in manager.core.agents,
            loss_s + 2 * HEARTBEAT_S,
            "loss of the frozen agent in the manager",
        )
        frozen_s = time.monotonic() - stopped
    finally:
        agent.signal(signal.SIGCONT)
        woke = time.time()
    done, _ = await asyncio.wait({held}, timeout=2 * HEARTBEAT_S)
    if done:
        outcome = held.exception() or held.result()
        # run_task leases again when the agent does not know its lease (UNKNOWN_LEASE): a
        # result then comes from a new run under a new lease, started after the agent woke.
        rerun = isinstance(outcome, TaskOutcome) and (
            outcome.lease.lease_id not in leased_before and outcome.result.started_at >= woke
        )
        expect(
            isinstance(outcome, BaseException) or rerun,
            "the result of a task claimed before the silence was delivered after the agent "
            "was declared lost",
        )
        what = (
            "withheld, then run again under a new lease"
            if rerun
            else f"answered {getattr(outcome, 'code', type(outcome).__name__)}, not delivered"
        )
    else:
        held.cancel()
        what = "withheld, not delivered"
    await kit.watch.until(
        lambda: len(kit.watch.registrations) > before, 3 * HEARTBEAT_S, "registration again"
    )
    await kit.until_live(START_TIMEOUT_S)
    return (
        f"frozen {frozen_s:.0f} s until declared lost; the task it held was {what}; "
        "registered again, Ready"
    )


async def _in_flight(kit: Kit, count: int) -> list[asyncio.Task[Any]]:
    """``count`` slow tasks on the lease path, started: wait until the agent holds them."""
    assert kit.client is not None and kit.manager is not None
    client, manager = kit.client, kit.manager
    calls = [
        asyncio.create_task(
            client.run_task(kit.s.capability, kit.s.slow_payload, timeout_s=ANSWER_TIMEOUT_S * 2)
        )
        for _ in range(count)
    ]
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        agent = manager.core.agents.get(kit.agent_id)
        if agent is not None and len(agent.leases) >= count:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # delivered and started
    return calls


async def _all_answered(calls: list[asyncio.Task[Any]], what: str) -> int:
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    expect(
        not failed,
        f"{len(failed)} of {len(calls)} tasks {what} failed: {failed[0] if failed else ''}",
    )
    return len(calls)


async def drains_on_request(kit: Kit) -> str:
    assert kit.client is not None
    calls = await _in_flight(kit, 2)
    accepted = await kit.client.drain(kit.agent_id, reason="conformance kit")
    expect(accepted.type == "mesh.drain-accepted.v1", f"the drain was refused: {accepted}")
    served = await _all_answered(calls, "in flight at the drain")
    assert kit.agent is not None
    code = await kit.agent.wait(ANSWER_TIMEOUT_S * 2)
    expect(code is not None, "still running after the drain completed")
    return f"{served} tasks in flight all answered; exited {code} after the drain"


async def drains_on_sigterm(kit: Kit) -> str:
    await kit.ready_agent()
    calls = await _in_flight(kit, 2)
    assert kit.agent is not None
    kit.agent.signal(signal.SIGTERM)
    served = await _all_answered(calls, "in flight at SIGTERM")
    code = await kit.agent.wait(ANSWER_TIMEOUT_S * 2)
    expect(code == 0, f"exit code {code} after SIGTERM (a drain ends with 0)")
    return f"{served} tasks in flight all answered; exited 0"


# (key, what it checks, the check), in the order they run: each leaves the agent as the
# next one needs it (the first starts it; the drains end it; the SIGTERM check starts a new one).
CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("register", "registers and is Ready after acceptance", registers_and_is_ready),
    ("heartbeats", "heartbeats on time with increasing seq", heartbeats_on_time),
    ("lease-path", "serves a task on the lease path", serves_the_lease_path),
    ("input-schema", "answers INPUT_SCHEMA_VIOLATION for an invalid payload", validates_task_input),
    ("admission-path", "serves a task on the admission path", serves_the_admission_path),
    ("trace-context", "carries a task's trace context onto its result", carries_the_trace_context),
    ("grants", "refuses foreign, expired and revoked grants", refuses_bad_grants),
    ("epochs", "refuses an older-epoch grant, honours the draining allowlist", judges_epochs),
    ("reregister", "registers again when the manager asks", reregisters_when_asked),
    (
        "hand-over",
        "keeps its leases when handed to another manager",
        keeps_leases_when_handed_over,
    ),
    (
        "signed",
        "takes control messages only from the managers' user",
        takes_control_only_from_the_managers,
    ),
    (
        "pool-queue",
        "consumes its pool queue again once it is deleted and declared again",
        consumes_a_replaced_pool_queue,
    ),
    (
        "forged-heartbeat",
        "keeps being accepted after a heartbeat forged in its name",
        is_not_fooled_by_a_forged_heartbeat,
    ),
    (
        "restart",
        "takes nothing before its restart under the same ID is accepted",
        takes_nothing_before_its_restart_is_accepted,
    ),
    (
        "fence",
        "fences itself after a silence it was declared lost in",
        fences_itself_after_a_silence,
    ),
    ("drain", "drains on request without losing a task", drains_on_request),
    ("sigterm", "drains on SIGTERM without losing a task", drains_on_sigterm),
    (
        "short-interval",
        "refuses a heartbeat interval below the minimum",
        refuses_a_short_heartbeat_interval,
    ),
)
CHECK_KEYS = tuple(key for key, _, _ in CHECKS)
