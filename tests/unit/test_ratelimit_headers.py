"""The partner's rate-limit headers, every family the matrix sends, and garbage."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from supervisor.budget.base import Policy
from supervisor.partner import parse_policies

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
