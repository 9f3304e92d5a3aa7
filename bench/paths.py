"""Where the bench lives and writes, which interpreter it starts, and the peers' broker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
LOGS = OUT / "logs"
PY = sys.executable
TOOLS = ("service", "cron", "celery")
PEERS = ("cron", "celery")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
REDIS_MARKER = "cleanup-bench:owned"
CELERY_POOL = os.environ.get("BENCH_CELERY_POOL", "threads")  # threads | prefork


def log_path(scenario: str, cell: str, tool: str) -> Path:
    """The log file of one process of one run: ``<scenario>@<cell>-<tool>.log``."""
    LOGS.mkdir(parents=True, exist_ok=True)
    return LOGS / f"{scenario}@{cell}-{tool}.log"
