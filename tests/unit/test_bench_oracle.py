"""The bench's arithmetic for the oracle and for repeated runs (issue 20): the oracle's
time for a scenario (its rates scaled to the oracle's pace, its pauses unchanged), a row's
ratio against it, how K runs of a cell become a mean, a worst run and a spread, and for a
long cell the oracle's whole runs (their schedule through pauses, which one counts) and
what learning the limit cost a run."""

from __future__ import annotations

import pytest

import oracle
from repeats import Runs, best_cell, by_cell, worst_cell
from scenario import Event, Result, Scenario, learning_s, new_result, steady_pace


def _changing(r: float = 50.0) -> Scenario:
    return Scenario("changing-limit", "changing", n=1375, partner_rate=r, ceiling=r, matrix=True,
                    events=(Event(8.0, rate_per_second=r / 4), Event(18.0, rate_per_second=r)))


def _storms() -> Scenario:
    return Scenario("storms", "storms", n=600, partner_rate=50, ceiling=50, matrix=True,
                    events=tuple(Event(t, pause_s=3.0) for t in (2.0, 6.0, 10.0)))


def test_the_oracle_at_r_equal_to_the_limit_is_the_ideal() -> None:
    for sc in (_changing(), _storms()):
        assert sc.oracle_s(sc.partner_rate) == pytest.approx(sc.ideal_s())


def test_the_oracle_scales_every_rate_change_with_its_pace() -> None:
    # At 48 for a partner of 50: 48 for 8 s, 12 for 10 s, then 48 again.
    sc = _changing()
    assert sc.ideal_s() == pytest.approx(35.0)
    assert sc.oracle_s(48.0) == pytest.approx(18.0 + (1375 - 8 * 48 - 10 * 12) / 48)
    scaled = sc.at_rate(48.0)
    assert [e.rate_per_second for e in scaled.rate_changes] == pytest.approx([12.0, 48.0])
    assert [e.at_s for e in scaled.events] == [8.0, 18.0]


def test_the_oracle_keeps_the_pauses_as_they_are() -> None:
    # 600 at 40/s with three 3 s pauses at 2, 6, 10 s: 80 by 2 s, 40 in [5, 6), 40 in
    # [9, 10), the other 440 from 13 s on: 24 s (at 50/s: 21 s).
    sc = _storms()
    assert sc.ideal_s() == pytest.approx(21.0)
    assert sc.oracle_s(40.0) == pytest.approx(24.0)


def _row(cell: str, wall: float | None, ideal: float = 30.0, repeat: int = 1,
         oracle_s: float | None = None) -> Result:
    r = Result("known-limit", "service", 1500, "50", ideal, wall_s=wall, elapsed_s=wall or 75.0,
               completed=1500 if wall else 0, requests=1500, cell=cell)
    r.extra["repeat"] = repeat
    if oracle_s is not None:
        r.extra["oracle"] = {"rate": 48.0, "s": oracle_s}
    return r


def test_a_row_is_measured_against_the_oracle_time_it_carries() -> None:
    r = _row("bucket-1", 33.0, oracle_s=31.25)
    assert r.ratio == pytest.approx(1.1)
    assert r.oracle_ratio == pytest.approx(33.0 / 31.25)
    assert r.as_dict()["oracle_ratio"] == pytest.approx(33.0 / 31.25)
    assert _row("bucket-1", 33.0).oracle_ratio is None


def test_attach_gives_matrix_rows_their_cells_oracle_time() -> None:
    sc = _changing()
    row = new_result(sc, "service")
    row.wall_s = 40.0
    oracle.attach([row], {oracle.key("bucket-10", 50.0): {"rate": 48.0, "n": 1500}})
    assert row.oracle_rate == 48.0
    assert row.extra["oracle"]["s"] == pytest.approx(sc.oracle_s(48.0))
    assert row.oracle_ratio == pytest.approx(40.0 / sc.oracle_s(48.0))


def test_the_paces_tried_step_down_from_r_to_the_floor() -> None:
    paces = oracle.rates(50.0, step=0.005, floor=0.9)
    assert paces[:3] == [50.0, 49.75, 49.5]
    assert paces[-1] == pytest.approx(45.0)
    assert len(paces) == 21


def test_k_runs_give_the_mean_the_worst_and_the_spread() -> None:
    rows = [_row("a", 30.0, repeat=1), _row("a", 33.0, repeat=2), _row("a", 39.0, repeat=3)]
    (runs,) = by_cell(rows)
    assert runs.count == 3
    assert runs.mean_ratio == pytest.approx((1.0 + 1.1 + 1.3) / 3)
    assert runs.spread == pytest.approx(0.3)
    assert runs.worst.extra["repeat"] == 3
    assert Runs((rows[0],)).spread is None  # one run: nothing to spread


def test_the_ranking_is_on_each_cells_worst_run_not_its_mean() -> None:
    # a: mean 1.13 but a worst run of 1.3; b: one run of 1.2. a is the worst cell, b the best.
    rows = [_row("a", 30.0), _row("b", 36.0), _row("a", 33.0, repeat=2), _row("a", 39.0, repeat=3)]
    bad, good = worst_cell(rows), best_cell(rows)
    assert bad is not None
    assert (bad.cell, bad.ratio) == ("a", pytest.approx(1.3))
    assert good is not None
    assert good.cell == "b"


def test_a_run_without_a_ratio_makes_its_cell_the_worst() -> None:
    rows = [_row("a", 30.0), _row("a", None, repeat=2), _row("b", 45.0)]
    (a, _b) = by_cell(rows)
    assert a.worst.ratio is None
    assert a.mean_ratio == pytest.approx(1.0)  # over the runs that have one
    assert a.spread is None
    bad = worst_cell(rows)
    assert bad is not None
    assert bad.cell == "a"
    good = best_cell(rows)
    assert good is not None
    assert good.cell == "b"


# -- a long cell: the oracle's whole runs, and what learning cost ----------------------------


def test_a_whole_runs_schedule_is_absolute_until_a_pause_restarts_it_at_its_end() -> None:
    s = oracle.Schedule(20.0, t0=100.0)
    dues = []
    for _ in range(3):
        dues.append(s.due())
        s.sent()
    assert dues == pytest.approx([100.0, 100.05, 100.1])
    s.pause_until(100.12)  # before the next departure (100.15): nothing moves
    assert s.due() == pytest.approx(100.15)
    assert s.paused_s == 0.0
    s.pause_until(101.2)
    assert s.due() == pytest.approx(101.2)
    assert s.paused_s == pytest.approx(101.2 - 100.15)
    s.sent()
    assert s.due() == pytest.approx(101.25)  # k restarted at the pause's end
    s.pause_until(100.5)  # an earlier end cannot shorten the pause
    assert s.resume_at == pytest.approx(101.2)


def test_a_guard_holds_back_the_second_departure_after_a_pause_and_the_rest_with_it() -> None:
    s = oracle.Schedule(20.0, t0=100.0, guard_s=0.003)
    assert s.due() == pytest.approx(100.0)
    s.sent()
    assert s.due() == pytest.approx(100.05)  # the run's start is no pause: no guard
    s.sent()
    s.pause_until(102.0)
    assert s.due() == pytest.approx(102.0)
    s.sent()
    assert s.due() == pytest.approx(102.053)
    s.sent()
    assert s.due() == pytest.approx(102.103)
    assert [oracle.k_bucket(k) for k in (0, 1, 2, 3, 9, 10, 99, 100)] == [
        "0", "1", "2", "3-9", "3-9", "10-99", "10-99", "100+"]


def _long(n: int = 18_400) -> Scenario:
    return Scenario("article-hidden-bucket-1", "long", n=n, partner_rate=20, ceiling=40)


def test_the_fastest_whole_run_that_finished_is_the_oracles_time() -> None:
    runs = [{"rate": 19.5, "wall_s": 960.0, "partner_429": 9, "ok": True},
            {"rate": 19.75, "wall_s": 950.0, "partner_429": 30, "ok": False},
            {"rate": 19.25, "wall_s": 958.0, "partner_429": 1, "ok": True}]
    entry = oracle.whole_entry(18_400, runs)
    assert (entry["rate"], entry["wall_s"], entry["partner_429"]) == (19.25, 958.0, 1)
    assert oracle.whole_entry(18_400, runs[1:2])["wall_s"] is None


def test_a_row_of_the_whole_runs_n_is_measured_against_their_time() -> None:
    short = {"rate": 19.5, "n": 600, "cell": {"name": "bucket-1"}}
    whole = oracle.whole_entry(18_400, [{"rate": 19.25, "wall_s": 958.0, "partner_429": 1,
                                         "ok": True}])
    row = new_result(_long(), "service")
    entries = {oracle.key(row.cell, 20.0): {**short, "whole": whole}}
    row.wall_s = 990.0
    oracle.attach([row], entries)
    assert row.extra["oracle"]["whole"] is True
    assert row.oracle_ratio == pytest.approx(990.0 / 958.0)
    # Another N: the short trial's pace, scaled as before.
    other = new_result(_long(6_000), "service")
    other.wall_s = 330.0
    oracle.attach([other], entries)
    assert "whole" not in other.extra["oracle"]
    assert other.extra["oracle"]["s"] == pytest.approx(6_000 / 19.5)


def test_a_cell_measured_again_keeps_its_whole_runs() -> None:
    cell = {"name": "bucket-1", "burst": 1}
    whole = {"n": 18_400, "wall_s": 958.0}
    kept = oracle.keep_whole({"cell": cell, "whole": whole}, {"cell": cell, "rate": 19.5})
    assert kept["whole"] == whole
    other = oracle.keep_whole({"cell": {"name": "bucket-1", "burst": 2}, "whole": whole},
                              {"cell": cell, "rate": 19.5})
    assert "whole" not in other


def _ran(times: list[float], n: int, wall: float) -> Result:
    r = new_result(_long(n), "service")
    r.wall_s = wall
    r.extra["executions_s"] = times
    return r


def test_learning_is_the_wall_less_n_at_the_pace_held_once_learnt() -> None:
    # 10/s for the first 60 s (600), then 20/s to the end: 1,000 more over 50 s... made
    # long enough (the pace after 60 s must be seen for 4 x 60 s): 6,000 at 20/s.
    first = [k / 10.0 for k in range(600)]
    then = [60.0 + k / 20.0 for k in range(6_000)]
    r = _ran(first + then, 6_600, wall=360.0)
    assert steady_pace(r) == pytest.approx(20.0)
    # At 20/s from the start the 6,600 would take 330 s: learning cost the other 30.
    assert learning_s(r) == pytest.approx(30.0)
    # Three stragglers retried a minute after the rest are not the pace that was held.
    late = _ran(first + then[:-3] + [420.0, 421.0, 422.0], 6_600, wall=422.0)
    assert steady_pace(late) == pytest.approx(20.0)


def test_a_scenario_that_changes_the_limit_has_no_held_pace() -> None:
    r = new_result(_changing(), "service")
    r.wall_s = 400.0
    r.extra["executions_s"] = [k / 20.0 for k in range(8_000)]
    assert steady_pace(r) is None


def test_a_run_too_short_to_show_a_held_pace_has_no_learning_figure() -> None:
    r = _ran([k / 20.0 for k in range(1_500)], 1_500, wall=75.0)
    assert steady_pace(r) is None
    assert learning_s(r) is None
    unfinished = _ran([k / 20.0 for k in range(18_400)], 18_400, wall=920.0)
    unfinished.wall_s = None
    assert learning_s(unfinished) is None
