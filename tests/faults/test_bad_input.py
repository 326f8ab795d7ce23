"""Bad input through the real broker into the real manager (issue 7, "Bad input").

``tests/unit/test_wire.py`` fuzzes the codec alone; this shows the same promise end to end:
the only outcome of bad bytes reaching a running manager is a typed refusal, a dead letter
with a reason, and a counter, and the manager's consumers stay up.

How
---
Hypothesis generates the bad bodies up front (a small ``@given`` collector run once per queue,
``phases=generate`` only, so the CI profile's ``derandomize`` makes the stream fixed): raw
bytes, valid JSON of the wrong shape, mutated samples of every wire message
(``tests/unit/samples.py``: a field dropped, retyped or added, the ``type`` changed), truncated
encodings, and whole valid messages of a type the queue does not take. The codec is the oracle:
a body is kept only if ``decode_as(body, *what the queue takes)`` rejects it, and the reason it
gives is the reason the manager must report. Each body gets a unique ``correlation_id``;
about half are sent with ``reply_to``.

One manager runs in-process for the whole stream, which is published through the real
exchanges to the three queues the manager consumes (``Topology.manager()``), shuffled together
with good traffic (agent registrations, heartbeats, status requests) and oversized messages.
What the manager does with a rejected message (``Intake._guarded``/``_dead_letter``
and ``HeartbeatSink``):

* announce and rpc queues: republished (confirmed) to the dead-letter exchange with the reason
  in ``x-mesh-reason``, counted in ``dead_lettered`` and ``dead_lettered.<reason>`` and in
  ``mesh_dead_lettered_messages_total{reason}`` on ``/metrics``, then acked; when it carried
  ``reply_to``, the requester *also* gets a ``Refusal`` with the same reason. So every bad
  announce/rpc message is dead-lettered, and refusals = the subset sent with ``reply_to``.
* heartbeat queue: by design not dead-lettered (one broken agent must not flood the DLQ) and
  never answered: counted in ``heartbeat_rejected.<reason>`` and
  ``mesh_heartbeats_rejected_total{reason}``, and dropped.

The test asserts that per message, by correlation id: each bad announce/rpc message is in the
dead-letter queue exactly once, byte for byte, with its reason and source queue; each one sent
with ``reply_to`` got exactly one ``Refusal`` with that reason and nothing else got a reply;
bad heartbeats are counted per reason. So bad-sent = dead-lettered (announce, rpc) +
heartbeat-rejected, and every counter rose by exactly that. The good traffic is all processed,
the manager still answers, and the broker lists the same consumer tags on the same channels
before and after (no consumer died or was re-subscribed).

Oversized messages (over ``MAX_MESSAGE_BYTES``) — unparseable ones and valid ones padded with
whitespace — get ``MESSAGE_TOO_LARGE``, never ``MALFORMED_JSON``, and a padded valid
registration registers nobody; spies on the codec's parsers show no parser ever saw a body
over the limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from integration.harness import (
    RawAgent,
    echo_capability,
    eventually,
    manager_settings,
    start_manager,
)
from prometheus_client.parser import text_string_to_metric_families
from unit.samples import SAMPLES, sample_json

import mesh.wire.codec as codec
from mesh import constants as c
from mesh.errors import MessageRejected
from mesh.manager.intake import _ANNOUNCE_TYPES, _RPC_TYPES
from mesh.producer import MeshClient
from mesh.topology import Topology, names
from mesh.transport import AmqpTransport, Delivery
from mesh.wire import (
    AgentRegistration,
    Heartbeat,
    Message,
    Reason,
    Refusal,
    RegistrationAccepted,
    StatusReply,
    StatusRequest,
    decode,
    decode_as,
    encode,
)

if TYPE_CHECKING:  # fixtures' types only; conftest modules are not imported by tests
    from tests.conftest import ManagementApi, TransportFactory

ANNOUNCE, RPC, HEARTBEATS = "announce", "rpc", "heartbeats"
TAKES: dict[str, tuple[type[Message], ...]] = {
    ANNOUNCE: _ANNOUNCE_TYPES,
    RPC: _RPC_TYPES,
    HEARTBEATS: (Heartbeat,),
}
# Bad bodies per queue (≈ 250 in all) and the good traffic shuffled in among them.
EXAMPLES = {ANNOUNCE: 90, RPC: 100, HEARTBEATS: 60}
GOOD_AGENTS, GOOD_HEARTBEATS_EACH, GOOD_STATUS = 6, 5, 10

CLASSES = sorted(SAMPLES, key=lambda cls: cls.TYPE)
TYPE_NAMES = [cls.TYPE for cls in CLASSES]


# ---- the bad stream -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Bad:
    queue: str
    kind: str
    body: bytes
    reply: bool
    reason: str  # what the codec says; what the manager must report
    cid: str


def rejection(body: bytes, queue: str) -> str | None:
    """The codec's verdict for ``body`` on ``queue``: its reason code, or None if valid."""
    try:
        decode_as(body, *TAKES[queue])
    except MessageRejected as exc:
        return str(exc.reason)
    return None


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid sample with one thing wrong: a field dropped, retyped, added, or its type."""
    cls = draw(st.sampled_from(CLASSES))
    obj = sample_json(cls)
    how = draw(st.sampled_from(["drop", "retype", "add", "type"]))
    if how == "drop":
        del obj[draw(st.sampled_from(sorted(obj)))]
    elif how == "retype":
        obj[draw(st.sampled_from(sorted(obj)))] = draw(json_values)
    elif how == "add":
        obj[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in obj))] = draw(
            json_values
        )
    else:
        obj["type"] = draw(st.sampled_from(TYPE_NAMES) | st.text(max_size=30) | json_values)
    return f"mutated-{how}", json.dumps(obj).encode()


@st.composite
def truncated(draw: st.DrawFn) -> tuple[str, bytes]:
    raw = encode(SAMPLES[draw(st.sampled_from(CLASSES))])
    return "truncated", raw[: draw(st.integers(0, len(raw) - 1))]


bad_bodies = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(st.just("json-shape"), json_values.map(lambda v: json.dumps(v).encode())),
    mutated(),
    truncated(),
    st.tuples(
        st.just("wrong-type"), st.sampled_from(CLASSES).map(lambda cls: encode(SAMPLES[cls]))
    ),
)


def collect(queue: str, n: int) -> list[Bad]:
    """``n`` bodies the codec rejects on ``queue``, generated by hypothesis (run once)."""
    found: list[Bad] = []

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(bad_bodies, st.booleans())
    def generate(kind_body: tuple[str, bytes], reply: bool) -> None:
        kind, body = kind_body
        reason = rejection(body, queue)
        assume(reason is not None)
        assert reason is not None
        found.append(Bad(queue, kind, body, reply, reason, f"bad-{uuid.uuid4().hex}"))

    generate()
    return found


def oversized(agent_id: str) -> list[Bad]:
    """Over the limit: one not JSON at all, one a valid message padded with whitespace."""
    limit = c.MAX_MESSAGE_BYTES
    garbage = b"{" + b"\xff" * limit  # neither UTF-8 nor JSON
    registration = AgentRegistration(
        agent_id=agent_id,
        incarnation=uuid.uuid4().hex,
        deployment="oversized",
        capabilities=[echo_capability()],
    )
    heartbeat = Heartbeat(
        agent_id=agent_id, incarnation=uuid.uuid4().hex, seq=1, sent_at=time.time()
    )
    bodies = [
        (ANNOUNCE, garbage, False),
        (ANNOUNCE, encode(registration) + b" " * limit, True),
        (RPC, garbage, True),
        (RPC, encode(StatusRequest()) + b" " * limit, True),
        (HEARTBEATS, garbage, False),
        (HEARTBEATS, encode(heartbeat) + b" " * limit, False),
    ]
    out = []
    for queue, body, reply in bodies:
        assert len(body) > limit
        assert rejection(body, queue) == Reason.MESSAGE_TOO_LARGE
        # Parsed, they would be malformed or valid: their reason is their size alone.
        try:
            decode_as(body, *TAKES[queue], max_bytes=len(body))
        except MessageRejected as exc:
            assert exc.reason == Reason.MALFORMED_JSON
        out.append(
            Bad(
                queue,
                "oversized",
                body,
                reply,
                str(Reason.MESSAGE_TOO_LARGE),
                f"big-{uuid.uuid4()}",
            )
        )
    return out


# ---- spying on the codec's parsers ----------------------------------------------------------
class ParserSpy:
    """Records the size of every body handed to a parser in :mod:`mesh.wire.codec`: orjson,
    the all-types union, one type's validator, and the single-type path (heartbeats)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sizes = self.sizes
        loads, union, validate = orjson.loads, codec._ANY_MESSAGE, codec._validate
        heartbeat_parse = Heartbeat.model_validate_json

        class Orjson:
            JSONDecodeError = orjson.JSONDecodeError
            dumps = staticmethod(orjson.dumps)

            @staticmethod
            def loads(body: bytes) -> Any:
                sizes.append(len(body))
                return loads(body)

        class AnyMessage:
            @staticmethod
            def validate_json(body: bytes, **kwargs: Any) -> Any:
                sizes.append(len(body))
                return union.validate_json(body, **kwargs)

        def spied_validate(cls: type[Message], body: bytes) -> Message:
            sizes.append(len(body))
            return validate(cls, body)

        def spied_heartbeat(cls: type[Heartbeat], /, body: bytes, **kwargs: Any) -> Heartbeat:
            sizes.append(len(body))
            return heartbeat_parse(body, **kwargs)

        monkeypatch.setattr(codec, "orjson", Orjson)
        monkeypatch.setattr(codec, "_ANY_MESSAGE", AnyMessage)
        monkeypatch.setattr(codec, "_validate", spied_validate)
        monkeypatch.setattr(Heartbeat, "model_validate_json", classmethod(spied_heartbeat))


# ---- observing the manager from outside -----------------------------------------------------
def consumer_tags(api: ManagementApi, queues: list[str]) -> dict[str, set[tuple[str, str]]]:
    """(consumer tag, channel) of every consumer the broker lists on each of ``queues``."""
    found: dict[str, set[tuple[str, str]]] = {q: set() for q in queues}
    vhost = api._q(api.vhost)
    for consumer in api.request("GET", f"/api/consumers/{vhost}"):
        queue = consumer["queue"]["name"]
        if queue in found:
            # A consumer whose channel is closing is listed with ``channel_details: []``.
            details = consumer.get("channel_details")
            channel = details.get("name", "") if isinstance(details, dict) else ""
            found[queue].add((consumer["consumer_tag"], channel))
    return found


async def scrape(url: str, family_name: str = "mesh_dead_lettered_messages") -> dict[str, float]:
    """A counter family's ``_total`` by reason, from the manager's ``/metrics``."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
        if sample.name == f"{family_name}_total"
    }


def metric_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {
        r: after.get(r, 0) - before.get(r, 0)
        for r in set(after) | set(before)
        if after.get(r, 0) != before.get(r, 0)
    }


def delta(after: Counter[str], before: Counter[str], prefix: str) -> Counter[str]:
    return Counter(
        {
            k.removeprefix(prefix): after[k] - before[k]
            for k in set(after) | set(before)
            if k.startswith(prefix) and after[k] != before[k]
        }
    )


async def publish_all(
    pub: AmqpTransport,
    topology: Topology,
    schedule: list[tuple[str, Any]],
    reply_queue: str,
    client: MeshClient,
) -> list[asyncio.Task[StatusReply]]:
    """Send the shuffled stream; status requests run as tasks (their replies awaited later)."""
    exchange_of = {
        ANNOUNCE: (topology.announce_exchange, names.agent_announce_key("x", "register")),
        RPC: (topology.control_exchange, names.rpc_key("status")),
        HEARTBEATS: (topology.heartbeat_exchange, names.heartbeat_key("x")),
    }
    statuses = []
    for what, item in schedule:
        if what == "bad":
            exchange, key = exchange_of[item.queue]
            reply_to = reply_queue if item.reply else None
            await pub.publish(exchange, key, item.body, reply_to=reply_to, correlation_id=item.cid)
        elif what == "register":
            await item.register()
        elif what == "heartbeat":
            await item.heartbeat()
        else:
            statuses.append(asyncio.create_task(client.status()))
    return statuses


async def drain_dead_letters(pub: AmqpTransport, queue: str, expected: int) -> list[Delivery]:
    """Exactly ``expected`` messages from the dead-letter queue, and then nothing."""
    assert await pub.queue_depth(queue) == expected
    letters = []
    for _ in range(expected):
        letter = await pub.get_one(queue)
        assert letter is not None
        letters.append(letter)
    assert await pub.get_one(queue, timeout_s=1) is None
    return letters


# ---- the test -------------------------------------------------------------------------------
@pytest.fixture
def bad_stream() -> list[Bad]:
    stream = [b for queue, n in EXAMPLES.items() for b in collect(queue, n)]
    return stream + oversized("oversized-agent")


async def test_bad_input_is_refused_counted_and_never_stops_the_manager(
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    transport_factory: TransportFactory,
    management_api: ManagementApi,
    bad_stream: list[Bad],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = time.monotonic()
    topology = Topology(namespace=namespace)
    queue_of = {
        ANNOUNCE: topology.announce_queue,
        RPC: topology.rpc_queue,
        HEARTBEATS: topology.heartbeat_queue,
    }
    dead = [b for b in bad_stream if b.queue != HEARTBEATS]  # announce and rpc
    dropped = [b for b in bad_stream if b.queue == HEARTBEATS]
    refused = [b for b in dead if b.reply]
    manager = await start_manager(
        manager_settings(namespace, tmp_path / "journal.sqlite3", amqp_url=amqp_url, http_port=0)
    )
    client: MeshClient | None = None
    try:
        assert manager.observer.web is not None
        metrics_url = manager.observer.web.url
        pub = await transport_factory(suffix="bad")
        agents_transport = await transport_factory(suffix="agents")
        client = await MeshClient.connect(amqp_url, namespace=namespace, name=f"client:{namespace}")

        # Replies to the bad requests, by correlation id.
        replies: dict[str, list[Message]] = {}
        reply_queue = await pub.declare_reply_queue(f"{namespace}.bad-replies")

        async def on_reply(delivery: Delivery) -> None:
            replies.setdefault(delivery.correlation_id or "", []).append(decode(delivery.body))

        await pub.consume(reply_queue, on_reply, no_ack=True)

        agents = [
            RawAgent(agents_transport, topology, f"good-{i}", interval_s=10.0)
            for i in range(GOOD_AGENTS)
        ]
        for agent in agents:
            await agent.start()

        queues = list(queue_of.values())
        # Listed, and with their channels: the management API lists a new consumer before its
        # channel's details (an empty name), which a later listing fills in.
        await eventually(
            lambda: all(
                tags and all(channel for _, channel in tags)
                for tags in consumer_tags(management_api, queues).values()
            ),
            what="the manager's consumers listed by the broker, with their channels",
        )
        consumers_before = consumer_tags(management_api, queues)
        counters_before = Counter(manager.counters)
        metrics_before = await scrape(metrics_url)
        heartbeat_metrics_before = await scrape(metrics_url, "mesh_heartbeats_rejected")

        # Good traffic shuffled into the bad stream (fixed seed: a fixed interleaving).
        good: list[tuple[str, Any]] = [("register", a) for a in agents]
        good += [("heartbeat", a) for a in agents for _ in range(GOOD_HEARTBEATS_EACH)]
        good += [("status", None)] * GOOD_STATUS
        schedule: list[tuple[str, Any]] = [("bad", b) for b in bad_stream] + good
        random.Random(7).shuffle(schedule)
        spy = ParserSpy()
        spy.install(monkeypatch)
        statuses = await publish_all(pub, topology, schedule, reply_queue, client)

        # Everything is handled: the counters reach their totals, the refusals arrive.
        def handled() -> bool:
            now = Counter(manager.counters)
            return (
                now["dead_lettered"] - counters_before["dead_lettered"] >= len(dead)
                and sum(delta(now, counters_before, "heartbeat_rejected.").values()) >= len(dropped)
                and sum(len(v) for v in replies.values()) >= len(refused)
                and all(a.received(RegistrationAccepted) for a in agents)
            )

        async def dlq_full() -> bool:
            return await pub.queue_depth(topology.dead_letter_queue) >= len(dead)

        await eventually(handled, timeout_s=30, what="every message handled")
        status_replies = await asyncio.gather(*statuses)
        await eventually(dlq_full, what="the dead letters in their queue")
        await asyncio.sleep(0.5)  # anything extra (a second reply, a dead letter) shows up now
        counters_after = Counter(manager.counters)

        # 1. Every bad announce/rpc message was dead-lettered, exactly once, with its reason.
        letters = await drain_dead_letters(pub, topology.dead_letter_queue, len(dead))
        expected = {b.cid: b for b in dead}
        assert Counter(letter.correlation_id for letter in letters) == Counter(expected.keys())
        for letter in letters:
            sent = expected[letter.correlation_id or ""]
            # The body, or of an oversized one its first DEAD_LETTER_KEEP_BYTES, and its size.
            assert letter.body == sent.body[: c.DEAD_LETTER_KEEP_BYTES]
            assert letter.headers[c.H_ORIGINAL_SIZE] == len(sent.body)
            assert letter.headers[c.H_TRUNCATED] is (len(sent.body) > c.DEAD_LETTER_KEEP_BYTES)
            assert letter.headers[c.H_REASON] == sent.reason, sent
            assert letter.headers[c.H_SOURCE_QUEUE] == queue_of[sent.queue]
            assert letter.headers[c.H_DETAIL]

        # 2. Each one with reply_to got exactly one Refusal with that reason; nothing else did
        # (not the bad heartbeats sent with reply_to, not the messages without it).
        assert sorted(replies) == sorted(b.cid for b in refused)
        for b in refused:
            (reply,) = replies[b.cid]
            assert isinstance(reply, Refusal), (b, reply)
            assert reply.reason == b.reason

        # 3. The counters rose by exactly as many, per reason; bad heartbeats counted, dropped.
        by_reason = Counter(b.reason for b in dead)
        assert counters_after["dead_lettered"] - counters_before["dead_lettered"] == len(dead)
        assert delta(counters_after, counters_before, "dead_lettered.") == by_reason
        rejected_heartbeats = delta(counters_after, counters_before, "heartbeat_rejected.")
        assert rejected_heartbeats == Counter(b.reason for b in dropped)
        metrics_after = await scrape(metrics_url)
        assert metric_delta(metrics_after, metrics_before) == by_reason
        heartbeat_metrics_after = await scrape(metrics_url, "mesh_heartbeats_rejected")
        assert metric_delta(heartbeat_metrics_after, heartbeat_metrics_before) == (
            Counter(b.reason for b in dropped)
        )
        for name in ("handler_errors", "reply_failed", "requester_gone"):
            assert counters_after[name] == counters_before[name], name

        # 4. Oversized: refused for their size before any parser saw them.
        big = [b for b in bad_stream if b.kind == "oversized"]
        assert len(big) == 6 and all(b.reason == Reason.MESSAGE_TOO_LARGE for b in big)
        assert len(spy.sizes) >= len(bad_stream), "the parser spy is not wired in"
        assert max(spy.sizes) <= c.MAX_MESSAGE_BYTES
        assert "oversized-agent" not in manager.core.agents

        # 5. The good traffic shuffled in was all processed.
        received = delta(counters_after, counters_before, "received.")
        assert received[AgentRegistration.TYPE] == GOOD_AGENTS
        assert received[StatusRequest.TYPE] == GOOD_STATUS
        good_heartbeats = counters_after["heartbeats"] - counters_before["heartbeats"]
        assert good_heartbeats == GOOD_AGENTS * GOOD_HEARTBEATS_EACH
        assert all(len(a.received(RegistrationAccepted)) == 1 for a in agents)
        assert len(status_replies) == GOOD_STATUS
        assert {a.agent_id for a in agents} <= set(manager.core.agents)

        # 6. Still up and serving: a new agent registers, a status answers with the counters.
        late = RawAgent(agents_transport, topology, "late", interval_s=10.0)
        await late.start()
        await late.register()
        await eventually(lambda: bool(late.received(RegistrationAccepted)), what="late agent")
        status = await client.status()
        assert status.counters["dead_lettered"] == counters_after["dead_lettered"]
        assert {a.agent_id for a in status.agents} >= {a.agent_id for a in [*agents, late]}

        # 7. No consumer died or was re-subscribed: the same tags on the same channels.
        assert consumer_tags(management_api, queues) == consumers_before

        print(
            "\nbad bodies:",
            dict(Counter(b.queue for b in bad_stream)),
            "with reply_to:",
            dict(Counter(b.queue for b in bad_stream if b.reply)),
            "\nkinds:",
            dict(Counter(b.kind for b in bad_stream)),
            f"\ndead-lettered: {len(letters)} by reason {dict(by_reason)}",
            f"\nrefused (Refusal replies): {len(refused)}",
            f"\nheartbeats rejected: {dict(rejected_heartbeats)}",
            f"\ngood: {GOOD_AGENTS} registrations, {good_heartbeats} heartbeats,",
            f"{len(status_replies)} status replies",
            f"\nparser calls: {len(spy.sizes)}, largest body parsed {max(spy.sizes)} B;",
            f"runtime {time.monotonic() - started:.1f} s",
        )
    finally:
        if client is not None:
            await client.close()
        await manager.stop()
