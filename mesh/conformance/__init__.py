"""``mesh conformance``: run an agent command against a manager of the kit's own and check it
speaks the protocol (docs/protocol.md).

The kit starts a manager in a namespace of its own on the given broker (an SQLite ledger and
journal in a temporary directory, the operator being the URL's user), then runs the agent
command — any language — telling it where through the environment:

==================  ===================================================
``MESH_AMQP_URL``   the broker
``MESH_NAMESPACE``  the kit's namespace (every exchange and queue name)
``AGENT_ID``        the agent's ID
``MESH_POOL``       the pool (deployment) it should join
``HEARTBEAT_INTERVAL_S``  the heartbeat interval to use
==================  ===================================================

It watches what the agent publishes (a queue of its own bound to the announce and heartbeat
exchanges for that agent ID), acts as producer and operator through :class:`MeshClient`, and
publishes hand-made tasks (forged grants) where a check needs them. Each check prints one
line, ``PASS`` or ``FAIL`` with what was seen, and the run ends with a summary; the exit code
is 1 if any check failed.

The agent must offer ``--capability`` (default ``test.echo``), accept ``--payload`` and
answer ``INPUT_SCHEMA_VIOLATION`` for ``--invalid-payload``; ``--slow-payload`` is a payload
its handler takes a second or more on (drain checks need tasks in flight). The defaults fit
``mesh agent echo``.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mesh.conformance.checks import CHECK_KEYS, CHECKS
from mesh.conformance.kit import CheckFailed, CheckResult, Kit, KitSettings
from mesh.errors import MeshError

__all__ = ["CHECKS", "CHECK_KEYS", "CheckResult", "KitSettings", "run"]


async def run(settings: KitSettings, out: Callable[[str], None] = print) -> list[CheckResult]:
    """Run every check in order, printing a line for each and a summary; the results."""
    with contextlib.ExitStack() as stack:
        work_dir = settings.work_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="mesh-conformance-"))
        )
        kit = Kit(settings, work_dir)
        out(f"conformance of: {settings.agent_cmd}")
        out(f"namespace {kit.namespace}, broker {_without_password(settings.amqp_url)}")
        results: list[CheckResult] = []
        await kit.open()
        try:
            for key, name, check in CHECKS:
                if settings.only and key != "register" and key not in settings.only:
                    continue
                started = time.monotonic()
                try:
                    detail = await check(kit)
                    result = CheckResult(key, name, True, detail)
                except CheckFailed as exc:
                    result = CheckResult(key, name, False, str(exc))
                except MeshError as exc:
                    result = CheckResult(key, name, False, f"{type(exc).__name__}: {exc}")
                result.detail += f" ({time.monotonic() - started:.1f} s)"
                results.append(result)
                out(result.line())
        finally:
            await kit.close()
        passed = sum(r.passed for r in results)
        out(
            f"{passed} of {len(results)} checks passed"
            + (
                ""
                if passed == len(results)
                else (f"; agent logs in {work_dir}" if settings.work_dir else "")
            )
        )
        return results


def _without_password(url: str) -> str:
    scheme, _, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
