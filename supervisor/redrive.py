"""The queue is transport, the ledger is truth: republish what the queue has lost.

Decided from ledger state and age alone, so it works with a transport that cannot be
asked what it holds: an unsettled operation is overdue when no message of it is live and
its retry is due, or when nothing has delivered, held or changed it for the grace period
plus the time the backlog ahead of it needs at the current rate (a long drain ages the
tail of the queue legitimately; republishing it would only double the traffic).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from supervisor import metrics
from supervisor.config import QueueConfig
from supervisor.ledger.base import Ledger
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier

log = logging.getLogger(__name__)

PAGE = 1000
# A retry whose repost is a moment behind its commit is not lost yet.
UNPOSTED_GRACE_S = 10.0
# Allow twice the time the backlog needs: the rate moves, and workers hold messages.
BACKLOG_FACTOR = 2.0


class Redriver:
    """Every ``redrive_interval_seconds``, publishes again each overdue operation."""

    def __init__(self, config: QueueConfig, ledger: Ledger, queue: Queue,
                 rate: Callable[[], float]) -> None:
        self.config = config
        self.ledger = ledger
        self.courier = Courier(ledger, queue)
        self._rate = rate

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.redrive_interval_seconds)  # a period, not a sync
            await self.sweep()

    async def sweep(self) -> int:
        """One pass over the ledger; returns how many operations were published again."""
        now = time.time()
        backlog = await self.ledger.queue_stats()
        ahead = backlog.depth + backlog.leased
        before = now - self.config.redrive_grace_seconds \
            - BACKLOG_FACTOR * ahead / max(self._rate(), 1e-3)
        after = 0
        total = 0
        while page := await self.ledger.overdue(before, now - UNPOSTED_GRACE_S, after, PAGE):
            after = page[-1][0]
            lost = [m for _, m in page]
            await self.courier.publish(lost)
            total += len(lost)
            metrics.REDRIVEN.inc(len(lost))
        if total:
            log.warning("redrive: %d unfinished operations had no live message; published "
                        "again", total, extra={"action": "redrive"})
        return total
