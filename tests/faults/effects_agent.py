"""An agent process for the executions-per-task fault test (``test_effects_once.py``).

It serves pool ``echo``'s ``test.echo`` capability. Each task runs a handler that writes one
line per run to ``runs-<agent>-<pid>.log`` and performs one *effect* — a line in
``effects-<agent>-<pid>.log`` — either directly (``"guarded": false``: what a handler
without the SDK's helper does) or through :func:`mesh.agent.once` on a PostgreSQL effect log
every agent of the pool shares (``"guarded": true``). Lines go out with one unbuffered
``write`` each, so a ``kill -9`` keeps every line written before it.

The handler sleeps before and after the effect, so a kill lands on tasks in every phase: not
yet run, effect done but no answer sent, answer sent but not acked.

Usage (what the test runs): ``python effects_agent.py AGENT_ID`` with ``MESH_AMQP_URL``,
``MESH_NAMESPACE``, ``MESH_EFFECTS_DIR``, ``MESH_EFFECTS_DSN`` and ``MESH_EFFECTS_SCHEMA``
in the environment.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from mesh.agent import Agent, AgentSettings, capability, current_task, once, run_agent
from mesh.agent.effects import PostgresEffectLog

INPUT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 64},
        "guarded": {"type": "boolean"},
        "before_ms": {"type": "integer", "minimum": 0, "maximum": 1000},
        "after_ms": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["id", "guarded", "before_ms", "after_ms"],
    "additionalProperties": False,
}
OUTPUT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"id": {"type": "string"}, "receipt": {"type": "string"}},
    "required": ["id", "receipt"],
    "additionalProperties": False,
}


class Lines:
    """An append-only file written one whole line per ``write`` (kept by a kill -9)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def add(self, *fields: object) -> None:
        os.write(self._fd, (" ".join(str(f) for f in fields) + "\n").encode())


class EffectsAgent(Agent):
    deployment = "echo"

    def __init__(self, agent_id: str, out: Path, log: PostgresEffectLog) -> None:
        super().__init__(agent_id, heartbeat_interval_s=5.0)
        tag = f"{agent_id}-{os.getpid()}"
        self.runs = Lines(out / f"runs-{tag}.log")
        self.effects = Lines(out / f"effects-{tag}.log")
        self.effect_log = log
        self.made = 0

    @capability(
        "test.echo",
        version="1.0.0",
        input_schema=INPUT,
        output_schema=OUTPUT,
        max_concurrency=8,
    )
    async def work(self, payload: dict[str, Any]) -> dict[str, Any]:
        task = current_task()
        business_id = payload["id"]
        self.runs.add(business_id, task.idempotency_key, task.attempt, self.agent_id)
        await asyncio.sleep(payload["before_ms"] / 1000)

        async def effect() -> str:
            self.made += 1
            receipt = f"{self.agent_id}-{os.getpid()}-{self.made}"
            self.effects.add(business_id, receipt)
            return receipt

        if payload["guarded"]:
            receipt = await once("effect", effect, log=self.effect_log)
        else:
            receipt = await effect()
        await asyncio.sleep(payload["after_ms"] / 1000)
        return {"id": business_id, "receipt": receipt}


async def main(agent_id: str) -> None:
    env = os.environ
    log = PostgresEffectLog(env["MESH_EFFECTS_DSN"], schema=env["MESH_EFFECTS_SCHEMA"])
    agent = EffectsAgent(agent_id, Path(env["MESH_EFFECTS_DIR"]), log)
    settings = AgentSettings(amqp_url=env["MESH_AMQP_URL"], namespace=env["MESH_NAMESPACE"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_agent(agent, settings, stop)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
