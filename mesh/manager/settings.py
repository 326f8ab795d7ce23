"""Typed manager settings. Environment parsing lives in the CLI, not here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mesh import constants as c
from mesh.core.pool import PoolSettings


@dataclass(frozen=True, slots=True)
class ManagerSettings:
    amqp_url: str = c.DEFAULT_AMQP_URL
    namespace: str = c.DEFAULT_NAMESPACE
    journal_path: Path = Path(".mesh/orchestration.sqlite3")
    manager_id: str = "manager"
    tick_interval_s: float = 1.0
    publish_timeout_s: float = c.DEFAULT_PUBLISH_TIMEOUT_S
    prefetch: int = 64
    pool: PoolSettings = field(default_factory=PoolSettings)
