"""The network under the mesh made bad, through :mod:`tests.faults.tcp_proxy` in front of the
shared broker (nothing destructive: only the proxy's own connections suffer). Each case
ends on the invariants of :class:`~tests.faults.accounting.Tally`.

* **Latency and jitter** (20 ms ± 15 ms on every chunk, both ways): a stream of persistent
  publishes from concurrent producers is all confirmed and all consumed; the delay did apply.
* **A blackhole** (the path goes silent: no RST, no FIN) mid-stream: no publish waits past its
  timeout (each such attempt is ``unknown``); the AMQP heartbeat finds the dead connection
  within aiormq's bound (:func:`heartbeat_detection_bound_s`); once the path is back the robust
  connection reconnects, the producer retries its unknown IDs under the same IDs, and
  everything confirmed is consumed.
* **Resets** (every connection aborted with a RST, reconnect attempts too, for a while):
  publishes come back ``unknown`` within their timeout, the transport reconnects within its
  reconnect interval of the path passing again, retried IDs are consumed.
* **One byte per write**: every AMQP frame arrives in pieces, both ways; a stream of publishes
  and its consumption still work, all confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aio_pika
import pytest
from integration.harness import eventually

from mesh.topology import Declarations
from mesh.transport.amqp import AmqpTransport

from .tcp_proxy import TcpProxy
from .workload import POLL_S, Workload, ids, work_queue

BROKER = ("127.0.0.1", 5672)
BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"
HEARTBEAT_S = 1
RECONNECT_INTERVAL_S = 0.5
PUBLISH_TIMEOUT_S = 1.0
MARGIN_S = 0.5
"""Slack on every time bound: scheduling on a loaded two-core machine, not a tolerance."""


def heartbeat_detection_bound_s(heartbeat_s: int) -> float:
    """How long aiormq (7.2) takes, at most, to give up on a connection that went silent.

    Not two heartbeat intervals: aiormq's ``Connection.__heartbeat`` loop wakes every
    ``max(1, heartbeat // 2)`` s and cancels the reader once no frame has arrived for its
    grace period, ``(heartbeat + 1) * HEARTBEAT_GRACE_MULTIPLIER`` with the multiplier 3
    ("allow three missed heartbeats"). So: grace plus at most one wake-up interval, measured
    from the last frame received (which is before the blackhole starts, never after).
    With ``heartbeat=1``: 6 s + 1 s = 7 s. (While the producer has not filled the socket: a
    heartbeat that waits for room in aiormq's write queue can delay the check by up to one
    more grace period; here the proxy keeps reading and the stream is one publish at a time.)
    """
    return (heartbeat_s + 1) * 3 + max(1, heartbeat_s // 2)


async def delete_directly(declarations: Declarations) -> None:
    """Remove the test's queue and exchange over a connection of its own, not the proxy's."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        for queue in declarations.queues:
            await channel.queue_delete(queue.name)
        for exchange in declarations.exchanges:
            await channel.exchange_delete(exchange.name)


@pytest.fixture
async def proxy() -> AsyncIterator[TcpProxy]:
    async with TcpProxy(BROKER) as running:
        yield running


@pytest.fixture
async def work(proxy: TcpProxy, namespace: str) -> AsyncIterator[Workload]:
    """A producer and a consumer connected through the proxy, on a work queue of the test's."""
    url = (
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        f"?heartbeat={HEARTBEAT_S}&reconnect_interval={RECONNECT_INTERVAL_S}"
    )
    declarations = work_queue(namespace)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(delete_directly, declarations)
        stack.callback(proxy.pass_through)  # closing needs a path to the broker
        transports = []
        for role in ("producer", "consumer"):
            transport = await AmqpTransport.connect(
                url, name=f"{namespace}:{role}", publish_timeout_s=PUBLISH_TIMEOUT_S
            )
            stack.push_async_callback(transport.close)
            transports.append(transport)
        producer, consumer = transports
        yield await Workload.over(producer, consumer, declarations, PUBLISH_TIMEOUT_S)


class Watch:
    """When the transport saw its connection drop and come back, on the loop's clock."""

    def __init__(self, transport: AmqpTransport) -> None:
        self.dropped: list[float] = []
        self.reconnected: list[float] = []
        self._loop = asyncio.get_running_loop()
        transport.on_disconnect(lambda: self.dropped.append(self._loop.time()))
        transport.on_reconnect(self._reconnected)

    async def _reconnected(self) -> None:
        self.reconnected.append(self._loop.time())


async def produce_concurrently(work: Workload, business_ids: list[str], producers: int) -> None:
    await asyncio.gather(*(work.produce(business_ids[k::producers]) for k in range(producers)))


async def test_latency_and_jitter_lose_nothing(proxy: TcpProxy, work: Workload) -> None:
    mean_s, jitter_s, count, producers = 0.020, 0.015, 100, 5
    proxy.latency(mean_s, jitter_s)
    await work.consume(prefetch=20)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await produce_concurrently(work, ids("lat", count), producers)
    published_s = loop.time() - started
    await work.settled(timeout_s=20)

    work.tally.check()
    delay = f"{mean_s * 1e3:.0f} ± {jitter_s * 1e3:.0f} ms"
    print(f"{count} publishes through {delay} each way in {published_s:.2f} s")
    assert work.tally.confirmed == count
    assert work.tally.unknown == 0
    # Each producer's publishes are sequential round trips, each delayed both ways.
    round_trips = count // producers
    assert published_s >= round_trips * 2 * (mean_s - jitter_s)
    assert work.tally.slowest_publish_s <= PUBLISH_TIMEOUT_S


async def test_a_blackhole_is_detected_by_heartbeats_and_no_publish_outlives_its_timeout(
    proxy: TcpProxy, work: Workload
) -> None:
    watch = Watch(work.producer)
    loop = asyncio.get_running_loop()
    await work.consume()
    producing = asyncio.create_task(work.produce(ids("bh", 60), give_up_after_s=40))
    await eventually(
        lambda: work.tally.confirmed >= 20,
        what="20 confirms before the blackhole",
        timeout_s=60,
        poll_s=POLL_S,
    )

    proxy.blackhole()
    silent_at = loop.time()
    bound_s = heartbeat_detection_bound_s(HEARTBEAT_S)
    await eventually(
        lambda: bool(watch.dropped),
        what="the heartbeat to notice",
        timeout_s=bound_s + 5,
        poll_s=POLL_S,
    )
    detected_s = watch.dropped[0] - silent_at
    unknown_while_silent = work.tally.unknown

    proxy.pass_through()
    healed_at = loop.time()
    await asyncio.wait_for(producing, 30)
    await work.settled(timeout_s=15)

    work.tally.check()
    back_s = watch.reconnected[0] - healed_at
    print(
        f"dead connection detected {detected_s:.2f} s into the blackhole (bound {bound_s} s), "
        f"reconnected {back_s:.2f} s after it passed again; "
        f"{unknown_while_silent} unknown while silent; proxy: {proxy.connections} connections"
    )
    assert detected_s <= bound_s + MARGIN_S
    assert unknown_while_silent >= 1  # the blackhole did land mid-stream
    assert work.tally.slowest_publish_s <= PUBLISH_TIMEOUT_S + MARGIN_S
    assert work.tally.confirmed == 60
    assert back_s <= RECONNECT_INTERVAL_S + 2.0


async def test_reset_connections_make_publishes_unknown_in_time_and_then_reconnect(
    proxy: TcpProxy, work: Workload
) -> None:
    watch = Watch(work.producer)
    loop = asyncio.get_running_loop()
    await work.consume()
    producing = asyncio.create_task(work.produce(ids("rst", 60), give_up_after_s=30))
    await eventually(
        lambda: work.tally.confirmed >= 20,
        what="20 confirms before the resets",
        timeout_s=60,
        poll_s=POLL_S,
    )

    proxy.reset()
    reset_at = loop.time()
    await eventually(
        lambda: bool(watch.dropped), what="the reset to be noticed", timeout_s=5, poll_s=POLL_S
    )
    noticed_s = watch.dropped[0] - reset_at
    await asyncio.sleep(4 * RECONNECT_INTERVAL_S)  # reconnect attempts are reset, too
    accepted_while_resetting = proxy.connections

    proxy.pass_through()
    healed_at = loop.time()
    await asyncio.wait_for(producing, 30)
    await work.settled(timeout_s=15)

    work.tally.check()
    back_s = watch.reconnected[0] - healed_at
    print(
        f"reset noticed after {noticed_s:.3f} s, reconnected {back_s:.2f} s after the path "
        f"passed again; proxy: {accepted_while_resetting} connections accepted by then"
    )
    assert noticed_s <= MARGIN_S
    assert work.tally.unknown >= 1  # the resets did land mid-stream
    assert work.tally.slowest_publish_s <= PUBLISH_TIMEOUT_S + MARGIN_S
    assert work.tally.confirmed == 60
    assert accepted_while_resetting > 2  # reconnect attempts met the resets
    assert back_s <= RECONNECT_INTERVAL_S + 2.0


async def test_frames_split_into_single_bytes_still_arrive_whole(
    proxy: TcpProxy, work: Workload
) -> None:
    count = 20
    work.publish_timeout_s = 5.0  # a byte per millisecond: a publish takes a few tenths
    await work.consume(prefetch=5)
    proxy.slice()
    writes, forwarded = proxy.writes, proxy.bytes_up + proxy.bytes_down
    await work.produce(ids("sl", count))
    await work.settled(timeout_s=15)

    work.tally.check()
    writes = proxy.writes - writes
    forwarded = proxy.bytes_up + proxy.bytes_down - forwarded
    print(f"{forwarded} bytes forwarded in {writes} writes")
    assert work.tally.confirmed == count
    assert work.tally.unknown == 0
    assert writes == forwarded > count * 100  # every write was one byte, of whole frames


PROBE_S = 0.5


async def test_the_liveness_probe_notices_a_blackhole_within_two_intervals(
    proxy: TcpProxy, namespace: str
) -> None:
    """With the AMQP heartbeat at 60 s (aiormq would take over three minutes), the transport's
    own probe (``liveness_probe_s``: a round trip every half interval, one interval to
    answer) drops a silent connection within two probe intervals (1.5 by construction); the
    robust connection comes back once the path passes, and publishes flow again."""
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?heartbeat=60&reconnect_interval=0.5"
    transport = await AmqpTransport.connect(
        url,
        name=f"{namespace}:probed",
        publish_timeout_s=PUBLISH_TIMEOUT_S,
        liveness_probe_s=PROBE_S,
    )
    declarations = work_queue(namespace)
    try:
        work = await Workload.over(transport, transport, declarations, PUBLISH_TIMEOUT_S)
        watch = Watch(transport)
        loop = asyncio.get_running_loop()
        await work.consume()
        await work.produce(ids("before", 10))
        await asyncio.sleep(3 * PROBE_S)  # probes answered meanwhile: nothing is dropped
        assert not watch.dropped and transport.probes_unanswered == 0

        proxy.blackhole()
        silent_at = loop.time()
        await eventually(
            lambda: bool(watch.dropped),
            what="the probe to drop the connection",
            timeout_s=10,
            poll_s=POLL_S,
        )
        detected_s = watch.dropped[0] - silent_at
        proxy.pass_through()
        await eventually(
            lambda: bool(watch.reconnected), what="the reconnection", timeout_s=10, poll_s=POLL_S
        )
        await work.produce(ids("after", 10))
        await work.settled(timeout_s=15)
        work.tally.check()
        print(f"blackhole noticed after {detected_s:.2f} s (bound {2 * PROBE_S} s)")
        assert detected_s <= 2 * PROBE_S + MARGIN_S
        assert transport.probes_unanswered >= 1
    finally:
        proxy.pass_through()
        await transport.close()
        await delete_directly(declarations)
