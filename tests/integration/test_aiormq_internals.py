"""The aiormq internals :mod:`mesh.transport.amqp` writes into, checked against the installed
aiormq on a real connection: if an upgrade renames or reshapes one, this fails by name —
before a confirm is attached to the wrong publish in production.

The transport publishes on aiormq's confirming channel with aiormq's own bookkeeping (a
delivery tag and a confirm future per message, the message ID mapped to the tag so a return
finds it) but writes the frames itself (``AmqpTransport._put_confirmed``); it reads the
"blocked" flag aiormq keeps and does not expose (``AmqpTransport.blocked``), and raises the
process-wide frame buffer (``aiormq.Connection.FRAME_BUFFER_SIZE``). pyproject.toml pins
aiormq and pamqp to the ranges this test has passed on.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import aiormq
import pamqp
import pytest
from aiormq.abc import ChannelFrame
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mesh.transport import AmqpTransport
from mesh.transport.amqp import WRITE_QUEUE_FRAMES


def pinned(package: str) -> SpecifierSet:
    """The range pyproject.toml declares for ``package``, as installed metadata says."""
    from importlib.metadata import requires

    for requirement in requires("agent-mesh") or []:
        name = requirement.split(";")[0].strip()
        if name.startswith(package) and name[len(package)] in "<>=!~ ":
            return SpecifierSet(name[len(package) :].strip())
    raise AssertionError(f"pyproject.toml declares no range for {package}")


def test_the_installed_aiormq_and_pamqp_are_within_the_ranges_pinned() -> None:
    from importlib.metadata import version

    for package in ("aiormq", "pamqp"):
        assert Version(version(package)) in pinned(package), (package, version(package))
    assert pamqp.__version__  # the package the lean connection's frames come from


def test_the_frame_buffer_is_a_class_attribute_aiormq_reads() -> None:
    assert isinstance(aiormq.Connection.FRAME_BUFFER_SIZE, int)
    assert aiormq.Connection.FRAME_BUFFER_SIZE >= WRITE_QUEUE_FRAMES  # raised at import
    assert "FRAME_BUFFER_SIZE" in inspect.getsource(aiormq.Connection)  # and read there


def test_a_channel_frame_takes_the_payload_and_the_close_flag() -> None:
    frame: Any = ChannelFrame(b"frames", should_close=False)
    assert (frame.payload, frame.should_close) == (b"frames", False)


async def test_the_confirming_channel_keeps_the_bookkeeping_the_transport_writes_into(
    amqp_url: str,
) -> None:
    transport = await AmqpTransport.connect(amqp_url, name="aiormq-internals")
    try:
        channel = await transport._publish_channel.get_underlay_channel()
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
        # A publish through those: confirmed, and the bookkeeping left as aiormq leaves it.
        before = channel.delivery_tag
        await transport.publish("", "amq.no-such-queue-is-fine", b"{}", mandatory=False)
        assert channel.delivery_tag == before + 1
        assert before + 1 not in channel.confirmations
        assert channel.message_id_delivery_tag == {}
    finally:
        await transport.close()


async def test_the_blocked_flag_is_where_the_transport_reads_it(amqp_url: str) -> None:
    transport = await AmqpTransport.connect(amqp_url, name="aiormq-blocked")
    try:
        amqp = transport._connection.transport.connection  # type: ignore[union-attr]
        unblocked = getattr(amqp, "_Connection__connection_unblocked", None)
        assert isinstance(unblocked, asyncio.Event), "aiormq no longer keeps the blocked flag"
        assert unblocked.is_set() and transport.blocked is False
        unblocked.clear()  # as aiormq does on connection.blocked
        assert transport.blocked is True
        unblocked.set()
    finally:
        await transport.close()


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
