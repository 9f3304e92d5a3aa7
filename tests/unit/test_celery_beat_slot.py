"""The slot a Celery beat entry fires for (supervisor/callers/celery_beat.py), against
Celery's own crontab arithmetic: the latest instant the schedule names at or before now."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from supervisor.callers.celery_beat import TASK_NAME, beat_entry, slot_iso, slot_of
from tests.conftest import unavailable

if importlib.util.find_spec("celery") is not None:
    from celery import Celery
    from celery.beat import BeatLazyFunc
    from celery.schedules import BaseSchedule, crontab


@pytest.fixture(scope="module", autouse=True)
def _celery_installed() -> None:
    # Module-scoped: hypothesis runs its examples inside one call of the test.
    if importlib.util.find_spec("celery") is None:
        unavailable("celery is not installed: pip install -e '.[celery]' to test the Celery "
                    "beat caller", "CLEANUP_REQUIRE_REDIS")


def _app(tz: str = "UTC") -> Celery:
    app = Celery("slot-test", set_as_current=False)
    app.conf.timezone = tz
    return app


def _field(values: set[int] | None) -> str:
    return "*" if values is None else ",".join(str(v) for v in sorted(values))


def _next_after(cron: crontab, moment: datetime) -> datetime:
    """Celery's own answer: the first instant the crontab names after ``moment``."""
    start, delta, _ = cron.remaining_delta(moment)
    return start + delta


def _matches(cron: crontab, moment: datetime) -> bool:
    local = moment.astimezone(cron.tz)
    return (local.second == 0 and local.microsecond == 0 and local.minute in cron.minute
            and local.hour in cron.hour and local.day in cron.day_of_month
            and local.month in cron.month_of_year and local.isoweekday() % 7 in cron.day_of_week)


def _maybe(values: st.SearchStrategy[set[int]]) -> st.SearchStrategy[set[int] | None]:
    return st.one_of(st.none(), values)


@settings(max_examples=300, deadline=None)
@given(minute=st.sets(st.integers(0, 59), min_size=1, max_size=4),
       hour=_maybe(st.sets(st.integers(0, 23), min_size=1, max_size=3)),
       dow=_maybe(st.sets(st.integers(0, 6), min_size=1, max_size=3)),
       dom=_maybe(st.sets(st.integers(1, 31), min_size=1, max_size=3)),
       moy=_maybe(st.sets(st.integers(1, 12), min_size=1, max_size=3)),
       now=st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2090, 1, 1),
                        timezones=st.just(UTC)))
def test_the_slot_is_the_crontabs_latest_instant_at_or_before_now(minute, hour, dow, dom, moy, now):
    try:
        cron = crontab(minute=_field(minute), hour=_field(hour), day_of_week=_field(dow),
                       day_of_month=_field(dom), month_of_year=_field(moy), app=_app())
    except ValueError:
        assume(False)  # Celery refuses days no month of the crontab has (31 February)
    try:
        slot = slot_of(cron, now)
    except ValueError:
        assume(False)  # no instant in 29 years: a crontab beat would never fire either
    assert slot.tzinfo is UTC
    assert slot <= now
    assert _matches(cron, slot)
    # Nothing the crontab names lies between the slot and now (Celery's forward step).
    assert _next_after(cron, slot) > now
    # The slot is what Celery itself counts as the next instant after a minute before it.
    assert _next_after(cron, slot - timedelta(minutes=1)) == slot


def test_every_fire_within_a_period_names_the_same_slot():
    weekly = crontab(minute=0, hour=2, day_of_week=1, app=_app("Europe/Berlin"))
    monday_2am = datetime(2026, 12, 7, 1, 0, tzinfo=UTC)  # 02:00 in Berlin (CET)
    # Beat fires at 02:00:00.004; a second beat a second later; a restarted one on Friday.
    for fired in (monday_2am + timedelta(milliseconds=4), monday_2am + timedelta(seconds=1),
                  datetime(2026, 12, 11, 17, 30, tzinfo=UTC), monday_2am):
        assert slot_iso(weekly, fired) == "2026-12-07T01:00:00+00:00"
    assert slot_iso(weekly, monday_2am - timedelta(microseconds=1)) == "2026-11-30T01:00:00+00:00"
    # Across the DST change the crontab's wall clock holds: 02:00 CEST is 00:00 UTC.
    assert slot_iso(weekly, datetime(2026, 4, 1, tzinfo=UTC)) == "2026-03-30T00:00:00+00:00"


def test_an_interval_slot_is_the_latest_multiple_of_the_interval_since_the_epoch():
    t = datetime(2026, 1, 5, 2, 0, 7, 250_000, tzinfo=UTC)
    assert slot_iso(1, t) == "2026-01-05T02:00:07+00:00"
    assert slot_iso(timedelta(seconds=5), t) == "2026-01-05T02:00:05+00:00"
    assert slot_iso(0.5, t) == "2026-01-05T02:00:07+00:00"
    assert slot_iso(timedelta(hours=1), t) == "2026-01-05T02:00:00+00:00"
    # Two fires one period apart never share a slot; fires within one bucket always do.
    assert slot_of(2, t) != slot_of(2, t + timedelta(seconds=2))
    assert slot_of(2, t - timedelta(seconds=1, microseconds=250_000)) == slot_of(2, t)


def test_a_schedule_without_slots_is_refused_naming_its_kind():
    class Sunrise(BaseSchedule):
        pass

    with pytest.raises(TypeError, match="no slot for a Sunrise schedule"):
        slot_of(Sunrise(), datetime(2026, 1, 1, tzinfo=UTC))
    with pytest.raises(TypeError, match="no slot for a Sunrise schedule"):
        beat_entry(Sunrise())
    with pytest.raises(ValueError, match="UTC offset"):
        slot_of(60, datetime(2026, 1, 1))


def test_the_beat_entry_sends_the_slot_beat_computes_at_send_time():
    weekly = crontab(minute=0, hour=2, day_of_week=1, app=_app(),
                     nowfun=lambda: datetime(2026, 12, 9, 12, 0, tzinfo=UTC))
    entry: dict[str, Any] = beat_entry(weekly, options={"queue": "ticks"})
    assert entry["task"] == TASK_NAME
    assert entry["schedule"] is weekly
    assert entry["options"] == {"queue": "ticks"}
    [lazy] = entry["args"]
    assert isinstance(lazy, BeatLazyFunc)
    # What beat's apply_async does with the args just before it sends.
    assert lazy() == "2026-12-07T02:00:00+00:00"
