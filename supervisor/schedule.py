"""The embedded cron: ticks keyed by schedule name + scheduled slot, so they dedupe."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from zoneinfo import ZoneInfo

from croniter import croniter

from supervisor.config import ScheduleConfig
from supervisor.model import OpenRunResult
from supervisor.runs import RunOpener, Tick

log = logging.getLogger(__name__)

# Long sleeps are cut into pieces so a wall-clock jump (NTP, a suspended VM) is noticed.
MAX_SLEEP_S = 60.0


def next_slot(cron: str, tz: str, after: datetime) -> datetime:
    result: datetime = croniter(cron, after.astimezone(ZoneInfo(tz))).get_next(datetime)
    return result


def previous_slot(cron: str, tz: str, before: datetime) -> datetime:
    result: datetime = croniter(cron, before.astimezone(ZoneInfo(tz))).get_prev(datetime)
    return result


class Scheduler:
    """Fires a tick at each cron slot. Missed slots are skipped, or the latest runs once."""

    def __init__(self, config: ScheduleConfig, opener: RunOpener) -> None:
        assert config.cron is not None
        self.config = config
        self.cron = config.cron
        self.opener = opener
        self.ticked = asyncio.Event()  # set after every tick, opened or not
        self.waiting = asyncio.Event()  # set while waiting for next_tick_at
        self.next_tick_at: datetime | None = None
        self.last_result: OpenRunResult | None = None

    async def run(self) -> None:
        c = self.config
        now = datetime.now(ZoneInfo(c.timezone))
        if c.missed == "latest":
            # Ticks are deduped by slot, so this opens nothing if that slot already ran.
            await self._tick(previous_slot(self.cron, c.timezone, now))
        slot = next_slot(self.cron, c.timezone, now)
        log.info("schedule %s: next tick at %s", c.name, slot.isoformat(),
                 extra={"action": "schedule_next"})
        while True:
            self.next_tick_at = slot
            self.waiting.set()
            await _sleep_until(slot)
            self.waiting.clear()
            await self._tick(slot)
            slot = next_slot(self.cron, c.timezone, slot)

    async def _tick(self, slot: datetime) -> None:
        self.last_result = await self.opener.open(Tick(schedule=self.config.name, slot=slot))
        self.ticked.set()


async def _sleep_until(when: datetime) -> None:
    """A wall-clock timer: re-reads the clock at least every MAX_SLEEP_S."""
    while True:
        delay = (when - datetime.now(when.tzinfo)).total_seconds()
        if delay <= 0:
            return
        await asyncio.sleep(min(delay, MAX_SLEEP_S))
