"""The sans-I/O manager core: events in, commands out. No asyncio, aio-pika or kubernetes."""

from mesh.core.events import (
    AcquireRequested,
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
    RegistrationReceived,
    ReleaseRequested,
    Reply,
    SendToAgent,
    Tick,
)
from mesh.core.index import Candidate, CapabilityIndex, InvalidVersionSpec
from mesh.core.lifecycle import TRANSITIONS, AgentState, Trigger, next_state, render_mermaid
from mesh.core.pool import PoolCore, PoolSettings

__all__ = [
    "TRANSITIONS",
    "AcquireRequested",
    "AgentState",
    "Announce",
    "AppendLog",
    "Candidate",
    "CapabilityIndex",
    "Command",
    "DeregistrationReceived",
    "DrainRequested",
    "Event",
    "FindRequested",
    "HeartbeatReceived",
    "Instant",
    "InvalidVersionSpec",
    "LogEntry",
    "PoolCore",
    "PoolSettings",
    "RegistrationReceived",
    "ReleaseRequested",
    "Reply",
    "SendToAgent",
    "Tick",
    "Trigger",
    "next_state",
    "render_mermaid",
]
