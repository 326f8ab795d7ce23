"""Sample agent ``echo``: sleep, then echo (``test.echo@1.0.0``, cost class C).

It does no work but take time: ``sleep_ms`` (0 to 60 000, default 0) decides how
long a task stays in flight, which is what load and drain tests need.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.agent import Agent, capability

MAX_SLEEP_MS = 60_000
MAX_MESSAGE_LENGTH = 10_000


class EchoAgent(Agent):
    """Sleeps ``sleep_ms`` and returns the message. Dear (cost class C), eight at a time."""

    deployment = "echo"

    @capability(
        "test.echo",
        version="1.0.0",
        description="Sleep sleep_ms milliseconds, then return the message: for load tests.",
        input_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "message": {"type": "string", "maxLength": MAX_MESSAGE_LENGTH},
                "sleep_ms": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_SLEEP_MS,
                    "default": 0,
                },
            },
            "required": ["message"],
            "additionalProperties": False,
        },
        output_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "slept_ms": {"type": "integer", "minimum": 0},
            },
            "required": ["message", "slept_ms"],
            "additionalProperties": False,
        },
        max_concurrency=8,
        cost_class="C",
    )
    async def echo(self, payload: dict[str, Any]) -> dict[str, Any]:
        sleep_ms: int = payload.get("sleep_ms", 0)
        if sleep_ms:
            await asyncio.sleep(sleep_ms / 1000)
        return {"message": payload["message"], "slept_ms": sleep_ms}
