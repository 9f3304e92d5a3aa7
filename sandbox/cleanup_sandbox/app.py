"""aiohttp handlers and app factory of the partner API simulator."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import logging
import math
import socket
import struct
import time
from collections.abc import Callable, Mapping

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from cleanup_sandbox.config import SandboxConfig
from cleanup_sandbox.headers import ratelimit_headers, retry_after
from cleanup_sandbox.limits import ceil_seconds
from cleanup_sandbox.state import Claim, SandboxState, StoredResponse

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("sandbox_state", SandboxState)
# Set on shutdown so hung responses and long-polls end instead of stalling the runner.
CLOSING_KEY = web.AppKey("sandbox_closing", asyncio.Event)

JSON = "application/json"
DEFAULT_PAGE_LIMIT = 500
MAX_PAGE_LIMIT = 5000
DEFAULT_WAIT_TIMEOUT = 30.0
MAX_WAIT_TIMEOUT = 3600.0
# Matches what common partners (e.g. Stripe) accept; longer keys are a client bug.
MAX_IDEMPOTENCY_KEY_LENGTH = 255


class ClientError(Exception):
    """A request the sandbox refuses; rendered as a JSON error by the middleware."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def json_response(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type=JSON, headers=headers
    )


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return json_response({"error": code, "message": message}, status, headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure, including aiohttp's own 404/405, leaves as JSON and never as a traceback."""
    try:
        return await handler(request)
    except ClientError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() != "content-type"}
        code = (exc.reason or "error").lower().replace(" ", "_")
        return error_response(exc.status, code, exc.reason or "error", headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("sandbox handler failed: %s %r", request.method, request.path)
        return error_response(500, "internal_error", "the sandbox hit an unexpected error")


def _require_auth(request: web.Request) -> None:
    token = request.app[STATE_KEY].config.token
    if token is None:
        return
    scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        credential.strip().encode(), token.encode()
    ):
        raise ClientError(
            401,
            "unauthorized",
            "missing or invalid bearer token",
            {"WWW-Authenticate": "Bearer"},
        )


def _with_quota(state: SandboxState, response: web.Response) -> web.Response:
    style = state.config.ratelimit_headers
    if style == "none":
        return response
    response.headers.update(ratelimit_headers(style, state.policies(state.clock()), time.time()))
    return response


def _too_many_requests(state: SandboxState, now: float, wait: float, reason: str) -> web.Response:
    announced = retry_after(wait, state.config.retry_after_format, time.time())
    body: dict[str, object] = {"error": reason, "message": "too many requests"}
    headers: dict[str, str] = {}
    if announced is not None:
        headers["Retry-After"] = announced.value
        # A partner that sends no Retry-After gives no hint in the body either.
        body["retry_after_seconds"] = ceil_seconds(wait)
        if reason != "paused":
            # Storms are counted on their own (requests_during_pause); this tracks the
            # limiter's and quotas' own announcements.
            state.note_announced(now, announced.announced_seconds)
    return _with_quota(state, json_response(body, 429, headers))


def _response_from(stored: StoredResponse, replayed: bool) -> web.Response:
    response = web.Response(
        status=stored.status, body=stored.body or None, content_type=stored.content_type
    )
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


def _reset_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0 turns the close into a TCP RST, like a crashing load balancer,
        # rather than a polite FIN.
        with contextlib.suppress(OSError, AttributeError, NotImplementedError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _hang(app: web.Application, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await app[CLOSING_KEY].wait()


async def delete_recipient(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.note_request()
    try:
        _require_auth(request)
    except ClientError:
        state.note_unauthorized()
        raise
    recipient_id = request.match_info["recipient_id"]
    entry = state.open_request(recipient_id, request.headers.get("Idempotency-Key"))
    status: int | None = None
    try:
        response = await _delete(request, state, recipient_id)
        status = response.status
        return response
    finally:
        state.close_request(entry, status)


async def _delete(request: web.Request, state: SandboxState,
                  recipient_id: str) -> web.StreamResponse:
    now = state.clock()
    refusal = state.admit(now)
    if refusal is not None:
        return _too_many_requests(state, now, refusal.retry_after, refusal.reason)

    raw_key = request.headers.get("Idempotency-Key")
    key = raw_key if state.config.honour_idempotency_keys else None
    if key is not None:
        if not key or len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
            return _with_quota(
                state,
                error_response(
                    400,
                    "invalid_idempotency_key",
                    f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY_LENGTH} characters",
                ),
            )
        claim, stored = state.idempotency.begin(key, recipient_id)
        if claim is Claim.REPLAY and stored is not None:
            state.note_replay()
            return _with_quota(state, _response_from(stored, replayed=True))
        if claim is Claim.IN_PROGRESS:
            state.note_conflict()
            return _with_quota(
                state,
                error_response(
                    409, "idempotency_key_in_use", "a request with this key is in progress"
                ),
            )
        if claim is Claim.MISMATCH:
            state.note_key_mismatch()
            return _with_quota(
                state,
                error_response(
                    422,
                    "idempotency_key_reused",
                    "this Idempotency-Key was first used for another recipient",
                ),
            )

    completed = False
    state.begin_delete()
    try:
        latency = state.tunables.latency_ms + (
            state.config.latency_per_inflight_ms * (state.in_flight - 1))
        if latency > 0:
            await asyncio.sleep(latency / 1000.0)
        plan = state.plan_faults()
        if plan.fail_before:
            return _with_quota(
                state, error_response(503, "unavailable", "injected fault: try again later")
            )

        execution = state.execute(recipient_id, raw_key, plan.after_act)
        if execution.result == "deleted":
            stored = StoredResponse(204, b"", None)
        else:
            stored = StoredResponse(
                404,
                orjson.dumps({"error": "not_found", "id": recipient_id}),
                JSON,
            )
        if key is not None:
            # Stored before any after-act fault, so a retry during the hang replays.
            state.idempotency.complete(key, stored)
            completed = True
        response = _with_quota(state, _response_from(stored, replayed=False))

        if plan.after_act == "timeout":
            await _hang(request.app, state.tunables.hang_seconds)
        elif plan.after_act == "reset":
            # aiohttp swallows the write to the aborted transport, so returning is safe.
            _reset_connection(request)
        return response
    finally:
        state.end_delete()
        if key is not None and not completed:
            state.idempotency.release(key)


async def probe_recipient(request: web.Request) -> web.StreamResponse:
    _require_auth(request)
    state = request.app[STATE_KEY]
    recipient_id = request.match_info["recipient_id"]
    if state.is_present(recipient_id):
        return json_response({"id": recipient_id})
    return error_response(404, "not_found", f"recipient {recipient_id!r} does not exist")


def encode_cursor(position: int) -> str:
    return base64.urlsafe_b64encode(f"p:{position}".encode()).rstrip(b"=").decode()


def decode_cursor(cursor: str, listing_length: int) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        prefix, _, number = raw.partition(":")
        position = int(number)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ClientError(400, "invalid_cursor", "cursor is not one this API issued") from None
    if prefix != "p" or not 0 <= position <= listing_length:
        raise ClientError(400, "invalid_cursor", "cursor is not one this API issued")
    return position


def _int_param(request: web.Request, name: str, default: int, minimum: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ClientError(400, "invalid_parameter", f"{name} must be an integer") from None
    if value < minimum:
        raise ClientError(400, "invalid_parameter", f"{name} must be >= {minimum}")
    return value


def _float_param(request: web.Request, name: str, default: float, maximum: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClientError(400, "invalid_parameter", f"{name} must be a number") from None
    if not math.isfinite(value) or not 0 <= value <= maximum:
        raise ClientError(400, "invalid_parameter", f"{name} must be within [0, {maximum}]")
    return value


async def stale_recipients(request: web.Request) -> web.StreamResponse:
    _require_auth(request)
    state = request.app[STATE_KEY]
    # Oversized pages are clamped rather than refused, as most paging APIs do.
    limit = min(_int_param(request, "limit", DEFAULT_PAGE_LIMIT, 1), MAX_PAGE_LIMIT)
    cursor = request.query.get("cursor")
    after = decode_cursor(cursor, len(state.listing)) if cursor else 0
    delay = state.tunables.page_delay_ms
    if delay > 0:
        await asyncio.sleep(delay / 1000.0)
    items, next_position = state.page(after, limit)
    state.note_page()
    next_cursor = None if next_position is None else encode_cursor(next_position)
    return json_response({"items": items, "next_cursor": next_cursor})


async def sandbox_stats(request: web.Request) -> web.StreamResponse:
    return json_response(request.app[STATE_KEY].stats())


async def sandbox_log(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    since = _int_param(request, "since", 0, 0)
    # seq is 1-based and dense, so "after seq N" is a plain slice.
    entries = [execution.as_dict() for execution in state.log[since:]]
    fmt = request.query.get("format", "json")
    if fmt == "jsonl":
        body = b"".join(orjson.dumps(entry) + b"\n" for entry in entries)
        return web.Response(body=body, content_type="application/x-ndjson")
    if fmt != "json":
        raise ClientError(400, "invalid_parameter", "format must be json or jsonl")
    return json_response(entries)


async def sandbox_requests(request: web.Request) -> web.StreamResponse:
    """Every authorised DELETE after ``since`` (its seq), answered or still in the air."""
    state = request.app[STATE_KEY]
    since = _int_param(request, "since", 0, 0)
    return json_response([entry.as_dict() for entry in state.requests_log[since:]])


async def sandbox_wait(request: web.Request) -> web.StreamResponse:
    """Long-poll until every counter named in the query reaches its target: any integer
    counter of ``/_sandbox/stats`` (executions, pages or pages_served, requests,
    batch_requests, requests_during_pause...). A name it does not count is refused (400),
    never waited on as if it had been reached."""
    state = request.app[STATE_KEY]
    closing = request.app[CLOSING_KEY]
    counters = {k for k, v in state.stats().items() if isinstance(v, int)}
    targets: dict[str, int] = {}
    for name in request.query:
        if name == "timeout":
            continue
        counter = "pages_served" if name == "pages" else name
        if counter not in counters:
            raise ClientError(400, "invalid_parameter", f"{name} is not a counter this "
                              f"sandbox waits on (one of: {', '.join(sorted(counters))})")
        targets[counter] = _int_param(request, name, 0, 0)
    timeout = _float_param(request, "timeout", DEFAULT_WAIT_TIMEOUT, MAX_WAIT_TIMEOUT)

    def reached() -> bool:
        stats = state.stats()
        return all(stats[name] >= target for name, target in targets.items())

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await state.wait_until(lambda: reached() or closing.is_set())
    if reached():
        return json_response(state.stats())
    if closing.is_set():
        return json_response({"error": "shutting_down", "stats": state.stats()}, 503)
    return json_response({"error": "timeout", "stats": state.stats()}, 408)


def _number(name: str, value: object) -> float:
    # bool is an int subclass; {"fault_5xx": true} is a typo, not a probability of 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClientError(400, "invalid_control", f"{name} must be a number")
    return float(value)


async def sandbox_control_get(request: web.Request) -> web.StreamResponse:
    return json_response(request.app[STATE_KEY].control_snapshot())


async def sandbox_control_post(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        payload = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise ClientError(400, "invalid_json", "body must be a JSON object") from None
    if not isinstance(payload, dict):
        raise ClientError(400, "invalid_json", "body must be a JSON object")
    changes = {str(name): _number(str(name), value) for name, value in payload.items()}
    try:
        state.apply_control(changes)
    except ValueError as exc:
        raise ClientError(400, "invalid_control", str(exc)) from None
    return json_response(state.control_snapshot())


async def _on_shutdown(app: web.Application) -> None:
    app[CLOSING_KEY].set()
    app[STATE_KEY].wake_waiters()


def create_app(
    config: SandboxConfig | None = None, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """``clock`` drives the limiters, so tests can step time instead of sleeping."""
    state = SandboxState(config if config is not None else SandboxConfig(), clock)
    app = web.Application(middlewares=[json_errors])
    app[STATE_KEY] = state
    app[CLOSING_KEY] = asyncio.Event()
    # Imported here: the batch handlers build on this module's helpers. Registered first,
    # so /recipients/batch-jobs is never read as a recipient's ID.
    from cleanup_sandbox.batch import add_batch_routes

    add_batch_routes(app)
    app.router.add_delete("/recipients/{recipient_id}", delete_recipient)
    app.router.add_get("/recipients/{recipient_id}", probe_recipient, allow_head=False)
    app.router.add_get("/stale-recipients", stale_recipients, allow_head=False)
    app.router.add_get("/_sandbox/stats", sandbox_stats, allow_head=False)
    app.router.add_get("/_sandbox/log", sandbox_log, allow_head=False)
    app.router.add_get("/_sandbox/requests", sandbox_requests, allow_head=False)
    app.router.add_get("/_sandbox/wait", sandbox_wait, allow_head=False)
    app.router.add_get("/_sandbox/control", sandbox_control_get, allow_head=False)
    app.router.add_post("/_sandbox/control", sandbox_control_post)
    app.on_shutdown.append(_on_shutdown)
    return app
