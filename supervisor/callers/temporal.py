"""Cleanup as one step of a Temporal workflow: an activity that opens the run of a slot and
heartbeats its progress until the service has drained it (issue 21, point 5).

The activity speaks to the service only through its `/v1` API (docs/api.md):

* ``POST /v1/runs {"scheduled_for": <slot>}`` opens the slot's run. The service dedups
  ticks by schedule and slot, so a retried attempt (a worker lost, a timeout, a resent
  POST whose answer was lost) finds the same run (``created: false``) and opens no
  second one. A 409 (another run is unfinished and ``schedule.overlap = "skip"``) is a
  non-retryable :class:`~temporalio.exceptions.ApplicationError` of type
  :data:`RUN_UNFINISHED` naming that run: the tick was skipped, and retrying it blindly
  would only open a late run once the other finishes.
* ``GET /v1/runs/{id}?wait=done&timeout=N`` long-polls the run; after each answer the
  activity heartbeats a :class:`CleanupProgress` (counts per state, unfinished). N is
  kept well under the activity's heartbeat timeout so a heartbeat is never late.
* The run's final counts come back as a :class:`CleanupResult`.

Cancellation (the workflow cancelled, the activity paused or reset, the worker shutting
down) reaches an async activity as :class:`asyncio.CancelledError` at its next await,
once a heartbeat has told the worker. The activity logs that the run is left to finish
in the service and re-raises. **Stopping the run on cancel is not offered**: the service
has no endpoint to stop a run, on purpose. Each DELETE is written to the ledger before
it is sent and settled after; a run stopped half-way would leave recipients the digest
excludes as ``deletion_pending`` until some later run picks them up, and a run is
cheap to let finish (it only deletes what is stale anyway). A workflow that must not
wait for it simply stops waiting; the service finishes the run on its own.

Configuration: the service URL and the *name* of the environment variable holding the
token are constructor arguments; the token itself is read once, at construction (a
missing one fails the worker at start-up, not the first run), and never logged or put
in an error. ``token_env`` is sent with the tick; reading the run needs a token that may
``GET`` (``read_token_env``, the viewer token, when ``token_env`` names the tick token,
which may only open runs).

Install with ``pip install 'cleanup-supervisor[temporal]'``; register
``CleanupActivity(url).run`` on a worker, and see
:mod:`supervisor.callers.temporal_workflow` for the workflow that runs it with a retry
policy.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from temporalio import activity
from temporalio.exceptions import ApplicationError

from supervisor.states import RunState

ACTIVITY_NAME = "cleanup_run"
DEFAULT_TOKEN_ENV = "CLEANUP_TRIGGER_TOKEN"

# The ApplicationError types the activity raises: a workflow can tell them apart with
# ``isinstance(err.cause, ApplicationError) and err.cause.type == RUN_UNFINISHED``.
RUN_UNFINISHED = "CleanupRunUnfinished"  # 409: another run is unfinished (not retried)
REFUSED = "CleanupRequestRefused"  # 400/401/403/404/...: a configuration error (not retried)
UNAVAILABLE = "CleanupServiceUnavailable"  # unreachable, 5xx, shutting down (retried)

# The API's longest long-poll (docs/api.md: `wait=done` up to 60 s).
MAX_WAIT_S = 60
# A heartbeat goes out after each long-poll: the poll is at most this share of the
# heartbeat timeout, leaving the rest for the request's round trip and a busy worker.
_POLL_SHARE_OF_HEARTBEAT = 0.4
# Statuses that say "not now" rather than "never": Temporal's retry policy retries them.
_RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class CleanupRequest:
    """The activity's argument: the slot the run is for (ISO 8601 with its offset, as
    ``POST /v1/runs`` takes it) and, optionally, the schedule (the service's
    ``schedule.name`` when omitted; the tick token may open only that one)."""

    scheduled_for: str
    schedule: str | None = None


@dataclass(frozen=True)
class CleanupProgress:
    """The heartbeat's details: the run as the last long-poll saw it."""

    run_id: str
    state: str
    discovered: int
    unfinished: int
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CleanupResult:
    """The activity's result: the run's final counts. ``created`` is true only for the
    attempt whose tick opened the run (a retry finds it); ``attempt`` is Temporal's."""

    run_id: str
    tick_key: str
    state: str
    created: bool
    attempt: int
    discovered: int
    counts: dict[str, int] = field(default_factory=dict)


def _slot(text: str) -> str:
    """The slot as sent: an ISO 8601 instant with its offset, or a named error."""
    if not isinstance(text, str):
        raise ApplicationError("scheduled_for must be an ISO 8601 string", type=REFUSED,
                               non_retryable=True)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ApplicationError(f"scheduled_for is not an ISO 8601 instant: {text!r}",
                               type=REFUSED, non_retryable=True) from None
    if moment.tzinfo is None:
        # A naive time is a different instant on every worker's clock: the tick key (and
        # so the dedup of a retried tick) must not depend on where the activity runs.
        raise ApplicationError(f"scheduled_for needs a UTC offset: {text!r}", type=REFUSED,
                               non_retryable=True)
    return moment.isoformat()


def _error_text(doc: Any) -> str:
    """The service's ``{"error": ...}``, or a short excerpt of whatever came back."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return repr(doc)[:200]


def _progress(doc: dict[str, Any]) -> CleanupProgress:
    return CleanupProgress(run_id=str(doc["id"]), state=str(doc["state"]),
                           discovered=int(doc.get("discovered") or 0),
                           unfinished=int(doc.get("unfinished") or 0),
                           counts={str(k): int(v) for k, v in (doc.get("counts") or {}).items()})


class CleanupActivity:
    """The activity, bound to one service: register ``CleanupActivity(url).run``.

    ``poll_s`` is the longest one long-poll waits (1 to 60 s); it is shortened to 40 %
    of the activity's heartbeat timeout when that is smaller, so set the heartbeat timeout
    to at least 3 * ``poll_s`` to poll at the full length. ``request_timeout_s`` bounds
    the rest of each request (connect, answer).
    """

    def __init__(self, service_url: str, *, token_env: str = DEFAULT_TOKEN_ENV,
                 read_token_env: str | None = None, poll_s: int = 20,
                 request_timeout_s: float = 30.0) -> None:
        parts = urlsplit(service_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"service_url must be an http(s) URL, got {service_url!r}")
        if not isinstance(poll_s, int) or not 1 <= poll_s <= MAX_WAIT_S:
            raise ValueError(f"poll_s must be an integer from 1 to {MAX_WAIT_S}, got {poll_s!r}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        self.service_url = service_url.rstrip("/")
        self.poll_s = poll_s
        self.request_timeout_s = request_timeout_s
        # Read once, here: a worker without its token fails at start, naming the variable.
        self.__tick_auth = {"Authorization": f"Bearer {self._token(token_env)}"}
        self.__read_auth = (self.__tick_auth if read_token_env is None else
                            {"Authorization": f"Bearer {self._token(read_token_env)}"})

    @staticmethod
    def _token(env: str) -> str:
        if not env:
            raise ValueError("token_env must name an environment variable")
        token = os.environ.get(env, "")
        if not token:
            raise ValueError(f"the cleanup service's token is not set: ${env} is empty")
        return token

    def __repr__(self) -> str:  # never the tokens
        return f"CleanupActivity({self.service_url!r}, poll_s={self.poll_s})"

    @activity.defn(name=ACTIVITY_NAME)
    async def run(self, request: CleanupRequest) -> CleanupResult:
        """Open (or find) the run of ``request.scheduled_for`` and wait until it is done.

        Heartbeats a :class:`CleanupProgress` after every long-poll. Returns the run's
        final counts. Raises :class:`ApplicationError` of type :data:`RUN_UNFINISHED`
        (409), :data:`REFUSED` (the service refused the request: token, schedule, slot)
        or :data:`UNAVAILABLE` (retryable); re-raises cancellation after logging that the
        run goes on in the service.
        """
        slot = _slot(request.scheduled_for)
        info = activity.info()
        body: dict[str, Any] = {"scheduled_for": slot}
        if request.schedule is not None:
            body["schedule"] = request.schedule
        timeout = aiohttp.ClientTimeout(total=MAX_WAIT_S + self.request_timeout_s,
                                        sock_connect=self.request_timeout_s)
        run_id: str | None = None
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                opened = await self._open(http, body)
                run_id = str(opened["run"]["id"])
                created = bool(opened["created"])
                activity.logger.info("cleanup run %s for %s (%s, attempt %d)", run_id, slot,
                                     "opened" if created else "found", info.attempt)
                doc = await self._wait_done(http, run_id, self._poll_s(info))
            except asyncio.CancelledError:
                # The service has no way to stop a run, and should not get one from here
                # (module docstring): the run drains on its own; only this wait ends.
                activity.logger.info(
                    "activity cancelled (%s); cleanup run %s is left to finish in the service",
                    _why(activity.cancellation_details()), run_id or "(none opened)")
                raise
        return CleanupResult(run_id=run_id, tick_key=str(opened["run"]["tick_key"]),
                             state=str(doc["state"]), created=created, attempt=info.attempt,
                             discovered=int(doc.get("discovered") or 0),
                             counts=_progress(doc).counts)

    def _poll_s(self, info: activity.Info) -> int:
        if info.heartbeat_timeout is None:
            return self.poll_s
        share = int(info.heartbeat_timeout.total_seconds() * _POLL_SHARE_OF_HEARTBEAT)
        return max(1, min(self.poll_s, share))

    async def _call(self, http: aiohttp.ClientSession, method: str, path: str,
                    auth: dict[str, str], body: dict[str, Any] | None = None,
                    ) -> tuple[int, Any, str | None]:
        """One request: (status, JSON body, Retry-After). A request that never got an
        answer is :data:`UNAVAILABLE`, retryable (the tick is idempotent by its slot)."""
        headers = dict(auth)
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            async with http.request(method, f"{self.service_url}{path}", data=data,
                                    headers=headers) as resp:
                raw = await resp.read()
                try:
                    doc = orjson.loads(raw) if raw else None
                except orjson.JSONDecodeError:
                    doc = raw[:200].decode(errors="replace")
                return resp.status, doc, resp.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The exception's text names the host and the error, never the headers.
            raise ApplicationError(f"{method} {path}: the cleanup service did not answer "
                                   f"({type(exc).__name__}: {exc})", type=UNAVAILABLE) from None

    def _refused(self, what: str, status: int, doc: Any) -> ApplicationError:
        retryable = status in _RETRYABLE
        return ApplicationError(f"{what}: {status} {_error_text(doc)}",
                                {"status": status},
                                type=UNAVAILABLE if retryable else REFUSED,
                                non_retryable=not retryable)

    async def _open(self, http: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
        status, doc, _ = await self._call(http, "POST", "/v1/runs", self.__tick_auth, body)
        if status in (200, 201) and isinstance(doc, dict) and "run" in doc:
            return doc
        if status == 409:
            active = doc.get("active_run") if isinstance(doc, dict) else None
            raise ApplicationError(
                f"the tick for {body['scheduled_for']} opened no run: run {active} is "
                f"unfinished (schedule.overlap = 'skip'); it goes on in the service",
                {"active_run": active}, type=RUN_UNFINISHED, non_retryable=True)
        raise self._refused("POST /v1/runs", status, doc)

    async def _wait_done(self, http: aiohttp.ClientSession, run_id: str, poll_s: int,
                         ) -> dict[str, Any]:
        """Long-poll the run until it is done, heartbeating after every answer. The first
        read does not wait, so the run's counts are in the history at once."""
        path = f"/v1/runs/{run_id}"
        while True:
            status, doc, retry_after = await self._call(http, "GET", path, self.__read_auth)
            path = f"/v1/runs/{run_id}?wait=done&timeout={poll_s}"
            if status == 200 and isinstance(doc, dict):
                activity.heartbeat(_progress(doc))
                if doc["state"] == RunState.DONE:
                    return doc
                continue
            if status in (429, 503) and retry_after is not None:
                # Too many long-polls held, or the service beginning to drain (the run as
                # it stands comes with the 503): ask again after the pause it names, kept
                # short enough that the next heartbeat is not late.
                if status == 503 and isinstance(doc, dict) and isinstance(doc.get("run"), dict):
                    activity.heartbeat(_progress(doc["run"]))
                await asyncio.sleep(min(_seconds(retry_after), poll_s))
                continue
            raise self._refused(f"GET /v1/runs/{run_id}", status, doc)


def _seconds(retry_after: str) -> float:
    try:
        return max(0.0, float(retry_after))
    except ValueError:  # an HTTP-date: this API sends seconds; wait a moment
        return 1.0


def _why(details: activity.ActivityCancellationDetails | None) -> str:
    if details is None:
        return "no reason given"
    reasons = [name for name in ("cancel_requested", "worker_shutdown", "timed_out", "paused",
                                 "reset", "not_found") if getattr(details, name)]
    return ", ".join(reasons) or "no reason given"
