"""How the server logs: text for people, or one JSON object per line for log shippers.

``configure(level, fmt)`` runs once, where ``jitserve serve`` starts. jitserve's own
loggers (``jitserve.*``) log at ``level``; third parties (jax's backend probing) at
warning. A record's ``fields`` (passed as ``extra={"fields": {...}}``) become keys of
its JSON object, so a shipper can filter compiles by tier or refusals by code
without parsing the message::

    {"ts": "2026-11-23T03:12:44.101Z", "level": "info", "logger": "jitserve.compile",
     "message": "compiled 3f2a9c1b0d4e f(float32[8,4]) tier=compiled 0.412s",
     "program_id": "3f2a9c1b0d4e...", "tier": "compiled", "seconds": 0.412, ...}
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any, Literal

__all__ = ["JsonFormatter", "LogFormat", "configure", "uvicorn_log_config"]

LogFormat = Literal["text", "json"]
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def _formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT)


def configure(level: str, fmt: LogFormat) -> None:
    """Root handler in ``fmt`` at warning; ``jitserve.*`` at ``level``."""
    handler = logging.StreamHandler()
    handler.setFormatter(_formatter(fmt))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("jitserve").setLevel("DEBUG" if level == "trace" else level.upper())


def uvicorn_log_config(fmt: LogFormat) -> dict[str, Any] | None:
    """uvicorn's own loggers (startup, access lines) in ``fmt``; ``None`` keeps its default."""
    if fmt != "json":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"default": handler},
        "loggers": {name: {"handlers": ["default"], "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
