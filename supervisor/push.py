"""Push delivery: Infrai POSTs each message of a subscribed queue to ``/v1/push/{queue}``.

A delivery is verified (an HMAC-SHA256 of the raw body with the subscription's secret),
read as one message, and worked by the same consumer code as a pulled one
(:meth:`supervisor.consumer.ConsumerPool.handle_pushed`) on a pool whose transport is a
:class:`PushedQueue`: its ack and its "publish again later" only note on the delivery
what the HTTP answer must say, because the answer *is* the ack. A 2xx deletes the message
at Infrai, so it is sent only after the ledger committed the outcome; a retry wait is a
non-2xx with ``Retry-After`` (the delivery is the message: Infrai redelivers it).

The reference leaves the delivery's body, headers and signature UNKNOWN
(infrai-api.md 3.2, 7.11): every choice made here is a setting of :class:`PushSettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from supervisor.configtypes import Secret
from supervisor.errors import QueueError
from supervisor.queue.base import (
    MAX_DELAY_S,
    Capabilities,
    Delivery,
    Message,
    QueueStats,
    Unsupported,
)

# "timestamp.body": HMAC over "<timestamp>." + body, the timestamp header required (a
# replay outside the tolerance fails); "body": HMAC over the raw body alone.
Scheme = Literal["timestamp.body", "body"]
SCHEMES: tuple[Scheme, ...] = ("timestamp.body", "body")
_FIELDS = ("run_id", "operation_id", "recipient_id")
_TIMESTAMP = re.compile(r"[0-9]{1,16}(\.[0-9]{1,9})?")
# A Unix time past this is in milliseconds (it is the year 5138 in seconds).
_MILLIS_FROM = 1e11


@dataclass(frozen=True, slots=True)
class PushSettings:
    """How deliveries are verified and paced (from ``infrai.push_*``)."""

    secret: Secret
    signature_header: str = "X-Infrai-Signature"
    # Stripped when present; a bare lowercase or uppercase hex digest is accepted too.
    signature_prefix: str = "sha256="
    timestamp_header: str = "X-Infrai-Timestamp"
    scheme: Scheme = "timestamp.body"
    timestamp_tolerance_s: float = 300.0
    # The lease Infrai gives one delivery (subscribed as visibility_timeout).
    visibility_timeout_s: float = 60.0
    # A delivery that would wait longer than this for the limiter is refused with 429
    # and Retry-After instead of holding the connection (must stay below the lease).
    max_wait_s: float = 5.0


class PushRejected(Exception):
    """A delivery refused before anything was written: the status and why."""

    def __init__(self, status: int, message: str, result: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.result = result  # the metric label


def verify(settings: PushSettings, headers: Mapping[str, str], body: bytes,
           now: float) -> None:
    """Raise PushRejected (401) unless ``body`` carries a valid, fresh signature."""
    sig_name, ts_name = settings.signature_header, settings.timestamp_header
    supplied = headers.get(sig_name)
    if supplied is None or not supplied.strip():
        raise PushRejected(401, f"missing {sig_name} header (HMAC-SHA256 of the body)",
                           "unsigned")
    stamp = headers.get(ts_name)
    stamp = stamp.strip() if stamp is not None else None
    signed = settings.scheme == "timestamp.body"
    if signed and not stamp:
        raise PushRejected(401, f"missing {ts_name} header: the signature covers "
                                f"'<{ts_name}>.' + body", "unsigned")
    material = f"{stamp}.".encode("utf-8", "replace") + body if signed else body
    expected = hmac.new(settings.secret.reveal().encode(), material, hashlib.sha256) \
        .hexdigest().encode()
    ok = False
    prefix = settings.signature_prefix.lower()
    # Several signatures (a rotation) may come comma-separated: any one may match. Every
    # candidate is compared, in constant time.
    for candidate in supplied.split(","):
        value = candidate.strip()
        if prefix and value.lower().startswith(prefix):
            value = value[len(prefix):]
        ok |= hmac.compare_digest(value.lower().encode("utf-8", "replace"), expected)
    if not ok:
        raise PushRejected(401, f"{sig_name} does not match the body (HMAC-SHA256 with the "
                                "push secret)", "bad_signature")
    if stamp is not None:
        at = _timestamp(stamp)
        if at is None:
            raise PushRejected(401, f"{ts_name} must be a Unix time in seconds, got "
                                    f"{stamp[:40]!r}", "stale")
        if abs(now - at) > settings.timestamp_tolerance_s:
            raise PushRejected(401, f"{ts_name} is {abs(now - at):.0f} s away from now, beyond "
                                    f"the {settings.timestamp_tolerance_s:g} s tolerance "
                                    "(a replay, or a clock off)", "stale")


def _timestamp(text: str) -> float | None:
    if not _TIMESTAMP.fullmatch(text):
        return None
    value = float(text)
    return value / 1000.0 if value >= _MILLIS_FROM else value


def parse_delivery(body: bytes) -> Delivery:
    """The delivery in ``body``: ``{"message_id", "payload": {run_id, operation_id,
    recipient_id}}`` (``body`` instead of ``payload`` too, and a payload sent as JSON
    text). Raises PushRejected (400) naming the field that is wrong."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise PushRejected(400, f"body is not valid JSON: {exc}", "malformed") from None
    if not isinstance(doc, dict):
        raise PushRejected(400, "body must be a JSON object", "malformed")
    message_id = doc.get("message_id")
    if not isinstance(message_id, str) or not message_id or len(message_id) > 500:
        raise PushRejected(400, "message_id is missing or not a non-empty string", "malformed")
    name = "payload" if "payload" in doc else "body"
    payload = doc.get(name)
    if isinstance(payload, str):
        with contextlib.suppress(orjson.JSONDecodeError):
            payload = orjson.loads(payload)
    if not isinstance(payload, dict):
        raise PushRejected(400, "payload (or body) is missing or not a JSON object",
                           "malformed")
    values = []
    for key in _FIELDS:
        value = payload.get(key)
        if not isinstance(value, str) or not value or len(value) > 500:
            raise PushRejected(400, f"{name}.{key} is missing or not a non-empty string",
                               "malformed")
        values.append(value)
    return Delivery(Message(*values), message_id,
                    f"push/{message_id}/{secrets.token_hex(6)}")


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """What to answer Infrai for one delivery: a 2xx acks (deletes) it, anything else
    has it delivered again, after ``retry_after_s`` if Infrai honours the header."""

    status: int
    detail: str
    retry_after_s: float | None = None
    result: str = "accepted"  # the metric label

    @property
    def retry_after(self) -> str | None:
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(slots=True)
class PushRecord:
    """What the consumer code did with one delivery's message."""

    delivery: Delivery
    acked: bool = False
    retry_after_s: float | None = None  # set: due again after this long (a non-2xx)


class PushHandler(Protocol):
    async def handle_pushed(self, delivery: Delivery) -> PushOutcome: ...


@dataclass
class PushReceiver:
    """What the HTTP route needs: how to verify, and the pool each queue is pushed to."""

    settings: PushSettings
    handlers: Mapping[str, PushHandler] = field(default_factory=dict)


class PushedQueue:
    """The transport of a pool that is pushed to. Nothing is received (deliveries arrive
    over HTTP); an ack and a publish of the delivery's own message only note on its
    :class:`PushRecord` what the answer must be. No transactional ack, nack, extend or
    stats, so the courier takes its managed-transport path unchanged: a retry wait is
    "publish again with a delay, then ack", which here records the delay, and the answer
    is a non-2xx carrying it as ``Retry-After``. A wait past ``max_delay_s`` is acked and
    left to redrive (the courier publishes nothing for it)."""

    def __init__(self, lease_s: float, max_wait_s: float,
                 max_delay_s: float = MAX_DELAY_S) -> None:
        self.lease_s = lease_s  # the visibility timeout of one delivery
        self.max_wait_s = max_wait_s  # the longest a delivery may wait for the limiter
        self._capabilities = Capabilities(transactional_ack=False, extend=False, nack=False,
                                          stats=False, max_delay_s=max_delay_s, pull=False)
        self._open: dict[str, PushRecord] = {}

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def healthy(self) -> bool:
        return True

    @contextlib.contextmanager
    def track(self, delivery: Delivery) -> Iterator[PushRecord]:
        record = PushRecord(delivery)
        self._open[delivery.receipt] = record
        try:
            yield record
        finally:
            self._open.pop(delivery.receipt, None)

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        ids = []
        for m in messages:
            # The courier publishes again only the message of a delivery it holds: the
            # very object, so two deliveries of one operation are never confused.
            record = next((r for r in self._open.values() if r.delivery.message is m), None)
            if record is None:
                raise QueueError(f"a pushed queue cannot publish a new message "
                                 f"({m.operation_id}); publish to the subscribed queue")
            record.retry_after_s = delay_s
            ids.append(record.delivery.message_id)
        return ids

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        return []  # a running pool's fetcher finds nothing: its messages come over HTTP

    async def wait(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)  # an idle poll of nothing, not a synchronisation

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            record = self._open.get(d.receipt)
            if record is not None:
                record.acked = True

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        raise Unsupported("a pushed delivery is handed back by its answer")

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        raise Unsupported("a pushed delivery's lease cannot be extended")

    async def stats(self) -> QueueStats:
        raise Unsupported("a pushed queue has no stats: the ledger reports them")

    async def close(self) -> None:
        return None


def answer_body(outcome: PushOutcome, delivery: Delivery) -> dict[str, Any]:
    """The JSON answer: small (Infrai may keep only part of it)."""
    body: dict[str, Any] = {"message_id": delivery.message_id,
                            "operation_id": delivery.message.operation_id}
    if 200 <= outcome.status < 300:
        return {"ok": True, **body, "result": outcome.detail}
    return {"error": outcome.detail, **body, "retry_after": outcome.retry_after}
