"""When a submitted job is read next (supervisor.batch.schedule): doubling with its age,
within [initial, max], never outliving half its results' learnt lifetime, and before an
expiry it announced."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from supervisor.batch.schedule import next_poll, seen_lifetime

T0 = 1_800_000_000.0
INITIAL, MAX = 0.5, 30.0


def due(age: float, **kw: float | None) -> float:
    """The interval after a read ``age`` seconds after submission."""
    return next_poll(T0, T0 + age, initial=INITIAL, maximum=MAX, **kw) - (T0 + age)


def test_first_read_is_initial_after_submission() -> None:
    assert next_poll(T0, None, initial=INITIAL, maximum=MAX, lifetime=0.1,
                     expires_at=T0) == T0 + INITIAL


def test_without_anything_learnt_the_interval_doubles_up_to_max() -> None:
    assert [due(a) for a in (0.5, 1.0, 2.0, 8.0, 29.0, 100.0)] == [
        0.5, 1.0, 2.0, 8.0, 29.0, 30.0]
    assert due(0.1) == INITIAL


def test_a_learnt_lifetime_caps_the_interval_at_half_of_it() -> None:
    # Results kept 4 s: a job that finishes just after a read is read 2 s later.
    assert due(100.0, lifetime=4.0) == 2.0
    assert due(1.0, lifetime=4.0) == 1.0  # younger jobs still double
    # Never below initial, however short the lifetime seen.
    assert due(100.0, lifetime=0.0) == INITIAL
    # A lifetime longer than twice the max changes nothing.
    assert due(100.0, lifetime=3600.0) == MAX


def test_an_announced_expiry_brings_the_read_forward() -> None:
    age = 8.0
    polled = T0 + age
    # Doubling says 8 s; the results expire 3 s after this read: read 0.5 s before.
    assert due(age, expires_at=polled + 3.0) == pytest.approx(2.5)
    assert due(age, expires_at=polled + 3.0, margin=1.0) == pytest.approx(2.0)
    # Far away, it changes nothing.
    assert due(age, expires_at=polled + 3600.0) == age
    # Too close (or past) to meet without reading sooner than initial: initial.
    assert due(age, expires_at=polled + 0.7) == INITIAL
    assert due(age, expires_at=polled - 10.0) == INITIAL


def test_seen_lifetime_is_a_lower_bound_never_negative() -> None:
    assert seen_lifetime(T0 + 90.0, T0) == 90.0
    assert seen_lifetime(T0 - 1.0, T0) == 0.0


_secs = st.floats(min_value=0.0, max_value=100_000.0, allow_nan=False)
_positive = st.floats(min_value=0.01, max_value=10_000.0, allow_nan=False)


@given(age=_secs, initial=_positive, spread=st.floats(min_value=1.0, max_value=1_000.0),
       lifetime=st.none() | _secs, expires_in=st.none() | st.floats(-1e5, 1e5),
       margin=st.none() | _secs)
def test_properties(age: float, initial: float, spread: float, lifetime: float | None,
                    expires_in: float | None, margin: float | None) -> None:
    maximum = initial * spread
    polled = T0 + age
    expires_at = None if expires_in is None else polled + expires_in
    at = next_poll(T0, polled, initial=initial, maximum=maximum, lifetime=lifetime,
                   expires_at=expires_at, margin=margin)
    interval = at - polled
    eps = 1e-6 * max(1.0, abs(at))  # float rounding of absolute Unix times
    assert interval >= initial - eps  # never sooner than initial
    assert interval <= maximum + eps  # never later than max
    if lifetime is not None:
        assert interval <= max(initial, lifetime / 2) + eps
    if expires_at is not None:
        before = expires_at - (initial if margin is None else margin)
        if before >= polled + initial:  # an expiry that can be met is met
            assert at <= before + eps
    # Knowing more never makes a read later than not knowing it.
    assert at <= next_poll(T0, polled, initial=initial, maximum=maximum) + eps


@given(age=_secs, initial=_positive, spread=st.floats(min_value=1.0, max_value=1_000.0),
       longer=_secs, shorter=_secs)
def test_a_shorter_lifetime_never_reads_later(age: float, initial: float, spread: float,
                                              longer: float, shorter: float) -> None:
    assume(shorter <= longer)
    kw = {"initial": initial, "maximum": initial * spread}
    assert next_poll(T0, T0 + age, lifetime=shorter, **kw) \
        <= next_poll(T0, T0 + age, lifetime=longer, **kw)


@given(finished_after_read=st.floats(min_value=0.0, max_value=1.0),
       lifetime=st.floats(min_value=0.02, max_value=10_000.0),
       initial=st.floats(min_value=0.01, max_value=5_000.0),
       age=_secs)
def test_a_job_finishing_after_any_read_is_read_before_its_results_expire(
        finished_after_read: float, lifetime: float, initial: float, age: float) -> None:
    # Whatever the job's age, with its results' lifetime learnt (and at least twice
    # initial, else nothing but reading sooner than initial could meet it), a job
    # finishing anywhere before the next read has half its results' life left then.
    assume(lifetime >= 2 * initial)
    polled = T0 + age
    at = next_poll(T0, polled, initial=initial, maximum=1e9, lifetime=lifetime)
    finished = polled + finished_after_read * (at - polled)
    assert at - finished <= lifetime / 2 + 1e-6 * at
