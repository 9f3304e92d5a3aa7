"""Batch endpoints of the simulated partner: the three answer shapes of docs/batch.md.

* ``per_item``: ``POST /recipients/batch-delete`` answers 200 ``{"results": [{"id",
  "status"}]}`` in request order (Salesforce Collections, Graph ``$batch``).
* ``accepted``: ``POST /recipients/batch-archive`` answers 204 whatever each id's state
  (HubSpot), and may silently leave some ids in place.
* ``job``: ``POST /recipients/batch-jobs`` answers 202 ``{"job_id"}``; the job is read at
  ``GET /recipients/batch-jobs/{job_id}`` and found by our batch ID at
  ``GET /recipients/batch-jobs?tag=B`` (Mailchimp, Zendesk, Segment).

``POST /recipients/batch-delete``, the contract's default ``batch.path``, plays whichever
shape is configured, so a service on the defaults reaches every shape; the other two paths
answer only their own shape, and every path answers 404 while batches are off.

Each submission path takes ``POST``, ``DELETE`` or ``PUT``, and its ids in a JSON body
(``{"ids": [...]}``), as a comma list in the query (``?ids=a,b``: SendGrid, Salesforce
Collections) or comma-joined in the path (``/recipients/batch-delete/a,b``), as the
service's ``batch.ids_in`` sends them. A result's verdict is an HTTP status, or with
``batch_verdict = "success"`` Salesforce's ``{"success", "errors": [{"statusCode"}]}``.

A job runs on the state's clock: item i of n is executed once ``(i + 1) / n`` of
``batch_job_seconds`` has passed, so a job is ``pending`` until its first item,
``running`` until its last, then terminal. Nothing ticks by itself: a middleware advances
the jobs before every request, so a status read, a probe and ``/_sandbox/log`` all see
the same progress. A test reading the state in-process calls :meth:`BatchPartner.advance`.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from dataclasses import dataclass
from urllib.parse import unquote, unquote_plus

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from cleanup_sandbox.app import (
    JSON,
    MAX_IDEMPOTENCY_KEY_LENGTH,
    STATE_KEY,
    ClientError,
    _hang,
    _require_auth,
    _reset_connection,
    _response_from,
    _too_many_requests,
    _with_quota,
    error_response,
    json_response,
)
from cleanup_sandbox.config import BatchShape, SandboxConfig
from cleanup_sandbox.state import AfterActFault, Claim, SandboxState, StoredResponse

BATCH_PATH = "/recipients/batch-delete"
ARCHIVE_PATH = "/recipients/batch-archive"
JOBS_PATH = "/recipients/batch-jobs"

# Float noise must not hold back an item due exactly now.
_EPSILON = 1e-9
# Salesforce's StatusCode for each status an item is answered with here: the record is
# already gone, the org's request limit, an id the partner refuses for good.
SALESFORCE_CODES = {404: "ENTITY_IS_DELETED", 429: "REQUEST_LIMIT_EXCEEDED",
                    422: "INVALID_ID_FIELD"}


@dataclass(frozen=True, slots=True)
class BatchBody:
    ids: tuple[str, ...]
    tag: str | None


class ItemDraws:
    """Which items a batch throttles, fails or silently misses; seeded by the config.

    A failure is decided per id, so a resend fails again, as a bad record would. A
    throttle or a silent miss is drawn per occurrence from its own stream, so the resend
    the contract prescribes for them can succeed.
    """

    def __init__(self, config: SandboxConfig) -> None:
        self._config = config
        self._throttle = random.Random(f"{config.seed}:batch-throttle")
        self._miss = random.Random(f"{config.seed}:batch-miss")

    def fails(self, recipient_id: str) -> bool:
        share = self._config.batch_item_error_share
        return share > 0 and (
            random.Random(f"{self._config.seed}:batch-error:{recipient_id}").random() < share
        )

    def throttled(self) -> bool:
        share = self._config.batch_item_throttle_share
        # Only draw when armed, so a run without throttling leaves the stream untouched.
        return share > 0 and self._throttle.random() < share

    def missed(self) -> bool:
        share = self._config.batch_silent_miss_share
        return share > 0 and self._miss.random() < share


@dataclass(slots=True)
class Job:
    job_id: str
    tag: str | None
    idempotency_key: str | None
    ids: tuple[str, ...]
    # One per occurrence: 404 for a repeated id and 422 for a failing one are known at
    # submission; the others are filled in (200 or 404) when the item is executed.
    statuses: list[int | None]
    submitted: float
    ends: float
    done: int = 0
    finished: bool = False

    @property
    def status(self) -> str:
        if not self.finished:
            return "pending" if self.done == 0 else "running"
        failed = sum(1 for status in self.statuses if status == 422)
        if failed == 0:
            return "finished"
        return "failed" if failed == len(self.statuses) else "partial_success"


class BatchPartner:
    """The batch side of one simulated partner: per-item draws and the job store."""

    def __init__(self, state: SandboxState) -> None:
        self.state = state
        self.config = state.config
        self.draws = ItemDraws(state.config)
        pattern = state.config.batch_bad_id_pattern
        self._bad_id = re.compile(pattern) if pattern else None
        self._jobs: dict[str, Job] = {}
        self._submitted = 0

    # -- whole-batch refusals ------------------------------------------------------

    def refusal(self, ids: tuple[str, ...]) -> web.Response | None:
        """The 400 refusing the whole batch for one id (nothing is done), or None."""
        if self._bad_id is not None:
            for rid in ids:
                if self._bad_id.search(rid):
                    self.state.counters.batch_refused_bad_id += 1
                    return json_response(
                        {"error": "invalid_id", "id": rid, "message": "one id fails the batch"},
                        400,
                    )
        if self.config.batch_duplicates == "error":
            seen: set[str] = set()
            for rid in ids:
                if rid in seen:
                    return json_response(
                        {"error": "duplicate_id", "id": rid,
                         "message": "an id appears twice in the batch"},
                        400,
                    )
                seen.add(rid)
        return None

    # -- acting --------------------------------------------------------------------

    def delete_each(self, ids: tuple[str, ...], key: str | None, fault: AfterActFault | None,
                    statuses: dict[str, int]) -> list[dict[str, object]]:
        """per_item: one result per occurrence, in request order; a repeat answers 404."""
        counters = self.state.counters
        results: list[dict[str, object]] = []
        for rid in ids:
            if rid in statuses:
                counters.batch_duplicate_ids += 1
                status = 404
            else:
                if self.draws.fails(rid):
                    counters.batch_item_errors += 1
                    status = 422
                elif self.draws.throttled():
                    counters.batch_item_throttled += 1
                    status = 429
                else:
                    status = self._execute(rid, key, fault)
                statuses[rid] = status
            results.append(self.result(rid, status))
        return results

    def result(self, recipient_id: str, status: int) -> dict[str, object]:
        """One item's result in the configured verdict format."""
        config = self.config
        done = 200 <= status < 300
        shown = recipient_id if done or config.batch_result_ids == "always" else None
        if config.batch_verdict == "status":
            return {"id": shown, "status": status}
        errors = [] if done else [{"statusCode": SALESFORCE_CODES[status],
                                   "message": f"item answered as HTTP {status}", "fields": []}]
        return {"id": shown, "success": done, "errors": errors}

    def archive(self, ids: tuple[str, ...], key: str | None, fault: AfterActFault | None) -> None:
        """accepted: every distinct id acted on, except the silent misses."""
        distinct = dict.fromkeys(ids)
        self.state.counters.batch_duplicate_ids += len(ids) - len(distinct)
        for rid in distinct:
            if self.state.is_present(rid) and self.draws.missed():
                self.state.counters.batch_silent_misses += 1
                continue
            self._execute(rid, key, fault)

    def _execute(self, recipient_id: str, key: str | None, fault: AfterActFault | None) -> int:
        execution = self.state.execute(recipient_id, key, fault)
        return 200 if execution.result == "deleted" else 404

    # -- jobs ----------------------------------------------------------------------

    def submit(self, ids: tuple[str, ...], tag: str | None, key: str | None, now: float) -> Job:
        statuses: list[int | None] = []
        seen: set[str] = set()
        for rid in ids:
            if rid in seen:
                self.state.counters.batch_duplicate_ids += 1
                statuses.append(404)
            elif self.draws.fails(rid):
                self.state.counters.batch_item_errors += 1
                statuses.append(422)
            else:
                statuses.append(None)
            seen.add(rid)
        self._submitted += 1
        job = Job(f"job-{self._submitted:06d}", tag, key, ids, statuses, now,
                  now + self.config.batch_job_seconds)
        self._jobs[job.job_id] = job
        self.state.counters.batch_jobs_submitted += 1
        return job

    def advance(self, now: float) -> None:
        """Execute every job item due by ``now``; forget jobs whose results expired."""
        ttl = self.config.batch_job_result_ttl_seconds
        for job in list(self._jobs.values()):
            if not job.finished:
                self._run(job, now)
            if job.finished and now >= job.ends + ttl:
                del self._jobs[job.job_id]
                self.state.counters.batch_jobs_expired += 1

    def _run(self, job: Job, now: float) -> None:
        n = len(job.ids)
        if now >= job.ends:
            due = n
        else:
            # now < ends implies a duration > 0.
            elapsed = max(0.0, now - job.submitted)
            due = min(n, math.floor(n * elapsed / (job.ends - job.submitted) + _EPSILON))
        while job.done < due:
            if job.statuses[job.done] is None:
                job.statuses[job.done] = self._execute(
                    job.ids[job.done], job.idempotency_key, None)
            job.done += 1
        if job.done == n:
            job.finished = True
            self.state.counters.batch_jobs_finished += 1

    def unfinished(self) -> list[Job]:
        return [job for job in self._jobs.values() if not job.finished]

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def tagged(self, tag: str) -> list[Job]:
        return [job for job in self._jobs.values() if job.tag == tag]

    def view(self, job: Job, now: float) -> dict[str, object]:
        expires_in = job.ends + self.config.batch_job_result_ttl_seconds - now
        view: dict[str, object] = {
            "job_id": job.job_id,
            "tag": job.tag,
            "status": job.status,
            "progress": job.done / len(job.ids),
            # Unix seconds, rounded down: a poller trusting it is never a moment late.
            "expires_at": math.floor(time.time() + expires_in),
        }
        if job.finished:
            # Every status is known once the job has finished.
            view["results"] = [
                self.result(rid, status)
                for rid, status in zip(job.ids, job.statuses, strict=True) if status is not None
            ]
        return view


BATCH_KEY = web.AppKey("sandbox_batch", BatchPartner)


# -- request handling --------------------------------------------------------------


def _enabled(state: SandboxState, shape: BatchShape | None) -> BatchShape:
    """The configured shape, if it is the one this path plays; else a 404, as a partner
    without the endpoint answers."""
    configured = state.config.batch_shape
    if not configured or (shape is not None and shape != configured):
        wanted = f"the {shape} batch endpoint" if shape else "batch endpoints"
        raise ClientError(404, "not_found", f"this partner has no {wanted}")
    return configured


def _authorise(request: web.Request, state: SandboxState) -> None:
    try:
        _require_auth(request)
    except ClientError:
        state.note_unauthorized()
        raise


def _ids_in_url(request: web.Request) -> tuple[str, ...] | None:
    """The ids comma-joined in the path (a route's ``{ids}``) or in the query's ``ids``;
    None when the URL carries none. Split before decoding: an id may hold ``%2C``."""
    if "ids" in request.match_info:
        listed = [request.raw_path.partition("?")[0].rpartition("/")[2]]
        ids = tuple(unquote(rid) for rid in listed[0].split(","))
    else:
        # A query decodes "+" as a space too (form encoding); a path keeps it.
        pairs = (part.partition("=") for part in request.rel_url.raw_query_string.split("&"))
        listed = [value for name, _, value in pairs if unquote_plus(name) == "ids"]
        if not listed:
            return None
        ids = tuple(unquote_plus(rid) for value in listed for rid in value.split(","))
    if not all(ids):
        raise ClientError(400, "invalid_ids", "ids must be a comma list of non-empty ids")
    return ids


async def _read_body(request: web.Request) -> BatchBody:
    in_url = _ids_in_url(request)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ClientError(
            400, "body_too_large", f"body must be under {request.client_max_size} bytes"
        ) from None
    if in_url is not None and not raw.strip():
        return BatchBody(in_url, None)
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ClientError(400, "invalid_json", 'body must be JSON: {"ids": [...]}') from None
    if not isinstance(payload, dict):
        raise ClientError(400, "invalid_json", 'body must be a JSON object: {"ids": [...]}')
    ids = payload.get("ids")
    if in_url is not None:
        if ids is not None:
            raise ClientError(400, "invalid_ids", "ids were sent both in the URL and the body")
        ids = list(in_url)
    if not isinstance(ids, list) or not ids or not all(isinstance(rid, str) for rid in ids):
        raise ClientError(400, "invalid_ids", "ids must be a non-empty list of strings")
    tag = payload.get("tag")
    if tag is not None and not isinstance(tag, str):
        raise ClientError(400, "invalid_tag", "tag must be a string")
    return BatchBody(tuple(ids), tag)


def _claim(state: SandboxState, key: str, ids: tuple[str, ...]) -> web.Response | None:
    """None when this request may act under ``key``; else the answer (a replay or a refusal)."""
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        return error_response(400, "invalid_idempotency_key",
                              f"Idempotency-Key must be 1..{MAX_IDEMPOTENCY_KEY_LENGTH} characters")
    # The whole id list is the target: the same key with other ids (or another order) is
    # another request, and a single DELETE's key can never match a batch's.
    claim, stored = state.idempotency.begin(key, "batch:" + orjson.dumps(ids).decode())
    if claim is Claim.REPLAY and stored is not None:
        state.note_replay()
        return _response_from(stored, replayed=True)
    if claim is Claim.IN_PROGRESS:
        state.note_conflict()
        return error_response(409, "idempotency_key_in_use", "a request with this key is in progress")
    if claim is Claim.MISMATCH:
        state.note_key_mismatch()
        return error_response(422, "idempotency_key_reused",
                              "this Idempotency-Key was first used for other ids")
    return None


async def _submit(request: web.Request, path_shape: BatchShape | None) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    shape = _enabled(state, path_shape)
    state.counters.batch_requests += 1
    state.wake_waiters()  # a test long-polls the batch requests that arrived
    _authorise(request, state)
    body = await _read_body(request)
    state.counters.batch_items += len(body.ids)
    if len(body.ids) > state.config.batch_max_items:
        # Before the limiter: a batch charged per id could cost more than it ever holds.
        state.counters.batch_refused_too_large += 1
        return _with_quota(state, json_response(
            {"error": "too_many_items", "max_items": state.config.batch_max_items,
             "message": f"at most {state.config.batch_max_items} ids per batch"}, 413))
    raw_key = request.headers.get("Idempotency-Key")
    # Each id's batch is a request in the air for it, as a DELETE would be.
    entries = [state.open_request(rid, raw_key) for rid in dict.fromkeys(body.ids)]
    statuses: dict[str, int] = {}
    status: int | None = None
    try:
        response = await _answer(request, state, shape, body, raw_key, statuses)
        status = response.status
        return response
    finally:
        for entry in entries:
            state.close_request(entry, statuses.get(entry.recipient_id, status))


async def _answer(request: web.Request, state: SandboxState, shape: BatchShape,
                  body: BatchBody, raw_key: str | None,
                  statuses: dict[str, int]) -> web.StreamResponse:
    partner = request.app[BATCH_KEY]
    config = state.config
    now = state.clock()
    cost = len(body.ids) if config.batch_cost == "item" else 1
    # The item limit counts what is acted on: a repeated id is acted on once.
    items = len(dict.fromkeys(body.ids))
    # A 429 would be answered forever: a smaller batch is the only way through.
    if not state.holds(now, cost):
        return _with_quota(state, json_response(
            {"error": "batch_over_rate_limit", "cost": cost,
             "message": "the batch costs more than the rate limit ever allows at once"}, 413))
    if not state.holds_items(now, items):
        return _with_quota(state, json_response(
            {"error": "batch_over_item_limit", "items": items,
             "message": "the batch holds more ids than the item limit ever allows at once"},
            413))
    refusal = state.admit(now, cost, items)
    if refusal is not None:
        return _too_many_requests(state, now, refusal.retry_after, refusal.reason)
    refused = partner.refusal(body.ids)
    if refused is not None:
        return _with_quota(state, refused)

    key = raw_key if config.honour_idempotency_keys else None
    if key is not None:
        answer = _claim(state, key, body.ids)
        if answer is not None:
            return _with_quota(state, answer)

    completed = False
    state.begin_delete()
    try:
        latency = state.tunables.latency_ms + (
            config.latency_per_inflight_ms * (state.in_flight - 1))
        if latency > 0:
            await asyncio.sleep(latency / 1000.0)
        now = state.clock()
        if shape == "job":
            partner.advance(now)
            busy = partner.unfinished()
            if len(busy) >= config.batch_max_jobs:
                state.counters.batch_jobs_refused += 1
                wait = max(_EPSILON, min(job.ends for job in busy) - now)
                return _too_many_requests(state, now, wait, "too_many_jobs")
        plan = state.plan_faults()
        if plan.fail_before:
            return _with_quota(
                state, error_response(503, "unavailable", "injected fault: try again later"))

        if shape == "per_item":
            results = partner.delete_each(body.ids, raw_key, plan.after_act, statuses)
            stored = StoredResponse(200, orjson.dumps({"results": results}), JSON)
        elif shape == "accepted":
            partner.archive(body.ids, raw_key, plan.after_act)
            stored = StoredResponse(204, b"", None)
        else:
            job = partner.submit(body.ids, body.tag, raw_key, now)
            stored = StoredResponse(202, orjson.dumps({"job_id": job.job_id}), JSON)
        if key is not None:
            # Stored before any after-act fault, so a resend during the hang replays.
            state.idempotency.complete(key, stored)
            completed = True
        response = _with_quota(state, _response_from(stored, replayed=False))

        if plan.after_act == "timeout":
            await _hang(request.app, state.tunables.hang_seconds)
        elif plan.after_act == "reset":
            _reset_connection(request)
        return response
    finally:
        state.end_delete()
        if key is not None and not completed:
            state.idempotency.release(key)


async def batch_delete(request: web.Request) -> web.StreamResponse:
    return await _submit(request, None)


async def batch_archive(request: web.Request) -> web.StreamResponse:
    return await _submit(request, "accepted")


async def submit_job(request: web.Request) -> web.StreamResponse:
    return await _submit(request, "job")


def _admitted(state: SandboxState) -> web.Response | None:
    """A job read costs one request of the limiter: the 429 when it is refused."""
    now = state.clock()
    refusal = state.admit(now)
    if refusal is None:
        return None
    return _too_many_requests(state, now, refusal.retry_after, refusal.reason)


async def job_status(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    _enabled(state, "job")
    _authorise(request, state)
    refused = _admitted(state)
    if refused is not None:
        return refused
    job = request.app[BATCH_KEY].get(request.match_info["job_id"])
    if job is None:
        return _with_quota(state, error_response(
            404, "not_found", "no such job, or its results have expired"))
    return _with_quota(state, json_response(request.app[BATCH_KEY].view(job, state.clock())))


async def job_lookup(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    _enabled(state, "job")
    _authorise(request, state)
    tag = request.query.get("tag")
    if tag is None:
        raise ClientError(400, "invalid_parameter", "tag is required")
    refused = _admitted(state)
    if refused is not None:
        return refused
    jobs = [{"job_id": job.job_id, "tag": job.tag, "status": job.status}
            for job in request.app[BATCH_KEY].tagged(tag)]
    return _with_quota(state, json_response({"jobs": jobs}))


@web.middleware
async def advance_jobs(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bring every job up to the state's clock before any request reads or changes it."""
    request.app[BATCH_KEY].advance(request.app[STATE_KEY].clock())
    return await handler(request)


def add_batch_routes(app: web.Application) -> None:
    """Register the batch endpoints; call before ``/recipients/{recipient_id}`` routes
    (a ``DELETE /recipients/batch-delete?ids=...`` is a batch, not a recipient)."""
    state = app[STATE_KEY]
    app[BATCH_KEY] = BatchPartner(state)
    for path, handler in ((BATCH_PATH, batch_delete), (ARCHIVE_PATH, batch_archive),
                          (JOBS_PATH, submit_job)):
        for route in (path, path + "/{ids}"):
            for method in ("POST", "DELETE", "PUT"):
                app.router.add_route(method, route, handler)
    app.router.add_get(JOBS_PATH, job_lookup, allow_head=False)
    app.router.add_get(JOBS_PATH + "/{job_id}", job_status, allow_head=False)
    if state.config.batch_shape == "job":
        app.middlewares.append(advance_jobs)
