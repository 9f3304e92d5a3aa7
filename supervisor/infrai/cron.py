"""The clock at Infrai: one cron job per schedule, applied idempotently, and its status.

Infrai's cron calls a public URL with a JSON payload on each slot, gives up after 900 s,
keeps 4 KB of each run's output and does not replay triggers missed while paused. The job
only *opens* a run (the trigger answers in milliseconds), so it is nowhere near that
ceiling. The documented variants are tolerated: the two path families, the two field
styles, and the job ID under ``cron_id``, ``id`` or ``job_id``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from croniter import croniter

from supervisor.configtypes import Secret
from supervisor.errors import CleanupError
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.settings import InfraiConfig

# Quartz-style tokens Infrai is not known to support (reference: do not rely on them):
# L, W, # and ? outside the month and weekday names.
_EXTENDED = re.compile(r"[LW#?]")
_NAMES = re.compile(r"jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec|sun|mon|tue|wed|thu|"
                    r"fri|sat", re.IGNORECASE)


# Fields of an Infrai record whose values are credentials at any depth (the job's
# headers, a task's, a recent run's): never printed.
SENSITIVE = frozenset({"headers", "authorization", "token", "secret", "password", "api_key",
                       "apikey", "x-api-key", "cookie"})
MASK = "***"


def masked(record: Any, secrets: Iterable[Secret | None] = ()) -> Any:
    """``record`` with every sensitive field, and every string holding one of
    ``secrets``, replaced by ``***``, however deep Infrai nests them."""
    values = [s.reveal() for s in secrets if s is not None and s.reveal()]

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: MASK if isinstance(k, str) and k.lower() in SENSITIVE else walk(v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and any(secret in value for secret in values):
            return MASK
        return value

    return walk(record)


class CronRefused(CleanupError):
    """A schedule Infrai cannot run as written: refused before anything is sent."""


def check_expression(expr: str) -> None:
    """Raise CronRefused unless ``expr`` is a plain 5-field cron expression."""
    fields = expr.split()
    if len(fields) != 5:
        raise CronRefused(f"schedule.cron {expr!r} has {len(fields)} fields; Infrai takes the "
                          "5-field form (minute hour day month weekday), no seconds field")
    if _EXTENDED.search(_NAMES.sub("", expr)):
        raise CronRefused(f"schedule.cron {expr!r} uses L, W, # or ?, which Infrai is not "
                          "known to support; write the days out")
    if not croniter.is_valid(expr):
        raise CronRefused(f"schedule.cron {expr!r} is not a valid cron expression")


@dataclass(frozen=True, slots=True)
class CronSpec:
    name: str
    schedule: str
    timezone: str
    url: str
    retries: int
    timeout_seconds: int
    payload: dict[str, Any] = field(default_factory=dict)

    def digest(self, token: Secret | None) -> str:
        """Names this exact job, the tick token included (without showing it)."""
        body = orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS)
        secret = token.reveal().encode() if token else b""
        return hashlib.sha256(body + b"\0" + secret).hexdigest()[:16]


def _matches(job: dict[str, Any], spec: CronSpec) -> bool:
    """Whether a listed job is ``spec``, in either field style. The documented record
    holds name, schedule, url, enabled, next_run_at: a field it leaves out is not held
    against it."""
    return (job.get("schedule", job.get("cron_expr")) == spec.schedule
            and job.get("url", job.get("task_url", job.get("task"))) == spec.url
            and job.get("timezone", spec.timezone) == spec.timezone
            and job.get("payload", spec.payload) == spec.payload)


def job_id(job: Any) -> str:
    if isinstance(job, dict):
        for key in ("cron_id", "id", "job_id"):
            if isinstance(job.get(key), str | int) and str(job[key]):
                return str(job[key])
    # The record's field names only, never its values: it may hold the job's headers.
    fields = ", ".join(sorted(str(k)[:40] for k in job)[:20]) if isinstance(job, dict) else \
        type(job).__name__
    raise InfraiError("cron.create", 200, "NO_ID",
                      f"no cron_id, id or job_id in the answer (it has: {fields})", "")


class InfraiCron:
    """``tick_token``: what the job sends as its Bearer token (trigger.tick_token_env),
    never the operator token: anyone who can read the project's cron jobs holds it."""

    def __init__(self, client: InfraiClient, config: InfraiConfig,
                 tick_token: Secret | None) -> None:
        self.client = client
        self.config = config
        self.token = tick_token
        self._family: str = config.cron_paths

    def spec(self, name: str, schedule: str, timezone: str) -> CronSpec:
        check_expression(schedule)
        if not self.config.trigger_url:
            raise CronRefused("infrai.trigger_url is not set: the public URL of this "
                              "service's /v1/runs, which Infrai's cron calls")
        return CronSpec(name=f"cleanup-{name}", schedule=schedule, timezone=timezone,
                        url=self.config.trigger_url, retries=self.config.cron_retries,
                        timeout_seconds=self.config.cron_timeout_seconds,
                        payload={"schedule": name})

    async def apply(self, spec: CronSpec, replace: bool = False) -> tuple[str, dict[str, Any]]:
        """Create the job, or keep it when it is already as specified; another job of
        the same name is replaced (no update route is documented). ``replace``: replace
        it even so (Infrai does not show the token it sends, so a rotated token, or the
        operator token an older version stored there, cannot be seen). Returns what was
        done ("created", "unchanged", "replaced") and the job."""
        digest = spec.digest(self.token)
        existing = [j for j in await self.jobs() if j.get("name") == spec.name]
        same = [j for j in existing if _matches(j, spec)]
        if same and not replace:
            return "unchanged", same[0]
        job = await self._create(spec, digest)
        for old in existing:
            if job_id(old) == job_id(job):
                continue  # the create replayed by its key: this is the job, keep it
            await self.client.call("cron.delete", f"/v1/cron/delete/{job_id(old)}",
                                   method="DELETE")
        return ("replaced" if existing else "created"), job

    async def jobs(self) -> list[dict[str, Any]]:
        data = await self._either("list", None)
        items = data.get("items", data.get("jobs")) if isinstance(data, dict) else data
        return [j for j in items if isinstance(j, dict)] if isinstance(items, list) else []

    async def runs(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        data = await self.client.call("cron.runs.list", f"/v1/cron/runs/list/{job_id(job)}",
                                      method="GET")
        items = data.get("items", data.get("runs")) if isinstance(data, dict) else data
        return [r for r in items if isinstance(r, dict)] if isinstance(items, list) else []

    async def _create(self, spec: CronSpec, digest: str) -> dict[str, Any]:
        payload = spec.payload
        headers = {"Authorization": f"Bearer {self.token.reveal()}"} if self.token else {}
        # The documented table names first; the curl example's names if those are refused.
        table = {"name": spec.name, "schedule": spec.schedule, "url": spec.url,
                 "timezone": spec.timezone, "retries": spec.retries,
                 "timeout_seconds": spec.timeout_seconds, "payload": payload,
                 "headers": headers}
        sdk = {"name": spec.name, "cron_expr": spec.schedule, "task_type": "http_url",
               "task_url": spec.url, "timezone": spec.timezone, "retry": spec.retries,
               "timeout_seconds": spec.timeout_seconds, "payload": payload,
               "headers": headers}
        key = f"cron-{spec.name}-{digest}"
        try:
            job = await self._either("create", table, key)
        except InfraiError as exc:
            if exc.status != 400:
                raise
            job = await self._either("create", sdk, key + "-b")
        job_id(job)  # an answer without an ID is no job
        return dict(job)

    async def _either(self, verb: str, body: dict[str, Any] | None, key: str | None = None
                      ) -> Any:
        """The configured path family, then the other one if Infrai answers 404."""
        families = [self._family, "scheduling" if self._family == "cron" else "cron"]
        for i, family in enumerate(families):
            prefix = "/v1/cron" if family == "cron" else "/v1/scheduling/cron"
            try:
                result = await self.client.call(
                    f"{'cron' if family == 'cron' else 'scheduling.cron'}.{verb}",
                    f"{prefix}/{verb}", body, idempotency_key=key,
                    method="POST" if body is not None else "GET")
            except InfraiError as exc:
                if exc.status == 404 and i == 0:
                    continue
                raise
            self._family = family
            return result
        raise AssertionError("unreachable")
