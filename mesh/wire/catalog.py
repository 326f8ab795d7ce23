"""Every message type of the wire contract, in one tuple: the codec's registry and the schema
generator both read it. Models import nothing from here, so there is no import cycle."""

from __future__ import annotations

from mesh.wire.admission import ADMISSION_MESSAGE_TYPES
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import CORE_MESSAGE_TYPES, Message
from mesh.wire.status import STATUS_MESSAGE_TYPES

MESSAGE_TYPES: tuple[type[Message], ...] = (
    *CORE_MESSAGE_TYPES,
    *STATUS_MESSAGE_TYPES,
    OrchestrationEvent,
    *ADMISSION_MESSAGE_TYPES,
)
