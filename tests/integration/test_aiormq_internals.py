"""The internals :mod:`mesh.transport.aiormq_bridge` relies on, checked against the installed
aiormq and aio-pika on a real connection: if an upgrade renames or reshapes one, this fails by
name — before a confirm is attached to the wrong publish in production.

The bridge publishes on aiormq's confirming channel with aiormq's own bookkeeping (a delivery
tag and a confirm future per message, the message ID mapped to the tag so a return finds it)
but writes the frames itself (``put_confirmed``, ``put_unconfirmed``); it reads the "blocked"
flag aiormq keeps and does not expose (``is_blocked``), raises the process-wide frame buffer
(``aiormq.Connection.FRAME_BUFFER_SIZE``), closes the aiormq connection under aio-pika's
(``drop``) and points aio-pika's reconnection at another address (``reconnect_to``).
pyproject.toml pins aiormq and pamqp to the ranges this test has passed on.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aiormq
import pamqp
import pytest
import yarl
from aio_pika.abc import AbstractRobustConnection
from aiormq.abc import ChannelFrame
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mesh.transport import aiormq_bridge
from mesh.transport.amqp091 import message_properties


def pinned(package: str) -> SpecifierSet:
    """The range pyproject.toml declares for ``package``, as installed metadata says."""
    from importlib.metadata import requires

    for requirement in requires("agent-mesh") or []:
        name = requirement.split(";")[0].strip()
        if name.startswith(package) and name[len(package)] in "<>=!~ ":
            return SpecifierSet(name[len(package) :].strip())
    raise AssertionError(f"pyproject.toml declares no range for {package}")


@pytest.fixture
async def connection(amqp_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    robust = await aio_pika.connect_robust(
        amqp_url, client_properties={"connection_name": request.node.nodeid}
    )
    try:
        yield robust
    finally:
        await robust.close()


def test_the_installed_aiormq_and_pamqp_are_within_the_ranges_pinned() -> None:
    from importlib.metadata import version

    for package in ("aiormq", "pamqp"):
        assert Version(version(package)) in pinned(package), (package, version(package))
    assert pamqp.__version__  # the package the consume-only connection's frames come from


def test_the_frame_buffer_is_a_class_attribute_aiormq_reads() -> None:
    assert isinstance(aiormq.Connection.FRAME_BUFFER_SIZE, int)
    assert aiormq.Connection.FRAME_BUFFER_SIZE >= aiormq_bridge.WRITE_QUEUE_FRAMES  # at import
    assert "FRAME_BUFFER_SIZE" in inspect.getsource(aiormq.Connection)  # and read there


def test_a_channel_frame_takes_the_payload_and_the_close_flag() -> None:
    frame: Any = ChannelFrame(b"frames", should_close=False)
    assert (frame.payload, frame.should_close) == (b"frames", False)


async def test_the_confirming_channel_keeps_the_bookkeeping_the_bridge_writes_into(
    connection: AbstractRobustConnection,
) -> None:
    robust = await connection.channel(publisher_confirms=True, on_return_raises=True)
    channel = await robust.get_underlay_channel()
    assert isinstance(channel, aiormq.Channel)
    assert hasattr(channel.lock, "__aenter__")  # held around a publish's bookkeeping
    assert isinstance(channel.delivery_tag, int)
    assert isinstance(channel.confirmations, dict)
    assert isinstance(channel.message_id_delivery_tag, dict)
    assert isinstance(channel.write_queue, asyncio.Queue)
    assert isinstance(channel.number, int) and channel.number > 0
    assert isinstance(channel.max_content_size, int) and channel.max_content_size > 0
    assert isinstance(channel.create_future(), asyncio.Future)
    assert hasattr(channel, "on_consumer_cancel_callbacks")
    # A publish through the bridge: confirmed, and the bookkeeping left as aiormq leaves it.
    before = channel.delivery_tag
    properties = message_properties(None, "internals-1")
    (confirm,) = await aiormq_bridge.put_confirmed(
        channel, "", [("amq.no-such-queue-is-fine", b"{}", properties, "internals-1")], False
    )
    await asyncio.wait_for(confirm, 10)
    assert channel.delivery_tag == before + 1
    assert before + 1 not in channel.confirmations
    assert channel.message_id_delivery_tag == {}


async def test_an_unconfirmed_batch_goes_out_on_the_channel_the_bridge_writes_to(
    connection: AbstractRobustConnection,
) -> None:
    robust = await connection.channel()
    queue = await robust.declare_queue(exclusive=True, auto_delete=True)
    fast = await (await connection.channel(publisher_confirms=False)).get_underlay_channel()
    marshalled = aiormq.spec.Basic.Properties(content_type="application/json").marshal()
    await aiormq_bridge.put_unconfirmed(
        fast, "", [(queue.name, b"1"), (queue.name, b"2")], marshalled
    )
    got = []
    for _ in range(50):
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            got.append(message.body)
        if len(got) == 2:
            break
        await asyncio.sleep(0.05)
    assert got == [b"1", b"2"]


async def test_the_blocked_flag_is_where_the_bridge_reads_it(
    connection: AbstractRobustConnection,
) -> None:
    amqp = connection.transport.connection  # type: ignore[union-attr]
    unblocked = getattr(amqp, "_Connection__connection_unblocked", None)
    assert isinstance(unblocked, asyncio.Event), "aiormq no longer keeps the blocked flag"
    assert unblocked.is_set() and aiormq_bridge.is_blocked(connection) is False
    unblocked.clear()  # as aiormq does on connection.blocked
    assert aiormq_bridge.is_blocked(connection) is True
    unblocked.set()


async def test_dropping_closes_the_aiormq_connection_under_the_robust_one(
    connection: AbstractRobustConnection,
) -> None:
    closed = asyncio.Event()
    connection.close_callbacks.add(lambda *_: closed.set())
    await aiormq_bridge.drop(connection, ConnectionError("internals test"), 5.0)
    await asyncio.wait_for(closed.wait(), 5)  # its close callbacks ran: it reconnects
    assert not connection.is_closed  # the robust connection itself lives on


async def test_the_robust_connection_reads_its_url_and_interval_where_the_bridge_sets_them(
    connection: AbstractRobustConnection,
) -> None:
    assert aiormq_bridge.reconnect_interval(connection) == connection.reconnect_interval  # type: ignore[attr-defined]
    aiormq_bridge.reconnect_to(connection, "amqp://guest:guest@127.0.0.1:5672/other")
    assert connection.url == yarl.URL("amqp://guest:guest@127.0.0.1:5672/other")  # type: ignore[attr-defined]
    # Each reconnect attempt connects to ``self.url`` (aio_pika.Connection.connect).
    assert "self.url" in inspect.getsource(aio_pika.Connection.connect)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
