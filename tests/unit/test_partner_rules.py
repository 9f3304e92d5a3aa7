"""The partner client's pure rules: Retry-After parsing, classification, recipient paths."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.partner import Verdict, classify, parse_retry_after, recipient_path

NOW = 1_700_000_000.0
MAX = 900.0


def http_date(offset_s: float) -> str:
    return format_datetime(datetime.fromtimestamp(NOW + offset_s, UTC), usegmt=True)


# -- Retry-After (RFC 9110 §10.2.3) -----------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("120", 120.0),
    ("  7 ", 7.0),
    ("0", 0.0),
    ("1.5", 1.5),
    ("86400", MAX),  # absurd values are clamped to the configured maximum pause
    ("99999999999999999999999", MAX),
])
def test_delay_seconds(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW, MAX) == expected


def test_http_date_in_the_future() -> None:
    assert parse_retry_after(http_date(30), NOW, MAX) == pytest.approx(30.0)


def test_http_date_in_the_past_is_no_wait() -> None:
    assert parse_retry_after(http_date(-3600), NOW, MAX) == 0.0


def test_http_date_far_ahead_is_clamped() -> None:
    assert parse_retry_after(http_date(10 * 86400), NOW, MAX) == MAX


@pytest.mark.parametrize("value", [
    None, "", "soon", "12abc", "nan", "NaN", "Wed, 99 Foo 2015 07:28:00 GMT",
    "Wed, 21 Oct 2015 07:28:00 -0000",  # a date without a zone: not an RFC 9110 date
    "-5", "+5", "1_000", "1e400", "inf",  # not 1*DIGIT
])
def test_garbage_is_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW, MAX) is None


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=40))
def test_any_header_value_is_none_or_within_bounds(value: str) -> None:
    result = parse_retry_after(value, NOW, MAX)
    assert result is None or 0.0 <= result <= MAX


# -- classification ------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "verdict"), [
    (200, Verdict.DELETED), (202, Verdict.DELETED), (204, Verdict.DELETED),
    (404, Verdict.ABSENT), (410, Verdict.ABSENT),
    (429, Verdict.THROTTLED),
    (408, Verdict.TRANSIENT), (409, Verdict.TRANSIENT),  # 409: the same key still in progress
    (500, Verdict.TRANSIENT), (502, Verdict.TRANSIENT), (503, Verdict.TRANSIENT),
    (504, Verdict.TRANSIENT),
    (400, Verdict.TERMINAL), (401, Verdict.TERMINAL), (403, Verdict.TERMINAL),
    (422, Verdict.TERMINAL),  # the key reused with another payload: a bug, fail loudly
    (301, Verdict.TERMINAL), (302, Verdict.TERMINAL),  # redirects are not followed
])
def test_classify(status: int, verdict: Verdict) -> None:
    assert classify(status, None) is verdict


def test_classify_429_with_retry_after_is_still_throttled() -> None:
    assert classify(429, 30.0) is Verdict.THROTTLED
    assert classify(503, 30.0) is Verdict.TRANSIENT


# -- recipient paths --------------------------------------------------------------------------


T = "/recipients/{recipient_id}"


@pytest.mark.parametrize(("recipient", "path"), [
    ("r-000001", "/recipients/r-000001"),
    ("a/b", "/recipients/a%2Fb"),
    ("../admin", "/recipients/..%2Fadmin"),
    ("..", "/recipients/%2E%2E"),
    (".", "/recipients/%2E"),
    ("...", "/recipients/..."),  # not a dot segment
    ("a b?c#d&e=f%", "/recipients/a%20b%3Fc%23d%26e%3Df%25"),
    ("ünïcødé", "/recipients/%C3%BCn%C3%AFc%C3%B8d%C3%A9"),
    ("日本", "/recipients/%E6%97%A5%E6%9C%AC"),
    ("user@example.com", "/recipients/user%40example.com"),
])
def test_recipient_path(recipient: str, path: str) -> None:
    assert recipient_path(T, recipient) == path


def test_recipient_path_in_the_middle_of_a_template() -> None:
    assert recipient_path("/v2/{recipient_id}/erase", "a/b") == "/v2/a%2Fb/erase"


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(min_size=1, max_size=50))
def test_recipient_path_is_one_segment_that_round_trips(recipient: str) -> None:
    path = recipient_path(T, recipient)
    assert path.startswith("/recipients/")
    segment = path[len("/recipients/"):]
    assert "/" not in segment
    assert "?" not in segment
    assert "#" not in segment
    assert segment not in (".", "..")
    assert unquote(segment, errors="surrogatepass") == recipient
