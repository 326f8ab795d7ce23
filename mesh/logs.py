"""Logging setup, used only by the CLI: JSON lines for services, plain text for humans."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonLines(logging.Formatter):
    """One JSON object per line, with every ``extra=`` field at top level."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class Readable(logging.Formatter):
    """``12:01:02 WARNING mesh.core.pool: message  key=value …``."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = " ".join(
            f"{k}={v}"
            for k, v in record.__dict__.items()
            if k not in _STANDARD and not k.startswith("_")
        )
        return f"{base}  {extras}" if extras else base


def configure(level: str = "INFO", *, json: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(
            Readable("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiormq/aio-pika log every reconnect attempt; keep them to warnings, and drop the
    # connect error that our own BrokerUnavailable message already explains in one sentence.
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("aiormq.connection").addFilter(_drop_connect_noise)


def _drop_connect_noise(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("error when creating transport")
