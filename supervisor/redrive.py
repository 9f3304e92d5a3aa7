"""The queue is transport, the ledger is truth: republish what the queue has lost."""

from __future__ import annotations

import asyncio
import logging
import time

from supervisor import metrics
from supervisor.config import QueueConfig
from supervisor.ledger.base import Ledger
from supervisor.queue.base import Queue

log = logging.getLogger(__name__)

PAGE = 1000


class Redriver:
    """Every ``redrive_interval_seconds``, publishes again each unfinished operation that
    has not changed for ``redrive_grace_seconds`` and has no message in the queue (a lost
    publish, an expired or dead-lettered message)."""

    def __init__(self, config: QueueConfig, ledger: Ledger, queue: Queue) -> None:
        self.config = config
        self.ledger = ledger
        self.queue = queue

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.redrive_interval_seconds)  # a period, not a sync
            await self.sweep()

    async def sweep(self) -> int:
        """One pass over the ledger; returns how many operations were published again."""
        cutoff = time.time() - self.config.redrive_grace_seconds
        after = 0
        total = 0
        while page := await self.ledger.active_since(cutoff, after, PAGE):
            after = page[-1][0]
            missing = await self.queue.missing([m.operation_id for _, m in page])
            lost = [m for _, m in page if m.operation_id in missing]
            if lost:
                await self.queue.publish(lost)
                total += len(lost)
                metrics.REDRIVEN.inc(len(lost))
        if total:
            log.warning("redrive: %d unfinished operations had no message; published again",
                        total, extra={"action": "redrive"})
        return total
