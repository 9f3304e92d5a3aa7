"""The policy against a fixed window it cannot see: the simulator's own limiter
(``cleanup_sandbox.limits.FixedWindow``, the dialects bench's partner), R requests in each
second counted from the partner's start, every 429 with the whole-second ``Retry-After``
it sends, through ``bench/policy_grid.py``'s ``against``.

A window takes its whole quota at once, so a first run at a ceiling twice the limit is
refused a second or a little more after each pause, where a bucket refuses at once: the
policy must not take those for close arrivals and step down 3 % at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cleanup_sandbox.limits import SECOND, FixedWindow

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)
try:
    from policy_grid import against
finally:
    sys.path.remove(BENCH)


@pytest.mark.parametrize("phase", [0.0, 0.25, 0.5, 0.75])
def test_a_hidden_window_of_a_second_is_found_without_a_ladder_of_small_steps(
        phase: float) -> None:
    # Where the partner's second starts, relative to our first request, decides when each
    # 429 comes. Measured: 1.17 - 1.22 x N/R, 6 - 10 429s; counting only 429s within a
    # second of resuming as quick, the window starting with the run took 1.34 and 20.
    run = against(FixedWindow(50.0, phase, SECOND), ceiling=100.0, limit=50.0, n=1500)
    assert run.done == 1500
    assert run.refused <= 11
    assert run.ratio(50.0) <= 1.25
    assert 0.9 * 50.0 <= run.state.rate <= 1.05 * 50.0
