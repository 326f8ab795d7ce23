"""Admission checks: resources outside the ledger that an admission must also hold (shared
budgets in Redis, an external service asked over HTTP), with Kueue's outcomes.

The contract is :mod:`mesh.checks.base`; :mod:`mesh.checks.runner` asks a pool's checks in
order and compensates; :mod:`mesh.checks.redis_budget` and :mod:`mesh.checks.webhook` are the
two checks the mesh ships; :mod:`mesh.checks.config` reads the checks file.
"""

from mesh.checks.base import (
    CHECK_UNAVAILABLE,
    AdmissionCheck,
    CheckOutcome,
    CheckRequest,
    CheckResult,
    Usage,
)
from mesh.checks.config import BuiltChecks, ChecksFile, build_checks, load_checks_file
from mesh.checks.redis_budget import BudgetLimit, LimitKind, RedisBudgetCheck
from mesh.checks.runner import CheckRunner, RunResult

__all__ = [
    "CHECK_UNAVAILABLE",
    "AdmissionCheck",
    "BudgetLimit",
    "BuiltChecks",
    "CheckOutcome",
    "CheckRequest",
    "CheckResult",
    "CheckRunner",
    "ChecksFile",
    "LimitKind",
    "RedisBudgetCheck",
    "RunResult",
    "Usage",
    "build_checks",
    "load_checks_file",
]
