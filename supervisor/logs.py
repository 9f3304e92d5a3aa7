"""Log configuration for the CLI: one line per event, in text or as one JSON object.

Both formats carry the same fields: time, level, logger, message and the structured
fields the code passes through ``extra=``; a traceback rides in ``exc`` (JSON) or after
the line (text), never split over several JSON lines.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any, Literal

import orjson

# Fields the code passes through ``extra=``; shown after the message when present.
FIELDS = ("action", "run_id", "operation_id")


class LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [f"{k}={getattr(record, k)}" for k in FIELDS if hasattr(record, k)]
        return f"{line} {' '.join(extras)}" if extras else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what a log shipper (Loki, Vector, journald) parses."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in FIELDS:
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        # default=str: an extra that is not JSON (a Path, an enum) must not lose the line.
        return orjson.dumps(doc, default=str).decode()


def json_configured() -> bool:
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def configure(level: str, stream: IO[str] | None = None,
              fmt: Literal["text", "json"] = "text") -> None:
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log would be one INFO line per request on the hot path.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # aiosqlite logs every statement with its parameters at DEBUG: noise, not diagnosis.
    logging.getLogger("aiosqlite").setLevel(max(logging.INFO, root.level))
