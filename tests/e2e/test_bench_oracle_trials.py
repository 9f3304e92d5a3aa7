"""The oracle's whole run (issue 20, points 1 and 6), against a real partner process: a
sender twice too fast for a bucket of one still answers every ID, sends nothing while a
``Retry-After`` it was given runs, and accounts the pauses it sat out. The long cells'
"vs oracle" rests on this run paying its refusals the way the service must."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import oracle
    from matrix import CELLS_BY_NAME
finally:
    sys.path.remove(str(BENCH))

pytestmark = pytest.mark.e2e


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
