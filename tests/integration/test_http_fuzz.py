"""Fuzz POST /v1/runs with random bodies and headers over real HTTP: every answer is a 2xx or
a 4xx (never a 5xx), always JSON, and a rejected request writes nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from .http_app import TOKEN, Api, load_config, running_api


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    # overlap = allow, so accepted ticks keep opening runs and the success path is fuzzed too;
    # a failure throttle out of reach, or the wrong tokens fuzzed would leave only 429s.
    async with running_api(load_config(tmp_path, schedule__overlap="allow",
                                       service__max_body_bytes="20000",
                                       service__auth_failures_per_minute="1000000",
                                       service__auth_failures_per_minute_total="1000000",
                                       )) as running:
        yield running


printable_ascii = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30)
any_text = st.text(max_size=30)
ids = st.one_of(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["r-000001", "", " ", "a\x00b", "x" * 300, "../../admin", "ünï"]),
    st.integers(), st.none(), st.booleans(), st.lists(st.text(max_size=3), max_size=2),
)
slots = st.one_of(
    st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
    st.datetimes().map(lambda d: d.isoformat()),  # naive: refused
    st.sampled_from(["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-14:00", "2024-02-30",
                     "", "now", "2024-01-01T00:00:00Z"]),
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False),
    st.booleans(), st.none(), st.lists(st.integers(), max_size=2),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | any_text,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(any_text, children, max_size=3),
    max_leaves=8,
)
documents = st.one_of(
    st.fixed_dictionaries({}, optional={
        "schedule": st.one_of(any_text, st.integers(), st.none()),
        "scheduled_for": slots,
        "recipient_ids": st.one_of(st.lists(ids, max_size=6), json_values),
        "extra": json_values,
    }),
    json_values,
)
# Mostly well-formed ticks, so the success path (201, and 200 for duplicates) is fuzzed too.
plausible = st.fixed_dictionaries(
    {"recipient_ids": st.lists(st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True), min_size=1,
                               max_size=5),
     "scheduled_for": st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat())},
    optional={"schedule": st.sampled_from(["weekly", "daily", "adhoc"])})
bodies = st.one_of(
    plausible.map(lambda d: json.dumps(d).encode()),
    plausible.map(lambda d: json.dumps(d).encode()),
    documents.map(lambda d: json.dumps(d).encode()),  # big ints too
    st.binary(max_size=64),
    st.sampled_from([b"", b"   ", b"{", b"\xff\xfe", b"[]", b"null", b"x" * 25_000]),
)
content_types = st.sampled_from(["application/json"] * 6 + [
    None, "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
    "", "*/*"])
authorizations = st.one_of(
    st.just(f"Bearer {TOKEN}"), st.just(f"Bearer {TOKEN}"), st.just(f"Bearer {TOKEN}"),
    st.just(f"bearer {TOKEN}"), st.none(),
    printable_ascii, printable_ascii.map(lambda t: f"Bearer {t}"),
)


def sendable(value: str) -> bool:
    """aiohttp's client refuses control characters (but tab) in a header value."""
    return not any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in value)


idempotency_keys = st.one_of(st.none(), st.none(), st.none(), printable_ascii,
                             st.text(max_size=8).filter(sendable))


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, content_type=content_types, authorization=authorizations,
       key=idempotency_keys)
@example(body=orjson.dumps({"recipient_ids": ["r-1"],
                            "scheduled_for": "0001-01-01T00:00:00+01:00"}),
         content_type="application/json", authorization=f"Bearer {TOKEN}", key=None)
@example(body=orjson.dumps({"recipient_ids": ["r-1"]}), content_type="application/json",
         authorization=f"Bearer {TOKEN}", key="k-1")
async def test_post_runs_never_500s_and_rejections_write_nothing(
        api: Api, body: bytes, content_type: str | None, authorization: str | None,
        key: str | None) -> None:
    headers: dict[str, str] = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if authorization is not None:
        headers["Authorization"] = authorization
    if key is not None:
        headers["Idempotency-Key"] = key
    before = await api.counts()
    async with api.client.post("/v1/runs", data=body, headers=headers,
                               skip_auto_headers={"Content-Type"}) as resp:
        raw = await resp.read()
        status = resp.status
        assert resp.content_type == "application/json", raw[:200]
    event(f"HTTP {status}")
    assert 200 <= status < 300 or 400 <= status < 500, (status, raw[:300])
    assert b"Traceback" not in raw
    doc = orjson.loads(raw)
    after = await api.counts()
    if status == 201:
        assert doc["created"] is True
        assert after[0] == before[0] + 1
        assert after[1:] == before[1:]  # only the run: the scanner discovers operations
    else:
        assert after == before, (status, doc)
        if status == 200:
            assert doc["created"] is False
        else:
            assert isinstance(doc["error"], str)
