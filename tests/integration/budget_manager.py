"""A second manager's Redis budget check, in a process of its own (for test_redis_budget).

``python budget_manager.py URL PREFIX LIMIT FIRST COUNT``: prints ``ready``, waits for a line
on stdin, reserves admissions ``adm-FIRST`` … ``adm-(FIRST+COUNT-1)`` against one shared
concurrency limit (64 at a time), and prints ``{"granted": n, "outcomes": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys

from mesh.checks import CheckRequest
from mesh.checks.redis_budget import BudgetLimit, LimitKind, RedisBudgetCheck


def shared_check(url: str, prefix: str, limit: int) -> RedisBudgetCheck:
    return RedisBudgetCheck.from_url(
        "shared",
        [BudgetLimit(LimitKind.CONCURRENCY, "tool", limit)],
        url,
        key_prefix=prefix,
        timeout_s=10.0,
    )


async def drive(
    check: RedisBudgetCheck, first: int, count: int, in_flight: int = 64
) -> tuple[int, dict[str, int]]:
    """Reserve ``count`` admissions; the number granted and the answers by outcome/reason."""
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> str:
        async with gate:
            result = await check.reserve(CheckRequest(f"adm-{i}", "pool", "t", "cap", ttl_s=300.0))
        return f"{result.outcome.value}/{result.reason}"

    answers = await asyncio.gather(*(one(i) for i in range(first, first + count)))
    outcomes: dict[str, int] = {}
    for answer in answers:
        outcomes[answer] = outcomes.get(answer, 0) + 1
    return outcomes.get("READY/None", 0), outcomes


async def main(url: str, prefix: str, limit: int, first: int, count: int) -> None:
    check = shared_check(url, prefix, limit)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    try:
        granted, outcomes = await drive(check, first, count)
    finally:
        await check.aclose()
    print(json.dumps({"granted": granted, "outcomes": outcomes}), flush=True)


if __name__ == "__main__":
    url, prefix, limit, first, count = sys.argv[1:]
    asyncio.run(main(url, prefix, int(limit), int(first), int(count)))
