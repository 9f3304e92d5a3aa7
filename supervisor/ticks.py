"""Ticks pulled from a queue: the clock for a deployment that takes no inbound traffic.

Anything may publish a tick to the Infrai tick queue (a relay Infrai's cron calls, another
system, ``cleanup-supervisor trigger --via infrai``); this component takes them and opens
runs through the same :class:`~supervisor.runs.RunOpener` as the webhook and the embedded
cron, so a tick delivered twice, late or retried dedupes on its slot and the overlap
policy applies. A tick is acked only once its run is recorded; a malformed one is said,
counted and acked (it can never become valid).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

from supervisor import metrics
from supervisor.errors import QueueBlocked, QueueError
from supervisor.queue.infrai import InfraiQueue
from supervisor.runs import RunOpener, Tick, slot_of

log = logging.getLogger(__name__)

LEASE_S = 60.0
BATCH = 10


def tick_from(payload: Any, default_schedule: str) -> Tick:
    """A tick message's payload: ``{"schedule"?, "scheduled_for"?, "key"?}``.
    Raises ValueError naming the field that is wrong."""
    if not isinstance(payload, dict):
        raise ValueError("payload must be a JSON object")
    unknown = set(payload) - {"schedule", "scheduled_for", "key"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    schedule = payload.get("schedule", default_schedule)
    if not isinstance(schedule, str) or not 0 < len(schedule) <= 100:
        raise ValueError("schedule must be a string of 1 to 100 characters")
    slot = None
    if "scheduled_for" in payload:
        text = payload["scheduled_for"]
        try:
            slot = datetime.fromisoformat(text) if isinstance(text, str) else None
        except ValueError:
            slot = None
        if slot is None or slot.tzinfo is None:
            raise ValueError("scheduled_for must be an ISO 8601 time with a UTC offset")
    key = payload.get("key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 200):
        raise ValueError("key must be a string of 1 to 200 characters")
    return Tick(schedule=schedule, slot=slot, key=key)


class TickPuller:
    def __init__(self, queue: InfraiQueue, opener: RunOpener, default_schedule: str,
                 poll_s: float) -> None:
        self.queue = queue
        self.opener = opener
        self.default_schedule = default_schedule
        self.poll_s = poll_s

    async def run(self) -> None:
        while True:
            try:
                taken = await self.pull()
            except QueueBlocked:
                taken = 0  # said once by the client; the next poll tries again
            if taken < BATCH:
                await asyncio.sleep(self.poll_s)  # a poll period, not a synchronisation

    def _superseded(self, tick: Tick) -> bool:
        s = self.opener.config.schedule
        if tick.slot is None or s.cron is None or tick.schedule != s.name:
            return False
        return tick.slot < slot_of(s.cron, s.timezone, datetime.now(UTC))

    async def pull(self) -> int:
        """One consume; returns how many ticks it took."""
        items = await self.queue.consume(BATCH, LEASE_S)
        for item in items:
            message_id = item.get("message_id") if isinstance(item, dict) else None
            if not isinstance(message_id, str):
                log.warning("tick queue answered an item without a message_id: %r", item)
                continue
            try:
                tick = tick_from(item.get("payload"), self.default_schedule)
            except ValueError as exc:
                metrics.TICKS.labels("malformed").inc()
                log.warning("tick %s dropped: %s", message_id, exc,
                            extra={"action": "tick_malformed"})
            else:
                if self._superseded(tick):
                    # Missed while nothing pulled (Infrai keeps messages for days): a later
                    # slot has come since, and missed slots are not caught up one by one.
                    metrics.TICKS.labels("missed").inc()
                    log.info("tick for %s dropped: a later slot has come since", tick.slot,
                             extra={"action": "tick_missed"})
                else:
                    await self.opener.open(tick)  # committed before the ack below
            try:
                await self.queue.ack_id(message_id)
            except QueueError as exc:
                # Delivered again later: the slot or key dedupes it.
                log.debug("tick %s ack failed: %s", message_id, exc)
        return len(items)


async def publish_tick(queue: InfraiQueue, payload: dict[str, Any]) -> str:
    tick_from(payload, "default")  # what the puller would refuse is refused here
    return await queue.publish_payload(payload)
