"""The partner's rate-limit headers, every family the matrix sends, and garbage."""

from __future__ import annotations

import logging
import math
import re
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from supervisor.budget.base import Policy
from supervisor.partner import (
    MAX_POLICIES_PER_FIELD,
    IgnoredHeaders,
    parse_policies,
    parse_retry_after,
)

NOW = 1_800_000_000.0


def test_ietf_draft_11_several_policies_in_one_field() -> None:
    got = parse_policies({
        "RateLimit-Policy": '"default";q=50;w=1, "hour";q=3000;w=3600, "day";q=50000;w=86400',
        "RateLimit": '"hour";r=0;t=1800',
    }, NOW)
    assert got == (Policy("default", 50, 1.0), Policy("hour", 3000, 3600.0, 0, 1800.0),
                   Policy("day", 50000, 86400.0))


def test_ietf_older_draft_with_remaining_and_reset() -> None:
    got = parse_policies({"RateLimit-Policy": "100;w=60", "RateLimit-Remaining": "7",
                          "RateLimit-Reset": "12"}, NOW)
    assert got == (Policy("default", 100, 60.0, 7, 12.0),)


def test_x_ratelimit_resetting_within_a_second_is_a_per_second_pace() -> None:
    got = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                          "X-RateLimit-Reset": "1"}, NOW)
    assert got == (Policy("x-ratelimit", 50, 1.0, 3, 1.0),)


def test_x_ratelimit_resetting_later_is_a_quota_not_a_pace() -> None:
    # 30 s to the reset may be the middle of a minute: 50 / 30 would be no pace at all.
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": "30"}, NOW)
    assert (p.window_s, p.remaining, p.reset_s) == (86400.0, 3, 30.0)


def test_x_ratelimit_resetting_within_a_second_in_whole_unix_seconds_is_a_pace() -> None:
    # The window resets 0.3 s from now; whole Unix seconds can only say "at the next
    # second", 1.3 s away. Read as a budget, each spent second held every worker.
    now = float(int(NOW)) + 0.7
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": str(int(NOW) + 2)}, now)
    assert p.window_s == 1.0
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": "1.3"}, now)  # seconds left: exact
    assert p.window_s == 86400.0


@pytest.mark.parametrize("ahead_s", [0.0, 0.001, 0.2])
def test_x_ratelimit_resetting_within_a_second_in_unix_milliseconds_is_a_pace(
        ahead_s: float) -> None:
    # A partner that sends now plus its counter's TTL (one whole second) in milliseconds,
    # rounded up, from a clock up to 0.2 s ahead of ours. Read as a budget, every spent
    # window held every worker to its reset (1.297 x N/R in the dialects bench).
    reset = str(math.ceil((NOW + 1.0 + ahead_s) * 1000))
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": reset}, NOW)
    assert (p.window_s, p.reset_s) == (1.0, pytest.approx(1.0 + ahead_s, abs=0.002))


def test_x_ratelimit_resetting_later_in_unix_milliseconds_is_a_quota() -> None:
    # Past the clocks' skew (0.25 s), a reset 1.3 s away is no longer a per-second window.
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": str(int((NOW + 1.3) * 1000))}, NOW)
    assert p.window_s == 86400.0


@pytest.mark.parametrize(("read_at", "window"), [(0.8, 1.0), (0.7, 86400.0)])
def test_x_ratelimit_in_whole_unix_seconds_allows_the_skew_and_a_second(
        read_at: float, window: float) -> None:
    # The reset at a whole second 2.2 s away is within a second, rounded up, and the
    # skew; 2.3 s away it is past both.
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "3",
                           "X-RateLimit-Reset": str(int(NOW) + 3)}, float(int(NOW)) + read_at)
    assert p.window_s == window


def test_x_ratelimit_with_a_unix_time_is_a_quota_until_then() -> None:
    got = parse_policies({"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "0",
                          "X-RateLimit-Reset": str(int(NOW + 1200))}, NOW)
    (p,) = got
    assert (p.limit, p.remaining, p.reset_s, p.window_s) == (5000, 0, 1200.0, 86400.0)


def test_unparseable_parts_are_ignored() -> None:
    assert parse_policies({"RateLimit-Policy": '"x";q=abc;w=1, "y";q=10;w=0'}, NOW) == ()
    assert parse_policies({"X-RateLimit-Limit": "-3"}, NOW) == ()
    assert parse_policies({}, NOW) == ()


@given(st.dictionaries(st.sampled_from(["RateLimit-Policy", "RateLimit", "X-RateLimit-Limit",
                                        "X-RateLimit-Remaining", "X-RateLimit-Reset",
                                        "RateLimit-Remaining", "RateLimit-Reset"]),
                       st.text(max_size=60)))
def test_any_header_values_give_policies_with_sane_numbers(headers: dict[str, str]) -> None:
    for p in parse_policies(headers, NOW):
        assert p.limit >= 0
        assert p.window_s > 0
        assert p.remaining is None or p.remaining >= 0
        assert p.reset_s is None or p.reset_s >= 0


# -- every dialect of a reset, each clamped (review H1) ---------------------------------------

MAX = 900.0


def _xrl(reset: str, remaining: str = "0") -> Policy:
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": remaining,
                           "X-RateLimit-Reset": reset}, NOW, MAX)
    return p


def test_x_ratelimit_reset_in_epoch_milliseconds_is_read_as_milliseconds() -> None:
    # The partner: a reset 60 s ahead, in milliseconds, once read as 1.8e12 s.
    assert _xrl(str(int((NOW + 60) * 1000))).reset_s == pytest.approx(60.0)
    assert _xrl(str(int((NOW + 0.5) * 1000))).reset_s == pytest.approx(0.5)


def test_x_ratelimit_reset_in_epoch_seconds_and_seconds_left() -> None:
    assert _xrl(str(int(NOW + 42))).reset_s == pytest.approx(42.0)
    assert _xrl("42").reset_s == 42.0
    assert _xrl("0.25").reset_s == 0.25


def test_a_reset_already_past_is_now() -> None:
    assert _xrl(str(int(NOW - 30))).reset_s == 0.0
    assert _xrl(str(int((NOW - 30) * 1000))).reset_s == 0.0


@pytest.mark.parametrize("reset", [
    str(int(NOW + 10 * 86400)),  # epoch seconds, ten days ahead
    str(int((NOW + 10 * 86400) * 1000)),  # the same in milliseconds
    "86400",  # a day left
    "99999999",  # seconds left, under the epoch threshold
    "1" + "0" * 30,  # absurd
])
def test_x_ratelimit_reset_is_clamped_to_the_longest_pause(reset: str) -> None:
    assert _xrl(reset).reset_s == MAX


def test_ietf_reset_is_clamped_to_its_window_and_the_longest_pause() -> None:
    minute, day = parse_policies({
        "RateLimit-Policy": '"minute";q=100;w=60, "day";q=5000;w=86400',
        "RateLimit": '"minute";r=0;t=3600, "day";r=0;t=50000',
    }, NOW, MAX)
    assert (minute.name, minute.reset_s) == ("minute", 60.0)  # its window
    assert (day.name, day.reset_s) == ("day", MAX)  # the longest pause
    (epoch,) = parse_policies({"RateLimit-Policy": '"hour";q=10;w=3600',
                               "RateLimit": f'"hour";r=0;t={int((NOW + 30) * 1000)}'}, NOW, MAX)
    assert epoch.reset_s == pytest.approx(30.0)  # a Unix time in ms, read as one


def test_older_ietf_reset_is_clamped_to_its_window() -> None:
    (p,) = parse_policies({"RateLimit-Policy": "100;w=60", "RateLimit-Remaining": "0",
                           "RateLimit-Reset": "1e10"}, NOW, MAX)
    assert p.reset_s == 60.0


class Reported:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, header: str, why: str) -> None:
        self.seen.append((header, why))


@pytest.mark.parametrize(("headers", "header", "why"), [
    ({"X-RateLimit-Limit": "50", "X-RateLimit-Reset": "nan"}, "X-RateLimit-Reset",
     "not a finite number"),
    ({"X-RateLimit-Limit": "50", "X-RateLimit-Reset": "inf"}, "X-RateLimit-Reset",
     "not a finite number"),
    ({"X-RateLimit-Limit": "50", "X-RateLimit-Reset": "-60"}, "X-RateLimit-Reset", "negative"),
    ({"X-RateLimit-Limit": "50", "X-RateLimit-Reset": "soon"}, "X-RateLimit-Reset",
     "not a number"),
    ({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "-1"}, "X-RateLimit-Remaining",
     "negative"),
    ({"X-RateLimit-Limit": "-50"}, "X-RateLimit-Limit", "negative"),
    ({"RateLimit-Policy": '"h";q=10;w=3600', "RateLimit": '"h";r=0;t=-5'}, "RateLimit",
     "negative"),
    ({"RateLimit-Policy": '"h";q=10;w=3600', "RateLimit": '"h";r=0;t=1e999'}, "RateLimit",
     "not a finite number"),
    ({"RateLimit-Policy": '"h";q=NaN;w=3600'}, "RateLimit-Policy", "not a finite number"),
    ({"RateLimit-Policy": "100;w=60", "RateLimit-Reset": "x"}, "RateLimit-Reset",
     "not a number"),
])
def test_a_bad_value_is_ignored_and_reported(headers: dict[str, str], header: str,
                                             why: str) -> None:
    reported = Reported()
    for p in parse_policies(headers, NOW, MAX, reported):
        assert p.reset_s is None or 0 <= p.reset_s <= MAX
    assert reported.seen == [(header, why)]


def test_a_bad_reset_leaves_the_policy_without_a_reset() -> None:
    (p,) = parse_policies({"X-RateLimit-Limit": "50", "X-RateLimit-Remaining": "0",
                           "X-RateLimit-Reset": "nan"}, NOW, MAX)
    assert (p.limit, p.remaining, p.reset_s) == (50, 0, None)  # never a pause on it


@pytest.mark.parametrize(("value", "why"), [
    ("nan", "neither delay-seconds nor an HTTP-date"),
    ("-5", "neither delay-seconds nor an HTTP-date"),
    ("inf", "neither delay-seconds nor an HTTP-date"),
    ("Wed, 21 Oct 2015 07:28:00 -0000", "neither delay-seconds nor an HTTP-date"),
])
def test_a_bad_retry_after_is_reported(value: str, why: str) -> None:
    reported = Reported()
    assert parse_retry_after(value, NOW, MAX, reported) is None
    assert reported.seen == [("Retry-After", why)]


def test_retry_after_dialects_are_clamped() -> None:
    date = format_datetime(datetime.fromtimestamp(NOW + 10 * 86400, UTC), usegmt=True)
    assert parse_retry_after(date, NOW, MAX) == MAX
    assert parse_retry_after("86400", NOW, MAX) == MAX
    soon = format_datetime(datetime.fromtimestamp(NOW + 30, UTC), usegmt=True)
    assert parse_retry_after(soon, NOW, MAX) == pytest.approx(30.0)
    assert parse_retry_after("30", NOW, MAX) == 30.0


def test_partner_named_policies_are_bounded_and_label_safe() -> None:
    many = ", ".join(f'"p{i}";q=10;w=3600' for i in range(1000))
    got = parse_policies({"RateLimit-Policy": many}, NOW, MAX)
    assert len(got) == MAX_POLICIES_PER_FIELD
    (odd,) = parse_policies({"RateLimit-Policy": '"a b\\n{x}' + "y" * 200 + '";q=1;w=3600'},
                            NOW, MAX)
    assert len(odd.name) <= 64
    assert re.fullmatch(r"[A-Za-z0-9_.:-]+", odd.name)


def test_ignored_values_are_counted_and_logged_at_a_bounded_rate(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    ignored = IgnoredHeaders(clock=lambda: clock[0])
    def count() -> float:
        return REGISTRY.get_sample_value("cleanup_partner_header_ignored_total",
                                         {"header": "X-RateLimit-Reset"}) or 0.0

    before = count()
    with caplog.at_level(logging.WARNING, logger="supervisor.partner"):
        for _ in range(100):
            ignored("X-RateLimit-Reset", "negative")
        clock[0] += IgnoredHeaders.LOG_EVERY_S
        ignored("X-RateLimit-Reset", "negative")
    assert count() - before == 101
    lines = [r.getMessage() for r in caplog.records if "X-RateLimit-Reset" in r.getMessage()]
    assert len(lines) == 2
    assert "(100 ignored since" in lines[1]


@given(st.dictionaries(st.sampled_from(["RateLimit-Policy", "RateLimit", "X-RateLimit-Limit",
                                        "X-RateLimit-Remaining", "X-RateLimit-Reset",
                                        "RateLimit-Remaining", "RateLimit-Reset"]),
                       st.one_of(st.text(max_size=60),
                                 st.floats(allow_nan=True, allow_infinity=True).map(str),
                                 st.integers(-10**15, 10**15).map(str))))
def test_any_reset_stays_within_its_window_and_the_longest_pause(
        headers: dict[str, str]) -> None:
    for p in parse_policies(headers, NOW, MAX, lambda header, why: None):
        assert p.reset_s is None or 0 <= p.reset_s <= min(MAX, p.window_s)
        assert len(p.name) <= 64
