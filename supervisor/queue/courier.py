"""Between the ledger and a transport: every move of a message, with its bookkeeping.

Whatever the transport can do, the same rules hold: a message is published before the
ledger records it as the operation's live one; an ack follows the commit of the outcome;
a retry wait is a nack with a delay where the transport has one and otherwise a new
message published with ``delay_s`` (the old one acked after), and a wait longer than the
transport's longest delay stays in the ledger for redrive to publish when it is due.
Each step is safe to lose to a crash: the ledger then still names a live message that
will be redelivered, or none, and redrive publishes one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from supervisor import metrics
from supervisor.errors import PartialPublish, QueueError
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Disposition, Message, Published, Settlement
from supervisor.queue.base import Queue

log = logging.getLogger(__name__)

HAND_BACK_S = 3.0
RECORD_EVERY = 32


class Courier:
    def __init__(self, ledger: Ledger, queue: Queue) -> None:
        self.ledger = ledger
        self.queue = queue
        self.capabilities = queue.capabilities

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0,
                      outbox: bool = False) -> None:
        """Publish, then record each message as its operation's live one. A delay past
        the transport's longest publishes nothing: redrive does when it is due."""
        if not messages:
            return
        due = time.time() + delay_s
        if delay_s > self.capabilities.max_delay_s:
            await self.ledger.record_published([Published(m.operation_id, None, due)
                                                for m in messages])
            return
        # A transport outside the ledger's database publishes message by message: record
        # them a chunk at a time, so a crash mid-batch republishes a chunk, not the batch.
        step = len(messages) if self.capabilities.transactional_ack else RECORD_EVERY
        for i in range(0, len(messages), step):
            chunk = messages[i:i + step]
            try:
                ids: list[str | None] = list(await self.queue.publish(chunk, delay_s))
            except PartialPublish as exc:
                # Record what was stored (else it is published again, a copy more), then
                # fail as the transport did.
                await self.ledger.record_published(
                    [Published(m.operation_id, mid, due)
                     for m, mid in zip(chunk, exc.ids, strict=True) if mid is not None],
                    outbox=outbox)
                raise
            await self.ledger.record_published([Published(m.operation_id, mid, due)
                                                for m, mid in zip(chunk, ids, strict=True)],
                                               outbox=outbox)

    async def follow_up(self, settlements: Sequence[Settlement]) -> None:
        """After the ledger committed these outcomes: what their messages still need (for
        a transport outside the ledger's database). A failure is logged, not raised: the
        message comes back and finds its operation settled, or redrive republishes it."""
        for s in settlements:
            if s.delivery is None or s.disposition is Disposition.KEEP:
                continue
            try:
                if s.disposition is Disposition.ACK:
                    await self.queue.ack([s.delivery])
                else:
                    await self.retry_later(s.delivery, s.delay_s)
            except QueueError as exc:
                self._failed("follow-up", s.delivery, exc)

    async def retry_later(self, delivery: Delivery, delay_s: float) -> None:
        """The message's operation is due again in ``delay_s``: nack it, or publish a
        delayed copy (recorded as live) and ack this one."""
        if self.capabilities.nack:
            await self.queue.nack(delivery, delay_s)
            await self.ledger.record_published([Published(
                delivery.message.operation_id, delivery.message_id, time.time() + delay_s)])
            return
        await self.publish([delivery.message], delay_s)
        metrics.QUEUE_REPOSTS.inc()
        await self.queue.ack([delivery])

    async def defer(self, delivery: Delivery, delay_s: float) -> None:
        """Like :meth:`retry_later` for a message held without an outcome (it would wait
        past its visibility timeout); a failure leaves the message to its lease."""
        try:
            await self.retry_later(delivery, delay_s)
        except QueueError as exc:
            self._failed("deferral", delivery, exc)

    async def hand_back(self, delivery: Delivery) -> None:
        """Give a message back unworked, visible at once: a nack, or a copy published
        and this one acked. Bounded: a transport that does not answer leaves the message
        to its visibility timeout rather than hold up a shutdown."""
        try:
            async with asyncio.timeout(HAND_BACK_S):
                await self.retry_later(delivery, 0.0)
        except (QueueError, TimeoutError) as exc:
            self._failed("hand-back", delivery, QueueError(str(exc) or "timed out"))

    async def drop(self, delivery: Delivery, reason: str) -> None:
        """Ack a delivery that carries no work (its operation settled, or not ours)."""
        metrics.QUEUE_DROPPED.labels(reason).inc()
        try:
            await self.queue.ack([delivery])
        except QueueError as exc:
            self._failed("ack", delivery, exc)

    def _failed(self, what: str, delivery: Delivery, exc: QueueError) -> None:
        # One line per fault comes from the transport; each message is a detail.
        log.log(logging.WARNING if self.queue.healthy else logging.DEBUG,
                "queue %s of %s failed: %s; the ledger keeps the operation", what,
                delivery.message.operation_id, exc,
                extra={"operation_id": delivery.message.operation_id})
