"""Ticks pulled from a queue: the clock for a deployment that takes no inbound traffic.

Ticks come from a :class:`TickSource` (today Infrai's tick queue,
supervisor/infrai/tick_source.py). Anything may publish a tick to it (a relay Infrai's cron calls, another
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
from typing import Any, Protocol

from supervisor import metrics
from supervisor.errors import QueueBlocked, QueueError
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


class TickSource(Protocol):
    """Where ticks wait. A taken tick is hidden for its lease and comes back unless acked,
    so one whose run was not recorded is taken again."""

    async def take(self, max_ticks: int, lease_s: float) -> list[tuple[str, Any]]:
        """Up to ``max_ticks`` waiting ticks, oldest first, as (tick ID, payload as sent);
        an empty list when none waits. Raises QueueError (QueueBlocked when refused)."""

    async def ack(self, tick_id: str) -> None:
        """Remove a taken tick for good; one already gone (acked, lease lost) is no error."""

    async def put(self, payload: dict[str, Any]) -> str:
        """Add a tick; returns its ID."""


class TickPuller:
    def __init__(self, source: TickSource, opener: RunOpener, default_schedule: str,
                 poll_s: float) -> None:
        self.source = source
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
        taken = await self.source.take(BATCH, LEASE_S)
        for message_id, payload in taken:
            try:
                tick = tick_from(payload, self.default_schedule)
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
                await self.source.ack(message_id)
            except QueueError as exc:
                # Delivered again later: the slot or key dedupes it.
                log.debug("tick %s ack failed: %s", message_id, exc)
        return len(taken)


async def publish_tick(source: TickSource, payload: dict[str, Any]) -> str:
    tick_from(payload, "default")  # what the puller would refuse is refused here
    return await source.put(payload)
