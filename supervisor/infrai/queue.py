"""Infrai's managed queue, pulled, as a ``Queue``: publish, receive, ack by message ID,
over one :class:`~supervisor.infrai.channel.InfraiChannel` (the raw calls).

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

import orjson

from supervisor import metrics
from supervisor.errors import MessageTooLarge, PartialPublish, QueueError
from supervisor.infrai.channel import InfraiChannel, gone
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.settings import InfraiConfig
from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import MAX_DELAY_S, MAX_PAYLOAD_BYTES, Capabilities, Unsupported

log = logging.getLogger(__name__)

MAX_TRACKED_DUE = 100_000
# Each consume is a round trip to a managed service: a few messages kept in hand beyond
# the idle workers so that no worker waits on it.
PREFETCH = 10


class InfraiQueue:
    """The work queue. Its raw calls go through :attr:`channel`, which nothing else uses:
    ticks, sinks and operators' commands have channels of their own."""

    def __init__(self, config: InfraiConfig, client: InfraiClient | None = None) -> None:
        self.channel = InfraiChannel(config, client)
        self.config = config
        self._capabilities = Capabilities(
            transactional_ack=False, extend=bool(config.extend_path),
            nack=bool(config.nack_path), stats=False, max_delay_s=MAX_DELAY_S,
            billed=True, default_prefetch=PREFETCH)
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
        return self.channel.healthy

    async def start(self) -> None:
        await self.channel.start()

    async def close(self) -> None:
        await self.channel.close()

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        bodies = [self._body(m, delay_s) for m in messages]
        await self.channel.ensure_queues()
        results = await asyncio.gather(*(self.channel.publish_body(b) for b in bodies),
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

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        self._seen = self._published
        items = await self.channel.consume(max_messages, lease_s)
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
                    await self.channel.ack_id(item["message_id"])
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
            await self.channel.ack_id(d.message_id)

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        if not self.config.nack_path:
            raise Unsupported("Infrai nack is not configured (infrai.nack_path)")
        body: dict[str, Any] = {"queue": self.config.queue, "message_id": delivery.message_id}
        if delay_s > 0:
            body["delay_seconds"] = math.ceil(min(delay_s, MAX_DELAY_S))
        try:
            await self.channel.client.call("queue.nack", self.config.nack_path, body)
        except InfraiError as exc:
            if not gone(exc):
                raise

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        if not self.config.extend_path:
            raise Unsupported("Infrai extend is not configured (infrai.extend_path)")
        try:
            await self.channel.client.call("queue.extend", self.config.extend_path, {
                "queue": self.config.queue, "message_id": delivery.message_id,
                "visibility_timeout": math.ceil(lease_s)})
        except InfraiError as exc:
            if gone(exc) or exc.status == 409:
                return False
            raise
        return True

    async def stats(self) -> QueueStats:
        raise Unsupported("Infrai documents no queue stats: the ledger reports them")


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

