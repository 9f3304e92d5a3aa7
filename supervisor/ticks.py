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
import re
from datetime import UTC, datetime
from typing import Any

from supervisor import metrics
from supervisor.errors import QueueBlocked, QueueError
from supervisor.queue.infrai import InfraiQueue
from supervisor.runs import RunOpener, Tick, slot_of
from supervisor.tickrules import TICK_KEY, check_schedule, parse_slot

log = logging.getLogger(__name__)

LEASE_S = 60.0
BATCH = 10


def tick_from(payload: Any, default_schedule: str) -> Tick:
    """A tick message's payload: ``{"schedule"?, "scheduled_for"?, "key"?}``, held to the
    webhook's rules (supervisor/tickrules.py). Raises ValueError naming the field that is
    wrong."""
    if not isinstance(payload, dict):
        raise ValueError("payload must be a JSON object")
    unknown = set(payload) - {"schedule", "scheduled_for", "key"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    schedule = payload.get("schedule", default_schedule)
    if (problem := check_schedule(schedule)) is not None:
        raise ValueError(problem)
    slot = parse_slot(payload["scheduled_for"]) if "scheduled_for" in payload else None
    key = payload.get("key")
    if key is not None and (not isinstance(key, str) or not re.fullmatch(TICK_KEY, key)):
        raise ValueError("key must be 1 to 200 visible ASCII characters")
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
                if self._superseded(tick):
                    # Missed while nothing pulled (Infrai keeps messages for days): a later
                    # slot has come since, and missed slots are not caught up one by one.
                    metrics.TICKS.labels("missed").inc()
                    log.info("tick for %s dropped: a later slot has come since", tick.slot,
                             extra={"action": "tick_missed"})
                else:
                    await self.opener.open(tick)  # committed before the ack below
            except (ValueError, OverflowError) as exc:
                # It can never become valid: acked, or it would come back every lease and
                # fail again, forever, with the ticks behind it waiting.
                metrics.TICKS.labels("malformed").inc()
                log.warning("tick %s dropped: %s", message_id, exc,
                            extra={"action": "tick_malformed"})
            try:
                await self.queue.ack_id(message_id)
            except QueueError as exc:
                # Delivered again later: the slot or key dedupes it.
                log.debug("tick %s ack failed: %s", message_id, exc)
        return len(items)


async def publish_tick(queue: InfraiQueue, payload: dict[str, Any]) -> str:
    tick_from(payload, "default")  # what the puller would refuse is refused here
    return await queue.publish_payload(payload)
