"""The cron model behind the Infrai emulator: jobs, the scheduler step, run history.

Pure and synchronous like state.py: no I/O, no aiohttp, every instant from the emulator's
clock. The server's scheduler calls ``step`` (every ~50 ms, and right after the clock is
advanced), performs the POST each returned ``Attempt`` describes, and reports back through
``finish``, which may hand out the retry. Section 4 of shared/reference/infrai-api.md.

Decided where the reference is silent (see also the ``cron_*`` config fields):
- A clock jump across several slots fires the most recent missed slot once (catch-up cap 1),
  never one run per slot; a slot missed while paused is never fired (no backfill), and a
  resumed job's next_run_at is the first slot after "now".
- ``next_run_at`` is null while paused, after a one-shot fired, and for a 'store'd schedule.
- A ``run_at`` in the past fires at the next step; one whose instant passed while paused never.
- A manual trigger runs even while paused and leaves next_run_at alone.
- Every attempt is its own run record (``attempt`` 1..retries+1, one ``scheduled_for``);
  ``status`` is "running" until it ends, then "succeeded" (any 2xx), "failed" or "timeout".
- Retries already due when a job is paused still run; deleting a job drops them and its runs.
- DST is croniter's: a slot in the spring-forward gap fires at the first instant after it, a
  slot in the repeated fall-back hour fires in both occurrences.
- The POST (unknown 12): body = the payload JSON alone ({} when none), headers = the job's own
  ``headers`` plus Content-Type: application/json, X-Infrai-Cron-Id, X-Infrai-Scheduled-For
  (the slot, ISO-8601 UTC) and, if configured, a signature. Success = any 2xx; redirects are
  not followed (a 3xx fails). The attempt's timeout is real time: the network is not on the
  emulator clock. Output = the first cron_output_limit_bytes bytes of the answer as UTF-8.
- Runs of one job may overlap; overlap_policy, max_runs and on_failure_webhook (unknown 15)
  are accepted and ignored. ``secret`` and ``headers`` are stored but never echoed.
- Create fields: both styles (inconsistency #1), two aliases with different values are a
  400; run_at and a schedule together are a 400 (#6: they are alternatives); a naive run_at is
  read as UTC; timeout_seconds over 900 is a 400, else clamped to cron_timeout_seconds.
"""

from __future__ import annotations

import codecs
import hashlib
import hmac
import ipaddress
import random
import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

import orjson
from croniter import croniter

from cleanup_sandbox.infrai.config import CRON_RUN_CEILING, EmulatorConfig
from cleanup_sandbox.infrai.state import ApiError, timestamp, uuid7

RunStatus = Literal["running", "succeeded", "failed", "timeout"]
Trigger = Literal["schedule", "manual"]

# Field aliases across the documented create styles (inconsistencies #1, #5); the first is the
# name used in records and error messages when none was sent.
SCHEDULE_FIELDS = ("schedule", "cron_expr")
URL_FIELDS = ("url", "task_url", "task", "http_url")
RETRY_FIELDS = ("retries", "retry")
CREATE_FIELDS = (*SCHEDULE_FIELDS, "run_at", *URL_FIELDS, *RETRY_FIELDS, "name", "payload", "timezone",
                 "timeout_seconds", "task_type", "enabled", "headers", "secret")
_NAMES = re.compile(r"JAN|FEB|MAR|APR|MAY|JUN|JUL|AUG|SEP|OCT|NOV|DEC|SUN|MON|TUE|WED|THU|FRI|SAT")
_PLAIN_FIELD = re.compile(r"[0-9*,/-]+")
_CRONISH = re.compile(r"(@[a-z]+|[0-9A-Za-z*,/#?-]+(\s+[0-9A-Za-z*,/#?-]+){4,6})")
_PRIVATE_SUFFIXES = (".localhost", ".local", ".internal", ".lan", ".home.arpa")


def invalid(name: str, expected: str) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", f"{name}: {expected}", f"fix the {name} field")


def cron_not_found(cron_id: str) -> ApiError:
    return ApiError(404, "CRON_NOT_FOUND", f"cron job {cron_id!r} does not exist", "see GET /v1/cron/list")


def iso(seconds: float) -> str:
    return str(timestamp(seconds, "iso"))


def sign(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


# -- validation --------------------------------------------------------------------------


def _alias(body: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any]:
    """(field used, value) of one alias group; two aliases with different values are refused."""
    given = [(n, body[n]) for n in names if body.get(n) is not None]
    for n, value in given[1:]:
        if value != given[0][1]:
            raise invalid(n, f"disagrees with {given[0][0]}; send one of {', '.join(names)}")
    return given[0] if given else (names[0], None)


def is_extended(expr: str) -> bool:
    """Anything but 5 fields of digits, * , - / and month/day names."""
    fields = expr.split()
    if len(fields) != 5:
        return True
    return not all(_PLAIN_FIELD.fullmatch(_NAMES.sub("0", f.upper())) for f in fields)


def check_schedule(expr: object, name: str, mode: str) -> tuple[str, bool]:
    """The expression and whether croniter evaluates it (False: stored, never fires)."""
    if not isinstance(expr, str) or not expr.strip():
        raise invalid(name, "required (or run_at), a 5-field cron expression such as '0 9 * * *'")
    expr = " ".join(expr.split())
    extended = is_extended(expr)
    if extended and mode == "reject":
        raise invalid(name, f"{expr!r} uses syntax beyond 5 standard fields (L, W, #, ?, a seconds "
                      "or year field, @macros); use 'min hour day-of-month month day-of-week'")
    if extended and mode == "store":
        if not _CRONISH.fullmatch(expr):
            raise invalid(name, f"{expr!r} is not a cron expression")
        return expr, False
    try:
        croniter(expr, datetime.fromtimestamp(0, UTC), second_at_beginning=True).get_next(float)
    except (ValueError, KeyError, TypeError) as exc:  # croniter's errors are ValueErrors
        raise invalid(name, f"{expr!r} is not a valid cron expression ({exc})") from None
    return expr, True


def check_timezone(value: object) -> str:
    if value is None:
        return "UTC"
    if not isinstance(value, str) or not value:
        raise invalid("timezone", "must be an IANA zone name such as 'Europe/Berlin'")
    try:
        ZoneInfo(value)
    except (KeyError, ValueError, OSError):
        raise invalid("timezone", f"unknown IANA zone {value!r}") from None
    return value


def check_run_at(value: object) -> float:
    """ISO-8601; an offset other than Z is converted, a naive time is read as UTC."""
    if not isinstance(value, str):
        raise invalid("run_at", "must be an ISO-8601 UTC instant such as '2025-01-01T09:00:00Z'")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise invalid("run_at", f"{value!r} is not an ISO-8601 instant") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def check_target(url: object, name: str, allow_private: bool) -> str:
    """A public https URL, or with ``allow_private`` any absolute http(s) URL."""
    if not isinstance(url, str) or not url:
        raise invalid(name, "required, the https URL that receives the scheduled POST")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise invalid(name, f"{url!r} is not a valid URL") from None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise invalid(name, f"{url!r} must be an absolute http(s) URL")
    if allow_private:
        return url
    if parts.scheme != "https":
        raise invalid(name, f"{url!r} must use https (Infrai only calls public https URLs)")
    try:
        public = ipaddress.ip_address(host).is_global
    except ValueError:
        public = "." in host and host != "localhost" and not host.endswith(_PRIVATE_SUFFIXES)
    if not public:
        raise invalid(name, f"{url!r} is not a public address; Infrai cannot reach private endpoints")
    return url


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise invalid(name, "must be a number")
    return float(value)


@dataclass(slots=True)
class JobSpec:
    """What create/update asked for, validated."""

    name: str | None
    schedule: str | None
    evaluable: bool
    run_at: float | None
    url: str
    timezone: str
    payload: Any
    retries: int
    timeout_seconds: float
    task_type: str
    enabled: bool
    headers: dict[str, str]
    secret: str | None


def parse_spec(body: Mapping[str, Any], cfg: EmulatorConfig) -> JobSpec:
    """Either field style (inconsistency #1): name/schedule/url/retries or cron_expr/task(_url)/retry."""
    schedule_field, schedule = _alias(body, SCHEDULE_FIELDS)
    run_at = body.get("run_at")
    if run_at is not None and schedule is not None:
        raise invalid("run_at", f"is an alternative to {schedule_field}; send one of them")
    evaluable = True
    if run_at is None:
        schedule, evaluable = check_schedule(schedule, schedule_field, cfg.cron_extended_syntax)
    url_field, url = _alias(body, URL_FIELDS)
    retry_field, retry_value = _alias(body, RETRY_FIELDS)
    retries = cfg.cron_default_retries
    if retry_value is not None:
        number = _number({retry_field: retry_value}, retry_field)
        if number is None or not number.is_integer() or not 0 <= number <= cfg.cron_max_retries:
            raise invalid(retry_field, f"must be an integer within [0, {cfg.cron_max_retries}]")
        retries = int(number)
    timeout = _number(body, "timeout_seconds")
    if timeout is not None and not 0 < timeout <= CRON_RUN_CEILING:
        raise invalid("timeout_seconds", f"must be within (0, {CRON_RUN_CEILING:g}], one run's ceiling")
    task_type = body.get("task_type", "http_url")
    if task_type != "http_url":
        raise invalid("task_type", "must be 'http_url' (the only task type the docs show)")
    name, enabled, secret = body.get("name"), body.get("enabled", True), body.get("secret")
    if name is not None and (not isinstance(name, str) or not name):
        raise invalid("name", "must be a non-empty string")
    if not isinstance(enabled, bool):
        raise invalid("enabled", "must be a boolean")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise invalid("secret", "must be a non-empty string")
    headers = body.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise invalid("headers", "must be an object of strings")
    payload = body.get("payload")
    return JobSpec(
        name=name,
        schedule=None if run_at is not None else schedule,
        evaluable=evaluable,
        run_at=None if run_at is None else check_run_at(run_at),
        url=check_target(url, url_field, cfg.cron_allow_private_targets),
        timezone=check_timezone(body.get("timezone")),
        payload={} if payload is None else payload,
        retries=retries,
        timeout_seconds=cfg.cron_default_timeout_seconds if timeout is None else timeout,
        task_type=task_type,
        enabled=enabled,
        headers=dict(headers),
        secret=secret,
    )


def spec_body(spec: JobSpec) -> dict[str, Any]:
    """The spec as a create body, so an update can merge its fields over it and re-validate."""
    when: dict[str, Any] = {"run_at": iso(spec.run_at)} if spec.run_at is not None else {
        "schedule": spec.schedule}
    return {**when, "name": spec.name, "url": spec.url, "timezone": spec.timezone,
            "payload": spec.payload, "retries": spec.retries, "timeout_seconds": spec.timeout_seconds,
            "task_type": spec.task_type, "enabled": spec.enabled, "headers": spec.headers,
            "secret": spec.secret}


def merge_update(spec: JobSpec, changes: Mapping[str, Any]) -> dict[str, Any]:
    base = spec_body(spec)
    groups = ((*SCHEDULE_FIELDS, "run_at"), URL_FIELDS, RETRY_FIELDS)
    for group in groups:
        if any(changes.get(n) is not None for n in group):
            for n in group:
                base.pop(n, None)
    base.update({k: v for k, v in changes.items() if k in CREATE_FIELDS})
    return base


# -- jobs and runs -----------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class CronRun:
    run_id: str
    cron_id: str
    scheduled_for: float
    trigger: Trigger
    attempt: int
    started_at: float
    finished_at: float | None = None
    status: RunStatus = "running"
    http_status: int | None = None
    output: str = ""
    output_truncated: bool = False
    error: str | None = None
    duration_ms: int | None = None

    def record(self, cfg: EmulatorConfig) -> dict[str, object]:
        fmt = cfg.timestamp_format
        return {
            "run_id": self.run_id,
            "cron_id": self.cron_id,
            "scheduled_for": timestamp(self.scheduled_for, fmt),
            "started_at": timestamp(self.started_at, fmt),
            "finished_at": None if self.finished_at is None else timestamp(self.finished_at, fmt),
            "status": self.status,
            "http_status": self.http_status,
            "attempt": self.attempt,
            "trigger": self.trigger,
            "output": self.output,
            "output_truncated": self.output_truncated,
            "error": self.error,
            "duration_ms": self.duration_ms,
        }


@dataclass(slots=True, eq=False)
class CronJob:
    cron_id: str
    spec: JobSpec
    created_at: float
    next_run_at: float | None = None  # the slot, as shown
    fire_at: float | None = None  # the slot plus jitter, as the scheduler uses it
    fired: bool = False  # a one-shot that ran
    runs: deque[CronRun] = field(default_factory=deque)

    def record(self, cfg: EmulatorConfig) -> dict[str, object]:
        s, fmt = self.spec, cfg.timestamp_format
        return {
            "cron_id": self.cron_id,
            "id": self.cron_id,
            "job_id": self.cron_id,
            "name": s.name,
            "schedule": s.schedule,
            "run_at": None if s.run_at is None else timestamp(s.run_at, fmt),
            "url": s.url,
            "timezone": s.timezone,
            "enabled": s.enabled,
            "next_run_at": None if self.next_run_at is None else timestamp(self.next_run_at, fmt),
            "payload": s.payload,
            "retries": s.retries,
            "timeout_seconds": s.timeout_seconds,
            "task_type": s.task_type,
            "created_at": timestamp(self.created_at, fmt),
        }


@dataclass(frozen=True, slots=True)
class Attempt:
    """One POST to make: everything is fixed when it starts, so an update cannot change it."""

    run: CronRun
    url: str
    body: bytes
    headers: dict[str, str]
    timeout: float
    retries: int


@dataclass(frozen=True, slots=True)
class Result:
    http_status: int | None
    body: bytes
    timed_out: bool = False
    error: str | None = None
    elapsed_ms: int = 0


@dataclass(frozen=True, slots=True)
class PendingRetry:
    due: float
    cron_id: str
    scheduled_for: float
    attempt: int
    trigger: Trigger


def decode_output(body: bytes, limit: int) -> tuple[str, bool]:
    """The first ``limit`` bytes as text (a cut multi-byte character is dropped), and whether cut."""
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(body[:limit], final=False)
    return text, len(body) > limit


class CronModel:
    """All cron jobs of one emulated account."""

    def __init__(self, now: Callable[[], float], config: Callable[[], EmulatorConfig]) -> None:
        self._now = now
        self._config = config
        self.jobs: dict[str, CronJob] = {}
        self.pending: list[PendingRetry] = []
        seed = config().seed
        self._id_rng = random.Random(seed * 15485863 + 3)
        self._jitter_rng = random.Random(seed * 32452843 + 9)

    @property
    def config(self) -> EmulatorConfig:
        return self._config()

    def new_id(self, prefix: str) -> str:
        return prefix + uuid7(self._now(), self._id_rng)

    def get(self, cron_id: str) -> CronJob:
        job = self.jobs.get(cron_id)
        if job is None:
            raise cron_not_found(cron_id)
        return job

    # -- slots -----------------------------------------------------------------------------

    def _iter(self, spec: JobSpec, at: float) -> croniter:
        assert spec.schedule is not None
        start = datetime.fromtimestamp(at, ZoneInfo(spec.timezone))
        return croniter(spec.schedule, start, second_at_beginning=True)

    def next_slot(self, spec: JobSpec, after: float) -> float | None:
        if spec.run_at is not None or not spec.evaluable:
            return None
        return float(self._iter(spec, after).get_next(float))

    def latest_slot(self, spec: JobSpec, now: float) -> float:
        """The last slot at or before ``now`` (croniter's get_prev is strictly before)."""
        before = float(self._iter(spec, now).get_prev(float))
        following = float(self._iter(spec, before).get_next(float))
        return following if following <= now else before

    def _plan(self, job: CronJob, slot: float | None) -> None:
        job.next_run_at = slot
        jitter = self.config.cron_jitter_seconds
        job.fire_at = None if slot is None else slot + (self._jitter_rng.uniform(0, jitter) if jitter else 0)

    def _schedule_from_now(self, job: CronJob, *, creating: bool) -> None:
        s, now = job.spec, self._now()
        if not s.enabled:
            self._plan(job, None)
        elif s.run_at is not None:
            # Overdue at creation: fire at once. Passed while paused: missed, not backfilled.
            self._plan(job, None if job.fired or (not creating and s.run_at <= now) else s.run_at)
        else:
            self._plan(job, self.next_slot(s, now))

    # -- operations ------------------------------------------------------------------------

    def create(self, spec: JobSpec) -> CronJob:
        policy = self.config.cron_create_existing_name
        existing = next((j for j in self.jobs.values() if spec.name and j.spec.name == spec.name), None)
        if existing is not None and policy != "new":
            if policy == "conflict":
                raise ApiError(409, "CRON_EXISTS", f"a cron job named {spec.name!r} exists",
                               f"its id is {existing.cron_id}; pause, update or delete it")
            if policy == "replace":
                self.replace(existing, spec)
            return existing
        job = CronJob(self.new_id("cron_"), spec, self._now())
        self._schedule_from_now(job, creating=True)
        self.jobs[job.cron_id] = job
        return job

    def replace(self, job: CronJob, spec: JobSpec) -> CronJob:
        job.spec, job.fired = spec, False
        self._schedule_from_now(job, creating=True)
        return job

    def update(self, cron_id: str, changes: Mapping[str, Any]) -> CronJob:
        job = self.get(cron_id)
        return self.replace(job, parse_spec(merge_update(job.spec, changes), self.config))

    def pause(self, cron_id: str) -> CronJob:
        job = self.get(cron_id)
        job.spec.enabled = False
        self._plan(job, None)
        return job

    def resume(self, cron_id: str) -> CronJob:
        job = self.get(cron_id)
        if not job.spec.enabled:
            job.spec.enabled = True
            self._schedule_from_now(job, creating=False)
        return job

    def delete(self, cron_id: str) -> CronJob:
        job = self.get(cron_id)
        del self.jobs[cron_id]
        self.pending = [p for p in self.pending if p.cron_id != cron_id]
        return job

    def trigger(self, cron_id: str) -> Attempt:
        job = self.get(cron_id)
        return self._begin(job, self._now(), 1, "manual")

    def runs(self, cron_id: str) -> list[CronRun]:
        return list(self.get(cron_id).runs)

    # -- the scheduler ---------------------------------------------------------------------

    def step(self) -> list[Attempt]:
        """Start every attempt due by now: at most one per job for its slots, plus due retries."""
        now = self._now()
        attempts: list[Attempt] = []
        for job in list(self.jobs.values()):
            if not job.spec.enabled or job.fire_at is None or job.fire_at > now:
                continue
            slot = job.next_run_at
            assert slot is not None
            if job.spec.run_at is not None:
                job.fired = True
                self._plan(job, None)
            else:
                # Catch-up cap 1: after a jump across several slots only the latest one runs.
                slot = max(slot, self.latest_slot(job.spec, now))
                self._plan(job, self.next_slot(job.spec, now))
            attempts.append(self._begin(job, slot, 1, "schedule"))
        due = [p for p in self.pending if p.due <= now]
        if due:
            self.pending = [p for p in self.pending if p.due > now]
            for retry in sorted(due, key=lambda p: p.due):
                owner = self.jobs.get(retry.cron_id)
                if owner is not None:
                    attempts.append(self._begin(owner, retry.scheduled_for, retry.attempt, retry.trigger))
        return attempts

    def _begin(self, job: CronJob, scheduled_for: float, attempt: int, trigger: Trigger) -> Attempt:
        cfg, s = self.config, job.spec
        run = CronRun(self.new_id("run_"), job.cron_id, scheduled_for, trigger, attempt, self._now())
        kept = cfg.cron_runs_kept
        if job.runs.maxlen != kept:
            job.runs = deque(job.runs, maxlen=kept)
        job.runs.append(run)
        body = orjson.dumps(s.payload)
        headers = {
            **s.headers,
            "Content-Type": "application/json",
            "X-Infrai-Cron-Id": job.cron_id,
            "X-Infrai-Scheduled-For": iso(scheduled_for),
        }
        if cfg.cron_signature_header is not None and s.secret is not None:
            headers[cfg.cron_signature_header] = cfg.cron_signature_prefix + sign(s.secret, body)
        timeout = min(s.timeout_seconds, cfg.cron_timeout_seconds)
        return Attempt(run, s.url, body, headers, timeout, s.retries)

    def finish(self, attempt: Attempt, result: Result) -> Attempt | None:
        """Record how an attempt ended; the retry to start at once, if one is due now."""
        cfg, run, now = self.config, attempt.run, self._now()
        run.finished_at = now
        run.http_status = result.http_status
        run.error = result.error
        run.duration_ms = result.elapsed_ms
        run.output, run.output_truncated = decode_output(result.body, cfg.cron_output_limit_bytes)
        if result.timed_out:
            run.status = "timeout"
        elif result.http_status is not None and 200 <= result.http_status < 300:
            run.status = "succeeded"
        else:
            run.status = "failed"
        job = self.jobs.get(run.cron_id)
        if run.status == "succeeded" or job is None or run.attempt > attempt.retries:
            return None
        backoff = cfg.cron_retry_backoff_seconds
        if backoff <= 0:
            return self._begin(job, run.scheduled_for, run.attempt + 1, run.trigger)
        self.pending.append(PendingRetry(now + backoff, job.cron_id, run.scheduled_for,
                                         run.attempt + 1, run.trigger))
        return None

    # -- inspection ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        cfg, fmt = self.config, self.config.timestamp_format
        jobs = []
        for job in self.jobs.values():
            record = job.record(cfg)
            record["fire_at"] = None if job.fire_at is None else timestamp(job.fire_at, fmt)
            record["runs"] = [run.record(cfg) for run in job.runs]
            jobs.append(record)
        pending = [{"cron_id": p.cron_id, "attempt": p.attempt, "due": timestamp(p.due, fmt)}
                   for p in self.pending]
        return {"now": timestamp(self._now(), fmt), "jobs": jobs, "pending_retries": pending}
