"""Infrai's REST API: bearer auth, the envelope, idempotency keys and retries, one place.

Every answer is read as the envelope ``{ok, data, error: {code, message, hint}}``, and
``ok: false`` is a failure whatever the HTTP status (a 5xx is one whatever the body).
A 429 waits out its ``Retry-After``; a 5xx, a reset, a timeout or an answer that is not
the envelope is retried with capped, jittered backoff under the same idempotency key, so
a retried create or publish creates one resource. A refused key (401/403) or no credit
(402 ``INSUFFICIENT_CREDIT``) is no fault of the call: it blocks the transport with one
log line and a metric until a call succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from supervisor import metrics
from supervisor.errors import QueueBlocked, QueueError, QueueRefused
from supervisor.httputil import parse_retry_after
from supervisor.infrai.settings import InfraiConfig
from supervisor.logtext import outside

log = logging.getLogger(__name__)

BLOCKING = {401: "UNAUTHORIZED", 403: "FORBIDDEN", 402: "INSUFFICIENT_CREDIT"}
# Error codes of an ok:false answer that say "try again" (no list is documented).
RETRYABLE = frozenset({"", "INTERNAL", "INTERNAL_ERROR", "SERVICE_UNAVAILABLE", "TIMEOUT",
                       "UNAVAILABLE", "RATE_LIMITED", "BAD_GATEWAY"})


class InfraiError(QueueRefused):
    """Infrai answered a documented failure that retrying will not cure (4xx)."""

    def __init__(self, call: str, status: int, code: str, message: str, hint: str) -> None:
        self.status = status
        self.code = code
        self.hint = hint
        text = f"Infrai {call}: HTTP {status} {code}: {message}"
        super().__init__(text + (f" ({hint})" if hint else ""))


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed try: whether to try again, after how long (None: backoff), and why."""

    retry: bool
    wait_s: float | None
    error: QueueError


class InfraiClient:
    def __init__(self, config: InfraiConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self.blocked: str | None = None  # the code that blocks us, while it does
        self._blocked_label = ""  # its metric label: one of BLOCKING's (review L4)

    async def start(self) -> None:
        if self.config.token is None:
            raise QueueError("infrai.token_env: no project key")  # config refuses this first
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_seconds)
        self._session = aiohttp.ClientSession(
            base_url=self.config.base_url.rstrip("/") + "/", timeout=timeout,
            headers={"Authorization": f"Bearer {self.config.token.reveal()}",
                     "Content-Type": "application/json"},
            json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, name: str, path: str, body: Mapping[str, Any] | None = None,
                   idempotency_key: str | None = None, retry: bool = True,
                   method: str = "POST") -> Any:
        """``method`` (POST unless said) ``body`` to ``path``; return the envelope's ``data``.

        Raises QueueBlocked (401/403/402), InfraiError (another refusal) or QueueError
        (still failing after ``max_attempts``).
        """
        if self._session is None:
            raise QueueError("Infrai client is not started")
        payload = dict(body or {})
        headers = {}
        if idempotency_key is not None:
            # Both places: the method tables name the body field, the conventions the
            # header; which wins when they differ is undocumented, so they never differ.
            payload["idempotency_key"] = idempotency_key
            headers["Idempotency-Key"] = idempotency_key
        data = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS) + b"\n"
        c = self.config
        attempt = 0
        while True:
            attempt += 1
            result = await self._try(name, method, path.lstrip("/"),
                                     data if method == "POST" else None, headers)
            if not isinstance(result, _Failure):
                self._unblock()
                return result
            if not retry or not result.retry or attempt >= c.max_attempts:
                raise result.error
            wait = result.wait_s
            if wait is None:
                ceiling = min(c.backoff_max_seconds, c.backoff_initial_seconds * 2 ** (attempt - 1))
                wait = ceiling / 2 + random.uniform(0, ceiling / 2)
            log.debug("Infrai %s failed (%s); try %d of %d in %.2fs", name, result.error,
                      attempt + 1, c.max_attempts, wait)
            await asyncio.sleep(wait)  # a backoff, not a synchronisation

    async def _try(self, name: str, method: str, path: str, data: bytes | None,
                   headers: Mapping[str, str]) -> Any:
        assert self._session is not None
        try:
            async with self._session.request(method, path, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            metrics.TRANSPORT_CALLS.labels(name, "error").inc()
            # Reset or timed out: it may have acted. The retry carries the same key.
            return _Failure(True, None, QueueError(
                f"Infrai {name}: {type(exc).__name__}: {outside(str(exc))}"))
        metrics.TRANSPORT_CALLS.labels(name, str(status)).inc()
        envelope = _envelope(raw)
        if status == 429:
            wait = parse_retry_after(retry_after, time.time(), self.config.max_retry_after_seconds)
            return _Failure(True, wait, QueueError(f"Infrai {name}: HTTP 429 (rate limited)"))
        if status in BLOCKING:
            code = _error(envelope)[0] or BLOCKING[status]
            self._block(code, status, _error(envelope)[2])
            return _Failure(False, None, QueueBlocked(code, f"Infrai {name}: HTTP {status} {code}"))
        if envelope is None:
            return _Failure(True, None, QueueError(
                f"Infrai {name}: HTTP {status} answer is not the Infrai envelope: {raw[:200]!r}"))
        if status >= 400 or envelope.get("ok") is not True:
            code, message, hint = _error(envelope)
            if status >= 500 or (status < 400 and code in RETRYABLE):
                # Any 5xx, or ok:false with a 2xx naming the service's own trouble (or
                # naming nothing): retried. A 4xx fails whatever its body says.
                return _Failure(True, None, QueueError(
                    f"Infrai {name}: HTTP {status} {code or 'not ok'}: {message}"))
            return _Failure(False, None, InfraiError(name, status, code or "NOT_OK",
                                                     message, hint))
        return envelope.get("data")

    def _block(self, code: str, status: int, hint: str) -> None:
        if self.blocked != code:
            log.error("Infrai refuses us: HTTP %d %s%s; consumption stopped until it clears "
                      "(nothing is lost)", status, code, f" ({hint})" if hint else "",
                      extra={"action": "transport_blocked"})
            if self.blocked is not None:
                metrics.TRANSPORT_BLOCKED.labels(self._blocked_label).set(0)
            self.blocked = code
            # Infrai's own code names the label only when it is one of the few known:
            # any other text it sends must not grow the series (the log line has it).
            self._blocked_label = code if code in BLOCKING.values() else BLOCKING[status]
            metrics.TRANSPORT_BLOCKED.labels(self._blocked_label).set(1)

    def _unblock(self) -> None:
        if self.blocked is not None:
            log.warning("Infrai accepts us again (was %s); consumption resumes", self.blocked,
                        extra={"action": "transport_unblocked"})
            metrics.TRANSPORT_BLOCKED.labels(self._blocked_label).set(0)
            self.blocked = None


def _envelope(raw: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
        return None
    return value


def _error(envelope: Mapping[str, Any] | None) -> tuple[str, str, str]:
    error = envelope.get("error") if envelope else None
    if not isinstance(error, dict):
        return "", "", ""
    code, message, hint = (str(error.get(k) or "") for k in ("code", "message", "hint"))
    # Infrai's own text goes into errors that are logged: escaped and bounded.
    return outside(code, 64), outside(message), outside(hint)
