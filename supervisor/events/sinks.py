"""Where events go: an Infrai queue or a signed HTTP webhook.

Both take a batch of events, oldest first, as one delivery of the same body,
``{"events": [{"id": ..., "kind": ..., ...}, ...]}``: one Infrai message, one POST. A
receiver deduplicates by each event's ``id``, which is the same on every delivery.

A webhook request carries:

- ``Idempotency-Key``: the event ID when the batch holds one event, else
  ``<first id>..<last id>`` (the same batch sent again carries the same key; a batch that
  differs carries another);
- ``X-Cleanup-Timestamp``: Unix seconds when this try was sent;
- ``X-Cleanup-Signature: sha256=<hex>``: HMAC-SHA256 with the sink's secret over
  ``<timestamp>.<raw body>`` (``signed = "timestamp_body"``, the default) or over the raw
  body alone (``signed = "body"``).

Only a 2xx answer counts as delivered; anything else (redirects included) is tried again.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import orjson

from supervisor.errors import QueueError
from supervisor.events.settings import SinkConfig
from supervisor.httputil import parse_retry_after
from supervisor.infrai.channel import InfraiChannel
from supervisor.logtext import LIMIT, outside
from supervisor.model import Event
from supervisor.queue.base import MAX_PAYLOAD_BYTES

SIGNATURE_HEADER = "X-Cleanup-Signature"
TIMESTAMP_HEADER = "X-Cleanup-Timestamp"
# One delivery stays under Infrai's message limit, with room for the request around it.
MAX_BODY_BYTES = MAX_PAYLOAD_BYTES - 4096
# A Retry-After is honoured up to this; the relay caps it again at its backoff ceiling.
MAX_RETRY_AFTER_S = 3600.0


class SinkError(Exception):
    """A delivery that did not succeed; ``retry_after_s`` when the receiver named a wait."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Sink(Protocol):
    @property
    def name(self) -> str: ...

    async def start(self) -> None: ...

    async def deliver(self, events: Sequence[Event]) -> int:
        """Deliver the oldest events of ``events`` (as many as fit in one delivery, at least
        one) and return how many; raise SinkError when the delivery did not succeed."""

    async def close(self) -> None: ...


def event_payload(e: Event) -> dict[str, Any]:
    """What a receiver sees of one event: identifiers and an outcome, nothing else."""
    out: dict[str, Any] = {
        "id": e.id, "kind": e.kind,
        "at": datetime.fromtimestamp(e.at, UTC).isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "run_id": e.run_id}
    if e.operation_id is not None:
        out["operation_id"] = e.operation_id
    if e.recipient_id is not None:
        out["recipient_id"] = e.recipient_id
    if e.outcome is not None:
        out["outcome"] = e.outcome
    if e.counts is not None:
        out["counts"] = dict(e.counts)
    return out


def batch_body(events: Sequence[Event],
               max_bytes: int = MAX_BODY_BYTES) -> tuple[int, dict[str, Any], bytes]:
    """The oldest events that fit in ``max_bytes`` (always at least one): how many, the
    body as an object and as the bytes that are sent."""
    n = len(events)
    while True:
        payload = {"events": [event_payload(e) for e in events[:n]]}
        raw = orjson.dumps(payload)
        if len(raw) <= max_bytes or n == 1:
            return n, payload, raw
        n = max(1, n // 2)


def idempotency_key(events: Sequence[Event]) -> str:
    return events[0].id if len(events) == 1 else f"{events[0].id}..{events[-1].id}"


def signature(secret: bytes, timestamp: str, body: bytes, signed: str = "timestamp_body") -> str:
    """The X-Cleanup-Signature value: ``sha256=`` and the hex HMAC-SHA256 of the signed bytes."""
    message = body if signed == "body" else timestamp.encode() + b"." + body
    return "sha256=" + hmac.new(secret, message, hashlib.sha256).hexdigest()


class InfraiSink:
    """Each batch is one message (``queue.publish``) on the sink's own Infrai queue, which
    is created at the first delivery if missing, with no dead-letter queue (the
    composition root builds its channel: supervisor/composition.py)."""

    def __init__(self, config: SinkConfig, channel: InfraiChannel) -> None:
        self.config = config
        self.channel = channel

    @property
    def name(self) -> str:
        return self.config.name

    async def start(self) -> None:
        await self.channel.start()

    async def deliver(self, events: Sequence[Event]) -> int:
        n, payload, _ = batch_body(events)
        try:
            # Keyed by the batch's events: a retry after a lost answer is one message.
            await self.channel.publish_payload(payload, key=f"ev-{idempotency_key(events[:n])}")
        except QueueError as exc:  # after the client's own retries; blocked keys too
            raise SinkError(str(exc)) from exc
        return n

    async def close(self) -> None:
        await self.channel.close()


class WebhookSink:
    """Each batch is one signed POST to the sink's URL."""

    def __init__(self, config: SinkConfig) -> None:
        if config.secret is None:
            raise ValueError(f"events sink {config.name}: no secret (config refuses this first)")
        self.config = config
        self._secret = config.secret.reveal().encode()
        self._session: aiohttp.ClientSession | None = None

    @property
    def name(self) -> str:
        return self.config.name

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.timeout_seconds),
            headers={"User-Agent": "cleanup-supervisor"})

    async def deliver(self, events: Sequence[Event]) -> int:
        if self._session is None:
            raise SinkError("webhook sink is not started")
        n, _, body = batch_body(events)
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": idempotency_key(events[:n]),
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: signature(self._secret, timestamp, body, self.config.signed),
        }
        try:
            async with self._session.post(self.config.url, data=body, headers=headers,
                                          allow_redirects=False) as resp:
                if 200 <= resp.status < 300:
                    return n
                detail = outside((await resp.content.read(LIMIT)).decode("utf-8", "replace")
                                 .strip())
                wait = parse_retry_after(resp.headers.get("Retry-After"), time.time(),
                                         MAX_RETRY_AFTER_S)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # aiohttp's text names the URL, which may hold a token: cut to the host.
            raise SinkError(outside(f"{type(exc).__name__}: {exc}".rstrip(": "))) from exc
        raise SinkError(f"HTTP {resp.status}" + (f": {detail}" if detail else ""), wait)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
