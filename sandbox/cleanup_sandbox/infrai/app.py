"""aiohttp application of the Infrai queue emulator: routes, envelope, auth, faults, call log.

Every /v1 call goes through one handler so that the nack and extend routes, which only
exist when configured, can be switched at runtime like everything else. After the body is
read (and the injected latency slept), a call runs to completion without awaiting: fault
draws, the idempotency look-up, the action and its record cannot interleave with another call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import random
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import unquote

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from cleanup_sandbox.headers import retry_after
from cleanup_sandbox.infrai.config import FAULT_FIELDS, EmulatorConfig
from cleanup_sandbox.infrai.state import ApiError, QueueState, StoredCall, timestamp, uuid7

log = logging.getLogger(__name__)

JSON = "application/json"
REDRIVE_PREFIX = "/v1/queue/dlq/redrive/"
DISCOVERY = "/v1/discovery"
# Bodies past Infrai's 256 KB are refused with an envelope; this only bounds what is read.
CLIENT_MAX_SIZE = 16 * 1024 * 1024
LOG_FIELDS = ("t", "route", "capability", "method", "status", "ok", "code", "queue", "message_ids",
              "idempotency_key", "fault")
TOPUP_HINT = (
    "add funds on the console billing page, or call POST /v1/account/topup and open the "
    "checkout_url it returns"
)


class Runtime:
    """What the app keeps besides the queues: the live config, fault draws, the call log."""

    def __init__(self, state: QueueState) -> None:
        self.state = state
        self.rng = random.Random(state.config.seed)
        self._id_rng = random.Random(state.config.seed * 104729 + 5)
        self.log: deque[dict[str, Any]] = deque(maxlen=state.config.log_limit)
        self.calls: Counter[str] = Counter()
        self._seq = 0
        # More route families (the cron surface, cron_routes.py), asked after the queue routes.
        self.routes: list[Resolver] = []

    @property
    def config(self) -> EmulatorConfig:
        return self.state.config

    @config.setter
    def config(self, value: EmulatorConfig) -> None:
        self.state.config = value
        if self.log.maxlen != value.log_limit:
            self.log = deque(self.log, maxlen=value.log_limit)

    def set_faults(self, changes: Mapping[str, object]) -> EmulatorConfig:
        unknown = sorted(set(changes) - set(FAULT_FIELDS))
        if unknown:
            raise ValueError(f"not fault fields: {', '.join(unknown)} (known: {', '.join(FAULT_FIELDS)})")
        # replace() re-runs the config's validation, so a bad value changes nothing.
        self.config = dataclasses.replace(self.config, **cast(dict[str, Any], dict(changes)))
        return self.config

    def take(self, name: Literal["rate_limit_next", "error_next"]) -> bool:
        left = int(getattr(self.config, name))
        if left <= 0:
            return False
        self.config = dataclasses.replace(self.config, **cast(dict[str, Any], {name: left - 1}))
        return True

    def roll(self, share: float) -> bool:
        # No draw at share 0, so turning one fault on does not reshuffle the others.
        return share > 0 and self.rng.random() < share

    def request_id(self) -> str:
        return uuid7(self.state.now(), self._id_rng)

    def record(self, entry: dict[str, Any]) -> None:
        self._seq += 1
        entry["seq"] = self._seq
        self.log.append(entry)
        self.calls[str(entry["route"])] += 1


RUNTIME_KEY = web.AppKey("infrai_runtime", Runtime)


# -- request fields ----------------------------------------------------------------------


def _invalid(name: str, expected: str) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", f"{name}: {expected}", f"fix the {name} field")


def _req_str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise _invalid(name, "required, a non-empty string")
    return value


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _invalid(name, "must be a non-empty string")
    return value


def _opt_num(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise _invalid(name, "must be a number")
    return float(value)


def _opt_int(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    number = _opt_num(body, name)
    if number is None:
        return None
    if not number.is_integer() or number < lo:
        raise _invalid(name, f"must be an integer >= {lo}")
    return int(number)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _invalid(name, "must be a boolean")
    return value


def _delay(body: Mapping[str, Any], cfg: EmulatorConfig) -> float:
    delay = _opt_num(body, "delay_seconds") or 0.0
    if not 0 <= delay <= cfg.max_delay_seconds:
        raise ApiError(
            400,
            "INVALID_DELAY",
            f"delay_seconds must be within [0, {cfg.max_delay_seconds:g}], got {delay:g}",
            "7 days (604800 s) is the longest delay",
        )
    return delay


# -- capabilities ------------------------------------------------------------------------


@dataclass(slots=True)
class Call:
    body: dict[str, Any]
    raw_size: int
    param: str | None
    key: str | None
    duplicate_rng: random.Random | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    data: object
    queue: str | None
    message_ids: tuple[str, ...] = ()
    duplicate: bool = False
    extra: tuple[tuple[str, object], ...] = ()  # more call-log fields, e.g. a new cron_id


Act = Callable[[QueueState, Call], Outcome]


def act_create(state: QueueState, call: Call) -> Outcome:
    b, cfg = call.body, state.config
    name = _req_str(b, "name")
    kind = _opt_str(b, "type") or "standard"
    if kind not in ("standard", "fifo"):
        raise _invalid("type", "must be 'standard' or 'fifo'")
    retention = _opt_num(b, "message_retention_days")
    if retention is not None and not 0 < retention <= cfg.max_retention_days:
        raise _invalid("message_retention_days", f"must be within (0, {cfg.max_retention_days:g}]")
    lease = _opt_num(b, "visibility_timeout_default")
    if lease is not None and not 0 <= lease <= cfg.max_visibility_timeout:
        raise _invalid("visibility_timeout_default", f"must be within [0, {cfg.max_visibility_timeout:g}]")
    queue, _ = state.create_queue(
        name,
        type=kind,
        dead_letter_queue=_opt_str(b, "dead_letter_queue"),
        max_retries=_opt_int(b, "max_retries", 0),
        message_retention_days=retention,
        visibility_timeout_default=lease,
        enable_priority=bool(_opt_bool(b, "enable_priority")),
    )
    return Outcome(queue.record(cfg.timestamp_format), name)


def act_publish(state: QueueState, call: Call) -> Outcome:
    b, cfg = call.body, state.config
    name = _req_str(b, "queue")
    # One third-party article names the field "body" (inconsistency #8).
    payload = b.get("payload") if b.get("payload") is not None else b.get("body")
    if not isinstance(payload, dict):
        raise _invalid("payload", "required, a JSON object")
    by_payload = cfg.payload_size_accounting == "payload"
    size = len(orjson.dumps(payload)) if by_payload else call.raw_size
    if size > cfg.max_payload_bytes:
        raise ApiError(
            413,
            "PAYLOAD_TOO_LARGE",
            f"message is {size} bytes; the limit is {cfg.max_payload_bytes}",
            "store large bodies elsewhere and publish a reference",
        )
    headers = b.get("headers")
    if headers is not None and (
        not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values())
    ):
        raise _invalid("headers", "must be an object of strings")
    message_id, _ = state.publish(
        name,
        payload,
        delay_seconds=_delay(b, cfg),
        priority=_opt_num(b, "priority") or 0.0,
        group_id=_opt_str(b, "message_group_id"),
        deduplication_id=_opt_str(b, "deduplication_id"),
        idempotency_key=call.key,
        headers=headers,
    )
    return Outcome({"message_id": message_id}, name, (message_id,))


def act_consume(state: QueueState, call: Call) -> Outcome:
    b, cfg = call.body, state.config
    name = _req_str(b, "queue")
    count = _opt_int(b, "max_messages", 1) or 1
    lease = _opt_num(b, "visibility_timeout")
    if lease is not None and lease < 0:
        raise _invalid("visibility_timeout", "must be >= 0")
    deliveries = state.consume(name, count, lease, call.duplicate_rng)
    messages: list[dict[str, object]] = []
    for m, _ in deliveries:
        item: dict[str, object] = {"message_id": m.message_id, "payload": m.payload}
        if cfg.message_extras:
            item["receive_count"] = m.receive_count
            item["enqueued_at"] = timestamp(m.enqueued_at, cfg.timestamp_format)
            item["headers"] = m.headers
            item["message_group_id"] = m.group_id
        messages.append(item)
    data: object = messages if cfg.consume_shape == "bare" else {"messages": messages}
    ids = tuple(m.message_id for m, _ in deliveries)
    return Outcome(data, name, ids, duplicate=any(dup for _, dup in deliveries))


def act_ack(state: QueueState, call: Call) -> Outcome:
    name, message_id = _req_str(call.body, "queue"), _req_str(call.body, "message_id")
    acked = state.ack(name, message_id)
    return Outcome({"message_id": message_id, "acked": acked}, name, (message_id,))


def act_nack(state: QueueState, call: Call) -> Outcome:
    name, message_id = _req_str(call.body, "queue"), _req_str(call.body, "message_id")
    nacked, dead = state.nack(name, message_id, _delay(call.body, state.config))
    data = {"message_id": message_id, "nacked": nacked, "dead_lettered": dead}
    return Outcome(data, name, (message_id,))


def act_extend(state: QueueState, call: Call) -> Outcome:
    b = call.body
    name, message_id = _req_str(b, "queue"), _req_str(b, "message_id")
    lease = _opt_num(b, "visibility_timeout")
    if lease is None or lease < 0:
        raise _invalid("visibility_timeout", "required, a number >= 0")
    until = state.extend(name, message_id, lease)
    data = {"message_id": message_id, "visible_at": timestamp(until, state.config.timestamp_format)}
    return Outcome(data, name, (message_id,))


def act_redrive(state: QueueState, call: Call) -> Outcome:
    name, moved = state.redrive(call.param or "")
    return Outcome({"moved": moved}, name)


@dataclass(frozen=True, slots=True)
class Capability:
    id: str
    path: str
    act: Act
    params: tuple[str, ...]
    method: str = "POST"
    # Consume is not replayed by key: a replay would hand out messages whose leases are gone.
    idempotent: bool = True
    param_log: str = "queue"  # the call-log field the path parameter goes to


CREATE = Capability("queue.create", "/v1/queue/create", act_create, (
    "name", "type", "dead_letter_queue", "max_retries", "message_retention_days",
    "visibility_timeout_default", "enable_priority", "idempotency_key"))
PUBLISH = Capability("queue.publish", "/v1/queue/publish", act_publish, (
    "queue", "payload", "delay_seconds", "priority", "message_group_id", "deduplication_id",
    "headers", "idempotency_key"))
CONSUME = Capability("queue.consume", "/v1/queue/consume", act_consume,
                     ("queue", "max_messages", "visibility_timeout"), idempotent=False)
ACK = Capability("queue.ack", "/v1/queue/ack", act_ack, ("queue", "message_id", "idempotency_key"))
REDRIVE = Capability("queue.dlq.redrive", REDRIVE_PREFIX + "{queue}", act_redrive,
                     ("queue", "idempotency_key"))
BUILTIN = {c.path: c for c in (CREATE, PUBLISH, CONSUME, ACK)}


Resolver = Callable[[str, str], tuple[Capability | None, str | None]]  # (method, raw path)


def capabilities(cfg: EmulatorConfig) -> list[Capability]:
    caps = [CREATE, PUBLISH, CONSUME, ACK, REDRIVE]
    if cfg.nack_route is not None:
        caps.append(Capability("queue.nack", cfg.nack_route, act_nack,
                               ("queue", "message_id", "delay_seconds", "idempotency_key")))
    if cfg.extend_route is not None:
        caps.append(Capability("queue.extend", cfg.extend_route, act_extend,
                               ("queue", "message_id", "visibility_timeout", "idempotency_key")))
    return caps


def resolve(cfg: EmulatorConfig, raw_path: str) -> tuple[Capability | None, str | None]:
    if raw_path in BUILTIN:
        return BUILTIN[raw_path], None
    if raw_path.startswith(REDRIVE_PREFIX) and len(raw_path) > len(REDRIVE_PREFIX):
        return REDRIVE, unquote(raw_path[len(REDRIVE_PREFIX):])
    for cap in capabilities(cfg)[5:]:
        if cap.path == raw_path:
            return cap, None
    return None, None


# -- responses ---------------------------------------------------------------------------


def envelope_response(
    rt: Runtime,
    started: float,
    status: int,
    data: object = None,
    error: ApiError | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    cfg, request_id = rt.config, rt.request_id()
    fault = None if error is None else {"code": error.code, "message": error.message, "hint": error.hint}
    metadata = {
        "request_id": request_id,
        "cost_usd": cfg.cost_usd,
        "latency_ms": int((time.perf_counter() - started) * 1000),
        "vendor": cfg.vendor,
        "cache_hit": False,
    }
    body = {"ok": error is None and status < 400, "data": data, "error": fault, "metadata": metadata}
    response = web.Response(body=orjson.dumps(body), status=status, content_type=JSON, headers=headers)
    response.headers["X-Request-Id"] = request_id
    return response


def _reset_connection(request: web.Request) -> web.Response:
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Linger 0 turns the close into a TCP RST, like a crashing gateway, not a FIN.
            with contextlib.suppress(OSError, AttributeError, NotImplementedError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    # aiohttp drops the write to an aborted transport, so answering is harmless.
    return web.Response(status=500)


def _authorized(request: web.Request, key: str) -> bool:
    scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), key.encode())


def _idempotency_key(request: web.Request, body: Mapping[str, Any], cfg: EmulatorConfig) -> str | None:
    in_body = _opt_str(body, "idempotency_key")
    in_header = request.headers.get("Idempotency-Key") or None
    if cfg.idempotency_precedence == "header":
        return in_header or in_body
    return in_body or in_header


# -- the /v1 handler ---------------------------------------------------------------------


async def handle_v1(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME_KEY]
    path = request.rel_url.raw_path
    started = time.perf_counter()
    if path == DISCOVERY or path.startswith(DISCOVERY + "/"):
        return discovery(rt, request, path, started)
    entry: dict[str, Any] = dict.fromkeys(LOG_FIELDS)
    entry.update(t=rt.state.now(), route=path, method=request.method, ok=False, message_ids=[])
    try:
        raw: bytes | None = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raw = None
    try:
        latency = rt.config.latency_ms
        if latency > 0:
            await asyncio.sleep(latency / 1000.0)
        return _serve(request, rt, path, raw, entry, started)
    finally:
        rt.record(entry)


def _serve(
    request: web.Request, rt: Runtime, path: str, raw: bytes | None, entry: dict[str, Any], started: float
) -> web.Response:
    cfg = rt.config

    def fail(error: ApiError, headers: Mapping[str, str] | None = None, status: int = 0) -> web.Response:
        entry.update(status=status or error.status, ok=False, code=error.code)
        return envelope_response(rt, started, status or error.status, None, error, headers)

    if cfg.unauthorized or not _authorized(request, cfg.api_key):
        entry["fault"] = "unauthorized" if cfg.unauthorized else None
        status = cfg.auth_failure_status
        error = ApiError(status, cfg.auth_failure_code, "missing or invalid project key",
                         "send Authorization: Bearer <project key>")
        return fail(error, {"WWW-Authenticate": "Bearer"} if status == 401 else None)
    cap, param = resolve(cfg, path)
    for extra in rt.routes if cap is None else ():
        cap, param = extra(request.method, path)
        if cap is not None:
            break
    if cap is None:
        return fail(ApiError(404, "NOT_FOUND", f"no route {request.method} {path}", f"see GET {DISCOVERY}"))
    entry.update({"route": cap.path, "capability": cap.id, cap.param_log: param})
    if request.method != cap.method:
        wrong = ApiError(405, "METHOD_NOT_ALLOWED", f"{cap.path} takes {cap.method}")
        return fail(wrong, {"Allow": cap.method})

    # Injected faults, in the order a gateway in front of the service would produce them.
    if cfg.credit_exhausted:
        entry["fault"] = "credit_exhausted"
        return fail(ApiError(402, "INSUFFICIENT_CREDIT", "the account is out of credit", TOPUP_HINT))
    if rt.take("rate_limit_next") or rt.roll(cfg.rate_limit_share):
        entry["fault"] = "rate_limited"
        announced = retry_after(cfg.retry_after, cfg.retry_after_format, time.time())
        headers = {} if announced is None else {"Retry-After": announced.value}
        hint = "slow down" if announced is None else f"retry after {announced.value}"
        return fail(ApiError(429, "RATE_LIMITED", "too many requests", hint), headers)
    if rt.take("error_next") or rt.roll(cfg.error_share):
        entry["fault"] = "error"
        return fail(ApiError(cfg.error_status, "SERVICE_UNAVAILABLE", "injected failure", "retry later"))
    if rt.roll(cfg.reset_share):
        entry["fault"] = "reset"
        return _reset_connection(request)
    if rt.roll(cfg.garbage_share):
        entry.update(status=200, fault="garbage")
        if rt.rng.random() < 0.5:
            return web.Response(body=b"<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        return web.Response(body=b'{"status":"ok","result":true}', content_type=JSON)
    if rt.roll(cfg.error_ok_false_200_share):
        entry["fault"] = "ok_false"
        return fail(ApiError(500, "INTERNAL", "injected internal error", "retry later"), status=200)

    if raw is None:
        return fail(ApiError(413, "PAYLOAD_TOO_LARGE", "request body too large"))
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return fail(_invalid("body", "must be a JSON object"))
    if not isinstance(body, dict):
        return fail(_invalid("body", "must be a JSON object"))
    if cfg.strict_canonical:
        entry["canonical"] = raw == orjson.dumps(body, option=orjson.OPT_SORT_KEYS) + b"\n"
    if entry["queue"] is None:
        queue_field = body.get("name" if cap is CREATE else "queue")
        entry["queue"] = queue_field if isinstance(queue_field, str) else None

    state = rt.state
    try:
        key = _idempotency_key(request, body, cfg)
        entry["idempotency_key"] = key
        if cap is CREATE and cfg.require_create_keys and key is None:
            raise _invalid("idempotency_key", "required on calls that create resources")
        # Consume keys are logged but never replayed (see Capability.idempotent).
        replay_key = key if cap.idempotent else None
        fingerprint = b""
        if replay_key is not None:
            unkeyed = {k: v for k, v in body.items() if k != "idempotency_key"}
            fingerprint = path.encode() + b" " + orjson.dumps(unkeyed, option=orjson.OPT_SORT_KEYS)
            stored = state.idempotency.get(cap.id, replay_key, state.now(), cfg.dedup_window_seconds)
            if stored is not None:
                if stored.fingerprint != fingerprint and cfg.key_reuse == "conflict":
                    raise ApiError(409, "IDEMPOTENCY_CONFLICT",
                                   "this idempotency key was first used with a different request",
                                   "use a fresh key for a different request")
                entry.update(status=stored.status, ok=True, queue=stored.queue,
                             message_ids=list(stored.message_ids), replayed=True)
                return envelope_response(rt, started, stored.status, stored.data,
                                         headers={"Idempotent-Replayed": "true"})
        duplicate_rng = rt.rng if cap is CONSUME and rt.roll(cfg.duplicate_share) else None
        outcome = cap.act(state, Call(body, len(raw), param, key, duplicate_rng))
    except ApiError as error:
        return fail(error)
    if replay_key is not None:
        # Only successes are kept: a refused call, like a faulted one, may be retried and act.
        state.idempotency.put(cap.id, replay_key, StoredCall(
            fingerprint, state.now(), 200, outcome.data, outcome.queue, outcome.message_ids))
    entry.update(status=200, ok=True, queue=outcome.queue, message_ids=list(outcome.message_ids))
    entry.update(outcome.extra)
    if outcome.duplicate:
        entry["fault"] = "duplicate"
    response = envelope_response(rt, started, 200, outcome.data)
    if rt.roll(cfg.reset_after_share):
        # It acted (and recorded its idempotent answer); the client only sees a reset.
        entry.update(status=None, fault="reset_after")
        return _reset_connection(request)
    return response


# -- discovery, errors, factory ----------------------------------------------------------

# code -> retryable
ERROR_CODES = {c: False for c in ("VALIDATION_ERROR", "UNAUTHORIZED", "INSUFFICIENT_CREDIT",
                                  "QUEUE_NOT_FOUND", "PAYLOAD_TOO_LARGE", "INVALID_DELAY",
                                  "IDEMPOTENCY_CONFLICT")}
ERROR_CODES.update({c: True for c in ("RATE_LIMITED", "SERVICE_UNAVAILABLE", "INTERNAL")})


def _describe(cap: Capability, cfg: EmulatorConfig) -> dict[str, object]:
    return {
        "id": cap.id,
        "method": cap.method,
        "path": cap.path,
        "available": True,
        "regions": ["local"],
        "vendors": [cfg.vendor],
        "billing": {
            "is_billable": True,
            "free": False,
            "unit": "call",
            "price_usd": cfg.cost_usd,
            "currency": "USD",
            "new_account_trial_uses": 0,
        },
    }


def discovery(rt: Runtime, request: web.Request, path: str, started: float) -> web.Response:
    """Public (no key, no faults, not in the call log), like the real discovery API."""
    cfg = rt.config
    if request.method != "GET":
        return envelope_response(rt, started, 405, error=ApiError(405, "METHOD_NOT_ALLOWED", "GET only"))
    caps = capabilities(cfg)
    if path == DISCOVERY:
        data = {
            "version": "emulator-1",
            "generated_at": timestamp(rt.state.now(), cfg.timestamp_format),
            "capabilities": [_describe(c, cfg) for c in caps],
        }
        return envelope_response(rt, started, 200, data)
    wanted = unquote(path[len(DISCOVERY) + 1:])
    for cap in caps:
        if cap.id == wanted:
            detail = _describe(cap, cfg)
            detail["parameters"] = list(cap.params)
            detail["errors"] = [{"code": c, "retryable": r} for c, r in ERROR_CODES.items()]
            return envelope_response(rt, started, 200, detail)
    missing = ApiError(404, "NOT_FOUND", f"no capability {wanted!r}", f"see GET {DISCOVERY}")
    return envelope_response(rt, started, 404, error=missing)


@web.middleware
async def envelope_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404/405 and any crash leave as envelopes too, never as tracebacks."""
    rt = request.app[RUNTIME_KEY]
    started = time.perf_counter()
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "NOT_FOUND" if exc.status == 404 else (exc.reason or "ERROR").upper().replace(" ", "_")
        error = ApiError(exc.status, code, exc.reason or code)
        return envelope_response(rt, started, exc.status, error=error)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("infrai emulator handler failed: %s %r", request.method, request.path)
        return envelope_response(rt, started, 500, error=ApiError(500, "INTERNAL", "emulator bug"))


def create_app(config: EmulatorConfig, *, now: Callable[[], float] = time.time) -> web.Application:
    """``now`` is the clock every lease, delay and retention is computed on (plus an offset)."""
    app = web.Application(middlewares=[envelope_errors], client_max_size=CLIENT_MAX_SIZE)
    app[RUNTIME_KEY] = Runtime(QueueState(config, now))
    app.router.add_route("*", "/v1/{tail:.*}", handle_v1)
    # Imported here: the cron surface builds on this module's dispatcher.
    from cleanup_sandbox.infrai.cron_routes import install_cron

    install_cron(app)
    return app
