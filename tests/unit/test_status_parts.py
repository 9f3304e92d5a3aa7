"""The status page's parts on their own: sessions, their expiry and per-role caps, the
chart's history, and the run summary against the digest cutoff. (Tokens to roles and the
failure throttle: tests/unit/test_apiauth.py.)"""

from __future__ import annotations

import asyncio

import pytest

from supervisor import metrics
from supervisor.model import Run
from supervisor.states import OpState, RunState
from supervisor.status.auth import Sessions
from supervisor.status.history import History, Reading, counter_total, metrics_reader
from supervisor.status.views import duration_text, summarize


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- sessions and logins ----------------------------------------------------------------


def test_a_session_lives_for_its_lifetime_only() -> None:
    clock = Clock()
    sessions = Sessions(60.0, clock)
    s = sessions.create("operator")
    assert sessions.get(s.id) is s
    assert s.csrf != s.id
    assert len(s.id) >= 40
    clock.t += 59.9
    assert sessions.get(s.id) is s
    clock.t += 0.1
    assert sessions.get(s.id) is None
    assert len(sessions) == 0
    assert sessions.get(None) is None
    assert sessions.get("") is None


def test_sessions_are_bounded_the_oldest_going_first() -> None:
    sessions = Sessions(60.0, Clock(), max_sessions=3)
    made = [sessions.create("viewer") for _ in range(4)]
    assert sessions.get(made[0].id) is None
    assert all(sessions.get(s.id) is s for s in made[1:])
    assert len(sessions) == 3


def test_a_viewers_logins_never_evict_an_operators_session() -> None:
    sessions = Sessions(60.0, Clock(), max_sessions=3)
    operator = sessions.create("operator")
    viewers = [sessions.create("viewer") for _ in range(1000)]
    assert sessions.get(operator.id) is operator
    assert [s for s in viewers if sessions.get(s.id) is not None] == viewers[-3:]
    assert len(sessions) == 4
    operators = [sessions.create("operator") for _ in range(3)]
    assert sessions.get(operator.id) is None  # an operator's own cap: the oldest went
    assert all(sessions.get(s.id) is s for s in operators + viewers[-3:])


def test_a_dropped_or_expired_session_frees_its_roles_place() -> None:
    clock = Clock()
    sessions = Sessions(60.0, clock, max_sessions=2)
    a, b = sessions.create("operator"), sessions.create("operator")
    sessions.drop(a.id)
    c = sessions.create("operator")
    assert sessions.get(b.id) is b
    assert sessions.get(c.id) is c
    clock.t += 60
    assert sessions.get(b.id) is None
    d, e = sessions.create("operator"), sessions.create("operator")
    assert sessions.get(d.id) is d
    assert sessions.get(e.id) is e


# -- the chart's history -------------------------------------------------------------------


def reading(rate: float, throttled: float, completed: float, paused: bool = False) -> Reading:
    return Reading(rate=rate, ceiling=20.0, paused=paused, throttled=throttled,
                   completed=completed)


def test_series_derives_rates_from_the_running_totals() -> None:
    clock = Clock(100.0)
    readings = iter([reading(20, 0, 0), reading(16, 3, 18), reading(16, 3, 34, paused=True),
                     reading(18, 3, 52)])
    history = History(lambda: next(readings), clock=clock)
    for _ in range(4):
        history.sample()
        clock.t += 1.0
    points = history.series(since=100.5)
    # The sample before `since` is the baseline of the first point.
    assert [p["t"] for p in points] == [101.0, 102.0, 103.0]
    assert [p["throughput"] for p in points] == [18.0, 16.0, 18.0]
    assert [p["throttled_per_min"] for p in points] == [180.0, 0.0, 0.0]
    assert [p["paused"] for p in points] == [False, True, False]
    assert history.series(since=100.5, until=101.5) == points[:1]
    assert history.series(since=200.0) == []


def test_a_long_run_is_averaged_into_at_most_max_points() -> None:
    clock = Clock(0.0)

    def read() -> Reading:  # one a second: 10 or 11/s, 10 settled/s, a 429 each 10 s
        return reading(10.0 + clock.t % 2, throttled=clock.t // 10, completed=10.0 * clock.t)

    history = History(read, clock=clock, capacity=1000)
    for _ in range(1000):
        history.sample()
        clock.t += 1.0
    points = history.series(since=0.0, max_points=100)
    assert len(points) == 100
    assert all(p["rate"] == pytest.approx(10.5) for p in points)
    assert all(p["throughput"] == pytest.approx(10.0) for p in points[1:])
    assert all(p["throttled_per_min"] == pytest.approx(6.0) for p in points[1:])
    assert len(history.samples) == 1000


async def test_a_failed_reading_leaves_a_gap_not_a_stopped_sampler() -> None:
    calls = 0
    taken = asyncio.Event()

    def read() -> Reading:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        taken.set()
        return reading(1, 0, 0)

    history = History(read, interval_s=0.001)
    task = asyncio.create_task(history.run())
    await asyncio.wait_for(taken.wait(), 5)
    task.cancel()
    assert len(history.samples) >= 1
    assert calls >= 2


def test_the_reader_follows_this_process_metrics() -> None:
    read = metrics_reader(lambda: 7.5, 20.0, clock=lambda: 1000.0)
    before = read()
    metrics.PARTNER_RESPONSES.labels("429").inc(2)
    metrics.PARTNER_RESPONSES.labels("204").inc(5)
    metrics.OPERATIONS.labels("deleted").inc(3)
    metrics.OPERATIONS.labels("failed").inc(1)
    after = read()
    assert (after.rate, after.ceiling) == (7.5, 20.0)
    assert after.throttled - before.throttled == 2
    assert after.completed - before.completed == 4
    assert counter_total(metrics.PARTNER_RESPONSES, status="no such") == 0


# -- the run against the digest cutoff -----------------------------------------------------


def run(state: RunState, created: float = 0.0, finished: float | None = None,
        scheduled: float | None = None) -> Run:
    return Run(id="run_1", tick_key="k", schedule="weekly", scheduled_for=scheduled,
               state=state, source={"kind": "inline"}, scan_cursor=None, scan_pages=1,
               discovered=100, skipped_candidates=0, scan_failures=0, last_error=None,
               created_at=created, scan_finished_at=None, finished_at=finished)


def test_a_draining_run_is_projected_against_the_cutoff() -> None:
    counts = {OpState.DELETED: 40, OpState.QUEUED: 60}
    s = summarize(run(RunState.DRAINING), counts, rate=2.0, now=100.0, cutoff_s=200.0)
    assert s["projected_finish"] == 130.0
    assert (s["verdict"], s["cutoff"]) == ("ok", 200.0)
    assert s["fields"]["verdict"] == "projected to finish 1m 10s before the cutoff"
    late = summarize(run(RunState.DRAINING), counts, rate=0.5, now=100.0, cutoff_s=200.0)
    assert late["verdict"] == "late"
    assert late["fields"]["verdict"] == "projected to finish 20s after the cutoff"
    # The cutoff counts from the slot the run stands for, when it has one.
    slotted = summarize(run(RunState.DRAINING, created=50.0, scheduled=10.0), counts, 2.0,
                        100.0, 200.0)
    assert slotted["cutoff"] == 210.0


def test_a_done_run_is_judged_by_when_it_finished() -> None:
    counts = {OpState.DELETED: 95, OpState.AMBIGUOUS: 5}
    s = summarize(run(RunState.DONE, finished=250.0), counts, rate=5.0, now=300.0,
                  cutoff_s=200.0)
    assert (s["projected_finish"], s["verdict"], s["unfinished"], s["settled"]) == \
        (None, "late", 0, 100)
    assert s["fields"]["verdict"] == "finished 50s after the cutoff"
    assert s["fields"]["finish"].endswith("after 4m 10s")
    assert s["fields"]["ambiguous"] == "5"


def test_the_budgets_projection_wins_over_the_bare_rate() -> None:
    # A spent quota resetting at t = 500: at 2/s the 60 left would end at 130, but the
    # budget says 530, after the cutoff; the page must say so, as the alert does.
    counts = {OpState.DELETED: 40, OpState.QUEUED: 60}
    asked: list[tuple[int, float]] = []

    def budget_projection(n: int, now: float) -> float:
        asked.append((n, now))
        return 500.0 + n / 2.0

    s = summarize(run(RunState.DRAINING), counts, rate=2.0, now=100.0, cutoff_s=200.0,
                  projected_finish=budget_projection)
    assert asked == [(60, 100.0)]
    assert s["projected_finish"] == 530.0
    assert s["verdict"] == "late"


def test_without_a_cutoff_or_a_rate_there_is_no_verdict() -> None:
    counts = {OpState.QUEUED: 100}
    assert summarize(run(RunState.DRAINING), counts, 2.0, 0.0, None)["verdict"] == "none"
    s = summarize(run(RunState.DRAINING), counts, 0.0, 0.0, 200.0)
    assert (s["verdict"], s["projected_finish"]) == ("none", None)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (59.4, "59s"), (61, "1m 01s"), (3599, "59m 59s"), (3600, "1h 00m"),
    (90061, "1d 01h"), (-70, "1m 10s"),
])
def test_durations_read_as_a_person_reads_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
