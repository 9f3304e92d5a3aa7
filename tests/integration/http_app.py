"""Build the real HTTP app around a real SQLite ledger, wired as supervisor/service.py does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from supervisor import config as config_module
from supervisor.apistate import ApiState
from supervisor.budget.local import LocalBudget
from supervisor.config import Config
from supervisor.http import create_app
from supervisor.monitor import Monitor
from supervisor.partner import PartnerClient
from supervisor.reconcile import Reconciler
from supervisor.runs import RunOpener, RunWatch
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue

TOKEN = "trigger-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Api:
    client: TestClient[object, object]
    state: ApiState
    ledger: SqliteLedger
    queue: SqliteQueue
    db: Database
    scan_wakeup: asyncio.Event
    budget: LocalBudget
    monitor: Monitor

    async def counts(self) -> tuple[int, int, int]:
        """Rows in runs, operations, messages: to prove a rejected request wrote nothing."""
        out = []
        for table in ("runs", "operations", "messages"):
            row = await self.db.read_one(f"SELECT COUNT(*) FROM {table}")
            assert row is not None
            out.append(int(row[0]))
        return out[0], out[1], out[2]

    async def notify_runs_changed(self) -> None:
        """What the monitor does after each pass: read the watched runs, then notify."""
        await self.monitor.read_watched()
        self.state.runs_changed.notify()


def load_config(tmp_path: Path, **env: str) -> Config:
    environ = {"CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP__SERVICE__DATA_DIR": str(tmp_path)}
    environ.update({f"CLEANUP__{k.upper()}": v for k, v in env.items()})
    return config_module.load(None, environ=environ)


@asynccontextmanager
async def running_api(cfg: Config, routes: Callable[[web.Application], None] | None = None
                      ) -> AsyncIterator[Api]:
    """``routes``: more routes for the app, as a module beside http.py adds its own."""
    db = Database(cfg.ledger_path)
    await db.open()
    queue = SqliteQueue(db)
    ledger = SqliteLedger(db, owns_queue=True)
    limiter = LocalBudget(cfg.limits, key="test", store=ledger,
                          max_pause_s=cfg.partner.max_retry_after_seconds)
    partner = PartnerClient(cfg.partner, cfg.limits.concurrency)
    scan_wakeup = asyncio.Event()
    opener = RunOpener(cfg, ledger, scan_wakeup)
    reconciler = Reconciler(cfg.partner, ledger, queue, limiter, partner)
    runs_changed = RunWatch()
    state = ApiState(config=cfg, ledger=ledger, opener=opener, reconciler=reconciler,
                     ready=lambda: (True, {"ledger": True}), runs_changed=runs_changed,
                     current_rate=lambda: limiter.snapshot().rate, budget=limiter)
    monitor = Monitor(ledger, queue, limiter, runs_changed)
    app = create_app(state)
    if routes is not None:
        routes(app)
    client: TestClient[object, object] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield Api(client, state, ledger, queue, db, scan_wakeup, limiter, monitor)
    finally:
        await client.close()
        await db.close()
