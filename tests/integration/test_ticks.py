"""Ticks pulled from an Infrai queue (the emulator): one run per slot however often a tick
arrives, malformed ones said, counted and dropped, each acked only after its run is
recorded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanup_sandbox.infrai import Emulator
from supervisor import composition, metrics
from supervisor.runs import RunOpener
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.ticks import TickPuller, TickSource, publish_tick, tick_from
from tests.helpers import infrai_config

from .http_app import load_config


@pytest.fixture
async def ticks(emulator: Emulator) -> AsyncIterator[TickSource]:
    async with composition.infrai_session(infrai_config(emulator, queue="work"),
                                          "ticks") as channel:
        yield composition.tick_source(channel)


async def test_a_tick_delivered_three_times_opens_one_run(
        ledger: SqliteLedger, ticks: TickSource, emulator: Emulator, tmp_path: Path) -> None:
    cfg = load_config(tmp_path, source__kind="file", source__path=str(tmp_path / "x.jsonl"))
    puller = TickPuller(ticks, RunOpener(cfg, ledger, asyncio.Event()), "weekly", 30)
    slot = {"schedule": "weekly", "scheduled_for": "2026-11-30T02:00:00+00:00"}
    for _ in range(3):  # a relay retrying, two systems publishing the same slot
        await publish_tick(ticks, slot)
    malformed = metrics.TICKS.labels("malformed")._value.get()
    await ticks.put({"schedule": "weekly", "scheduled_for": "monday"})
    assert await puller.pull() == 4
    [run] = await ledger.list_runs(10)
    assert run.tick_key == "weekly@2026-11-30T02:00:00+00:00"
    assert metrics.TICKS.labels("malformed")._value.get() == malformed + 1
    emulator.advance(120)  # past every visibility timeout: nothing comes back
    assert await puller.pull() == 0
    acks = [c for c in emulator.calls if c["capability"] == "queue.ack"]
    assert len(acks) == 4


async def test_an_unslotted_tick_takes_its_slot_from_the_expression(
        ledger: SqliteLedger, ticks: TickSource, tmp_path: Path) -> None:
    cfg = load_config(tmp_path, schedule__cron="0 2 * * 1", schedule__clock="external",
                      source__kind="file", source__path=str(tmp_path / "x.jsonl"))
    puller = TickPuller(ticks, RunOpener(cfg, ledger, asyncio.Event()), "weekly", 30)
    await publish_tick(ticks, {"schedule": "weekly"})
    await publish_tick(ticks, {})
    await puller.pull()
    [run] = await ledger.list_runs(10)
    assert run.tick_key.startswith("weekly@")
    assert run.tick_key.endswith("T02:00:00+00:00")


@pytest.mark.parametrize(("payload", "problem"), [
    ([1, 2], "payload must be a JSON object"),
    ({"schedule": ""}, "schedule must be"),
    ({"scheduled_for": "2026-11-30T02:00:00"}, "UTC offset"),
    ({"when": "now"}, "unknown field(s): when"),
    ({"key": 5}, "key must be"),
    ({"key": "two words"}, "key must be"),
    # Aware, but with no UTC instant: astimezone overflows (issue 17, M8).
    ({"scheduled_for": "0001-01-01T00:00:00+01:00"}, "scheduled_for is out of range"),
    ({"scheduled_for": "9999-12-31T23:59:59-01:00"}, "scheduled_for is out of range"),
    ({"scheduled_for": 1e300}, "scheduled_for is out of range"),
    # The webhook's one rule for schedule names (L10): no control characters, no spaces,
    # nothing that separates a tick key's parts.
    ({"schedule": "weekly\nINFO forged"}, "schedule must be"),
    ({"schedule": "weekly "}, "schedule must be"),
    ({"schedule": "w\u00f6chentlich"}, "schedule must be"),
    ({"schedule": "a#b"}, "schedule must be"),
    ({"schedule": "x" * 101}, "schedule must be"),
])
def test_a_bad_tick_names_its_field(payload: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        tick_from(payload, "weekly")


async def test_a_tick_a_later_slot_has_superseded_is_dropped(
        ledger: SqliteLedger, ticks: TickSource, tmp_path: Path) -> None:
    """Infrai kept ticks while nothing pulled: missed slots are not caught up one by one."""
    cfg = load_config(tmp_path, schedule__cron="0 2 * * 1", schedule__clock="external",
                      source__kind="file", source__path=str(tmp_path / "x.jsonl"))
    puller = TickPuller(ticks, RunOpener(cfg, ledger, asyncio.Event()), "weekly", 30)
    missed = metrics.TICKS.labels("missed")._value.get()
    await publish_tick(ticks, {"scheduled_for": "2025-01-06T02:00:00+00:00"})  # long past
    await publish_tick(ticks, {})  # the current slot
    await puller.pull()
    [run] = await ledger.list_runs(10)
    assert not run.tick_key.startswith("weekly@2025-01-06")
    assert metrics.TICKS.labels("missed")._value.get() == missed + 1


async def test_a_poisoned_tick_is_acked_and_counted_not_redelivered_forever(
        ledger: SqliteLedger, ticks: TickSource, emulator: Emulator, tmp_path: Path) -> None:
    """A slot without a UTC instant used to crash the puller before its ack, every lease,
    forever; now it is said, counted and acked, and the good tick behind it opens its run."""
    cfg = load_config(tmp_path, source__kind="file", source__path=str(tmp_path / "x.jsonl"))
    puller = TickPuller(ticks, RunOpener(cfg, ledger, asyncio.Event()), "weekly", 30)
    malformed = metrics.TICKS.labels("malformed")._value.get()
    for bad in ({"scheduled_for": "0001-01-01T00:00:00+01:00"},
                {"scheduled_for": "9999-12-31T23:59:59-01:00"},
                {"schedule": "weekly\nforged line"}):
        await ticks.put(bad)
    await publish_tick(ticks, {"schedule": "weekly",
                               "scheduled_for": "2026-11-30T02:00:00+00:00"})
    assert await puller.pull() == 4
    assert metrics.TICKS.labels("malformed")._value.get() == malformed + 3
    [run] = await ledger.list_runs(10)
    assert run.tick_key == "weekly@2026-11-30T02:00:00+00:00"
    emulator.advance(120)  # past every visibility timeout: none of them comes back
    assert await puller.pull() == 0
    assert len([c for c in emulator.calls if c["capability"] == "queue.ack"]) == 4
