"""Logging setup, used only by the CLI: JSON lines for services, plain text for humans; and
the one rule every ``extra=`` must keep (:data:`RESERVED`, :func:`checked`)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

from mesh.errors import LocalProtocolError

RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
}
"""Names an ``extra=`` field may not take: ``Logger.makeRecord`` raises ``KeyError`` for them
at the call — a log line in an error path would then fail the very command it reports on
(``msg`` once failed every command batch that messaged a vanished agent). A unit test walks
the source for them; :func:`checked` refuses them where fields are built at run time."""
_STANDARD = RESERVED


def checked(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields``, if none of its keys is :data:`RESERVED`; else :class:`LocalProtocolError`
    naming them (at once, where the fields are built, instead of a ``KeyError`` from
    deep inside ``logging`` in whatever path logs them first)."""
    clash = RESERVED.intersection(fields)
    if clash:
        raise LocalProtocolError(
            f"log field(s) {', '.join(sorted(clash))} are reserved by logging.LogRecord; "
            "name them otherwise"
        )
    return fields


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
    logging.getLogger("aiohttp.server").addFilter(malformed_http_quietly)


def _drop_connect_noise(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("error when creating transport")


def malformed_http_quietly(record: logging.LogRecord) -> bool:
    """A request our HTTP endpoints could not parse (a probe or scanner speaking something
    else) is answered 400 by aiohttp, which logs it as an ERROR with a traceback: keep it to
    one WARNING line naming the client's mistake. Any other error is left as it is."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None or not any(k.__name__ == "HttpProcessingError" for k in type(exc).__mro__):
        return True
    record.msg = f"{record.getMessage()}: malformed HTTP request answered 400 ({exc})"
    record.args = None
    record.levelno, record.levelname = logging.WARNING, "WARNING"
    record.exc_info, record.exc_text = None, None
    return True
