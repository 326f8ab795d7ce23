"""The heartbeat sink fed batches as the transport hands them over: one clock read per batch,
every heartbeat in order, a bad one counted with the same reason code as one alone."""

from __future__ import annotations

from collections import Counter

import pytest

from mesh.constants import MAX_MESSAGE_BYTES
from mesh.core import Command, Instant, PoolCore, RegistrationReceived
from mesh.manager.heartbeats import HeartbeatSink
from mesh.wire import Deregistration, Heartbeat, Reason, encode

from .builders import FakeClock, capability, registration


class CountingClock(FakeClock):
    """A fake clock that counts how often it is read."""

    reads: int = 0

    def now(self) -> Instant:
        self.reads += 1
        return super().now()


def heartbeat(agent_id: str, seq: int) -> bytes:
    return encode(Heartbeat(agent_id=agent_id, incarnation="inc-1", seq=seq, sent_at=1.0))


@pytest.fixture
def clock() -> CountingClock:
    return CountingClock()


@pytest.fixture
def core(clock: CountingClock) -> PoolCore:
    core = PoolCore()
    for agent_id in ("a-1", "a-2"):
        core.handle(RegistrationReceived(registration(agent_id, capability())), clock.now())
    return core


def sink_for(
    core: PoolCore, clock: CountingClock, **kwargs: bool
) -> tuple[HeartbeatSink, list[str]]:
    rejected: list[str] = []
    commands: list[Command] = []
    sink = HeartbeatSink(core, clock, commands.extend, on_rejected=rejected.append, **kwargs)
    return sink, rejected


def test_a_batch_reads_the_clock_once_and_feeds_every_heartbeat_in_order(
    core: PoolCore, clock: CountingClock
) -> None:
    sink, _ = sink_for(core, clock)
    clock.reads = 0
    clock.advance(5)

    sink.ingest_many(
        [(heartbeat("a-1", 1), None), (heartbeat("a-2", 1), None), (heartbeat("a-1", 2), None)]
    )

    assert clock.reads == 1
    assert sink.counters["heartbeats"] == 3
    assert core.agents["a-1"].last_heartbeat_seq == 2
    assert core.agents["a-2"].last_seen == clock.now().mono
    assert core.counters["heartbeat_stale"] == 0  # seq 1 then 2: taken in arrival order


def test_a_bad_heartbeat_in_a_batch_is_counted_and_the_rest_still_taken(
    core: PoolCore, clock: CountingClock
) -> None:
    sink, rejected = sink_for(core, clock)
    unknown_field = heartbeat("a-2", 1)[:-1] + b',"extra":1}'

    sink.ingest_many(
        [
            (heartbeat("a-1", 1), None),
            (b"{not json", None),
            (unknown_field, None),
            (heartbeat("a-2", 2), None),
        ]
    )

    assert rejected == [Reason.MALFORMED_JSON, Reason.UNKNOWN_FIELD]
    assert sink.counters == Counter(
        {
            "heartbeats": 2,
            f"heartbeat_rejected.{Reason.MALFORMED_JSON}": 1,
            f"heartbeat_rejected.{Reason.UNKNOWN_FIELD}": 1,
        }
    )
    assert core.agents["a-2"].last_heartbeat_seq == 2


def test_a_batch_checks_each_heartbeat_against_its_own_publisher(
    core: PoolCore, clock: CountingClock
) -> None:
    sink, rejected = sink_for(core, clock, verify_identity=True)

    sink.ingest_many([(heartbeat("a-1", 1), "a-1"), (heartbeat("a-2", 1), "a-1")])

    assert rejected == [Reason.NOT_AUTHORIZED]
    assert sink.counters["heartbeats"] == 1
    assert core.agents["a-2"].last_heartbeat_seq == -1  # never taken


def test_a_heartbeat_alone_is_a_batch_of_one(core: PoolCore, clock: CountingClock) -> None:
    sink, rejected = sink_for(core, clock)
    clock.reads = 0

    sink(heartbeat("a-1", 1))
    sink(b"[]")

    assert clock.reads == 2
    assert sink.counters["heartbeats"] == 1
    assert rejected == [Reason.MALFORMED_JSON]
    assert core.agents["a-1"].last_heartbeat_seq == 1


def test_a_batch_of_nothing_but_bad_heartbeats_counts_no_heartbeat(
    core: PoolCore, clock: CountingClock
) -> None:
    sink, rejected = sink_for(core, clock)

    sink.ingest_many([(b"", None), (b"null", None)])

    assert len(rejected) == 2
    assert "heartbeats" not in sink.counters


def test_an_oversized_body_or_another_message_gets_its_own_reason_not_the_fast_path(
    core: PoolCore, clock: CountingClock
) -> None:
    """The sink validates a heartbeat in one call and sends the rest the long way: a body
    over the size limit is refused before it is parsed, however valid its JSON, and another
    message type is named as such."""
    sink, rejected = sink_for(core, clock)
    padded = heartbeat("a-1", 1)[:-1] + b" " * MAX_MESSAGE_BYTES + b"}"
    other = encode(Deregistration(agent_id="a-1", incarnation="inc-1"))

    sink.ingest_many([(padded, None), (other, None), (heartbeat("a-2", 1), None)])

    assert rejected == [Reason.MESSAGE_TOO_LARGE, Reason.UNEXPECTED_MESSAGE_TYPE]
    assert sink.counters["heartbeats"] == 1
    assert core.agents["a-1"].last_heartbeat_seq == -1  # the oversized one was not taken
