"""The embedded schedule on a real ledger: slot-keyed ticks, missed-tick policy, overlap."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from supervisor import metrics
from supervisor.config import Config, ScheduleConfig, SourceConfig
from supervisor.runs import RunOpener, Tick
from supervisor.schedule import Scheduler, next_slot, previous_slot
from supervisor.sqlite.ledger import SqliteLedger


def _config(**schedule: object) -> Config:
    return Config(schedule=ScheduleConfig(**schedule),  # type: ignore[arg-type]
                  source=SourceConfig(kind="http", url="http://127.0.0.1:9/stale"))


def test_slots_follow_cron_and_timezone() -> None:
    after = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)  # a Sunday
    slot = next_slot("0 2 * * 1", "Europe/Berlin", after)
    assert slot == datetime(2026, 11, 30, 2, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    assert previous_slot("0 2 * * 1", "Europe/Berlin", after) == slot - timedelta(days=7)


def _ticks(result: str) -> float:
    return metrics.TICKS.labels(result)._value.get()


async def test_a_repeated_or_late_tick_opens_one_run(ledger: SqliteLedger) -> None:
    opener = RunOpener(_config(), ledger, asyncio.Event())
    slot = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
    first = await opener.open(Tick("weekly", slot=slot))
    # The same slot, delivered again and expressed in another zone: same tick key.
    again = await opener.open(Tick("weekly", slot=slot.astimezone(ZoneInfo("Asia/Tokyo"))))
    assert first.created
    assert first.run is not None
    assert not again.created
    assert again.run is not None
    assert again.run.id == first.run.id
    assert len(await ledger.list_runs(10)) == 1


async def test_a_tick_during_an_unfinished_run_is_skipped_and_counted(
        ledger: SqliteLedger) -> None:
    opener = RunOpener(_config(overlap="skip"), ledger, asyncio.Event())
    first = await opener.open(Tick("weekly", slot=datetime(2026, 11, 23, 2, tzinfo=UTC)))
    before = _ticks("skipped_overlap")
    second = await opener.open(Tick("weekly", slot=datetime(2026, 11, 30, 2, tzinfo=UTC)))
    assert second.run is None
    assert not second.created
    assert second.skipped_for is not None
    assert first.run is not None
    assert second.skipped_for.id == first.run.id
    assert _ticks("skipped_overlap") == before + 1
    assert len(await ledger.list_runs(10)) == 1


async def test_overlap_allow_opens_a_second_run(ledger: SqliteLedger) -> None:
    opener = RunOpener(_config(overlap="allow"), ledger, asyncio.Event())
    await opener.open(Tick("weekly", slot=datetime(2026, 11, 23, 2, tzinfo=UTC)))
    second = await opener.open(Tick("weekly", slot=datetime(2026, 11, 30, 2, tzinfo=UTC)))
    assert second.created


async def _start_and_first_tick(scheduler: Scheduler) -> None:
    task = asyncio.create_task(scheduler.run())
    try:
        async with asyncio.timeout(10):
            await scheduler.ticked.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_missed_latest_runs_the_previous_slot_once(ledger: SqliteLedger) -> None:
    config = _config(cron="0 2 * * 1", missed="latest", overlap="allow")
    opener = RunOpener(config, ledger, asyncio.Event())
    expected = previous_slot("0 2 * * 1", "UTC", datetime.now(UTC))

    first = Scheduler(config.schedule, opener)
    await _start_and_first_tick(first)
    assert first.last_result is not None
    assert first.last_result.created
    assert first.last_result.run is not None
    assert first.last_result.run.scheduled_for == expected.timestamp()

    # A restart within the same week: the missed slot already ran, nothing new opens.
    second = Scheduler(config.schedule, opener)
    await _start_and_first_tick(second)
    assert second.last_result is not None
    assert not second.last_result.created
    assert len(await ledger.list_runs(10)) == 1


async def test_missed_skip_opens_nothing_at_start(ledger: SqliteLedger) -> None:
    config = _config(cron="0 2 * * 1", missed="skip")
    scheduler = Scheduler(config.schedule, RunOpener(config, ledger, asyncio.Event()))
    task = asyncio.create_task(scheduler.run())
    try:
        async with asyncio.timeout(10):
            await scheduler.waiting.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert scheduler.next_tick_at is not None
    assert scheduler.next_tick_at > datetime.now(UTC)
    assert not scheduler.ticked.is_set()
    assert await ledger.list_runs(10) == []
