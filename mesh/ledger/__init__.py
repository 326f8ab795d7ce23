"""The reservation ledger: one behavioural contract, two transactional stores.

- :class:`LedgerStore` — the contract (:mod:`mesh.ledger.store` explains how it works);
- :class:`SqliteLedger` — the embedded default, one SQLite file in WAL mode;
- :class:`PostgresLedger` — when several managers share one ledger.

The values (:mod:`mesh.ledger.model`) import no I/O; the stores are imported on first use,
so ``from mesh.ledger import Reservation`` loads neither sqlite3 nor psycopg.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mesh.ledger.model import (
    FINAL_STATES,
    HOLDING_STATES,
    TENANT_POOL,
    TENANT_TOKENS_PREFIX,
    TRANSITIONS,
    Item,
    LedgerEvent,
    LedgerLogRow,
    LedgerReason,
    Prepared,
    Refused,
    Reservation,
    ReservationState,
    replay,
)

if TYPE_CHECKING:
    from mesh.ledger.postgres import PostgresLedger
    from mesh.ledger.sqlite import SqliteLedger
    from mesh.ledger.store import LedgerStore

_LAZY = {
    "LedgerStore": "mesh.ledger.store",
    "SqliteLedger": "mesh.ledger.sqlite",
    "PostgresLedger": "mesh.ledger.postgres",
}

__all__ = [
    "FINAL_STATES",
    "HOLDING_STATES",
    "TENANT_POOL",
    "TENANT_TOKENS_PREFIX",
    "TRANSITIONS",
    "Item",
    "LedgerEvent",
    "LedgerLogRow",
    "LedgerReason",
    "LedgerStore",
    "PostgresLedger",
    "Prepared",
    "Refused",
    "Reservation",
    "ReservationState",
    "SqliteLedger",
    "replay",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
