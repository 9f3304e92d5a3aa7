"""The aiohttp application: trigger webhook, read API, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_async.aio.web import server_stats

from supervisor import exclusions, metrics
from supervisor.apiauth import Role, Scope, authorize, host_middleware, install
from supervisor.apistate import (
    API,
    ApiError,
    ApiState,
    error_middleware,
    error_response,
    json_body,
    json_response,
)
from supervisor.budget_api import add_budget_routes
from supervisor.errors import IllegalTransition
from supervisor.model import Operation, Run
from supervisor.openapi import PRINTABLE, TICK_KEY, document_for
from supervisor.push import PushRejected, answer_body, parse_delivery, verify
from supervisor.readcaps import RETRY_AFTER_S, CapReached, holder_of
from supervisor.reconcile import RESOLUTIONS
from supervisor.runs import Tick
from supervisor.sources import check_recipient_id
from supervisor.states import SETTLED, OpState, RunState
from supervisor.status import add_status_routes
from supervisor.tickrules import check_schedule, parse_slot

log = logging.getLogger(__name__)

MAX_PAGE = 1000
# A page cursor is an operation ID: what next_after gave, nothing that needs escaping.
CURSOR = re.compile(r"[A-Za-z0-9_-]{0,200}")
MAX_WAIT_S = 60.0
MAX_INLINE_IDS = 10_000


def _authorize(request: web.Request, read_only: bool = False) -> Role:
    """``authorize`` for the API's own routes: read-only ones need :attr:`Scope.READ`
    (the viewer's token, or the operator's), the others :attr:`Scope.OPERATE`."""
    return authorize(request, Scope.READ if read_only else Scope.OPERATE)


def run_view(run: Run, counts: Mapping[OpState, int] | None = None,
             rate: float | None = None,
             projected_finish: Callable[[int, float], float] | None = None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": run.id, "state": run.state.value, "tick_key": run.tick_key,
        "schedule": run.schedule, "scheduled_for": run.scheduled_for,
        "source": run.source.get("kind"), "discovered": run.discovered,
        "scan": {"pages": run.scan_pages, "cursor": run.scan_cursor,
                 "skipped_candidates": run.skipped_candidates,
                 "failures": run.scan_failures, "last_error": run.last_error},
        "created_at": run.created_at, "scan_finished_at": run.scan_finished_at,
        "finished_at": run.finished_at,
    }
    if counts is not None:
        view["counts"] = {s.value: counts.get(s, 0) for s in OpState}
        unfinished = sum(n for s, n in counts.items() if s not in SETTLED)
        view["unfinished"] = unfinished
        if run.state is not RunState.DONE and unfinished:
            if projected_finish is not None:
                view["projected_finish"] = projected_finish(unfinished, time.time())
            elif rate:
                view["projected_finish"] = time.time() + unfinished / rate
    return view


def op_view(op: Operation) -> dict[str, Any]:
    return {"id": op.id, "run_id": op.run_id, "recipient_id": op.recipient_id,
            "state": op.state.value, "attempts": op.attempts, "reason": op.reason,
            "created_at": op.created_at, "updated_at": op.updated_at}


async def _tick_from(request: web.Request) -> Tick:
    config = request.app[API].config
    doc = await json_body(request)
    unknown = set(doc) - {"schedule", "scheduled_for", "recipient_ids"}
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
    schedule = doc.get("schedule", config.schedule.name)
    if (problem := check_schedule(schedule)) is not None:
        raise ApiError(400, problem)
    try:
        slot = parse_slot(doc["scheduled_for"]) if "scheduled_for" in doc else None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    ids = doc.get("recipient_ids")
    if ids is not None and config.source.kind != "inline":
        # The run reads its candidates from the configured source: a caller must not
        # add recipients of its choosing to a deletion run.
        raise ApiError(400, f"recipient_ids is refused: source.kind is "
                            f"{config.source.kind!r}, so the run reads its candidates there")
    if ids is not None:
        if not isinstance(ids, list):
            raise ApiError(400, "recipient_ids must be a list of strings")
        if len(ids) > MAX_INLINE_IDS:
            raise ApiError(400, f"recipient_ids holds more than {MAX_INLINE_IDS} IDs; "
                                "use a file or http source")
        for i, rid in enumerate(ids):
            if (reason := check_recipient_id(rid)) is not None:
                raise ApiError(400, f"recipient_ids[{i}] is not a valid ID ({reason})")
    elif config.source.kind == "inline":
        raise ApiError(400, "recipient_ids is required: source.kind is 'inline'")
    key = request.headers.get("Idempotency-Key")
    if key is not None and not re.fullmatch(TICK_KEY, key):
        raise ApiError(400, "Idempotency-Key must be 1 to 200 visible ASCII characters")
    return Tick(schedule=schedule, slot=slot, key=key, recipient_ids=ids)


async def post_run(request: web.Request) -> web.Response:
    role = authorize(request, Scope.TICK)
    api = request.app[API]
    if not api.accepting:
        raise ApiError(503, "shutting down; not accepting triggers")
    if not api.ledger.healthy:
        raise ApiError(503, "ledger cannot commit; not accepting triggers")
    tick = await _tick_from(request)
    if role is Role.TICK:
        # A cron caller's token (stored at Infrai) opens the configured schedule's run of
        # the configured source, and nothing a caller chooses.
        if tick.recipient_ids is not None:
            raise ApiError(403, "recipient_ids: the tick token may not name recipients; "
                                "the operator token may")
        if tick.schedule != api.config.schedule.name:
            raise ApiError(403, f"schedule: the tick token opens runs of schedule "
                                f"{api.config.schedule.name!r} only")
    result = await api.opener.open(tick)
    if result.run is None:
        assert result.skipped_for is not None
        return error_response(409, "a run is unfinished; tick skipped (schedule.overlap = 'skip')",
                      active_run=result.skipped_for.id)
    run = result.run
    # Kept small: a cron provider may store only the first few KB of the answer.
    return json_response({"created": result.created, "run": {"id": run.id, "state": run.state.value,
                                                      "tick_key": run.tick_key}},
                 201 if result.created else 200)


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"{name} must be between {lo} and {hi}")
    return value


async def list_runs(request: web.Request) -> web.Response:
    _authorize(request, read_only=True)
    api = request.app[API]
    limit = _int_param(request, "limit", 20, 1, 200)
    runs = await api.ledger.list_runs(limit, request.query.get("before"))
    return json_response({"runs": [run_view(r) for r in runs]})


def _done(run: Run) -> bool:
    return run.state is RunState.DONE


def _busy(exc: CapReached) -> web.Response:
    """A read refused at its cap: 429, and when to ask again."""
    response = error_response(429, str(exc))
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _holder(request: web.Request) -> str:
    return holder_of(request.headers.get("Authorization", ""))


async def get_run(request: web.Request) -> web.Response:
    _authorize(request, read_only=True)
    api = request.app[API]
    run_id = request.match_info["run_id"]
    wait = request.query.get("wait")
    if wait not in (None, "done"):
        raise ApiError(400, "wait must be 'done'")
    timeout = float(_int_param(request, "timeout", 30, 0, int(MAX_WAIT_S)))
    # The run and its counts as one read: read apart, a run closed just before a probe
    # queued an operation again answered "done" with that operation queued.
    found = await api.ledger.run_with_counts(run_id)
    if found is None:
        raise ApiError(404, f"no run {run_id}")
    counts: Mapping[OpState, int]  # a monitor's read below is a Mapping
    run, counts = found
    if wait == "done" and not _done(run) and api.accepting:
        looked = False
        # Long-poll: answered from the monitor's own read of the run (one per pass for
        # every waiter on it), woken whenever it has read, and by the start of a drain:
        # a waiting client must not hold the process past its grace period (it gets a
        # 503 with the run as it stands, below).
        try:
            with api.long_polls.hold(_holder(request)), api.runs_changed.watch(run_id):
                deadline = time.monotonic() + timeout
                while True:
                    changed = api.runs_changed.event()  # before looking: a later read sets it
                    if (seen := api.runs_changed.seen(run_id)) is not None:
                        run, counts, looked = seen.run, seen.counts, True
                    remaining = deadline - time.monotonic()
                    if _done(run) or not api.accepting or remaining <= 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await changed.wait()
        except CapReached as exc:
            return _busy(exc)
        if not looked and (found := await api.ledger.run_with_counts(run_id)) is not None:
            run, counts = found  # answered before the monitor's first read of it
    view = run_view(run, counts, api.current_rate(), api.projected_finish)
    if wait == "done" and not _done(run) and not api.accepting:
        # A wait this process can no longer honour: said so, with when to ask again (of
        # another replica, or of the next life), so a looping client does not spin.
        response = error_response(503, "shutting down; ask again", run=view)
        response.headers["Retry-After"] = "5"
        return response
    return json_response(view)


async def list_operations(request: web.Request) -> web.Response:
    _authorize(request, read_only=True)
    api = request.app[API]
    run_id = request.match_info["run_id"]
    if await api.ledger.get_run(run_id) is None:
        raise ApiError(404, f"no run {run_id}")
    state = _state_param(request)
    limit = _int_param(request, "limit", 100, 1, MAX_PAGE)
    after = _cursor_param(request)
    rows = await api.ledger.list_operations(run_id, state, after, limit)
    next_after = rows[-1].id if len(rows) == limit else None
    return json_response({"operations": [op_view(op) for op in rows], "next_after": next_after})


async def get_operation(request: web.Request) -> web.Response:
    _authorize(request, read_only=True)
    api = request.app[API]
    op_id = request.match_info["operation_id"]
    op = await api.ledger.get_operation(op_id)
    if op is None:
        raise ApiError(404, f"no operation {op_id}")
    # Paged: an operation probed for weeks has hundreds of rows (issue 17, L3).
    limit = _int_param(request, "attempts_limit", 100, 1, MAX_PAGE)
    after = _int_param(request, "attempts_after", 0, 0, 2**31 - 1)
    attempts = await api.ledger.attempts(op_id, after, limit + 1)
    view = op_view(op)
    view["attempts_log"] = [
        {"n": a.n, "kind": a.kind, "started_at": a.started_at, "finished_at": a.finished_at,
         "status": a.status, "outcome": a.outcome, "detail": a.detail}
        for a in attempts[:limit]]
    view["attempts_next"] = str(after + limit) if len(attempts) > limit else None
    return json_response(view)


def _state_param(request: web.Request) -> OpState | None:
    value = request.query.get("state")
    if value is None:
        return None
    try:
        return OpState(value)
    except ValueError:
        raise ApiError(400, f"state must be one of {', '.join(s.value for s in OpState)}"
                       ) from None


async def list_all_operations(request: web.Request) -> web.Response:
    """Operations in one state across every run (e.g. ``?state=ambiguous``)."""
    _authorize(request, read_only=True)
    state = _state_param(request)
    if state is None:
        raise ApiError(400, "state is required")
    limit = _int_param(request, "limit", 100, 1, MAX_PAGE)
    after = _cursor_param(request)
    rows = await request.app[API].ledger.operations_in_state(state, after, limit)
    next_after = rows[-1].id if len(rows) == limit else None
    return json_response({"operations": [op_view(op) for op in rows], "next_after": next_after})


def _cursor_param(request: web.Request) -> str | None:
    """``after``: the ``next_after`` of the previous page (an operation ID)."""
    value = request.query.get("after")
    if value is None or value == "":
        return None
    if not CURSOR.fullmatch(value):
        raise ApiError(400, "after must be the next_after of the previous page")
    return value


async def resolve_operation(request: web.Request) -> web.Response:
    """An operator's decision on an ambiguous operation, with who decided and why."""
    authorize(request, Scope.OPERATE)
    api = request.app[API]
    doc = await json_body(request)
    unknown = set(doc) - {"outcome", "by", "reason"}
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
    outcome, by, why = doc.get("outcome"), doc.get("by"), doc.get("reason")
    if not isinstance(outcome, str) or outcome not in RESOLUTIONS:
        raise ApiError(400, f"outcome must be one of {', '.join(RESOLUTIONS)}")
    for name, value in (("by", by), ("reason", why)):
        if not isinstance(value, str) or not 0 < len(value) <= 500 or \
                not re.fullmatch(PRINTABLE, value):
            raise ApiError(400, f"{name} must be a non-empty printable string")
    if not (isinstance(outcome, str) and isinstance(by, str) and isinstance(why, str)):
        raise AssertionError("validated above")
    op_id = request.match_info["operation_id"]
    op = await api.ledger.get_operation(op_id)
    if op is None:
        raise ApiError(404, f"no operation {op_id}")
    if op.state is not OpState.AMBIGUOUS:
        raise ApiError(409, f"operation {op_id} is {op.state.value}, not ambiguous")
    try:
        target = await api.reconciler.resolve(op, outcome, by, why)
    except IllegalTransition:
        raise ApiError(409, f"operation {op_id} changed meanwhile; read it again") from None
    return json_response({"id": op_id, "state": target.value})


async def get_exclusions(request: web.Request) -> web.StreamResponse:
    """The digest rule: every recipient of a schedule's current runs, with its reason.
    Paged as JSON (``limit``, ``after``), or every one streamed as JSON lines
    (``format=jsonl`` or ``Accept: application/x-ndjson``)."""
    _authorize(request, read_only=True)
    api = request.app[API]
    schedule = request.query.get("schedule", api.config.schedule.name)
    if (problem := check_schedule(schedule)) is not None:
        raise ApiError(400, problem)
    fmt = request.query.get("format")
    if fmt not in (None, "json", "jsonl"):
        raise ApiError(400, "format must be 'json' or 'jsonl'")
    accept = {part.split(";")[0].strip() for part in request.headers.get("Accept", "").split(",")}
    jsonl = fmt == "jsonl" or (fmt is None and exclusions.JSONL in accept)
    limit = _int_param(request, "limit", 1000, 1, MAX_PAGE)
    after_id = _cursor_param(request)
    try:
        with api.exclusion_reads.hold(_holder(request)):
            return await _exclusions(request, schedule, jsonl, limit, after_id)
    except CapReached as exc:
        return _busy(exc)


async def _exclusions(request: web.Request, schedule: str, jsonl: bool, limit: int,
                      after_id: str | None) -> web.StreamResponse:
    api = request.app[API]
    runs = await exclusions.current_runs(api.ledger, schedule)
    if not runs:
        raise ApiError(404, f"no run of schedule {schedule!r}")
    cutoff = api.config.schedule.digest_cutoff_seconds
    after = None
    if after_id is not None:
        after = await api.ledger.get_operation(after_id)
        if after is None or after.run_id not in {r.id for r in runs}:
            # A new run opened (or an older one finished) since the first page: the
            # cursor would mix two lists.
            raise ApiError(409, "the schedule's current runs changed since the first page; "
                                "start again without after")
    if jsonl:  # ``after``: resume a stream that was cut, after its last line
        return await exclusions.stream(request, api.ledger, runs, cutoff, after,
                                       api.exclusion_pages)
    rows, next_after = await exclusions.page(api.ledger, runs, after, limit,
                                             api.exclusion_pages)
    return json_response({"schedule": schedule,
                  "runs": [exclusions.run_header(run, cutoff) for run in runs],
                  "exclusions": [exclusions.record(op) for op in rows],
                  "next_after": next_after})


async def post_push(request: web.Request) -> web.Response:
    """One Infrai push delivery. The signature is the authentication: nothing is read
    from a body it does not cover, and nothing is written for a rejected delivery."""
    api = request.app[API]
    receiver = api.push
    if receiver is None:
        raise ApiError(404, "push delivery is not configured here")
    body = await request.read()  # past service.max_body_bytes: 413 from the middleware
    try:
        proof = verify(receiver.settings, request.headers, body, time.time())
        handler = receiver.handlers.get(request.match_info["queue"])
        if handler is None:
            raise PushRejected(404, f"no push subscription for queue "
                                    f"{request.match_info['queue']!r} here", "unknown_queue")
        delivery = parse_delivery(body)
    except PushRejected as exc:
        metrics.PUSH_DELIVERIES.labels(exc.result).inc()
        raise ApiError(exc.status, exc.message) from None
    if not api.accepting or not api.ledger.healthy:
        metrics.PUSH_DELIVERIES.labels("unavailable").inc()
        why = "shutting down" if not api.accepting else "ledger cannot commit"
        response = error_response(503, f"{why}; deliver again later")
        response.headers["Retry-After"] = "5"
        return response
    outcome = await receiver.deliver(handler, delivery, proof, time.time())
    metrics.PUSH_DELIVERIES.labels(outcome.result).inc()
    response = json_response(answer_body(outcome, delivery), outcome.status)
    if outcome.retry_after is not None:
        response.headers["Retry-After"] = outcome.retry_after
    return response


async def healthz(request: web.Request) -> web.Response:
    return json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    ok, checks = request.app[API].ready()
    return json_response({"ready": ok, "checks": checks}, 200 if ok else 503)


async def metrics_handler(request: web.Request) -> web.StreamResponse:
    if request.app[API].config.service.metrics_token is not None:
        authorize(request, Scope.METRICS)
    response: web.StreamResponse = await server_stats(request)
    return response


async def openapi(request: web.Request) -> web.Response:
    return json_response(document_for(request.app[API].config.source.kind))


def create_app(state: ApiState) -> web.Application:
    # error_middleware first: it answers what the Host check refuses.
    app = web.Application(middlewares=[error_middleware, host_middleware],
                          client_max_size=state.config.service.max_body_bytes)
    app[API] = state
    install(app, state.config)
    app.router.add_post("/v1/runs", post_run)
    app.router.add_get("/v1/runs", list_runs)
    app.router.add_get("/v1/runs/{run_id}", get_run)
    app.router.add_get("/v1/runs/{run_id}/operations", list_operations)
    app.router.add_get("/v1/operations", list_all_operations)
    app.router.add_get("/v1/operations/{operation_id}", get_operation)
    app.router.add_post("/v1/operations/{operation_id}/resolve", resolve_operation)
    app.router.add_get("/v1/exclusions", get_exclusions)
    app.router.add_post("/v1/push/{queue}", post_push)
    add_budget_routes(app)  # GET /v1/budget, POST /v1/budget/resume
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi)
    add_status_routes(app, state)  # the HTML status page at / (supervisor/status)
    return app
