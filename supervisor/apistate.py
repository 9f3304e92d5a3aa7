"""What the HTTP handlers (supervisor/http.py, the status page, the budget API) share:
the service's parts they read, the caps on their costly reads, and one way to answer
(JSON bodies and errors, the error middleware). Its own module so the status page and
the budget API need not import the application that mounts them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from supervisor.apiauth import Refused
from supervisor.budget.base import RateBudget
from supervisor.config import Config
from supervisor.errors import StorageError
from supervisor.ledger.base import Ledger
from supervisor.model import LedgerStats
from supervisor.push import PushReceiver
from supervisor.readcaps import ReadCap
from supervisor.reconcile import Reconciler
from supervisor.runs import RunOpener, RunWatch

log = logging.getLogger(__name__)


@dataclass
class ApiState:
    """What the handlers need from the service. ``accepting`` turns False at shutdown."""

    config: Config
    ledger: Ledger
    opener: RunOpener
    reconciler: Reconciler
    ready: Callable[[], tuple[bool, dict[str, bool]]]
    runs_changed: RunWatch
    current_rate: Callable[[], float]
    # When n more requests will have been sent (the budget's view: rate, a pause in force,
    # quotas); None: n / current_rate.
    projected_finish: Callable[[int, float], float] | None = None
    # The monitor's last count of the ledger (None before its first): what the status
    # page shows, rather than a second count of the same rows every second.
    ledger_stats: Callable[[], LedgerStats | None] = lambda: None
    accepting: bool = True
    # Push delivery (POST /v1/push/{queue}); None: not configured, the route answers 404.
    push: PushReceiver | None = None
    # The rate budget, for GET /v1/budget and its resume (supervisor/budget_api.py).
    budget: RateBudget | None = None
    long_polls: ReadCap = field(init=False)
    exclusion_reads: ReadCap = field(init=False)
    # One exclusions page read at a time (supervisor/exclusions.py batches).
    exclusion_pages: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        s = self.config.api
        self.long_polls = ReadCap("long_poll", s.max_long_polls, s.max_long_polls_per_token)
        self.exclusion_reads = ReadCap("exclusions", s.max_exclusion_reads,
                                       s.max_exclusion_reads_per_token)


API = web.AppKey("api", ApiState)



def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")



def error_response(status: int, message: str, **extra: Any) -> web.Response:
    return json_response({"error": message, **extra}, status)



class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message



@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                           ) -> web.StreamResponse:
    """Every error is JSON with a clear message; never a traceback to a client."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message)
    except Refused as exc:
        response = error_response(exc.status, exc.message)
        response.headers.update(exc.headers)
        return response
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[API].config.service.max_body_bytes
        return error_response(413, f"request body larger than {limit} bytes")
    except web.HTTPMethodNotAllowed as exc:
        response = error_response(405, f"{request.method} not allowed here")
        response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except StorageError as exc:
        # The ledger is away (a restart of PostgreSQL, a full disk): the client did nothing
        # wrong and may ask again; the ledger reported the fault once already.
        log.debug("ledger unavailable for %s %r: %s", request.method, request.path, exc)
        response = error_response(503, "the ledger is unavailable; try again shortly")
        response.headers["Retry-After"] = "5"
        return response
    except Exception:
        # %r: a decoded %0A in the path must not start a forged log line.
        log.exception("unhandled error in %s %r", request.method, request.path)
        return error_response(500, "internal error; see the service log")



async def json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; an empty body is an empty object."""
    body = await request.read()
    if not body.strip():
        return {}
    if request.content_type != "application/json":
        raise ApiError(415, "body must be application/json")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "body must be a JSON object")
    return doc
