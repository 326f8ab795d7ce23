"""Sample agent ``echo``: sleep, then echo (``test.echo@1.0.0``, cost class C).

It does no work but take time: ``sleep_ms`` (0 to 60 000, default 0) decides how
long a task stays in flight, which is what load and drain tests need.

When the deadline leaves less time than ``sleep_ms`` and the task allows
``partial_results``, it sleeps only what the deadline leaves (less a margin) and marks the
result degraded, naming the sleep it skipped as the missing evidence: the smallest real
example of :func:`~mesh.agent.current_task` and ``degrade``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.agent import Agent, capability, current_task

MAX_SLEEP_MS = 60_000
MAX_MESSAGE_LENGTH = 10_000
DEADLINE_MARGIN_S = 0.05  # a degraded answer is sent this long before the deadline


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
        task = current_task()
        budget_s = task.remaining_s() - DEADLINE_MARGIN_S  # inf without a deadline
        if sleep_ms > budget_s * 1000 and task.may_degrade("partial_results"):
            cut = max(0, int(budget_s * 1000))
            task.degrade(
                "partial_results",
                missing_evidence=[f"{sleep_ms - cut} ms of the {sleep_ms} ms asked for"],
                note="cut short to meet the deadline",
            )
            sleep_ms = cut
        if sleep_ms:
            await asyncio.sleep(sleep_ms / 1000)
        return {"message": payload["message"], "slept_ms": sleep_ms}
