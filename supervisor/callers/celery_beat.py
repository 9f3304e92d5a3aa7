"""Celery beat as the clock: a team's existing beat opens runs through the tick webhook.

The recipe (docs/operations.md, "Celery beat as the clock")::

    from celery.schedules import crontab
    from supervisor.callers.celery_beat import beat_entry, register

    open_cleanup_run = register(app)  # the task, on the team's own app
    app.conf.beat_schedule["cleanup-weekly"] = beat_entry(crontab(minute=0, hour=2, day_of_week=1))

Beat sends ``open_cleanup_run(slot_iso)`` with the slot it fired for; the task POSTs
``{"scheduled_for": slot_iso}`` to ``$CLEANUP_URL/v1/runs`` with the tick token. The
service keys a run by schedule and slot, so every send of one slot opens one run.

**The slot is computed in beat, at send time, from the entry's own schedule**: the
latest instant the schedule names at or before that moment (a crontab's latest match in
its timezone; an interval's latest multiple since the epoch). ``beat_entry`` puts a
``celery.beat.BeatLazyFunc`` in the entry's args, which beat calls just before it sends.
Why not elsewhere:

* not in the worker: a task that waited in the queue (workers busy or down) would name a
  later slot, and one delivered twice could name two;
* not from beat's ``last_run_at``: each beat process keeps its own, and after a beat was
  down it names the oldest missed slot, where this names the latest (the run due now).

So a beat that fires twice for a slot, two beat processes, a restarted beat that lost
its schedule file and a redelivered message all send the same ``scheduled_for``. A
crontab is what production wants: every beat fires just after the same instant, so
their clocks may differ by up to a period and still agree. An interval's fires are not
aligned to its boundaries (tests, demos).

Celery is not a dependency of the service (the ``celery`` extra): it is imported only
inside the functions that need it. HTTP is the standard library's: nothing else to
install on the workers.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from http.client import HTTPException
from typing import Any, Literal
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, read_secret
from supervisor.errors import CleanupError

TASK_NAME = "cleanup_supervisor.open_cleanup_run"

ENV_URL = "CLEANUP_URL"
ENV_TOKEN = "CLEANUP_TICK_TOKEN"
ENV_SCHEDULE = "CLEANUP_SCHEDULE"
ENV_TIMEOUT = "CLEANUP_TICK_TIMEOUT_SECONDS"

# A crontab naming a rare day (29 February on a Monday) matches once in up to 28 years.
_CRONTAB_LOOKBACK_DAYS = 366 * 29


# -- errors ----------------------------------------------------------------------------------
# One message argument each: Celery pickles a task's exception (``cls(*args)`` rebuilds it).


class TickError(CleanupError):
    """A tick that did not open (or find) a run."""


class TickRefused(TickError):
    """The service refused the tick (a 4xx other than 409 and 429): sending it again
    cannot help, so the task fails at once. The message names what was wrong."""


class TickTransient(TickError):
    """The service could not be reached, timed out, or answered 5xx or 429: worth retrying."""

    retry_after_s: float | None = None


class TickSettingsError(TickError):
    """The worker's environment lacks a setting, or holds a malformed one (named)."""


# -- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TickTarget:
    """Where and how a tick is sent. The token never shows in a repr or a log."""

    url: str  # the service's base URL, e.g. https://cleanup.internal:8080
    token: Secret = field(repr=False)  # the tick token (trigger.tick_token_env)
    schedule: str | None = None  # None: the service's schedule.name
    timeout_s: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TickTarget:
        """Read ``$CLEANUP_URL``, ``$CLEANUP_TICK_TOKEN`` (or the file
        ``$CLEANUP_TICK_TOKEN_FILE`` names), ``$CLEANUP_SCHEDULE`` (optional) and
        ``$CLEANUP_TICK_TIMEOUT_SECONDS`` (optional, 10). Raises TickSettingsError naming
        every variable that is missing or malformed."""
        env = os.environ if env is None else env
        problems: list[str] = []
        url = env.get(ENV_URL, "").strip()
        parts = urlsplit(url)
        if not url:
            problems.append(f"${ENV_URL} is not set: the service's base URL")
        elif parts.scheme not in ("http", "https") or not parts.netloc:
            problems.append(f"${ENV_URL} must be an http:// or https:// URL")
        token, problem = read_secret(ENV_TOKEN, ENV_TOKEN, env)
        if problem:
            problems.append(problem.removeprefix(f"{ENV_TOKEN}: "))
        elif token is None:
            problems.append(f"${ENV_TOKEN} (or ${ENV_TOKEN}_FILE) is not set: the service's tick token")
        timeout_s = 10.0
        if ENV_TIMEOUT in env:
            try:
                timeout_s = float(env[ENV_TIMEOUT])
            except ValueError:
                timeout_s = math.nan
            if not (math.isfinite(timeout_s) and timeout_s > 0):
                problems.append(f"${ENV_TIMEOUT} must be a number of seconds above 0")
        if problems:
            raise TickSettingsError("; ".join(problems))
        assert token is not None
        return cls(url.rstrip("/"), token, env.get(ENV_SCHEDULE) or None, timeout_s)


# -- the tick --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TickResult:
    """What the service answered a tick it took (200/201) or skipped (409)."""

    slot: str | None
    status: int
    outcome: Literal["opened", "found", "skipped"]
    run_id: str | None  # the run opened or found; for "skipped", the unfinished one
    state: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "status": self.status, "outcome": self.outcome,
                "run_id": self.run_id, "state": self.state}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A redirected POST would arrive as a GET without its body; a 3xx is an answer here.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def _doc(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _retry_after(value: str | None) -> float | None:
    # The service sends whole seconds (api.md); anything else falls back to the backoff.
    try:
        seconds = float(value) if value else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def send_tick(target: TickTarget, slot_iso: str | None) -> TickResult:
    """POST one tick to ``/v1/runs`` and classify the answer.

    Returns for 200 (the slot's run existed: ``found``), 201 (``opened``) and 409
    (``skipped``: another run is unfinished and the overlap policy skips this slot; the
    next slot tries again). Raises TickTransient for a connection failure, a timeout, a 5xx
    or a 429 (with its Retry-After), TickRefused for any other answer. ``slot_iso`` None
    names no slot: the service then picks one (``schedule.clock = "external"``) or matches
    a run opened in the last ten minutes."""
    body: dict[str, Any] = {}
    if target.schedule:
        body["schedule"] = target.schedule
    if slot_iso is not None:
        body["scheduled_for"] = slot_iso
    url = f"{target.url}/v1/runs"
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {target.token.reveal()}",
                 "Content-Type": "application/json", "Accept": "application/json"})
    try:
        with _opener.open(request, timeout=target.timeout_s) as resp:
            status, doc, retry_after = resp.status, _doc(resp.read()), None
    except urllib.error.HTTPError as exc:
        status, retry_after = exc.code, exc.headers.get("Retry-After")
        try:
            doc = _doc(exc.read())
        except (OSError, HTTPException):
            doc = {}
        finally:
            exc.close()
    except (urllib.error.URLError, OSError, HTTPException) as exc:
        # Refused, reset, timed out, garbled: whether or not the service saw the POST, a
        # resend is safe (the slot dedupes).
        reason = getattr(exc, "reason", None) or exc
        raise TickTransient(f"POST {url}: {type(exc).__name__}: {reason}") from None

    error = str(doc.get("error", "")) or "(no error given)"
    if status in (200, 201):
        run = doc.get("run") or {}
        return TickResult(slot_iso, status, "opened" if status == 201 else "found",
                          run.get("id"), run.get("state"))
    if status == 409:
        return TickResult(slot_iso, status, "skipped", doc.get("active_run"), None)
    if status == 429 or status >= 500:
        transient = TickTransient(f"POST {url} answered {status}: {error}")
        transient.retry_after_s = _retry_after(retry_after)
        raise transient
    hint = {401: f"the token in ${ENV_TOKEN} was refused",
            403: "the token may not open this tick",
            404: f"is ${ENV_URL} the service's base URL?"}.get(status)
    raise TickRefused(f"POST {url} answered {status}: {error}" + (f" ({hint})" if hint else ""))


def _celery(module: str) -> Any:
    """A Celery module, imported when first needed: Celery is the ``celery`` extra, not a
    dependency of the service (and ships no type information)."""
    return importlib.import_module(module)


# -- the slot --------------------------------------------------------------------------------


def slot_of(schedule: Any, now: datetime | None = None) -> datetime:
    """The slot a beat entry with ``schedule`` fires for at ``now`` (default: the
    schedule's own clock): the latest instant it names at or before ``now``, in UTC.

    A ``crontab``: its latest matching minute, in the crontab's timezone (the app's).
    An interval (``schedule``, or a number of seconds or a timedelta): the latest multiple
    of the interval since the Unix epoch. Raises TypeError for another kind (``solar``),
    ValueError for a crontab that names no instant in 29 years."""
    schedules = _celery("celery.schedules")
    if isinstance(schedule, int | float | timedelta):
        # Only these: maybe_schedule() of a schedule object unbinds it from its app (and
        # so from the app's timezone).
        schedule = schedules.maybe_schedule(schedule)
    if now is None:
        now = schedule.now()
    if now.tzinfo is None:
        raise ValueError("now must carry a UTC offset")
    if isinstance(schedule, schedules.crontab):
        return _latest_match(schedule, now).astimezone(UTC)
    if isinstance(schedule, schedules.schedule):
        period = schedule.run_every.total_seconds()
        if not period > 0:
            raise ValueError("an interval schedule's run_every must be above 0")
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        # Integer microseconds: float division would drift at a microsecond boundary.
        micros = (now.astimezone(UTC) - epoch) // timedelta(microseconds=1)
        step = max(1, round(period * 1_000_000))
        return epoch + timedelta(microseconds=micros - micros % step)
    raise TypeError(f"no slot for a {type(schedule).__name__} schedule: use a crontab or an interval")


def _latest_match(cron: Any, now: datetime) -> datetime:
    """The latest minute ``cron`` matches at or before ``now``. Celery's crontab matches a
    day when its month, day of month *and* day of week all match (not cron's "or")."""
    tz = cron.tz
    local = now.astimezone(tz)
    today = local.date()
    hours = sorted(cron.hour, reverse=True)
    minutes = sorted(cron.minute, reverse=True)
    for back in range(_CRONTAB_LOOKBACK_DAYS):
        day: date = today - timedelta(days=back)
        if not (day.month in cron.month_of_year and day.day in cron.day_of_month
                and day.isoweekday() % 7 in cron.day_of_week):
            continue
        for hour in hours:
            if back == 0 and hour > local.hour:
                continue
            for minute in minutes:
                if back == 0 and hour == local.hour and minute > local.minute:
                    continue
                found = datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz)
                # An aware comparison: a wall-clock time in a DST gap or fold may still lie
                # after ``now``; the next earlier match is then the slot.
                if found <= now:
                    return found
    raise ValueError(f"{cron!r} names no instant in the {_CRONTAB_LOOKBACK_DAYS} days before {now}")


def slot_iso(schedule: Any, now: datetime | None = None) -> str:
    """:func:`slot_of` as ISO 8601 in UTC, as ``scheduled_for`` carries it."""
    return slot_of(schedule, now).isoformat()


def beat_entry(schedule: Any, *, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``beat_schedule`` entry that sends :data:`TASK_NAME` with the slot it fires for,
    computed by beat at send time (a ``BeatLazyFunc``). ``schedule``: a crontab, an
    interval, a number of seconds or a timedelta; ``options``: the entry's send options
    (``queue``, ``expires``, ...)."""
    if isinstance(schedule, int | float | timedelta):
        schedule = _celery("celery.schedules").maybe_schedule(schedule)
    slot_of(schedule, datetime.now(UTC))  # a schedule with no slot fails here, not in beat
    # The one schedule object in both places: beat binds it to the app (its timezone).
    entry: dict[str, Any] = {"task": TASK_NAME, "schedule": schedule,
                             "args": (_celery("celery.beat").BeatLazyFunc(slot_iso, schedule),)}
    if options:
        entry["options"] = dict(options)
    return entry


# -- the Celery task -------------------------------------------------------------------------


def retry_countdown(retries: int, transient: TickTransient, backoff_s: float,
                    backoff_max_s: float) -> float:
    """The wait before retry ``retries + 1``: the service's Retry-After when it gave one,
    else ``backoff_s`` doubling up to ``backoff_max_s``, the upper half jittered (two
    workers retrying one slot do not resend in step)."""
    if transient.retry_after_s is not None:
        return min(transient.retry_after_s, backoff_max_s)
    wait = min(backoff_max_s, backoff_s * 2.0 ** retries)
    return wait / 2 + random.uniform(0, wait / 2)


def register(app: Any, *, target: TickTarget | None = None, max_retries: int = 5,
             backoff_s: float = 2.0, backoff_max_s: float = 60.0) -> Any:
    """Register ``open_cleanup_run(slot_iso)`` as :data:`TASK_NAME` on the Celery ``app``
    and return the task.

    ``target`` None reads :meth:`TickTarget.from_env` at each run (the worker's
    environment). A connection failure, timeout, 5xx or 429 is retried with Celery's
    retry, at most ``max_retries`` times, then the task fails with the last error; 409 is
    done with a warning (another run is unfinished; the next slot tries again); any other
    4xx and a missing setting fail at once, naming what was wrong.

    ``acks_late``: a worker lost mid-POST leaves the message to be delivered again, which
    is safe because the slot dedupes."""
    log = _celery("celery.utils.log").get_task_logger(__name__)

    # shared=False: a shared task is added to every Celery app made after it in the
    # process (a second register, another app of the team's) under the same name.
    @app.task(bind=True, name=TASK_NAME, shared=False, acks_late=True, reject_on_worker_lost=True,
              max_retries=max_retries, ignore_result=True)  # type: ignore[untyped-decorator]
    def open_cleanup_run(self: Any, slot_iso: str | None = None) -> dict[str, Any]:
        settings = target or TickTarget.from_env()
        try:
            result = send_tick(settings, slot_iso)
        except TickTransient as exc:
            countdown = retry_countdown(self.request.retries, exc, backoff_s, backoff_max_s)
            log.warning("cleanup tick: slot=%s retry=%d/%d in=%.1fs error=%s", slot_iso,
                        self.request.retries + 1, self.max_retries, countdown, exc)
            # Past max_retries Celery raises ``exc`` itself: the task fails with it.
            raise self.retry(exc=exc, countdown=countdown) from None
        except TickRefused as exc:
            log.error("cleanup tick: slot=%s refused: %s", slot_iso, exc)
            raise
        if result.outcome == "skipped":
            log.warning("cleanup tick: slot=%s status=409 skipped: run %s is unfinished; "
                        "the next slot tries again", slot_iso, result.run_id)
        else:
            log.info("cleanup tick: slot=%s status=%d created=%s run=%s state=%s", slot_iso,
                     result.status, str(result.outcome == "opened").lower(), result.run_id,
                     result.state)
        return result.as_dict()

    return open_cleanup_run
