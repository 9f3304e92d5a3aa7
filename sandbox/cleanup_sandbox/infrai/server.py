"""Run the emulator on a real socket, and the /_emulator control surface that steers it.

In-process users (tests) hold the ``Emulator`` object and change faults or the clock on it;
other processes (benchmarks, the adapter's own end-to-end tests) do the same over HTTP under
/_emulator, authenticated by a control key distinct from the API key.
"""

from __future__ import annotations

import hmac
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import orjson
from aiohttp import web

from cleanup_sandbox.infrai.app import JSON, RUNTIME_KEY, Runtime, create_app
from cleanup_sandbox.infrai.config import EmulatorConfig
from cleanup_sandbox.infrai.cron_routes import CRON_KEY, CronService, get_cron, post_cron_tick
from cleanup_sandbox.infrai.state import QueueState

CONTROL_HEADER = "X-Emulator-Control"
# Nothing here hangs on purpose, so anything still running after this is a bug.
SHUTDOWN_TIMEOUT = 5.0


def _plain(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type=JSON)


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        payload = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError:
        raise ValueError("body must be a JSON object") from None
    if not isinstance(payload, dict):
        raise ValueError("body must be a JSON object")
    return payload


ControlHandler = Callable[[web.Request, Runtime], Awaitable[web.Response]]


def _guarded(handler: ControlHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def guarded(request: web.Request) -> web.StreamResponse:
        rt = request.app[RUNTIME_KEY]
        key = rt.config.control_key
        if key is None:
            # Disabled: indistinguishable from a route that does not exist.
            return _plain({"error": "not_found"}, 404)
        given = request.headers.get(CONTROL_HEADER, "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            return _plain({"error": "unauthorized", "message": f"send {CONTROL_HEADER}"}, 401)
        try:
            return await handler(request, rt)
        except ValueError as exc:
            return _plain({"error": "invalid", "message": str(exc)}, 400)

    return guarded


async def get_faults(request: web.Request, rt: Runtime) -> web.Response:
    return _plain(rt.config.faults())


async def post_faults(request: web.Request, rt: Runtime) -> web.Response:
    return _plain(rt.set_faults(await _json_object(request)).faults())


async def get_log(request: web.Request, rt: Runtime) -> web.Response:
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        raise ValueError("since must be an integer (a seq)") from None
    return _plain([entry for entry in rt.log if entry["seq"] > since])


async def get_stats(request: web.Request, rt: Runtime) -> web.Response:
    return _plain(stats(rt))


async def post_clock(request: web.Request, rt: Runtime) -> web.Response:
    seconds = (await _json_object(request)).get("advance_seconds", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError("advance_seconds must be a number")
    now = rt.state.advance(float(seconds))
    request.app[CRON_KEY].tick()  # cron slots the jump made due fire now, not at the next poll
    return _plain({"now": now, "offset": rt.state.offset})


async def post_reset_log(request: web.Request, rt: Runtime) -> web.Response:
    cleared = len(rt.log)
    rt.log.clear()
    return _plain({"cleared": cleared})


async def control_not_found(request: web.Request, rt: Runtime) -> web.Response:
    return _plain({"error": "not_found"}, 404)


def stats(rt: Runtime) -> dict[str, object]:
    in_log = Counter(str(entry["route"]) for entry in rt.log)
    return {
        "queues": rt.state.stats(),
        # Cumulative; "calls_in_log" restarts with POST /_emulator/reset_log.
        "calls": dict(rt.calls),
        "total_calls": sum(rt.calls.values()),
        "calls_in_log": dict(in_log),
        "now": rt.state.now(),
        "idempotency_keys": len(rt.state.idempotency),
    }


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/_emulator/faults", _guarded(get_faults), allow_head=False)
    app.router.add_post("/_emulator/faults", _guarded(post_faults))
    app.router.add_get("/_emulator/log", _guarded(get_log), allow_head=False)
    app.router.add_get("/_emulator/stats", _guarded(get_stats), allow_head=False)
    app.router.add_post("/_emulator/clock", _guarded(post_clock))
    app.router.add_post("/_emulator/reset_log", _guarded(post_reset_log))
    app.router.add_get("/_emulator/cron", _guarded(get_cron), allow_head=False)
    app.router.add_post("/_emulator/cron/tick", _guarded(post_cron_tick))
    app.router.add_route("*", "/_emulator/{tail:.*}", _guarded(control_not_found))


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Emulator:
    """A running emulator. ``config`` may be swapped or its faults changed while it serves."""

    def __init__(self, runner: web.AppRunner, app: web.Application, host: str, port: int) -> None:
        self._runner = runner
        self.app = app
        self.host = host
        self.port = port
        self.url = _url(host, port)

    @property
    def runtime(self) -> Runtime:
        return self.app[RUNTIME_KEY]

    @property
    def state(self) -> QueueState:
        return self.runtime.state

    @property
    def config(self) -> EmulatorConfig:
        return self.runtime.config

    @config.setter
    def config(self, value: EmulatorConfig) -> None:
        self.runtime.config = value

    def set_faults(self, **changes: object) -> EmulatorConfig:
        """Change fault fields (see FAULT_FIELDS); ValueError leaves everything as it was."""
        return self.runtime.set_faults(changes)

    def advance(self, seconds: float) -> float:
        """Move the emulator's clock forward and start the cron runs it made due; the new time."""
        now = self.state.advance(seconds)
        self.cron.tick()
        return now

    @property
    def cron(self) -> CronService:
        """The cron jobs (``cron.model``), ``tick()`` and ``await cron.drain()`` for in-flight runs."""
        return self.app[CRON_KEY]

    @property
    def calls(self) -> list[dict[str, Any]]:
        return list(self.runtime.log)

    def stats(self) -> Mapping[str, object]:
        return stats(self.runtime)

    async def close(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> Emulator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def start_emulator(
    config: EmulatorConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    now: Callable[[], float] = time.time,
    access_log: bool = False,
) -> Emulator:
    """Serve a fresh emulator until ``close()``; port 0 picks a free port."""
    app = create_app(config, now=now)
    add_control_routes(app)
    # Access logging costs more than the handlers do in benchmarks.
    kwargs: dict[str, Any] = {} if access_log else {"access_log": None}
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT, **kwargs)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return Emulator(runner, app, host, int(runner.addresses[0][1]))
