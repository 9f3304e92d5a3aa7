"""The deletion client: one HTTP call per attempt, classified into what the ledger needs.

Where the line between *transient* and *ambiguous* is drawn matters most: a failure before
the request left (connect refused, connect timeout) cannot have acted, so retrying is
safe; a timeout or reset after it left may have acted, so the outcome is unknown.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from yarl import URL

from supervisor import metrics
from supervisor.budget.base import Feedback, Outcome, Policy, RateBudget
from supervisor.config import PartnerConfig
from supervisor.httputil import Ignored, parse_retry_after, report_ignored
from supervisor.timestamps import epoch_seconds

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class Verdict(enum.Enum):
    DELETED = "deleted"
    ABSENT = "absent"
    THROTTLED = "throttled"
    TRANSIENT = "transient"  # did not act; safe to retry
    TERMINAL = "terminal"  # will never succeed as sent
    AMBIGUOUS = "ambiguous"  # may have acted


@dataclass(frozen=True, slots=True)
class Answer:
    verdict: Verdict
    status: int | None
    detail: str
    retry_after_s: float | None = None
    elapsed_s: float = 0.0
    policies: tuple[Policy, ...] = ()


class Presence(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


# Past this a value is a Unix time (2001, in seconds or milliseconds: timestamps.py), not
# seconds left: a delay that long (31 years) is no delay anyone means.
_EPOCH_FROM = 1e9
# How much later than a second away a reset sent as a Unix time may read and still be a
# per-second window: the partner's clock ahead of ours (servers kept by NTP are within
# tens of milliseconds) and its rounding (now plus a counter's whole-second TTL, rounded
# up to the millisecond, is 1.001 s away). The cost: an hourly or daily quota read in its
# last quarter second is taken for a pace, and spent into for that long.
EPOCH_SKEW_S = 0.25
# At most this many policies are read from one field: a partner (or a middlebox) that
# sends thousands must not make every answer cost thousands of steps.
MAX_POLICIES_PER_FIELD = 16
# A policy name becomes a metric label value: only these characters, this long.
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")
MAX_NAME = 64


def _unix_time(value: float) -> bool:
    """Whether a reset is a Unix time (in seconds or milliseconds), not seconds left."""
    return value > _EPOCH_FROM


def reset_seconds(value: float, now: float) -> float:
    """Seconds until a reset given as seconds left, a Unix time in seconds or one in
    milliseconds, told apart by magnitude; a time already past is 0."""
    if _unix_time(value):
        return max(0.0, epoch_seconds(value) - now)
    return value


def policy_name(raw: str, fallback: str) -> str:
    """A partner's policy name as a bounded, label-safe string."""
    name = _NAME_CHARS.sub("_", raw)[:MAX_NAME]
    return name or fallback


def _params(item: str) -> dict[str, str]:
    out = {}
    for part in item.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        out[key.strip().lower()] = value.strip().strip('"')
    return out


def _number(value: str | None, header: str = "",
            on_ignored: Ignored | None = None) -> float | None:
    """A finite number >= 0; None when absent, and when not one (reported)."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        report_ignored(on_ignored, header, "not a number")
        return None
    if not math.isfinite(number):
        report_ignored(on_ignored, header, "not a finite number")
        return None
    if number < 0:
        report_ignored(on_ignored, header, "negative")
        return None
    return number


def _items(value: str) -> list[str]:
    return [item for item in value.split(",") if item.strip()][:MAX_POLICIES_PER_FIELD]


def _clamp(reset: float | None, window: float | None, maximum: float) -> float | None:
    """A quota's reset no later than its window (when known) and the longest pause."""
    if reset is None:
        return None
    return min(reset, window if window is not None else math.inf, maximum)


def parse_policies(headers: Mapping[str, str], now: float, maximum: float = math.inf,
                   on_ignored: Ignored | None = None) -> tuple[Policy, ...]:
    """The partner's rate-limit policies, from whichever header family it sends.

    * IETF draft 10/11: ``RateLimit-Policy: "burst";q=100;w=1, "day";q=50000;w=86400``
      (several policies in one field) and ``RateLimit: "day";r=12;t=3600``; also the older
      drafts' ``RateLimit-Policy: 100;w=60`` with ``RateLimit-Remaining/-Reset``.
    * ``X-RateLimit-Limit/-Remaining/-Reset``: one policy with no window. ``-Reset`` is
      seconds until the reset, or a Unix time in seconds (GitHub) or milliseconds when it
      is that large. No window is sent: a reset within a second (a Unix time allowed
      ``EPOCH_SKEW_S`` more) makes it a per-second pace, anything further a quota that
      holds everyone once spent.

    Every reset is read by magnitude the same way, and clamped to its policy's window
    where that is known and to ``maximum`` (``partner.max_retry_after_seconds``) always:
    no header can hold the workers longer than a Retry-After could. Unparseable,
    negative or non-finite values are ignored (reported to ``on_ignored``): pacing then
    falls back to 429s.
    """
    def number(value: str | None, header: str) -> float | None:
        return _number(value, header, on_ignored)

    def reset(value: str | None, header: str) -> float | None:
        seconds = number(value, header)
        return None if seconds is None else reset_seconds(seconds, now)

    out: dict[str, Policy] = {}
    state: dict[str, tuple[float | None, float | None]] = {}
    for item in _items(headers.get("RateLimit", "")):
        name = policy_name(item.split(";")[0].strip().strip('"'), "default")
        params = _params(item)
        state[name] = (number(params.get("r"), "RateLimit"), reset(params.get("t"), "RateLimit"))
    old = (number(headers.get("RateLimit-Remaining"), "RateLimit-Remaining"),
           reset(headers.get("RateLimit-Reset"), "RateLimit-Reset"))
    for i, item in enumerate(_items(headers.get("RateLimit-Policy", ""))):
        params = _params(item)
        head = item.split(";")[0].strip()
        if "q" in params:
            name = policy_name(head.strip('"'), f"policy-{i}")
            quota = number(params.get("q"), "RateLimit-Policy")
        else:
            name, quota = "default", number(head, "RateLimit-Policy")
        window = number(params.get("w", "1"), "RateLimit-Policy")
        if quota is None or not window:
            continue
        remaining, until = state.get(name, old if "q" not in params else (None, None))
        out[name] = Policy(name, int(quota), window,
                           None if remaining is None else int(remaining),
                           _clamp(until, window, maximum))
    limit = number(headers.get("X-RateLimit-Limit"), "X-RateLimit-Limit")
    if limit:
        remaining = number(headers.get("X-RateLimit-Remaining"), "X-RateLimit-Remaining")
        raw = number(headers.get("X-RateLimit-Reset"), "X-RateLimit-Reset")
        until = _clamp(None if raw is None else reset_seconds(raw, now), None, maximum)
        # The window is not sent. A reset within a second is a per-second limit, a pace;
        # anything further is a budget to spend until the reset (its window is unknown:
        # a reset 30 s away may be the middle of a minute, so limit / reset is no pace).
        # A Unix time is the partner's clock, ours off by its skew: one within a second
        # of its clock may read a little later on ours (a partner that sends now plus its
        # counter's TTL, rounded up to the millisecond, reads 1.001 s). In whole seconds
        # it is also up to a second after the real reset. Read as a budget, a per-second
        # window held every worker to its reset on each spent second (1.745 x N/R with
        # no 429 in whole seconds, 1.297 with six in milliseconds).
        within = 1.0
        if raw is not None and _unix_time(raw):
            in_whole_seconds = epoch_seconds(raw) == raw == int(raw)
            within += EPOCH_SKEW_S + (1.0 if in_whole_seconds else 0.0)
        window = 1.0 if until is not None and until <= within else 86400.0
        out["x-ratelimit"] = Policy("x-ratelimit", int(limit), window,
                                    None if remaining is None else int(remaining), until)
    return tuple(out.values())


def classify(status: int, retry_after_s: float | None) -> Verdict:
    if 200 <= status < 300:
        return Verdict.DELETED
    if status in (404, 410):
        return Verdict.ABSENT
    if status == 429:
        return Verdict.THROTTLED
    # 409: the original request with this key is still in progress (IETF Idempotency-Key
    # draft): retry later with the same key.
    if status in (408, 409) or status >= 500:
        return Verdict.TRANSIENT
    return Verdict.TERMINAL


def recipient_path(template: str, recipient_id: str) -> str:
    encoded = quote(recipient_id, safe="")
    if encoded in (".", ".."):
        # Dot segments would be resolved away and address the parent collection.
        encoded = encoded.replace(".", "%2E")
    return template.replace("{recipient_id}", encoded)


def no_answer(exc: BaseException, started: float) -> Answer:
    """What a request that got no answer (``exc``) may have done: a connection never
    made cannot have acted (transient); a timeout, reset or garbled answer after the
    request left cannot tell (ambiguous). ``started``: its monotonic start."""
    elapsed = time.monotonic() - started
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return Answer(Verdict.TRANSIENT, None, f"connect failed: {type(exc).__name__}",
                      elapsed_s=elapsed)
    return Answer(Verdict.AMBIGUOUS, None, f"no answer: {type(exc).__name__}",
                  elapsed_s=elapsed)


async def paced_probe(budget: RateBudget, partner: PartnerClient,
                      recipient_id: str) -> tuple[Presence, str]:
    """A probe on the budget deletions spend (a partner may count every request), its
    finding counted. Its answer is no rate signal: a 404 here means gone, not paced."""
    grant = await budget.acquire()
    try:
        presence, detail = await partner.probe(recipient_id)
    finally:
        budget.release(grant, Feedback(Outcome.OTHER))
    metrics.PROBES.labels(presence.value).inc()
    return presence, detail


class IgnoredHeaders:
    """Counts every header value the parsers ignore, and says so in the log at most once
    per header every ``LOG_EVERY_S`` (a partner sending garbage on every answer must not
    flood the log), with how many were ignored since."""

    LOG_EVERY_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged_at: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def __call__(self, header: str, why: str) -> None:
        metrics.PARTNER_HEADER_IGNORED.labels(header).inc()
        self._since[header] = self._since.get(header, 0) + 1
        now = self._clock()
        if now - self._logged_at.get(header, -math.inf) < self.LOG_EVERY_S:
            return
        self._logged_at[header] = now
        count = self._since.pop(header)
        log.warning("partner header %s ignored: %s (%d ignored since the last such line)",
                    header, why, count, extra={"action": "partner_header_ignored"})


def _departures(departed: Callable[[], None]) -> aiohttp.TraceConfig:
    """aiohttp calls this as a request's headers are written: when it leaves, which may be
    milliseconds after its grant (the ledger's ownership check, a pooled connection)."""
    async def sent(_session: aiohttp.ClientSession, _ctx: object,
                   _params: aiohttp.TraceRequestHeadersSentParams) -> None:
        departed()

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(sent)
    return trace


class PartnerClient:
    """DELETE with Bearer token and ``Idempotency-Key``; one pooled session for all workers."""

    def __init__(self, config: PartnerConfig, pool_size: int,
                 departed: Callable[[], None] | None = None) -> None:
        self.config = config
        self._pool_size = pool_size
        # Told as each request's headers are written (the budget's strict pacing).
        self._departed = departed
        self._session: aiohttp.ClientSession | None = None
        self._base = config.base_url.rstrip("/")
        self._ignored = IgnoredHeaders()

    async def start(self) -> None:
        headers = {"User-Agent": "cleanup-supervisor"}
        if self.config.token is not None:
            headers["Authorization"] = f"Bearer {self.config.token.reveal()}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=self._pool_size),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_seconds,
                                          connect=self.config.connect_timeout_seconds),
            headers=headers,
            trace_configs=[] if self._departed is None else [_departures(self._departed)],
        )
        # aiohttp silently resends an idempotent method (DELETE) once when a pooled
        # connection drops mid-request. A DELETE that may have acted must never be resent
        # behind the ledger's back: whether to retry is the consumer's decision, made on
        # the recorded attempt. aiohttp's own test client uses this same switch.
        self._session._retry_connection = False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (its auth header, timeouts and no silent resends), for the
        batch client (supervisor/batch/client.py)."""
        assert self._session is not None, "PartnerClient.start() was not awaited"
        return self._session

    @property
    def ignored(self) -> IgnoredHeaders:
        return self._ignored

    def url(self, path: str) -> URL:
        """``path`` (already encoded) under the partner's base URL."""
        return URL(self._base + path, encoded=True)

    def _url(self, template: str, recipient_id: str) -> URL:
        return URL(self._base + recipient_path(template, recipient_id), encoded=True)

    async def delete(self, recipient_id: str, idempotency_key: str) -> Answer:
        """Send one DELETE; never raises for the partner's or the network's failures."""
        assert self._session is not None, "PartnerClient.start() was not awaited"
        url = self._url(self.config.delete_path, recipient_id)
        headers = {}
        if self.config.idempotency_keys:
            headers["Idempotency-Key"] = idempotency_key
        started = time.monotonic()
        try:
            async with self._session.delete(url, headers=headers,
                                            allow_redirects=False) as resp:
                await resp.content.read(MAX_BODY_BYTES)
                now, maximum = time.time(), self.config.max_retry_after_seconds
                retry_after = parse_retry_after(resp.headers.get("Retry-After"), now, maximum,
                                                self._ignored)
                verdict = classify(resp.status, retry_after)
                detail = f"HTTP {resp.status}"
                if resp.headers.get("Idempotent-Replayed", "").lower() == "true":
                    detail += " (replayed)"
                h = resp.headers
                policies: tuple[Policy, ...] = ()
                if "RateLimit-Policy" in h or "X-RateLimit-Limit" in h:
                    policies = parse_policies(h, now, maximum, self._ignored)
                return Answer(verdict, resp.status, detail, retry_after,
                              time.monotonic() - started, policies)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return no_answer(exc, started)

    async def probe(self, recipient_id: str) -> tuple[Presence, str]:
        """Ask whether the recipient still exists (reconciliation evidence)."""
        assert self._session is not None, "PartnerClient.start() was not awaited"
        if not self.config.probe_path:
            return Presence.UNKNOWN, "no probe configured"
        url = self._url(self.config.probe_path, recipient_id)
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                await resp.content.read(MAX_BODY_BYTES)
                if 200 <= resp.status < 300:
                    return Presence.PRESENT, f"probe HTTP {resp.status}"
                if resp.status in (404, 410):
                    return Presence.ABSENT, f"probe HTTP {resp.status}"
                return Presence.UNKNOWN, f"probe HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return Presence.UNKNOWN, f"probe failed: {type(exc).__name__}"
