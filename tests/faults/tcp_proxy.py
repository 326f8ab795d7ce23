"""A TCP proxy for network-fault tests: the network between the mesh and RabbitMQ, made bad.

Why not netem: the machines these tests run on have no ``tc``/netem (and no Docker, no root),
so the faults are made in user space, between the client and the broker, like aio-pika's own
``tests/tcp_proxy.py``. The client connects to ``127.0.0.1:<proxy.port>``; the proxy connects
to the broker and forwards bytes both ways, shaped by the current :class:`Mode`.

Theory of operation. Each accepted connection is a :class:`_Link` with two directions
(client → broker "up", broker → client "down"). A direction is two tasks joined by a small
bounded queue: a *reader* that reads chunks and stamps each with the time it is due
(``now + delay``), and a *sender* that takes chunks in order, waits until the network is open
and the chunk is due, and writes it. Delays therefore overlap like real latency (many chunks
in flight) but never reorder a direction. The mode is read at each step, so switching it
affects existing and new connections at once:

* ``pass`` — forward as read;
* ``latency(mean_s, jitter_s)`` — each chunk due ``mean ± jitter`` after it was read;
* ``blackhole`` — nothing is forwarded either way and nothing is closed: no RST, no FIN, not
  even the broker's FIN. Chunks read are held; once the queue is full the proxy stops
  reading, so TCP flow control pushes back on both peers as a dead path would. New
  connections are accepted but not connected upstream. Back in ``pass``, what was held is
  delivered (TCP retransmitting after a partition heals) to whichever peer is still there;
* ``reset`` — every connection is aborted with a RST (``SO_LINGER`` 0, then ``abort()``); new
  ones are reset as soon as they are accepted;
* ``slice`` — one byte per write, with a tiny pause between, so every AMQP frame reaches the
  other side in pieces.

End of stream travels as a chunk too: a clean EOF becomes a FIN on the other side, a reset a
RST, each in order behind the data read before it (and held, like data, by a blackhole).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

READ_SIZE = 65536
QUEUE_CHUNKS = 64  # chunks held per direction before the proxy stops reading
EOF, RST = b"", None  # end-of-stream markers travelling behind the data

ModeName = Literal["pass", "latency", "blackhole", "reset", "slice"]
Chunk = bytes | None


@dataclass(frozen=True, slots=True)
class Mode:
    name: ModeName
    mean_s: float = 0.0
    jitter_s: float = 0.0


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, not a FIN: linger on, timeout 0, then drop the socket."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy:
    """``async with TcpProxy() as proxy``: listens on ``127.0.0.1:proxy.port`` and forwards
    to ``upstream``. Switch with :meth:`pass_through`, :meth:`latency`, :meth:`blackhole`,
    :meth:`reset` and :meth:`slice`; counts bytes forwarded, writes and connections."""

    def __init__(
        self,
        upstream: tuple[str, int] = ("127.0.0.1", 5672),
        *,
        rng: random.Random | None = None,
        slice_pause_s: float = 0.001,
    ) -> None:
        self.upstream = upstream
        self.port = 0
        self.bytes_up = 0  # client -> broker
        self.bytes_down = 0  # broker -> client
        self.writes = 0
        self.connections = 0  # accepted, in total
        self.mode = Mode("pass")
        self._rng = rng or random.Random(7)
        self._slice_pause_s = slice_pause_s
        self._open = asyncio.Event()  # cleared while blackholed
        self._open.set()
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False
        self._server: asyncio.Server | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        self._closing = True
        self._open.set()  # wake connections held by a blackhole: they see _closing
        for link in list(self._links):
            link.reset()
        await asyncio.gather(*self._handlers)
        await self._server.wait_closed()

    @property
    def open_connections(self) -> int:
        return len(self._links)

    @property
    def _refusing(self) -> bool:
        return self._closing or self.mode.name == "reset"

    # ---- modes -------------------------------------------------------------------------
    def pass_through(self) -> None:
        self._switch(Mode("pass"))

    def latency(self, mean_s: float, jitter_s: float = 0.0) -> None:
        self._switch(Mode("latency", mean_s, jitter_s))

    def blackhole(self) -> None:
        self._switch(Mode("blackhole"))

    def reset(self) -> None:
        self._switch(Mode("reset"))
        for link in list(self._links):
            link.reset()

    def slice(self) -> None:
        self._switch(Mode("slice"))

    def _switch(self, mode: Mode) -> None:
        self.mode = mode
        if mode.name == "blackhole":
            self._open.clear()
        else:
            self._open.set()

    def _delay_s(self) -> float:
        if self.mode.name != "latency":
            return 0.0
        jitter = self._rng.uniform(-self.mode.jitter_s, self.mode.jitter_s)
        return max(0.0, self.mode.mean_s + jitter)

    # ---- connections -------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Never raises, never ends cancelled: asyncio would log either as a callback error.
        self.connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._open.wait()  # blackholed: accepted, but the broker never hears of it
            if self._refusing:
                _reset(writer)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)
                return
            link = _Link(self, reader, writer, up_reader, up_writer)
            self._links.add(link)
            if self._refusing:  # switched (or closed) while connecting
                link.reset()
            try:
                await link.run()
            finally:
                self._links.discard(link)
        finally:
            self._handlers.discard(handler)


class _Link:
    """One proxied connection: two directions, each a reader and a sender task."""

    def __init__(
        self,
        proxy: TcpProxy,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.writers = (client_writer, upstream_writer)
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up: asyncio.Queue[tuple[float, Chunk]] = asyncio.Queue(QUEUE_CHUNKS)
        down: asyncio.Queue[tuple[float, Chunk]] = asyncio.Queue(QUEUE_CHUNKS)
        self.tasks = [
            asyncio.create_task(self._read(client_reader, up)),
            asyncio.create_task(self._send(up, upstream_writer, "up")),
            asyncio.create_task(self._read(upstream_reader, down)),
            asyncio.create_task(self._send(down, client_writer, "down")),
        ]

    async def run(self) -> None:
        """Until both directions ended (EOF each way), one failed (then both sides are reset),
        or the link was reset."""
        senders = self.tasks[1::2]
        done, _ = await asyncio.wait(senders, return_when=asyncio.FIRST_EXCEPTION)
        if any(not task.cancelled() and task.exception() is not None for task in done):
            self.reset()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def reset(self) -> None:
        for writer in self.writers:
            _reset(writer)
        for task in self.tasks:
            task.cancel()

    async def _read(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, Chunk]]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk: Chunk = await reader.read(READ_SIZE)
            except OSError:
                chunk = RST
            await queue.put((loop.time() + self.proxy._delay_s(), chunk))
            if not chunk:
                return

    async def _send(
        self,
        queue: asyncio.Queue[tuple[float, Chunk]],
        writer: asyncio.StreamWriter,
        direction: Literal["up", "down"],
    ) -> None:
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await proxy._open.wait()
            if chunk is RST:
                self.reset()
                return
            if chunk == EOF:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            sliced = proxy.mode.name == "slice"
            pieces = [chunk[i : i + 1] for i in range(len(chunk))] if sliced else [chunk]
            for piece in pieces:
                await proxy._open.wait()
                writer.write(piece)
                await writer.drain()
                proxy.writes += 1
                if direction == "up":
                    proxy.bytes_up += len(piece)
                else:
                    proxy.bytes_down += len(piece)
                if sliced:
                    await asyncio.sleep(proxy._slice_pause_s)
