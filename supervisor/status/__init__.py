"""The status page at ``/`` for a person: runs, the rate against the ceiling, and the
ambiguous operations with a resolve form (supervisor/status/page.py).

:func:`add_status_routes` is the one thing the HTTP app calls. The chart's sampler runs
with the app (started and stopped with its runner), reading the budget's rate through
the API state and this process's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from supervisor.apistate import ApiState
from supervisor.status import budget_form
from supervisor.status.auth import Sessions
from supervisor.status.history import History, metrics_reader
from supervisor.status.page import (
    STATUS,
    StatusContext,
    data,
    index,
    load_static,
    login,
    login_form,
    logout,
    resolve,
    static,
)
from supervisor.status.views import StatusData

__all__ = ["STATUS", "add_status_routes"]


def add_status_routes(app: web.Application, state: ApiState) -> None:
    """Serve the status page from ``app`` (nothing when ``status.enabled`` is false)."""
    config = state.config.status
    if not config.enabled:
        return
    history = History(metrics_reader(state.current_rate, state.config.limits.rate_per_second))
    app[STATUS] = StatusContext(
        api=state, config=config, sessions=Sessions(config.session_seconds),
        data=StatusData(state.ledger, state.current_rate,
                        state.config.schedule.digest_cutoff_seconds, history,
                        projected_finish=state.projected_finish,
                        ledger_stats=state.ledger_stats),
        history=history, static=load_static())
    app.router.add_get("/", index)
    app.router.add_get("/login", login_form)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/status/data", data)
    app.router.add_post("/status/operations/{operation_id}/resolve", resolve)
    app.router.add_post("/status/budget/resume", budget_form.resume)
    app.router.add_get("/static/{name}", static)
    app.cleanup_ctx.append(_sampling(history))


def _sampling(history: History) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(history.run(), name="status-history")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return run
