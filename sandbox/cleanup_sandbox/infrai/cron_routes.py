"""The cron/scheduling routes of the Infrai emulator and the scheduler that makes the POSTs.

The routes plug into app.py's /v1 dispatcher (``Runtime.routes``), so cron calls are
authenticated, faulted, logged and replayed by idempotency key exactly like queue calls. The
scheduler is a background task of the app: every cron_poll_seconds of real time, and right after
the emulator's clock is advanced, it runs ``CronModel.step`` and POSTs each due attempt.

Routes (reference 4.1-4.3; capability ids as the docs name them):
  POST /v1/cron/create, /v1/scheduling/cron/create, /v1/scheduling/cron   cron.create /
       scheduling.cron.create (the two families have their own idempotency keys, as two
       capabilities)
  GET  /v1/cron/list, /v1/scheduling/cron/list, /v1/scheduling/cron       cron.list / scheduling.cron.list
  POST /v1/cron/pause/{id}, POST /v1/cron/trigger/{id}                    cron.pause, cron.trigger
  DELETE (or POST) /v1/cron/delete/{id}                                   cron.delete
  GET  /v1/cron/runs/list/{id}                                            cron.runs.list
  cron_resume_route (default POST /v1/cron/resume/{id})                   cron.resume
  cron_update_route, cron_get_route (ASSUMED, off by default)             cron.update, cron.get
Only these: the operations are not mirrored under /v1/scheduling, where no source shows them,
so an adapter calling a route that does not exist fails here as it would against Infrai.
Unknown ids answer 404 CRON_NOT_FOUND (also a second delete); a name clash per
cron_create_existing_name. Lists are unpaged, jobs in creation order, runs oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson
from aiohttp import web

from cleanup_sandbox.infrai.app import JSON, RUNTIME_KEY, Act, Call, Capability, Outcome, Runtime
from cleanup_sandbox.infrai.cron import Attempt, CronJob, CronModel, Result, invalid, parse_spec
from cleanup_sandbox.infrai.state import QueueState

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5
ID_FIELDS = ("cron_id", "id", "job_id")
_CREATE_PARAMS = ("name", "schedule", "cron_expr", "run_at", "url", "task", "task_url", "task_type",
                  "payload", "timezone", "retries", "retry", "timeout_seconds", "enabled", "headers",
                  "secret", "idempotency_key")


def _ids(cron_id: str) -> dict[str, object]:
    return dict.fromkeys(ID_FIELDS, cron_id)


def _match(template: str, path: str) -> tuple[bool, str | None]:
    """Whether ``path`` fits ``template`` and the URL-decoded ``{id}`` segment it carries."""
    if "{id}" not in template:
        return path == template, None
    head, _, tail = template.partition("{id}")
    if not (path.startswith(head) and path.endswith(tail)) or len(path) <= len(head) + len(tail):
        return False, None
    segment = path[len(head):len(path) - len(tail)]
    return ("/" not in segment), unquote(segment)


def _cap(cap_id: str, template: str, act: Act, params: tuple[str, ...], method: str = "POST") -> Capability:
    # GETs are idempotent without a key: a replayed list would be stale.
    return Capability(cap_id, template, act, params, method, idempotent=method != "GET",
                      param_log="cron_id")


def _group(caps: list[Capability]) -> dict[str, list[Capability]]:
    """Path template -> its capabilities, one per method; the first answers other methods' 405."""
    routes: dict[str, list[Capability]] = {}
    for cap in caps:
        routes.setdefault(cap.path, []).append(cap)
    return routes


class CronService:
    """The cron model of one emulator, its routes and its scheduler."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.model = CronModel(rt.state.now, lambda: rt.state.config)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

        by_id = ("cron_id", "idempotency_key")
        self._fixed = _group([
            _cap("cron.create", "/v1/cron/create", self._create, _CREATE_PARAMS),
            _cap("cron.list", "/v1/cron/list", self._list, (), "GET"),
            _cap("scheduling.cron.create", "/v1/scheduling/cron/create", self._create, _CREATE_PARAMS),
            _cap("scheduling.cron.list", "/v1/scheduling/cron/list", self._list, (), "GET"),
            # D-L's older paths: one path, the method picks create or list.
            _cap("scheduling.cron.create", "/v1/scheduling/cron", self._create, _CREATE_PARAMS),
            _cap("scheduling.cron.list", "/v1/scheduling/cron", self._list, (), "GET"),
            _cap("cron.pause", "/v1/cron/pause/{id}", self._pause, by_id),
            _cap("cron.trigger", "/v1/cron/trigger/{id}", self._trigger, by_id),
            _cap("cron.delete", "/v1/cron/delete/{id}", self._delete, by_id, "DELETE"),
            _cap("cron.delete", "/v1/cron/delete/{id}", self._delete, by_id),  # POST too
            _cap("cron.runs.list", "/v1/cron/runs/list/{id}", self._runs, ("cron_id",), "GET"),
        ])

    # -- routing -------------------------------------------------------------------------

    def _configured(self) -> dict[str, list[Capability]]:
        cfg, caps = self.rt.config, []
        if cfg.cron_resume_route is not None:
            caps.append(_cap("cron.resume", cfg.cron_resume_route, self._resume,
                             ("cron_id", "idempotency_key")))
        if cfg.cron_update_route is not None:
            caps.append(_cap("cron.update", cfg.cron_update_route, self._update,
                             ("cron_id", *_CREATE_PARAMS)))
        if cfg.cron_get_route is not None:
            caps.append(_cap("cron.get", cfg.cron_get_route, self._get, ("cron_id",), "GET"))
        return _group(caps)

    def resolve(self, method: str, path: str) -> tuple[Capability | None, str | None]:
        """The capability serving ``method path`` (another method's, for a 405), and the id."""
        for template, caps in (*self._fixed.items(), *self._configured().items()):
            matched, param = _match(template, path)
            if matched:
                chosen = next((c for c in caps if c.method == method), caps[0])
                return chosen, param
        return None, None

    # -- capabilities (synchronous: each runs to completion inside the dispatcher) -----------

    def _job_id(self, call: Call) -> str:
        if call.param:
            return call.param
        for name in ID_FIELDS:
            value = call.body.get(name)
            if isinstance(value, str) and value:
                return value
        raise invalid("cron_id", "required, the id cron.create returned")

    def _record(self, job: CronJob) -> Outcome:
        return Outcome(job.record(self.rt.config), None, extra=(("cron_id", job.cron_id),))

    def _create(self, state: QueueState, call: Call) -> Outcome:
        cfg = state.config
        if cfg.require_create_keys and call.key is None:
            raise invalid("idempotency_key", "required on calls that create resources")
        return self._record(self.model.create(parse_spec(call.body, cfg)))

    def _list(self, state: QueueState, call: Call) -> Outcome:
        return Outcome({"items": [job.record(state.config) for job in self.model.jobs.values()]}, None)

    def _get(self, state: QueueState, call: Call) -> Outcome:
        return self._record(self.model.get(self._job_id(call)))

    def _update(self, state: QueueState, call: Call) -> Outcome:
        return self._record(self.model.update(self._job_id(call), call.body))

    def _pause(self, state: QueueState, call: Call) -> Outcome:
        return self._record(self.model.pause(self._job_id(call)))

    def _resume(self, state: QueueState, call: Call) -> Outcome:
        return self._record(self.model.resume(self._job_id(call)))

    def _delete(self, state: QueueState, call: Call) -> Outcome:
        job = self.model.delete(self._job_id(call))
        return Outcome({**_ids(job.cron_id), "deleted": True}, None, extra=(("cron_id", job.cron_id),))

    def _trigger(self, state: QueueState, call: Call) -> Outcome:
        attempt = self.model.trigger(self._job_id(call))
        self._spawn(attempt)
        run = attempt.run
        data = {**_ids(run.cron_id), "run_id": run.run_id, "triggered": True,
                "scheduled_for": run.record(state.config)["scheduled_for"]}
        return Outcome(data, None, extra=(("cron_id", run.cron_id), ("run_id", run.run_id)))

    def _runs(self, state: QueueState, call: Call) -> Outcome:
        cron_id = self._job_id(call)
        runs = [run.record(state.config) for run in self.model.runs(cron_id)]
        return Outcome({"items": runs}, None, extra=(("cron_id", cron_id),))

    # -- the scheduler ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def tick(self) -> list[str]:
        """Start every attempt due by the emulator clock now; their run ids."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return []  # no loop, no server: the scheduler's next poll picks them up
        if self._session is None:
            return []
        started = []
        for attempt in self.model.step():
            self._spawn(attempt)
            started.append(attempt.run.run_id)
        return started

    async def drain(self) -> None:
        """Wait until no attempt is in flight (immediate retries run inside their attempt's task)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def _spawn(self, attempt: Attempt) -> None:
        task = asyncio.get_running_loop().create_task(self._execute(attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, attempt: Attempt) -> None:
        current: Attempt | None = attempt
        while current is not None:
            result = await self._post(current)
            current = self.model.finish(current, result)

    async def _post(self, attempt: Attempt) -> Result:
        limit = self.rt.config.cron_output_limit_bytes
        started = time.perf_counter()

        def elapsed() -> int:
            return int((time.perf_counter() - started) * 1000)

        session = self._session
        if session is None:
            return Result(None, b"", error="the emulator is shutting down")
        try:
            async with session.post(
                attempt.url,
                data=attempt.body,
                headers=attempt.headers,
                timeout=aiohttp.ClientTimeout(total=attempt.timeout),
                allow_redirects=False,
            ) as resp:
                body = bytearray()
                # One byte past the limit tells a cut output from one that fits exactly.
                while len(body) <= limit:
                    chunk = await resp.content.read(limit + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
                return Result(resp.status, bytes(body), elapsed_ms=elapsed())
        except TimeoutError:
            return Result(None, b"", timed_out=True, error=f"no answer within {attempt.timeout:g} s",
                          elapsed_ms=elapsed())
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return Result(None, b"", error=f"{type(exc).__name__}: {exc}", elapsed_ms=elapsed())

    async def _poll(self) -> None:
        while True:
            interval = self.rt.config.cron_poll_seconds
            # With polling off, still wake now and then: the config may be swapped back.
            await asyncio.sleep(interval or IDLE_POLL_SECONDS)
            if interval <= 0:
                continue
            try:
                self.tick()
            except Exception:
                log.exception("infrai emulator: cron scheduler step failed")

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: the outbound session and the poll task live with the app."""
        self._session = aiohttp.ClientSession(trust_env=False)
        poller = asyncio.create_task(self._poll(), name="infrai-cron-scheduler")
        try:
            yield
        finally:
            poller.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(poller, *self._tasks, return_exceptions=True)
            session, self._session = self._session, None
            with contextlib.suppress(Exception):
                await session.close()


CRON_KEY = web.AppKey("infrai_cron", CronService)


def install_cron(app: web.Application) -> CronService:
    """Add the cron routes to an app made by create_app, and its scheduler to the app's life."""
    rt = app[RUNTIME_KEY]
    service = CronService(rt)
    app[CRON_KEY] = service
    rt.routes.append(service.resolve)
    app.cleanup_ctx.append(service.lifespan)
    return service


# -- the /_emulator control surface (server.py guards and mounts these) --------------------


def _plain(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type=JSON)


async def get_cron(request: web.Request, rt: Runtime) -> web.Response:
    """GET /_emulator/cron: every job with its runs, pending retries and attempts in flight."""
    service = request.app[CRON_KEY]
    return _plain({**service.model.snapshot(), "in_flight": service.in_flight})


async def post_cron_tick(request: web.Request, rt: Runtime) -> web.Response:
    """POST /_emulator/cron/tick ``{"wait": bool}``: run the scheduler step now (and wait)."""
    try:
        body: Mapping[str, Any] = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError:
        raise ValueError("body must be a JSON object") from None
    if not isinstance(body, dict) or not isinstance(body.get("wait", False), bool):
        raise ValueError('body must be a JSON object like {"wait": true}')
    service = request.app[CRON_KEY]
    started = service.tick()
    if body.get("wait"):
        await service.drain()
    return _plain({"started": started, "in_flight": service.in_flight})
