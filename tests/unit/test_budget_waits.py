"""The waits the rate policy sets where the partner says nothing (budget/waits.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from supervisor.budget import waits


@given(st.integers(0, 10**6), st.floats(0.0, 1e7))
def test_the_blind_backoff_is_finite_and_never_past_its_share_of_the_closure(
        blind: int, closed_s: float) -> None:
    backoff = waits.blind_backoff(blind, closed_s)
    assert math.isfinite(backoff)
    assert 0 < backoff <= max(waits.BLIND_MAX_S, waits.BLIND_SHARE * closed_s)


def test_the_blind_backoff_doubles_from_its_base_then_grows_with_the_closure() -> None:
    assert waits.blind_backoff(0, 0.0) == waits.BLIND_BASE_S
    assert waits.blind_backoff(1, 0.1) == 2 * waits.BLIND_BASE_S
    assert waits.blind_backoff(5, 2.0) == waits.BLIND_MAX_S
    assert waits.blind_backoff(40, 600.0) == waits.BLIND_SHARE * 600.0


def test_a_closely_bracketed_limit_waits_longer_to_probe_than_a_wide_one() -> None:
    # Between 48 and 51.2/s with a 1.3 s pause (a sliding log's HTTP-date): about 40 s.
    close = waits.repaid_s(48.0, 51.2, 100.0, 1.3)
    wide = waits.repaid_s(25.0, 50.0, 100.0, 1.0)
    assert 30.0 < close < 60.0
    assert wide < 2.0
    assert waits.repaid_s(48.0, 51.2, 100.0, 0.1) < close / 10  # a bare 429's pause
    assert waits.repaid_s(50.0, 50.0, 100.0, 1.0) == 0.0  # nothing bracketed
