"""The oracle's trials (issue 20, points 1 and 6), against a real partner process.

A short trial, what every "vs oracle" of the matrix rests on, is clean at a pace the
partner takes and stops at its first 429 at one it refuses. A whole run, the long cells'
oracle, sent twice too fast for a bucket of one still answers every ID, sends nothing
while a ``Retry-After`` it was given runs, and accounts the pauses it sat out: it pays its
refusals the way the service must."""

from __future__ import annotations

import pytest

import oracle
from matrix import CELLS_BY_NAME

pytestmark = pytest.mark.e2e


async def test_a_short_trial_at_a_pace_the_partner_takes_is_clean() -> None:
    # A bucket of ten at 20/s, sent 5/s: a stalled host bunching departures stays within
    # the burst.
    result = await oracle.trial(CELLS_BY_NAME["bucket-10"], 20.0, 5.0, 5)
    assert result["ok"], result
    assert result["statuses"] == {"204": 5}
    assert result["first_429_s"] is None
    assert result["partner_429"] == 0


async def test_a_short_trial_too_fast_stops_at_its_first_429() -> None:
    # 200 IDs at 40/s against a bucket of one at 1/s: the second departure is refused, and
    # the trial must stop there, not run out its 5 s schedule sending into the refusals.
    result = await oracle.trial(CELLS_BY_NAME["bucket-1"], 1.0, 40.0, 200)
    assert not result["ok"]
    assert result["first_429_s"] is not None
    assert result["partner_429"] >= 1
    assert result["sent"] < 200, result
    assert result["paused_s"] is None  # a short trial never pauses: it stops


async def test_a_whole_run_too_fast_honours_every_retry_after_and_answers_every_id() -> None:
    # 3 IDs at 40/s against a bucket of one at 1/s: the second departure comes 25 ms after
    # the first where the bucket wants a second, however slow the host, so the run meets
    # 429s (each Retry-After: 1) and must pause before every ID after the first.
    result = await oracle.trial(CELLS_BY_NAME["bucket-1"], 1.0, 40.0, 3, whole=True)
    assert result["ok"], result
    assert result["n"] == 3
    assert result["partner_429"] >= 1
    assert result["statuses"].get("429") == result["partner_429"]
    # Every ID deleted once, and nothing sent inside an announced wait.
    assert result["statuses"].get("204") == 3
    assert result["partner_requests_in_announced_wait"] == 0
    assert result["paused_s"] > 0
