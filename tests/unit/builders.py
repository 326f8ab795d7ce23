"""Small builders for driving :class:`mesh.core.PoolCore` in unit tests.

:class:`Pool` wraps a core and a fake clock: every helper feeds one event at the clock's
current instant and returns what the core returned. Nothing here sleeps or does I/O. Every
log entry the core returns is checked against the wire contract, as the manager's journal
and the events exchange would check it (:class:`CheckedPoolCore`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from mesh.core import (
    AcquireRequested,
    AgentState,
    Announce,
    AppendLog,
    Command,
    DeregistrationReceived,
    DrainRequested,
    Event,
    FindRequested,
    HeartbeatReceived,
    Instant,
    LogEntry,
    PoolCore,
    PoolSettings,
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    SendToAgent,
    Tick,
)
from mesh.core.tally import FleetTally
from mesh.manager.commands import _to_wire
from mesh.wire import (
    AcquireRequest,
    AgentRegistration,
    Capability,
    Deregistration,
    FindRequest,
    Heartbeat,
    Lease,
    LeaseGranted,
    Message,
    Refusal,
)
from mesh.wire.status import AgentStatus

M = TypeVar("M", bound=Message)

ANY_SCHEMA = {"type": "object"}


def capability(
    name: str = "calc.add",
    version: str = "1.0.0",
    *,
    cost_class: str = "A",
    max_concurrency: int = 1,
) -> Capability:
    return Capability.model_validate(
        {
            "name": name,
            "version": version,
            "input_schema": ANY_SCHEMA,
            "output_schema": ANY_SCHEMA,
            "max_concurrency": max_concurrency,
            "cost_class": cost_class,
        }
    )


def registration(
    agent_id: str,
    *capabilities: Capability,
    incarnation: str = "inc-1",
    heartbeat_interval_s: float = 10.0,
    deployment: str = "pool",
    features: Sequence[str] = (),
) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        incarnation=incarnation,
        deployment=deployment,
        capabilities=list(capabilities) or [capability()],
        heartbeat_interval_s=heartbeat_interval_s,
        features=list(features),
    )


@dataclass
class FakeClock:
    """Monotonic and wall time that move only when told to."""

    mono: float = 1_000.0
    wall_offset: float = 1_700_000_000.0 - 1_000.0

    def now(self) -> Instant:
        return Instant(self.mono, self.mono + self.wall_offset)

    def advance(self, seconds: float) -> None:
        self.mono += seconds


# ---- picking commands apart ----------------------------------------------------------------


def log_entries(commands: Iterable[Command], kind: str | None = None) -> list[LogEntry]:
    """Entries of the ``AppendLog`` commands (optionally of one kind), in order."""
    return [
        cmd.entry
        for cmd in commands
        if isinstance(cmd, AppendLog) and (kind is None or cmd.entry.kind == kind)
    ]


def announcements(commands: Iterable[Command]) -> list[Announce]:
    return [cmd for cmd in commands if isinstance(cmd, Announce)]


def sent(commands: Iterable[Command], cls: type[M]) -> list[tuple[str, M]]:
    """``(agent_id, message)`` for each ``SendToAgent`` carrying a ``cls``."""
    return [
        (cmd.agent_id, cmd.message)
        for cmd in commands
        if isinstance(cmd, SendToAgent) and isinstance(cmd.message, cls)
    ]


def reply(commands: Sequence[Command]) -> Message:
    """The one ``Reply`` among ``commands``."""
    replies = [cmd.message for cmd in commands if isinstance(cmd, Reply)]
    assert len(replies) == 1, f"expected exactly one reply, got {replies}"
    return replies[0]


def transitions(commands: Iterable[Command]) -> list[tuple[str | None, str | None, str]]:
    """``(from_state, to_state, kind)`` of each lifecycle log entry."""
    return [(e.from_state, e.to_state, e.kind) for e in log_entries(commands) if e.to_state]


# ---- the harness ---------------------------------------------------------------------------


class CheckedPoolCore(PoolCore):
    """A :class:`PoolCore` whose every log entry (journaled or announced) must make a valid
    :class:`~mesh.wire.events.OrchestrationEvent` (the manager could not journal or publish
    one that does not), and whose running tally must equal a recount of its agents after
    every event (the metrics and the status summary read the tally, never the agents)."""

    def handle(self, event: Event, now: Instant) -> list[Command]:
        commands = super().handle(event, now)
        for cmd in commands:
            if isinstance(cmd, AppendLog | Announce):
                _to_wire(cmd.entry)  # raises ValidationError for a detail its kind forbids
        assert_tally_matches(self)
        return commands


def assert_tally_matches(core: PoolCore) -> None:
    recount = FleetTally()
    for agent in core.agents.values():
        recount.count(agent.deployment, agent.state.value, agent.slots.values(), +1)
    tally = core.tally
    assert tally.agents == recount.agents == len(core.agents)
    assert tally.by_state == recount.by_state
    assert tally.by_pool_state == recount.by_pool_state
    assert tally.by_capability_state == recount.by_capability_state
    assert tally.loads == recount.loads


@dataclass
class Pool:
    """A :class:`PoolCore` driven at the instants of a :class:`FakeClock`."""

    settings: PoolSettings = field(default_factory=PoolSettings)
    clock: FakeClock = field(default_factory=FakeClock)
    core: PoolCore = field(init=False)
    _lease_ids: itertools.count[int] = field(init=False, default_factory=itertools.count)
    _heartbeat_seq: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.core = CheckedPoolCore(self.settings)

    # -- events ---------------------------------------------------------------------------
    def register(
        self,
        agent_id: str,
        *capabilities: Capability,
        incarnation: str = "inc-1",
        heartbeat_interval_s: float = 10.0,
        deployment: str = "pool",
        features: Sequence[str] = (),
        identity_verified: bool = False,
    ) -> list[Command]:
        reg = registration(
            agent_id,
            *capabilities,
            incarnation=incarnation,
            heartbeat_interval_s=heartbeat_interval_s,
            deployment=deployment,
            features=features,
        )
        return self.core.handle(RegistrationReceived(reg, identity_verified), self.clock.now())

    def deregister(self, agent_id: str, incarnation: str = "inc-1") -> list[Command]:
        msg = Deregistration(agent_id=agent_id, incarnation=incarnation, reason="bye")
        return self.core.handle(DeregistrationReceived(msg), self.clock.now())

    def heartbeat(
        self,
        agent_id: str,
        *,
        incarnation: str = "inc-1",
        seq: int | None = None,
        pool_in_flight: dict[str, int] | None = None,
        draining: bool = False,
    ) -> list[Command]:
        if seq is None:
            seq = self._heartbeat_seq.get(agent_id, -1) + 1
        self._heartbeat_seq[agent_id] = max(seq, self._heartbeat_seq.get(agent_id, -1))
        hb = Heartbeat(
            agent_id=agent_id,
            incarnation=incarnation,
            seq=seq,
            sent_at=self.clock.now().wall,
            pool_in_flight=pool_in_flight or {},
            draining=draining,
        )
        return self.core.handle(HeartbeatReceived(hb), self.clock.now())

    def acquire_commands(
        self,
        name: str = "calc.add",
        *,
        agent_id: str | None = None,
        version_spec: str = ">=0",
        ttl_s: float | None = None,
        lease_id: str | None = None,
    ) -> list[Command]:
        request = AcquireRequest(
            capability=name, version_spec=version_spec, agent_id=agent_id, ttl_s=ttl_s
        )
        lease_id = lease_id or f"lease-{next(self._lease_ids)}"
        return self.core.handle(AcquireRequested(request, lease_id), self.clock.now())

    def acquire(
        self,
        name: str = "calc.add",
        *,
        agent_id: str | None = None,
        version_spec: str = ">=0",
        ttl_s: float | None = None,
        lease_id: str | None = None,
    ) -> Lease | Refusal:
        """The lease granted, or the refusal."""
        answer = reply(
            self.acquire_commands(
                name,
                agent_id=agent_id,
                version_spec=version_spec,
                ttl_s=ttl_s,
                lease_id=lease_id,
            )
        )
        if isinstance(answer, LeaseGranted):
            return answer.lease
        assert isinstance(answer, Refusal), answer
        return answer

    def lease(
        self,
        name: str = "calc.add",
        *,
        agent_id: str | None = None,
        version_spec: str = ">=0",
        ttl_s: float | None = None,
    ) -> Lease:
        """Acquire and insist it is granted."""
        result = self.acquire(name, agent_id=agent_id, version_spec=version_spec, ttl_s=ttl_s)
        assert isinstance(result, Lease), result
        return result

    def release(self, lease_id: str) -> list[Command]:
        return self.core.handle(ReleaseRequested(lease_id), self.clock.now())

    def drain(self, agent_id: str) -> list[Command]:
        return self.core.handle(DrainRequested(agent_id, "test drain"), self.clock.now())

    def find_commands(
        self, name: str = "calc.add", version_spec: str = ">=0", limit: int | None = None
    ) -> list[Command]:
        request = FindRequest(capability=name, version_spec=version_spec, limit=limit)
        return self.core.handle(FindRequested(request), self.clock.now())

    def tick(self) -> list[Command]:
        return self.core.handle(Tick(), self.clock.now())

    def run_for(
        self, seconds: float, *, step: float = 1.0, heartbeats: Sequence[str] = ()
    ) -> list[Command]:
        """Advance ``seconds`` in ``step``s, ticking after each (as the shell's ticker does),
        with a heartbeat from each of ``heartbeats`` before every tick."""
        out: list[Command] = []
        for _ in range(round(seconds / step)):
            self.clock.advance(step)
            for agent_id in heartbeats:
                out += self.heartbeat(agent_id)
            out += self.tick()
        return out

    # -- queries --------------------------------------------------------------------------
    def found(
        self, name: str = "calc.add", version_spec: str = ">=0", limit: int | None = None
    ) -> list[str]:
        """Agent IDs ``find_by_capability`` returns, best first."""
        return [c.agent_id for c in self.core.find_by_capability(name, version_spec, limit)]

    def state(self, agent_id: str) -> AgentState | None:
        agent = self.core.agents.get(agent_id)
        return None if agent is None else agent.state


@dataclass(frozen=True)
class _StatusSlot:
    capability: str
    in_flight: int
    max_concurrency: int


def tally_of(statuses: Iterable[AgentStatus]) -> FleetTally:
    """The running tally a pool core holding these agents would have (for views in tests)."""
    tally = FleetTally()
    for agent in statuses:
        slots = [_StatusSlot(c.name, c.in_flight, c.max_concurrency) for c in agent.capabilities]
        tally.count(agent.deployment, agent.state, slots, +1)
    return tally
