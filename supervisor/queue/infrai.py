"""Infrai's managed queue, pulled: publish, consume, ack by message ID.

What Infrai documents is all this transport claims: no stats, no receive count, and no
nack or extend unless a route is configured for them (the reference found none). The
ledger keeps the rest (see supervisor/queue/courier.py). Messages carry identifiers only,
and one over the size limit is refused before it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import orjson

from supervisor import metrics
from supervisor.config import InfraiConfig
from supervisor.errors import MessageTooLarge, PartialPublish, QueueError
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import MAX_DELAY_S, MAX_PAYLOAD_BYTES, Capabilities, Unsupported

log = logging.getLogger(__name__)

# An ack that finds the message gone or re-leased did not fail us: a redelivery of a
# settled operation is acked again on sight.
_ACK_GONE = {"MESSAGE_NOT_FOUND", "LEASE_EXPIRED", "NOT_FOUND"}
MAX_TRACKED_DUE = 100_000
# Each consume is a round trip to a managed service: a few messages kept in hand beyond
# the idle workers so that no worker waits on it.
PREFETCH = 10


class InfraiQueue:
    def __init__(self, config: InfraiConfig, client: InfraiClient | None = None) -> None:
        self.config = config
        self.client = client or InfraiClient(config)
        self._capabilities = Capabilities(
            transactional_ack=False, extend=bool(config.extend_path),
            nack=bool(config.nack_path), stats=False, max_delay_s=MAX_DELAY_S,
            billed=True, default_prefetch=PREFETCH)
        self._created = False
        self._publishes = asyncio.Semaphore(config.publish_concurrency)
        self._wakeup = asyncio.Event()
        # Publishes of ours, and how many the last receive had seen: one that lands while
        # a receive is in the air must still cut the next wait short.
        self._published = 0
        self._seen = 0
        # When delayed messages we published fall due (a heap): no empty-poll backoff may
        # sleep past the next one.
        self._due: list[float] = []

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def healthy(self) -> bool:
        return self.client.blocked is None

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def ensure_queues(self) -> None:
        """Create the dead-letter queue, then the queue (once; an existing one is kept).
        Called before the first call that needs them, so a key refused at start blocks
        consumption instead of failing the start."""
        if self._created or not self.config.create_queues:
            return
        c = self.config
        if c.dlq:
            await self._create({"name": c.dlq, "type": "standard"})
        body: dict[str, Any] = {"name": c.queue, "type": "standard", "max_retries": c.max_retries}
        if c.dlq:
            body["dead_letter_queue"] = c.dlq
        await self._create(body)
        self._created = True

    async def _create(self, body: dict[str, Any]) -> None:
        try:
            await self.client.call("queue.create", "/v1/queue/create", body,
                                   idempotency_key=f"create-{body['name']}")
        except InfraiError as exc:
            if exc.status != 409:  # it exists already: what we wanted
                raise
        log.info("Infrai queue %s ready", body["name"], extra={"action": "queue_created"})

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        bodies = [self._body(m, delay_s) for m in messages]
        await self.ensure_queues()
        results = await asyncio.gather(*(self._publish_one(b) for b in bodies),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            if not isinstance(failed[0], Exception):
                raise failed[0]  # a cancellation, not a failed publish
            raise PartialPublish([r if isinstance(r, str) else None for r in results],
                                 failed[0])
        ids = [r for r in results if isinstance(r, str)]
        if delay_s > 0 and len(self._due) < MAX_TRACKED_DUE:
            # Taken after the publish returned, so never before Infrai makes it visible.
            heapq.heappush(self._due, time.time() + math.ceil(delay_s) + 0.1)
        self._published += 1
        self._wakeup.set()
        return list(ids)

    def _body(self, m: Message, delay_s: float) -> dict[str, Any]:
        payload = {"run_id": m.run_id, "operation_id": m.operation_id,
                   "recipient_id": m.recipient_id}
        size = len(orjson.dumps(payload))
        if size > MAX_PAYLOAD_BYTES:
            raise MessageTooLarge(f"message for {m.operation_id} is {size} bytes; Infrai "
                                  f"accepts at most {MAX_PAYLOAD_BYTES}")
        if not 0 <= delay_s <= MAX_DELAY_S:
            raise QueueError(f"delay_seconds {delay_s} is outside 0..{MAX_DELAY_S:g}")
        body: dict[str, Any] = {"queue": self.config.queue, "payload": payload}
        if delay_s > 0:
            # Whole seconds, rounded up: a retry is never due before its wait is over.
            body["delay_seconds"] = math.ceil(delay_s)
        return body

    async def _publish_one(self, body: dict[str, Any], key: str | None = None) -> str:
        # One key per message of this call, kept across its retries: a publish that acted
        # before its answer was lost is not a second message. Never derived from the
        # operation alone: a redrive must create a new message, not replay a lost one.
        key = key or f"pub-{body['payload'].get('operation_id', 'msg')}-{secrets.token_hex(6)}"
        async with self._publishes:
            data = await self.client.call("queue.publish", "/v1/queue/publish", body,
                                          idempotency_key=key)
        message_id = data.get("message_id") if isinstance(data, dict) else None
        if not isinstance(message_id, str) or not message_id:
            raise QueueError(f"Infrai queue.publish answered no message_id: {data!r}"[:300])
        return message_id

    async def consume(self, max_messages: int, lease_s: float) -> list[Any]:
        """The raw items of one consume call, in either documented answer shape."""
        await self.ensure_queues()
        data = await self.client.call("queue.consume", "/v1/queue/consume", {
            "queue": self.config.queue, "max_messages": min(max_messages, self.config.max_batch),
            "visibility_timeout": math.ceil(lease_s)})
        items = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise QueueError(f"Infrai queue.consume answered no message list: {data!r}"[:300])
        return items

    async def publish_payload(self, payload: dict[str, Any], key: str | None = None) -> str:
        """One message with any small JSON payload (a tick, an event). ``key``: the same
        content under the same key is one message (an event batch sent again after a
        lost answer)."""
        await self.ensure_queues()
        return await self._publish_one({"queue": self.config.queue, "payload": payload}, key)

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        self._seen = self._published
        items = await self.consume(max_messages, lease_s)
        token = secrets.token_hex(6)
        deliveries = []
        for item in items:
            delivery = _delivery(item, token)
            if delivery is not None:
                deliveries.append(delivery)
            elif isinstance(item, dict) and isinstance(item.get("message_id"), str):
                # Not one of ours (another producer, a corrupted body): it can never be
                # worked, and the ledger is not missing it. Removed, counted, said.
                log.warning("Infrai message %s has no operation in it; acked and dropped",
                            item["message_id"], extra={"action": "message_malformed"})
                metrics.QUEUE_DROPPED.labels("malformed").inc()
                with contextlib.suppress(QueueError):
                    await self.ack_id(item["message_id"])
            else:
                log.warning("Infrai queue.consume returned an item without a message_id: %r",
                            item, extra={"action": "message_malformed"})
        return deliveries

    async def wait(self, timeout_s: float) -> None:
        # No long poll is documented: a publish of our own wakes the consumer at once.
        self._wakeup.clear()
        if self._published != self._seen:
            return
        now = time.time()
        while self._due and self._due[0] <= now:
            heapq.heappop(self._due)
        if self._due:
            timeout_s = min(timeout_s, self._due[0] - now)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wakeup.wait()

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            await self.ack_id(d.message_id)

    async def ack_id(self, message_id: str) -> None:
        try:
            # A fresh key per ack: a key is replayed, and an ack refused once (lease
            # expired) must act when it is sent again under the next lease.
            await self.client.call("queue.ack", "/v1/queue/ack",
                                   {"queue": self.config.queue, "message_id": message_id},
                                   idempotency_key=f"ack-{message_id}-{secrets.token_hex(4)}")
        except InfraiError as exc:
            if exc.code not in _ACK_GONE and exc.status != 404:
                raise
            log.debug("ack of %s: %s (it comes back, and is acked then)", message_id, exc)

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        if not self.config.nack_path:
            raise Unsupported("Infrai nack is not configured (infrai.nack_path)")
        body: dict[str, Any] = {"queue": self.config.queue, "message_id": delivery.message_id}
        if delay_s > 0:
            body["delay_seconds"] = math.ceil(min(delay_s, MAX_DELAY_S))
        try:
            await self.client.call("queue.nack", self.config.nack_path, body)
        except InfraiError as exc:
            if exc.code not in _ACK_GONE and exc.status != 404:
                raise

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        if not self.config.extend_path:
            raise Unsupported("Infrai extend is not configured (infrai.extend_path)")
        try:
            await self.client.call("queue.extend", self.config.extend_path, {
                "queue": self.config.queue, "message_id": delivery.message_id,
                "visibility_timeout": math.ceil(lease_s)})
        except InfraiError as exc:
            if exc.code in _ACK_GONE or exc.status in (404, 409):
                return False
            raise
        return True

    async def stats(self) -> QueueStats:
        raise Unsupported("Infrai documents no queue stats: the ledger reports them")

    async def redrive_dead_letters(self) -> Any:
        """Move the dead-letter queue's messages back (an operator's command)."""
        path = self.config.redrive_path.replace("{queue}", quote(self.config.queue, safe=""))
        return await self.client.call("queue.dlq.redrive", path, {"queue": self.config.queue},
                                      idempotency_key=f"redrive-{secrets.token_hex(6)}")


def _delivery(item: Any, token: str) -> Delivery | None:
    if not isinstance(item, dict):
        return None
    message_id, payload = item.get("message_id"), item.get("payload", item.get("body"))
    if isinstance(payload, str | bytes):  # some transports hand the body back as text
        with contextlib.suppress(orjson.JSONDecodeError):
            payload = orjson.loads(payload)
    if not isinstance(message_id, str) or not message_id or not isinstance(payload, dict):
        return None
    fields = [payload.get(k) for k in ("run_id", "operation_id", "recipient_id")]
    strings = [f for f in fields if isinstance(f, str) and f]
    if len(strings) != 3:
        return None
    run_id, operation_id, recipient_id = strings
    return Delivery(Message(run_id, operation_id, recipient_id), message_id,
                    f"{message_id}/{token}")

