"""Declaring and deleting the transport's topology.

:class:`Declarer` declares exchanges, queues and bindings from :mod:`mesh.topology` specs
through aio-pika's robust objects (so a reconnect re-declares them), skipping specs already
declared on this connection; it moves a queue an older version declared with another type
(:mod:`mesh.transport.moves`) and turns a declaration the broker refuses into a
:class:`~mesh.errors.TopologyMismatch` that names what was asked for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractExchange,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)

from mesh.errors import TopologyMismatch, TopologyMissing, TransportError
from mesh.topology.specs import BindingSpec, Declarations, ExchangeSpec, QueueSpec, reply_queue
from mesh.transport import moves

log = logging.getLogger(__name__)


class Declarer:
    """The topology one transport declared: on its publishing ``channel`` (restored with the
    connection), or on channels of their own where a refusal must not close that one."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        channel: AbstractRobustChannel,
        *,
        control_timeout_s: float,
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._control_timeout_s = control_timeout_s
        self._exchanges: dict[str, AbstractExchange] = {}
        self._declared: set[ExchangeSpec | QueueSpec | BindingSpec] = set()
        self._queues: dict[str, AbstractRobustQueue] = {}
        self._queue_specs: dict[str, QueueSpec] = {}

    def forget(self) -> None:
        """After a reconnect: aio-pika has restored what it knew, so the next declarations
        are made again for real."""
        self._declared.clear()

    async def declare(self, declarations: Declarations) -> None:
        """Declare exchanges, queues and bindings; specs already declared are skipped.

        Everything is declared through aio-pika's robust objects, so after a reconnect the
        library re-declares the queues (with their arguments) and re-binds them.
        """
        channel = self._channel
        for ex in declarations.exchanges:
            if ex not in self._declared:
                self._exchanges[ex.name] = await channel.declare_exchange(
                    ex.name, type=ex.type, durable=ex.durable
                )
                self._declared.add(ex)
        for q in declarations.queues:
            if q not in self._declared:
                if q.replaces_classic:
                    await self._upgrade(q, declarations.bindings)
                try:
                    self._queues[q.name] = await self.declare_queue(channel, q)
                except aiormq.exceptions.ChannelPreconditionFailed as exc:
                    self._queue_specs.pop(q.name, None)
                    raise TopologyMismatch.for_queue(q.name, _arguments_text(q), str(exc)) from None
                self._declared.add(q)
        for b in declarations.bindings:
            if b not in self._declared:
                queue = self._queues.get(b.queue)
                if queue is None:
                    queue = await channel.declare_queue(b.queue, passive=True)
                    self._queues[b.queue] = queue
                await queue.bind(b.exchange, routing_key=b.routing_key)
                self._declared.add(b)

    async def _upgrade(self, spec: QueueSpec, bindings: Sequence[BindingSpec]) -> None:
        """Before ``spec`` is declared: if an older version declared its queue classic (or a
        move was left half-done), move it to ``spec``, messages and all."""
        connection = self._connection
        try:
            async with asyncio.timeout(60):
                old_type = await moves.is_other_type(connection, spec)
                if not (old_type or await moves.has_holding_queue(connection, spec)):
                    return
                own = [b for b in bindings if b.queue == spec.name]
                moved = await moves.move_in_place(connection, spec, own, old_type=old_type)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            raise TransportError(f"could not move queue {spec.name!r}: {exc}") from exc
        log.warning(
            "a queue an older version declared was moved to its new type",
            extra={"queue": spec.name, "type": spec.arguments.queue_type, "moved": moved},
        )

    async def empty_old_queue(self, name: str, bindings: Sequence[BindingSpec], into: str) -> int:
        """A queue renamed since an older version: move what ``name`` holds into ``into``
        (declared) and delete it; how many messages moved (0: there was none)."""
        try:
            async with asyncio.timeout(60):
                return await moves.empty_into(self._connection, name, bindings, into)
        except (aiormq.exceptions.AMQPError, RuntimeError, TimeoutError) as exc:
            raise TransportError(f"could not empty queue {name!r} into {into!r}: {exc}") from exc

    async def check_exchanges(self, names: Sequence[str]) -> None:
        """Check that each exchange exists with passive declares (which need no permission),
        on a channel of their own: a missing one closes that channel (404), not ours."""
        async with asyncio.timeout(self._control_timeout_s):
            channel = await self._connection.channel()
            try:
                for name in names:
                    try:
                        await channel.declare_exchange(name, passive=True)
                    except aio_pika.exceptions.ChannelNotFoundEntity:
                        raise TopologyMissing(
                            f"exchange {name!r} does not exist: the manager declares the "
                            "namespace's shared topology — start it first (or let this "
                            "client declare it: shared_topology='declare')"
                        ) from None
            finally:
                if not channel.is_closed:
                    await channel.close()

    async def try_declare(self, declarations: Declarations) -> bool:
        """Declare on a channel of its own; ``False`` if a queue already exists with other
        arguments (PRECONDITION_FAILED closes only that channel), leaving it as it is.

        For queues whose arguments follow something that changes (a pool's bound follows its
        capacity): the caller decides what to do with the old one. Durable queues declared
        here outlive a reconnect on the broker; the caller declares them again periodically.
        """
        async with asyncio.timeout(self._control_timeout_s):
            await self.declare(Declarations(exchanges=declarations.exchanges))
            channel = await self._connection.channel()
            try:
                queues = {
                    q.name: await channel.declare_queue(
                        q.name,
                        durable=q.durable,
                        exclusive=q.exclusive,
                        auto_delete=q.auto_delete,
                        arguments=q.arguments.to_amqp(),
                        robust=False,
                    )
                    for q in declarations.queues
                }
                for b in declarations.bindings:
                    queue = queues.get(b.queue) or await channel.declare_queue(
                        b.queue, passive=True, robust=False
                    )
                    await queue.bind(b.exchange, routing_key=b.routing_key)
            except aiormq.exceptions.ChannelPreconditionFailed:
                return False
            finally:
                if not channel.is_closed:
                    await channel.close()
        return True

    async def declare_queue(
        self, channel: AbstractRobustChannel, spec: QueueSpec
    ) -> AbstractRobustQueue:
        self._queue_specs[spec.name] = spec
        return await channel.declare_queue(
            spec.name,
            durable=spec.durable,
            exclusive=spec.exclusive,
            auto_delete=spec.auto_delete,
            arguments=spec.arguments.to_amqp(),
        )

    async def queue_on(self, channel: AbstractRobustChannel, name: str) -> AbstractRobustQueue:
        """The queue, declared on ``channel`` so a reconnect restores it before its consumer."""
        spec = self._queue_specs.get(name)
        if spec is not None:
            return await self.declare_queue(channel, spec)
        return await channel.declare_queue(name, passive=True)

    async def delete_queue(self, name: str, *, if_empty: bool = False) -> None:
        async with asyncio.timeout(self._control_timeout_s):
            await self._channel.queue_delete(name, if_empty=if_empty)
        self._queues.pop(name, None)
        self._queue_specs.pop(name, None)
        self._declared = {s for s in self._declared if getattr(s, "name", None) != name}

    async def delete_declared(self, made: Declarations) -> None:
        """Delete the queues and exchanges of ``made``: for a tool that ran in a namespace of
        its own (the conformance kit, a benchmark) and leaves nothing behind."""
        for queue in dict.fromkeys(q.name for q in made.queues):
            await self.delete_queue(queue)
        for exchange in dict.fromkeys(e.name for e in made.exchanges):
            await self.delete_exchange(exchange)

    async def delete_exchange(self, name: str) -> None:
        async with asyncio.timeout(self._control_timeout_s):
            await self._channel.exchange_delete(name)
        self._declared = {s for s in self._declared if getattr(s, "name", None) != name}

    async def declare_reply_queue(self, name: str) -> str:
        """An exclusive, auto-deleted queue for replies to this connection."""
        spec = reply_queue(name)
        self._queues[name] = await self.declare_queue(self._channel, spec)
        return name


def _arguments_text(spec: QueueSpec) -> str:
    """``durable, x-max-length=5, …``: what a declaration asked for, for error messages."""
    args = spec.arguments.to_amqp()
    flags = [f for f, on in (("durable", spec.durable), ("auto-delete", spec.auto_delete)) if on]
    return ", ".join([*flags, *(f"{k}={v}" for k, v in sorted(args.items()))])
