"""Helpers every command shares: environment defaults, argument types, signals, a client."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.errors import BrokerUnavailable, MeshError, RequestTimeout
from mesh.wire.status import MAX_STATUS_AGENTS

if TYPE_CHECKING:
    pass


SCHEMAS_DIR = Path("schemas")


DEFAULT_JOURNAL = ".mesh/orchestration.sqlite3"  # mesh manager's, unless --journal says


DEMO_JOURNAL = Path(".mesh/demo/orchestration.sqlite3")  # mesh demo's manager's


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _page_size(text: str) -> int:
    """An argparse type: agent rows a status page, 1 to MAX_STATUS_AGENTS."""
    value = _count(text)
    if not 1 <= value <= MAX_STATUS_AGENTS:
        raise argparse.ArgumentTypeError(f"{text!r}: from 1 to {MAX_STATUS_AGENTS:,} rows a page")
    return value


def _thresholds(text: str) -> tuple[float, float, float]:
    """An argparse type: three utilisation fractions, ascending, in (0, 1]: ``0.7,0.85,0.95``."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not three numbers") from None
    if len(values) != 3 or not all(0 < v <= 1 for v in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: need three ascending fractions in (0, 1], e.g. 0.7,0.85,0.95"
        )
    low, mid, high = values
    return low, mid, high


def _probe_interval(text: str) -> float | None:
    """An argparse type: seconds between broker liveness probes; 0 (or empty) is off."""
    try:
        seconds = float(text) if text.strip() else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: say a number of seconds") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return seconds or None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: say on or off")
    return text == "on"


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command; turn the errors a user can fix into one sentence and an exit code."""
    try:
        return asyncio.run(coro)
    except BrokerUnavailable as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 2
    except RequestTimeout as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 3
    except MeshError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _with_client(
    args: argparse.Namespace, fn: Callable[[Any], Awaitable[int]], *, read_only: bool = False
) -> int:
    """Run ``fn`` with a client. ``read_only``: a command that only asks (status, explain)
    declares nothing on the broker; a namespace no manager has set up is said in one
    sentence, with the exit code of a manager that does not answer (3)."""
    from mesh.errors import TopologyMissing
    from mesh.producer import MeshClient

    try:
        client = await MeshClient.connect(
            args.amqp_url, namespace=args.namespace, name="mesh-cli", declare=not read_only
        )
    except TopologyMissing:
        print(
            f"mesh: no manager has set up namespace {args.namespace!r} on this broker (its "
            "exchanges do not exist): is `mesh manager` running, and is --namespace right?",
            file=sys.stderr,
        )
        return 3
    try:
        return await fn(client)
    finally:
        await client.close()


def _json_object(text: str) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return value
