"""What every benchmark ends with: its targets printed as PASS/FAIL, and with ``--json FILE``
every figure and target written as one JSON document (value, baseline, ratio, the bound), so a
run can be compared with another by a script rather than by reading tables."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True)
class Target:
    """One target: what was measured against what, and the bound it had to meet."""

    name: str  # a stable key: "find_limit1_speedup_at_50k"
    passed: bool
    text: str  # the sentence the bench prints
    value: float | None = None  # ours
    baseline: float | None = None  # what ours is compared with (None: an absolute bound)
    ratio: float | None = None  # the figure the bound applies to, when it is a ratio
    bound: str = ""  # ">= 500", "< 3", "<= 1.5"


@dataclass
class Report:
    """Figures (rows of the printed tables) and targets of one run."""

    bench: str
    figures: list[dict[str, Any]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def figure(self, **fields: Any) -> None:
        self.figures.append(fields)

    def finish(self, started: float, json_path: Path | None) -> int:
        """Print the targets, write the JSON when asked; the exit code (1: a target failed)."""
        print()
        print(f"targets ({time.perf_counter() - started:.0f} s in all)")
        for target in self.targets:
            print(f"   {'PASS' if target.passed else 'FAIL'}  {target.text}")
        for reason in self.skipped:
            print(f"   SKIP  {reason}")
        if json_path is not None:
            document = {
                "bench": self.bench,
                "at": time.time(),
                "argv": sys.argv[1:],
                "python": platform.python_version(),
                "machine": platform.node(),
                "figures": self.figures,
                "targets": [asdict(t) for t in self.targets],
                "skipped": self.skipped,
                "passed": all(t.passed for t in self.targets),
            }
            json_path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
            print(f"   figures and targets written to {json_path}")
        return 0 if all(t.passed for t in self.targets) else 1


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write every figure and target (value, baseline, ratio, bound) to FILE",
    )


async def broker_unreachable(url: str, name: str) -> str | None:
    """Why RabbitMQ at ``url`` cannot be used (one sentence), or ``None``."""
    from mesh.errors import BrokerUnavailable
    from mesh.transport.amqp import AmqpTransport

    try:
        probe = await AmqpTransport.connect(url, name=name, connect_timeout_s=5)
        await probe.close()
    except BrokerUnavailable as exc:
        return str(exc)
    return None


def postgres_unreachable(dsn: str) -> str | None:
    """Why PostgreSQL at ``dsn`` cannot be used (one sentence), or ``None``."""
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=5):
            return None
    except psycopg.Error as exc:
        return f"cannot reach {dsn}: {exc}".strip()
