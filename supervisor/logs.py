"""Log configuration for the CLI: one line per event, structured fields as key=value."""

from __future__ import annotations

import logging
import sys

# Fields the code passes through ``extra=``; shown after the message when present.
FIELDS = ("action", "run_id", "operation_id")


class LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [f"{k}={getattr(record, k)}" for k in FIELDS if hasattr(record, k)]
        return f"{line} {' '.join(extras)}" if extras else line


def configure(level: str, stream: object = None) -> None:
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log would be one INFO line per request on the hot path.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # aiosqlite logs every statement with its parameters at DEBUG: noise, not diagnosis.
    logging.getLogger("aiosqlite").setLevel(max(logging.INFO, root.level))
