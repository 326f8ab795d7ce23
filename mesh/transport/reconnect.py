"""The transport connection's life: the first connection, a drop, reconnection (to the next
broker address when several are given), what is restored in which order, and a liveness
probe that drops a connection to a silent broker.

aio-pika's robust connection reconnects and restores channels, topology and consumers by
itself; what this adds is the order (consumers take messages only once the whole connection
is back, then the callers' ``on_reconnect`` callbacks run) and moving on through a cluster's
addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection

from mesh.errors import BrokerUnavailable
from mesh.transport import aiormq_bridge
from mesh.transport.addresses import BrokerAddresses, redact
from mesh.transport.urls import why_not_connected

log = logging.getLogger(__name__)


async def connect_first(
    addresses: BrokerAddresses,
    *,
    name: str,
    properties: Mapping[str, str] | None,
    timeout_s: float,
) -> tuple[AbstractRobustConnection, str]:
    """A robust connection to the first of ``addresses`` that answers (in this process's
    order) and its URL, or :class:`BrokerUnavailable` with one sentence that says why."""
    for address in addresses.urls:
        try:
            connection = await aio_pika.connect_robust(
                address,
                client_properties={**(properties or {}), "connection_name": name},
                timeout=timeout_s,
            )
            return connection, address
        except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as exc:
            failed: tuple[str, BaseException] = (address, exc)
    address, error = failed
    others = len(addresses.urls) - 1
    tried = f" (nor at the {others} other addresses given)" if others else ""
    raise BrokerUnavailable(why_not_connected(address, error) + tried) from None


class Reconnection:
    """Follows one robust connection through drops and reconnections.

    On a drop: ``restoring`` is set (consumers wait for the whole connection), the next
    broker address is tried, and ``on_dropped`` runs. Once reconnected: ``on_restored`` runs
    (declarations forgotten, consumers subscribed again), then each ``on_reconnect``
    callback. Nothing runs once :attr:`closing` is set."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        addresses: BrokerAddresses,
        address: str,
        *,
        url: str,
        on_dropped: Callable[[], None],
        on_restored: Callable[[], Awaitable[None]],
    ) -> None:
        self.closing = False
        self.restoring = False  # the connection dropped and is not whole again yet
        # The broker addresses (several: a cluster's nodes) and the one connected to.
        self.addresses = addresses
        self.address = address
        self._connection = connection
        self._url = url
        self._on_dropped = on_dropped
        self._on_restored = on_restored
        self._callbacks: list[Callable[[], Awaitable[None]]] = []
        self._moving_on: asyncio.Task[None] | None = None
        connection.reconnect_callbacks.add(self._reconnected)
        connection.close_callbacks.add(self._dropped)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the connection drops (before reconnection starts)."""

        def closed(*_: Any) -> None:
            if not self.closing:
                callback()

        self._connection.close_callbacks.add(closed)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every reconnection (consumers are restored before it)."""
        self._callbacks.append(callback)

    def _dropped(self, *_: Any) -> None:
        """The connection dropped (the broker, the network, the liveness probe)."""
        if not self.closing:
            self.restoring = True
            self._move_on()
            self._on_dropped()

    def _move_on(self) -> None:
        """Several addresses: the connection dropped, so reconnect to the next one (the node
        may be gone), and to the one after it every reconnect interval until connected."""
        if len(self.addresses.urls) < 2 or (
            self._moving_on is not None and not self._moving_on.done()
        ):
            return
        self._moving_on = asyncio.create_task(self._next_addresses(), name="broker-addresses")

    async def _next_addresses(self) -> None:
        connection = self._connection
        interval = aiormq_bridge.reconnect_interval(connection)
        while not self.closing:
            self.address = self.addresses.after(self.address)
            aiormq_bridge.reconnect_to(connection, self.address)
            log.info("reconnecting to the next broker address", extra={"url": redact(self.address)})
            await asyncio.sleep(interval)
            if connection.connected.is_set():
                return

    async def _reconnected(self, *_: Any) -> None:
        # aio-pika swallows exceptions from reconnect callbacks: log every failure here.
        log.warning("reconnected to the broker", extra={"url": redact(self._url)})
        # Every channel is back: only now do the consumers take messages again.
        self.restoring = False
        await self._on_restored()
        for callback in self._callbacks:
            try:
                await callback()
            except Exception:
                log.exception("reconnect callback failed")


class LivenessProbe:
    """One round trip (``basic.qos`` on the publish channel: it consumes nothing, so the
    setting changes nothing) every half ``interval_s``. Unanswered within ``interval_s``, the
    broker is taken for gone: the connection is closed — its close callbacks run, and the
    robust connection reconnects once the broker answers again. A path that goes silent is
    noticed at most half an interval (until the next probe) plus one interval (its timeout)
    later. Not while the broker blocks us (an alarm: it stops reading our socket on purpose)
    or while reconnecting."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        channel: AbstractRobustChannel,
        *,
        url: str,
        closing: Callable[[], bool],
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._url = url
        self._closing = closing
        self._task: asyncio.Task[None] | None = None
        self.probes_unanswered = 0

    def start(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the liveness probe interval must be > 0, got {interval_s}")
        if self._task is None:
            self._task = asyncio.create_task(self._probe_forever(interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _probe_forever(self, interval_s: float) -> None:
        while not self._closing():
            await asyncio.sleep(interval_s / 2)
            connection = self._connection
            if (
                connection.is_closed
                or connection.reconnecting
                or aiormq_bridge.is_blocked(connection)
            ):
                continue
            try:
                async with asyncio.timeout(interval_s):
                    channel = await self._channel.get_underlay_channel()
                    await channel.basic_qos(prefetch_count=0)
            except TimeoutError:
                self.probes_unanswered += 1
                log.warning(
                    "the broker did not answer a liveness probe; dropping the connection",
                    extra={"url": redact(self._url), "waited_s": interval_s},
                )
                # A silent broker never sends Close-Ok: wait a quarter interval at most.
                await aiormq_bridge.drop(
                    connection, ConnectionError("liveness probe unanswered"), interval_s / 4
                )
            except (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError) as exc:
                log.debug("liveness probe on a closing connection", extra={"error": str(exc)})
