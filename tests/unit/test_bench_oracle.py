"""The bench's arithmetic for the oracle and for repeated runs (issue 20): the oracle's
time for a scenario (its rates scaled to the oracle's pace, its pauses unchanged), a row's
ratio against it, and how K runs of a cell become a mean, a worst run and a spread.

bench/ is a folder of scripts importing each other by bare name (it is no package), so
its directory is put on sys.path for the import and taken off again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import oracle
    from repeats import Runs, best_cell, by_cell, worst_cell
    from scenario import Event, Result, Scenario, new_result
finally:
    sys.path.remove(str(BENCH))


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
