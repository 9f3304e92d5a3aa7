"""The queue is transport, the ledger is truth: republish what the queue has lost.

Decided from ledger state and age alone, so it works with a transport that cannot be
asked what it holds. An unsettled operation is overdue when no message of it is live and
its retry is due, or when it has been passed by: nothing has touched it (due, delivered,
held, changed) since a moment the consumers have since moved beyond. That moment is the
consumers' horizon (:meth:`supervisor.consumer.ConsumerPool.redrive_horizon`): the due
time of what they were receiving ``redrive_grace_seconds`` ago, or, when they have had
nothing to receive for that long, now less the grace. A long drain ages the tail of the
queue legitimately, and a pause delivers nothing; neither is a loss, and republishing
them would only multiply the traffic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from supervisor import metrics
from supervisor.ledger.base import Ledger
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.queue.settings import QueueConfig

log = logging.getLogger(__name__)

PAGE = 1000
# A retry whose repost is a moment behind its commit is not lost yet.
UNPOSTED_GRACE_S = 10.0
MAX_PAGES = 1000


class Redriver:
    """Every ``redrive_interval_seconds``, publishes again each overdue operation."""

    def __init__(self, config: QueueConfig, ledger: Ledger, queue: Queue,
                 horizon: Callable[[float], float | None] | None = None) -> None:
        self.config = config
        self.ledger = ledger
        self.queue = queue
        self.courier = Courier(ledger, queue)
        # Without consumers to ask (tests, tools): the plain age rule.
        self._horizon = horizon or (lambda grace: time.time() - grace)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.redrive_interval_seconds)  # a period, not a sync
            await self.sweep()

    async def sweep(self) -> int:
        """One pass over the ledger; returns how many operations were published again."""
        if not self.queue.healthy:
            return 0  # a transport that refuses us takes no publish either
        now = time.time()
        before = self._horizon(self.config.redrive_grace_seconds)
        total = 0
        # Each page published is recorded (touched now, a live message): the next query
        # does not return it again.
        for _ in range(MAX_PAGES):
            lost = await self.ledger.overdue(before, now - UNPOSTED_GRACE_S, PAGE)
            if not lost:
                break
            await self.courier.publish(lost)
            total += len(lost)
            metrics.REDRIVEN.inc(len(lost))
        if total:
            log.warning("redrive: %d unfinished operations had no live message; published "
                        "again", total, extra={"action": "redrive"})
        return total
