"""A process given several broker addresses moves to the next when its node goes away
(issue 47). Two TCP proxies in front of the shared broker stand for two cluster nodes (only
the proxies' connections suffer): the transport, connected through one, is cut off it while
that one refuses connections, and is back through the other within a reconnect interval —
its publishing connection and its consume-only connection alike."""

from __future__ import annotations

import asyncio
import time

from integration.harness import eventually

from mesh.errors import TransportError
from mesh.topology import Declarations, QueueSpec
from mesh.transport import DEFAULT_EXCHANGE
from mesh.transport.amqp import AmqpTransport

from .tcp_proxy import TcpProxy
from .test_network_faults import BROKER, delete_directly

RECONNECT_S = 0.5


async def test_a_transport_moves_to_the_next_address_when_its_node_goes_away(
    namespace: str,
) -> None:
    queue = f"{namespace}.addresses"
    declarations = Declarations(queues=(QueueSpec(queue, durable=False),))
    async with TcpProxy(BROKER) as a, TcpProxy(BROKER) as b:
        urls = ",".join(
            f"amqp://guest:guest@127.0.0.1:{p.port}/?reconnect_interval={RECONNECT_S}"
            for p in (a, b)
        )
        transport = await AmqpTransport.connect(urls, name=f"{namespace}:addresses")
        heard: list[bytes] = []
        try:
            await transport.declare(declarations)
            await transport.consume_raw(queue, lambda body, _user: heard.append(body))
            used, spare = (a, b) if a.open_connections else (b, a)
            assert used.open_connections == 2 and spare.open_connections == 0  # both conns

            used.reset()  # the node dies: its connections cut, new ones refused
            cut = time.monotonic()
            while True:  # as a producer does: a publish the cut met fails, and is retried
                try:
                    await transport.publish(DEFAULT_EXCHANGE, queue, b"after", timeout_s=5)
                    break
                except TransportError:
                    assert time.monotonic() - cut < 15, "never reached the other address"
                    await asyncio.sleep(0.1)
            moved_s = time.monotonic() - cut
            await eventually(lambda: heard == [b"after"], what="consumed through the other")
            print(f"\npublished through the other address {moved_s:.2f} s after the cut")
            assert spare.open_connections == 2
            assert moved_s < 5 * RECONNECT_S + 2  # a few reconnect intervals, not forever
        finally:
            a.pass_through()
            b.pass_through()
            await transport.close()
            await delete_directly(declarations)
