"""Start the simulator on a real socket, in-process."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from cleanup_sandbox.app import STATE_KEY, create_app
from cleanup_sandbox.config import SandboxConfig
from cleanup_sandbox.state import SandboxState

# Hung responses and long-polls are released on shutdown, so anything still running
# after this is a bug worth not waiting a minute for.
SHUTDOWN_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class RunningSandbox:
    url: str
    host: str
    port: int
    state: SandboxState
    app: web.Application


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def run_sandbox(
    config: SandboxConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    access_log: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[RunningSandbox]:
    """Serve a fresh sandbox until the block exits; port 0 picks a free port."""
    app = create_app(config, clock=clock)
    if access_log:
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT)
    else:
        # Access logging costs more than the handlers themselves in benchmarks.
        runner = web.AppRunner(
            app, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT, access_log=None
        )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        yield RunningSandbox(_url(host, bound_port), host, bound_port, app[STATE_KEY], app)
    finally:
        await runner.cleanup()
