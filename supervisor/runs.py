"""Opening runs from ticks, wherever they come from (webhook or embedded schedule)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter

from supervisor import metrics
from supervisor.config import Config
from supervisor.ledger.base import Ledger
from supervisor.model import OpenRunResult, Run
from supervisor.states import OpState

log = logging.getLogger(__name__)


class Broadcast:
    """Wakes every waiter at once, with no lock to wait for: a waiter takes :meth:`event`
    *before* reading what it waits on, so a change after its read still wakes it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def event(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()


@dataclass(frozen=True, slots=True)
class RunSeen:
    """A watched run and its operations by state, as the monitor last read them."""

    run: Run
    counts: Mapping[OpState, int]
    counted_at: float  # time.monotonic() of the count


class RunWatch(Broadcast):
    """The runs long-polls wait on. The monitor reads each watched run once per pass and
    publishes it here before it notifies, so however many clients wait on one run, the
    ledger is read for it once per pass, not once per waiter per pass."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: dict[str, int] = {}
        self._seen: dict[str, RunSeen] = {}

    @contextlib.contextmanager
    def watch(self, run_id: str) -> Iterator[None]:
        self._waiters[run_id] = self._waiters.get(run_id, 0) + 1
        try:
            yield
        finally:
            left = self._waiters[run_id] - 1
            if left:
                self._waiters[run_id] = left
            else:  # nobody waits on it: the monitor stops reading it
                del self._waiters[run_id]
                self._seen.pop(run_id, None)

    def watched(self) -> list[str]:
        return list(self._waiters)

    def seen(self, run_id: str) -> RunSeen | None:
        return self._seen.get(run_id)

    def publish(self, seen: Mapping[str, RunSeen]) -> None:
        """What the monitor read; then it notifies. A run nobody waits on any more (its
        last waiter left during the read) is not kept."""
        for run_id, view in seen.items():
            if run_id in self._waiters:
                self._seen[run_id] = view


@dataclass(frozen=True, slots=True)
class Tick:
    """A request to open a run. ``slot`` is the scheduled time it stands for, if known."""

    schedule: str
    slot: datetime | None = None
    key: str | None = None  # a caller's Idempotency-Key, when it has no slot
    recipient_ids: Sequence[Any] | None = None

    def tick_key(self, now: datetime) -> str:
        if self.slot is not None:
            return f"{self.schedule}@{self.slot.astimezone(UTC).isoformat()}"
        if self.key is not None:
            return f"{self.schedule}#{self.key}"
        return f"{self.schedule}@{now.astimezone(UTC).isoformat()}"


def slot_of(cron: str, tz: str, now: datetime) -> datetime:
    """The cron slot a tick arriving ``now`` stands for: the latest one at or before now,
    or the next one when it is at most ``EARLY_S`` away (a clock that jitters early)."""
    local = now.astimezone(ZoneInfo(tz))
    upcoming: datetime = croniter(cron, local).get_next(datetime)
    if (upcoming - local).total_seconds() <= EARLY_S:
        return upcoming
    current: datetime = croniter(cron, local + timedelta(microseconds=1)).get_prev(datetime)
    return current


# Infrai's cron jitters by seconds; a tick this early still stands for the coming slot.
EARLY_S = 30.0


class RunOpener:
    """Applies tick dedup and the overlap policy, then wakes the scanner."""

    # A tick with neither slot nor key matches a run of its schedule opened this recently:
    # a cron caller retrying its POST must not open a second run.
    UNKEYED_DEDUP_S = 600.0

    def __init__(self, config: Config, ledger: Ledger, on_created: asyncio.Event) -> None:
        self.config = config
        self.ledger = ledger
        self._on_created = on_created

    async def open(self, tick: Tick) -> OpenRunResult:
        now = datetime.now(UTC)
        s = self.config.schedule
        if tick.slot is None and tick.key is None and s.clock == "external" and \
                s.cron is not None and tick.schedule == s.name:
            # An external clock's tick (Infrai cron sends only its payload): the slot comes
            # from the expression, so a tick seconds late, or retried, dedupes on it.
            tick = Tick(tick.schedule, slot_of(s.cron, s.timezone, now), None,
                        tick.recipient_ids)
        if tick.recipient_ids is not None:
            source: dict[str, Any] = {"kind": "inline", "ids": list(tick.recipient_ids)}
        else:
            source = {"kind": self.config.source.kind}
        result = await self.ledger.open_run(
            tick.tick_key(now), tick.schedule,
            tick.slot.timestamp() if tick.slot else None, source,
            skip_if_unfinished=self.config.schedule.overlap == "skip",
            reuse_within_s=self.UNKEYED_DEDUP_S if tick.slot is None and tick.key is None
            else None)
        if result.created:
            assert result.run is not None
            metrics.TICKS.labels("opened").inc()
            metrics.LAST_TICK.set(result.run.created_at)
            log.info("run %s opened by tick %s", result.run.id, result.run.tick_key,
                     extra={"run_id": result.run.id, "action": "run_opened"})
            self._on_created.set()
        elif result.skipped_for is not None:
            metrics.TICKS.labels("skipped_overlap").inc()
            log.info("tick skipped: run %s is unfinished", result.skipped_for.id,
                     extra={"run_id": result.skipped_for.id, "action": "tick_skipped"})
        else:
            metrics.TICKS.labels("duplicate").inc()
        return result
