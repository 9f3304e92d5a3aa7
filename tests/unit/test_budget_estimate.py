"""The partner's hidden rate from two overloads (supervisor.budget.estimate), on curves
whose answer is known in closed form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.budget import estimate


def overloads(r: float, b: float, top: float, probe: float) -> tuple[float, float]:
    """A bucket of ``b`` at ``r``/s: how long the top drained it, and how long a probe at a
    steady ``probe``/s from a full bucket lasted."""
    return b / (top - r), b / (probe - r)


@given(r=st.floats(5.0, 90.0), b=st.floats(1.0, 50.0), over=st.floats(1.05, 1.5))
def test_a_bucket_is_measured_from_the_top_and_a_steady_probe(r: float, b: float,
                                                              over: float) -> None:
    top, probe, plateau = 100.0, min(99.0, r * over), r * 0.8
    first_s, probe_s = overloads(r, b, top, probe)
    found = estimate.limit(lambda t: probe, 0.0, probe_s, plateau, probe, top, first_s)
    assert found == pytest.approx(r, rel=1e-3)


def test_a_probe_that_ramps_is_integrated() -> None:
    # A probe climbing from 40/s by 10/s each second, refused at 3 s; the top ran 100/s
    # for 0.2 s. Its excess over r is 5 (3 - (r - 40) / 10)^2 and the top's burst at r is
    # (100 - r) 0.2: the limit is the r where the two meet.
    found = estimate.limit(lambda t: 40.0 + 10.0 * t, 0.0, 3.0, 40.0, 100.0, 100.0, 0.2)
    assert found is not None
    assert 40.0 < found < 70.0
    excess = 5.0 * (3.0 - (found - 40.0) / 10.0) ** 2
    assert excess == pytest.approx((100.0 - found) * 0.2, rel=1e-3)


@pytest.mark.parametrize(("refused_at", "plateau", "high", "first_s"), [
    (0.0, 40.0, 60.0, 0.2),  # refused before the probe began: nothing measured
    (1.0, 60.0, 60.0, 0.2),  # no room between the plateau and what was refused
    (1.0, 40.0, 60.0, 0.0),  # no first overload to read the burst from
    (0.01, 40.0, 60.0, 5.0),  # refused sooner than any bucket the top drained allows
])
def test_no_estimate_when_the_overloads_do_not_describe_a_bucket(
        refused_at: float, plateau: float, high: float, first_s: float) -> None:
    assert estimate.limit(lambda t: 60.0, 0.0, refused_at, plateau, high, 100.0,
                          first_s) is None
