"""The deletion client: one HTTP call per attempt, classified into what the ledger needs.

Where the line between *transient* and *ambiguous* is drawn matters most: a failure before
the request left (connect refused, connect timeout) cannot have acted, so retrying is
safe; a timeout or reset after it left may have acted, so the outcome is unknown.
"""

from __future__ import annotations

import email.utils
import enum
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from yarl import URL

from supervisor.budget.base import Policy
from supervisor.config import PartnerConfig

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
# RFC 9110 delay-seconds is 1*DIGIT; a decimal fraction is tolerated, nothing else.
_DELAY_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")


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


def parse_retry_after(value: str | None, now: float, maximum: float) -> float | None:
    """Seconds to wait from a Retry-After (delay-seconds or HTTP-date, RFC 9110 §10.2.3).

    None when absent or unparseable; clamped to [0, maximum].
    """
    if value is None:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT
            return None
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), maximum)


def _params(item: str) -> dict[str, str]:
    out = {}
    for part in item.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        out[key.strip().lower()] = value.strip().strip('"')
    return out


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number >= 0 and math.isfinite(number) else None


def parse_policies(headers: Mapping[str, str], now: float) -> tuple[Policy, ...]:
    """The partner's rate-limit policies, from whichever header family it sends.

    * IETF draft 10/11: ``RateLimit-Policy: "burst";q=100;w=1, "day";q=50000;w=86400``
      (several policies in one field) and ``RateLimit: "day";r=12;t=3600``; also the older
      drafts' ``RateLimit-Policy: 100;w=60`` with ``RateLimit-Remaining/-Reset``.
    * ``X-RateLimit-Limit/-Remaining/-Reset``: one policy with no window. ``-Reset`` is
      seconds until the reset, or a Unix time when it is that large (GitHub). No window is
      sent: a reset within a second makes it a per-second pace, anything further a quota
      that holds everyone once spent.

    Unparseable parts are ignored: pacing then falls back to 429s.
    """
    out: dict[str, Policy] = {}
    state: dict[str, tuple[float | None, float | None]] = {}
    for item in headers.get("RateLimit", "").split(","):
        if item.strip():
            name = item.split(";")[0].strip().strip('"') or "default"
            params = _params(item)
            state[name] = (_number(params.get("r")), _number(params.get("t")))
    old = (_number(headers.get("RateLimit-Remaining")), _number(headers.get("RateLimit-Reset")))
    for i, item in enumerate(headers.get("RateLimit-Policy", "").split(",")):
        if not item.strip():
            continue
        params = _params(item)
        head = item.split(";")[0].strip()
        if "q" in params:
            name, quota = head.strip('"') or f"policy-{i}", _number(params.get("q"))
        else:
            name, quota = "default", _number(head)
        window = _number(params.get("w", "1"))
        if quota is None or not window:
            continue
        remaining, reset = state.get(name, old if "q" not in params else (None, None))
        out[name] = Policy(name, int(quota), window,
                           None if remaining is None else int(remaining), reset)
    limit = _number(headers.get("X-RateLimit-Limit"))
    if limit:
        remaining = _number(headers.get("X-RateLimit-Remaining"))
        reset = _number(headers.get("X-RateLimit-Reset"))
        if reset is not None and reset > 1e9:  # a Unix time, not a delay
            reset = max(0.0, reset - now)
        # The window is not sent. A reset within a second is a per-second limit, a pace;
        # anything further is a budget to spend until the reset (its window is unknown:
        # a reset 30 s away may be the middle of a minute, so limit / reset is no pace).
        window = 1.0 if reset is not None and reset <= 1 else 86400.0
        out["x-ratelimit"] = Policy("x-ratelimit", int(limit), window,
                                    None if remaining is None else int(remaining), reset)
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


class PartnerClient:
    """DELETE with Bearer token and ``Idempotency-Key``; one pooled session for all workers."""

    def __init__(self, config: PartnerConfig, pool_size: int) -> None:
        self.config = config
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._base = config.base_url.rstrip("/")

    async def start(self) -> None:
        headers = {"User-Agent": "cleanup-supervisor"}
        if self.config.token is not None:
            headers["Authorization"] = f"Bearer {self.config.token.reveal()}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=self._pool_size),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_seconds,
                                          connect=self.config.connect_timeout_seconds),
            headers=headers,
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
                retry_after = parse_retry_after(resp.headers.get("Retry-After"), time.time(),
                                                self.config.max_retry_after_seconds)
                verdict = classify(resp.status, retry_after)
                detail = f"HTTP {resp.status}"
                if resp.headers.get("Idempotent-Replayed", "").lower() == "true":
                    detail += " (replayed)"
                h = resp.headers
                policies: tuple[Policy, ...] = ()
                if "RateLimit-Policy" in h or "X-RateLimit-Limit" in h:
                    policies = parse_policies(h, time.time())
                return Answer(verdict, resp.status, detail, retry_after,
                              time.monotonic() - started, policies)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # Never connected: the partner cannot have acted.
            return Answer(Verdict.TRANSIENT, None, f"connect failed: {type(exc).__name__}",
                          elapsed_s=time.monotonic() - started)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            # Sent, or possibly sent: a timeout, reset or garbled answer after the request
            # left cannot tell us whether the partner acted.
            return Answer(Verdict.AMBIGUOUS, None, f"no answer: {type(exc).__name__}",
                          elapsed_s=time.monotonic() - started)

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
