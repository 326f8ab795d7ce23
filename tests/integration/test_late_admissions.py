"""The manager away longer than a producer waits: a grant decided after its caller gave up is
given back at once, and ``submit`` asks again under the same admission ID until its deadline
(one grant, one execution); and a request answered twice (its first manager died between its
answer and its ack) keeps its grant, on the real broker."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import aiormq
import pytest

from mesh.core.answers import refused
from mesh.errors import RequestTimeout, SubmitDeadlineExceeded
from mesh.ledger.sqlite import SqliteLedger
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.topology import names
from mesh.topology.specs import BindingSpec, Declarations, QueueSpec
from mesh.transport import AmqpTransport
from mesh.transport.delivery import Delivery
from mesh.wire import AdmissionReason, AdmissionRequest, decode_as, encode

from .harness import eventually, start_manager
from .test_admission import settings_for
from .test_backpressure import echo_descriptor, echo_requirements
from .test_one_pool import echo_runtime


def reservations(tmp_path: Path) -> dict[str, str]:
    """admission ID -> state, from the ledger file itself (no manager needed)."""
    with SqliteLedger(tmp_path / "ledger.sqlite3") as ledger:
        return {a: state.value for a, (state, _) in ledger.replay_log().items()}


async def manager_then_away(amqp_url: str, namespace: str, tmp_path: Path) -> ManagerService:
    """A manager that set up the echo pool's descriptor, then stopped: its request queue
    stays and fills up; the next manager on the same ledger decides what queued meanwhile."""
    settings = settings_for(amqp_url, namespace, tmp_path, admission_capacity="descriptor")
    first = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="operator")
    try:
        assert (await client.publish_descriptor(echo_descriptor(4))).type.endswith("accepted.v1")
    finally:
        await client.close()
    await first.stop()
    return first


async def tap_on_admissions(
    amqp_url: str, producer: MeshClient
) -> tuple[AmqpTransport, asyncio.Queue[Delivery]]:
    """A queue of the test's own bound where admission requests go (the control exchange's
    ``rpc.admit``): a copy of every request, in order."""
    tap = await AmqpTransport.connect(amqp_url, name="tap")
    seen: asyncio.Queue[Delivery] = asyncio.Queue()
    queue = f"{producer.topology.namespace}.test.tap"
    control, admit_key = producer.topology.control_exchange, names.rpc_key("admit")
    await tap.declare(
        Declarations(
            queues=(QueueSpec(queue, durable=False),),
            bindings=(BindingSpec(queue, control, admit_key),),
        )
    )
    await tap.consume(queue, seen.put, no_ack=True)
    return tap, seen


async def publish_again(tap: AmqpTransport, request: Delivery) -> None:
    """A copy of an admission request taken from the tap, sent again as it was sent."""
    await tap.publish(
        request.exchange,
        request.routing_key,
        request.body,
        reply_to=request.reply_to,
        correlation_id=request.correlation_id,
        user_id=request.user_id,
    )


async def test_a_grant_decided_after_its_caller_gave_up_is_given_back(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    first = await manager_then_away(amqp_url, namespace, tmp_path)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    second = None
    try:
        with pytest.raises(RequestTimeout):
            await producer.admit(echo_requirements(), admission_id="adm-late", timeout_s=1.0)

        second = await start_manager(first.settings)  # decides the queued request: admitted
        await eventually(
            lambda: reservations(tmp_path).get("adm-late") == "RELEASED",
            what="the late grant given back by the producer",
        )
        assert producer.counters["late_admissions_released"] == 1
    finally:
        await producer.close()
        if second is not None:
            await second.stop()


async def test_submit_asks_again_under_the_same_admission_id_while_the_manager_is_away(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    first = await manager_then_away(amqp_url, namespace, tmp_path)
    runtime = echo_runtime(amqp_url, namespace, "echo-1")
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    second = None
    try:
        submitting = asyncio.create_task(
            producer.submit(echo_requirements(), {"message": "hi", "sleep_ms": 0}, timeout_s=60)
        )
        await asyncio.sleep(12)  # the first request's 10 s wait runs out: asked again
        assert not submitting.done()
        started = time.monotonic()
        second = await start_manager(first.settings)
        await runtime.start()
        done = await asyncio.wait_for(submitting, 40)
        print(f"\nsubmitted {time.monotonic() - started:.1f} s after the manager came back")

        assert done.output["message"] == "hi"
        assert producer.counters["submit_request_retries"] >= 1
        states = reservations(tmp_path)
        assert Counter(states.values()) == {"RELEASED": 1}  # one grant, used and settled
        assert done.decision.admission_id in states
        assert producer.counters["late_admissions_released"] == 0  # it was the retry's grant
    finally:
        await producer.close()
        await runtime.stop()
        if second is not None:
            await second.stop()


async def test_a_second_answer_to_an_answered_admission_leaves_its_grant_with_the_holder(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """Two managers share a request queue; one answers, dies before its ack, and the broker
    redelivers the request to the other, which answers again from the ledger: the same grant.
    Here the redelivery is made by hand — a copy of the request, taken from a tap on the
    control exchange, published again — so the second answer comes every time. The producer
    counts it and leaves the grant to its holder (it used to give it back as a late grant)."""
    settings = settings_for(amqp_url, namespace, tmp_path, admission_capacity="descriptor")
    manager = await start_manager(settings)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    tap, seen = await tap_on_admissions(amqp_url, producer)
    try:
        assert (await producer.publish_descriptor(echo_descriptor(4))).type.endswith("accepted.v1")

        decision = await producer.admit(echo_requirements(), admission_id="adm-twice")
        assert decision.grant is not None, decision
        request = await asyncio.wait_for(seen.get(), 5)
        await publish_again(tap, request)
        await eventually(lambda: producer.counters["late_replies"] == 1, what="the second answer")

        assert producer.counters["late_admissions_released"] == 0
        assert producer.counters["duplicate_replies"] == 1
        assert producer.counters["duplicate_replies_differing"] == 0  # the same answer again
        # Decided twice, the same grant: the second is counted (and journaled) as a replay.
        assert manager.counters["admission.admitted"] == 1
        assert manager.counters["admission.replayed"] == 1
        assert reservations(tmp_path) == {"adm-twice": "ACTIVE"}
        # A third answer that says otherwise (a woken manager's stale refusal, say) is
        # counted apart: a fault test asserts there are none.
        other = refused("adm-twice", AdmissionReason.NO_ELIGIBLE_POOL, "a stale answer")
        await tap.publish(
            "", request.reply_to or "", encode(other), correlation_id=request.correlation_id
        )
        await eventually(
            lambda: producer.counters["duplicate_replies_differing"] == 1, what="the third answer"
        )
        settled = await producer.release_admission(decision.grant)
        assert settled.released, settled
        assert reservations(tmp_path) == {"adm-twice": "RELEASED"}
    finally:
        await tap.close()
        await producer.close()
        await manager.stop()


async def test_a_redelivered_request_gets_its_recorded_deferral_again_not_a_new_decision(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """Its manager deferred it, answered, and stopped before its ack: the broker gives the
    request, marked redelivered, to the next manager. Capacity is free by then, and deciding
    it anew would answer one request twice, differently (a deferral, then a grant): the
    ledger's recorded deferral is given again. The redelivery is the broker's own: a copy of
    the request is put in the manager's queue while no manager runs, taken by the test and
    given back (requeue), so RabbitMQ marks it redelivered. A retry (a new request, not
    redelivered) is decided anew and admitted."""
    settings = settings_for(amqp_url, namespace, tmp_path, admission_capacity="descriptor")
    manager = await start_manager(settings)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    tap, seen = await tap_on_admissions(amqp_url, producer)
    second = None
    try:
        assert (await producer.publish_descriptor(echo_descriptor(1))).type.endswith("accepted.v1")
        holding = await producer.admit(echo_requirements(), admission_id="adm-hold")
        assert holding.grant is not None, holding
        waiting = await producer.admit(echo_requirements(), admission_id="adm-wait")
        assert waiting.outcome == "deferred", waiting
        await asyncio.wait_for(seen.get(), 5)  # adm-hold's request
        request = await asyncio.wait_for(seen.get(), 5)  # adm-wait's
        assert (await producer.release_admission(holding.grant)).released
        await manager.stop()

        await publish_again(tap, request)
        connection = await aiormq.connect(amqp_url)
        try:
            channel = await connection.channel()
            taken = await channel.basic_get(producer.topology.rpc_queue, no_ack=False)
            assert taken.delivery_tag is not None and taken.body == request.body
            await channel.basic_reject(taken.delivery_tag, requeue=True)
        finally:
            await connection.close()

        second = await start_manager(settings)
        await eventually(lambda: producer.counters["late_replies"] == 1, what="the redelivery")
        assert producer.counters["duplicate_replies"] == 1
        assert producer.counters["duplicate_replies_differing"] == 0, list(
            producer.answered_differently
        )
        assert second.admission.counters["admission.answered_again"] == 1
        assert second.journal is not None
        journaled = second.journal.query(limit=None)
        (again,) = [e for e in journaled if e.kind == "admission" and "answered_again" in e.detail]
        assert (again.detail["admission_id"], again.reason) == ("adm-wait", "CAPACITY")
        assert reservations(tmp_path) == {"adm-hold": "RELEASED"}  # nothing granted to it

        retried = await producer.admit(echo_requirements(), admission_id="adm-wait")
        assert retried.grant is not None, retried
        assert (await producer.release_admission(retried.grant)).released
    finally:
        await tap.close()
        await producer.close()
        await (second or manager).stop()


async def test_submit_tells_the_manager_its_deadline(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    """``submit(timeout_s=…)`` with requirements that carry no deadline sends the one it gives
    up at, so the manager can refuse work it cannot finish in time (``DEADLINE_UNREACHABLE``)
    rather than keep it deferred until the producer stops asking. Seen on a tap of the
    control exchange: every request of the call carries it."""
    settings = settings_for(amqp_url, namespace, tmp_path, admission_capacity="descriptor")
    manager = await start_manager(settings)
    producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
    tap, seen = await tap_on_admissions(amqp_url, producer)
    try:
        assert (await producer.publish_descriptor(echo_descriptor(4))).type.endswith("accepted.v1")
        requirements = echo_requirements()
        assert requirements.deadline is None

        called = time.time()
        with pytest.raises(SubmitDeadlineExceeded):  # no agent: deferred until it gives up
            await producer.submit(requirements, {"message": "hi"}, timeout_s=2.0)

        sent = [decode_as((await asyncio.wait_for(seen.get(), 5)).body, AdmissionRequest)]
        while not seen.empty():
            sent.append(decode_as(seen.get_nowait().body, AdmissionRequest))
        deadlines = {request.requirements.deadline for request in sent}
        assert len(deadlines) == 1, deadlines  # one deadline for the whole call
        [deadline] = deadlines
        assert deadline is not None and called + 1.5 <= deadline <= called + 2.5
    finally:
        await tap.close()
        await producer.close()
        await manager.stop()
