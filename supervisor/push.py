"""Push delivery: Infrai POSTs each message of a subscribed queue to ``/v1/push/{queue}``.

A delivery is verified (an HMAC-SHA256 of the raw body with the subscription's secret),
read as one message, and worked by the same consumer code as a pulled one
(:meth:`supervisor.consumer.ConsumerPool.deliver`, through :class:`PushEntry`) on a pool
whose transport is a :class:`PushedQueue`: its ack and its "publish again later" only
note on the delivery what the HTTP answer must say, because the answer *is* the ack. A 2xx deletes the message
at Infrai, so it is sent only after the ledger committed the outcome; a retry wait is a
non-2xx with ``Retry-After`` (the delivery is the message: Infrai redelivers it).

A signed request can be captured (a body-logging proxy, Infrai's delivery log) and sent
again. A copy of a delivery already verified (the same message ID and signature, while
that signature still verifies) is answered from :class:`ReplayCache` and never reaches
the ledger: it counts no receive, and no number of copies turns into a poison message.

The reference leaves the delivery's body, headers and signature UNKNOWN
(infrai-api.md 3.2, 7.11): every choice made here is a setting of :class:`PushSettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from supervisor import metrics
from supervisor.budget.base import RateBudget
from supervisor.configtypes import Secret
from supervisor.errors import QueueError, StorageError
from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import MAX_DELAY_S, Capabilities, Unsupported
from supervisor.timestamps import epoch_seconds

log = logging.getLogger(__name__)

# "timestamp.body": HMAC over "<timestamp>." + body, the timestamp header required (a
# replay outside the tolerance fails); "body": HMAC over the raw body alone.
Scheme = Literal["timestamp.body", "body"]
SCHEMES: tuple[Scheme, ...] = ("timestamp.body", "body")
_FIELDS = ("run_id", "operation_id", "recipient_id")
_TIMESTAMP = re.compile(r"[0-9]{1,16}(\.[0-9]{1,9})?")
# What a copy is told while the first of its kind is still being worked.
REPLAY_BUSY_S = 5.0
# Answers that wrote nothing, or nothing for sure: a copy of one may be worked afresh.
_NOT_REMEMBERED = ("held", "unavailable")


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
    # Deliveries remembered against replays (about 150 bytes each); past this the oldest
    # is forgotten, and counted.
    replay_cache_entries: int = 100_000


class PushRejected(Exception):
    """A delivery refused before anything was written: the status and why."""

    def __init__(self, status: int, message: str, result: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.result = result  # the metric label


@dataclass(frozen=True, slots=True)
class Verified:
    """A delivery whose signature matched: the digest it matched (whatever case, prefix
    or rotation list the header spelt it with) and until when that signature verifies."""

    digest: str
    valid_until: float


def verify(settings: PushSettings, headers: Mapping[str, str], body: bytes,
           now: float) -> Verified:
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
    tolerance = settings.timestamp_tolerance_s
    if stamp is not None:
        at = _timestamp(stamp)
        if at is None:
            raise PushRejected(401, f"{ts_name} must be a Unix time in seconds, got "
                                    f"{stamp[:40]!r}", "stale")
        if abs(now - at) > tolerance:
            raise PushRejected(401, f"{ts_name} is {abs(now - at):.0f} s away from now, beyond "
                                    f"the {tolerance:g} s tolerance "
                                    "(a replay, or a clock off)", "stale")
        if signed:
            return Verified(expected.decode(), at + tolerance)
    # An unsigned timestamp bounds nothing (a copy leaves it off): such a signature
    # verifies forever, and is remembered for the tolerance from now.
    return Verified(expected.decode(), now + tolerance)


def _timestamp(text: str) -> float | None:
    if not _TIMESTAMP.fullmatch(text):
        return None
    return epoch_seconds(float(text))


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


class Consumer(Protocol):
    """What a pushed delivery needs of the pool that works it
    (:class:`supervisor.consumer.ConsumerPool`)."""

    budget: RateBudget

    @property
    def stopping(self) -> bool: ...

    @property
    def waiting(self) -> int:
        """The pool's deliveries held and not yet sent."""

    @property
    def busy_s(self) -> float:
        """How long an attempt holds its operation."""

    @property
    def storage_healthy(self) -> bool:
        """False once the ledger has reported a failed commit itself."""

    async def deliver(self, delivery: Delivery, lease_s: float) -> None:
        """Note its receive, decide, attempt and settle, as a pulled delivery is."""


class PushEntry:
    """One subscribed queue's deliveries into ``pool``, whose transport is ``queue``: a
    pulled message's bookkeeping, decision and attempt, answered instead of acked (2xx
    only once the outcome is committed). While the limiter holds, or no token is likely
    within ``max_wait_s``, nothing is counted or sent."""

    def __init__(self, pool: Consumer, queue: PushedQueue) -> None:
        self.pool = pool
        self.queue = queue

    async def handle_pushed(self, delivery: Delivery) -> PushOutcome:
        pool, queue = self.pool, self.queue
        if pool.stopping:
            return PushOutcome(503, "shutting down", 1.0, "unavailable")
        snap = pool.budget.snapshot()
        hold = snap.held_for(time.time())
        # Ahead of it: this pool's deliveries not yet sent, or every request holding a
        # slot of the budget (other pools' too), whichever is more.
        ahead = max(pool.waiting, snap.in_flight)
        wait = hold or ahead / max(snap.rate, 1e-9)
        if hold > 0 or wait > queue.max_wait_s:
            why = "the partner's limit holds every request" if hold else \
                f"no token within {queue.max_wait_s:g} s"
            return PushOutcome(429, why, wait, "held")
        try:
            with queue.track(delivery) as record:
                await pool.deliver(delivery, queue.lease_s)
        except (StorageError, QueueError) as exc:
            log.log(logging.WARNING if pool.storage_healthy else logging.DEBUG,
                    "could not record pushed operation %s: %s", delivery.message.operation_id,
                    exc)
            return PushOutcome(503, "outcome not recorded (ledger fault)", 5.0, "unavailable")
        if record.retry_after_s is not None:
            held = pool.budget.snapshot().held_for(time.time()) > 0
            return PushOutcome(429 if held else 503, "retry wait: deliver again later",
                               record.retry_after_s, "retry")
        if not record.acked:  # another delivery of the operation has its attempt
            return PushOutcome(503, "the operation is in flight", pool.busy_s, "busy")
        return PushOutcome(200, "acked: the outcome is committed")


@dataclass(slots=True)
class _Seen:
    expires: float
    outcome: PushOutcome | None = None  # None: the first copy is still being worked
    answered_at: float = 0.0


class ReplayCache:
    """Deliveries verified lately, by message ID and signature digest, for as long as the
    signature verifies (a copy past that is refused as stale anyway). Bounded: past
    ``capacity`` the oldest entry is forgotten (``cleanup_push_replay_evictions_total``);
    a copy of a forgotten delivery is worked as a delivery of its own, which the in-flight
    guard, the receive count per message and the poison rule's holder check still bound."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a replay cache needs room for one entry, got {capacity}")
        self.capacity = capacity
        # Insertion order: the front is the oldest, swept as it expires.
        self._entries: OrderedDict[bytes, _Seen] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(delivery: Delivery, proof: Verified) -> bytes:
        # A digest of the two, not the two: a message ID may be 500 characters.
        return hashlib.blake2b(f"{delivery.message_id}\0{proof.digest}".encode(),
                               digest_size=16).digest()

    def answer(self, key: bytes, now: float) -> PushOutcome | None:
        """The answer for a copy of a delivery seen before; None for a new one."""
        self._sweep(now)
        seen = self._entries.get(key)
        if seen is None or seen.expires <= now:
            return None
        if seen.outcome is None:
            return PushOutcome(503, "a copy of this delivery is being worked",
                               REPLAY_BUSY_S, "replayed")
        first = seen.outcome
        if 200 <= first.status < 300:
            return PushOutcome(first.status, first.detail, None, "replayed")
        left = (first.retry_after_s or 0.0) - (now - seen.answered_at)
        if left <= 0:
            # The wait it was told is over: a copy now is as good as Infrai's redelivery.
            del self._entries[key]
            return None
        return PushOutcome(first.status, first.detail, left, "replayed")

    def begin(self, key: bytes, expires: float) -> _Seen:
        """Remember a delivery about to be worked (copies meanwhile are told it is)."""
        seen = _Seen(expires)
        self._entries[key] = seen
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            metrics.PUSH_REPLAY_EVICTIONS.inc()
        return seen

    def done(self, key: bytes, seen: _Seen, outcome: PushOutcome | None, now: float) -> None:
        """The answer ``seen``'s delivery got; None (or an answer that wrote nothing):
        forget it, so a copy is worked afresh."""
        if outcome is None or outcome.result in _NOT_REMEMBERED:
            if self._entries.get(key) is seen:
                del self._entries[key]
            return
        seen.outcome, seen.answered_at = outcome, now

    def _sweep(self, now: float) -> None:
        # Entries expire in roughly insertion order (a signed timestamp is within the
        # tolerance of its arrival); one behind an unexpired front waits its turn, and
        # counts as absent meanwhile.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                return
            self._entries.popitem(last=False)


@dataclass
class PushReceiver:
    """What the HTTP route needs: how to verify, the pool each queue is pushed to, and
    the deliveries seen lately (for the replays of one)."""

    settings: PushSettings
    handlers: Mapping[str, PushHandler] = field(default_factory=dict)
    replays: ReplayCache = field(init=False)

    def __post_init__(self) -> None:
        self.replays = ReplayCache(self.settings.replay_cache_entries)

    async def deliver(self, handler: PushHandler, delivery: Delivery, proof: Verified,
                      now: float) -> PushOutcome:
        """Work a verified delivery, or answer a copy of one seen before without
        touching the ledger: a replay counts no receive and sends nothing."""
        key = self.replays.key(delivery, proof)
        again = self.replays.answer(key, now)
        if again is not None:
            return again
        seen = self.replays.begin(key, proof.valid_until)
        outcome: PushOutcome | None = None
        try:
            outcome = await handler.handle_pushed(delivery)
            return outcome
        finally:
            # Its wait is counted from the arrival, before the wait was decided: a copy
            # that comes once the wait is over is never told to wait more.
            self.replays.done(key, seen, outcome, now)


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
        # Nothing is received, so nothing is billed or prefetched.
        self._capabilities = Capabilities(transactional_ack=False, extend=False, nack=False,
                                          stats=False, max_delay_s=max_delay_s, pull=False,
                                          billed=False, default_prefetch=0)
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
