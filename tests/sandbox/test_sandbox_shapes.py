"""Limiter shapes, quotas, Retry-After formats and rate-limit header styles over real HTTP.

The sandbox runs on an injected clock that the test steps, so boundaries are exact and
nothing sleeps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import orjson
import pytest

from cleanup_sandbox import RunningSandbox, SandboxConfig, run_sandbox


class FakeClock:
    def __init__(self, now: float = 5000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def sandbox(
    **overrides: Any,
) -> AsyncIterator[tuple[RunningSandbox, aiohttp.ClientSession, FakeClock]]:
    clock = FakeClock()
    # No absent recipients, so every admitted delete of a fresh ID answers 204.
    config = SandboxConfig(recipients=200, absent_share=0.0, **overrides)
    async with (
        run_sandbox(config, clock=clock) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield running, http, clock


class Caller:
    """Deletes a fresh recipient each call."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.n = 0

    async def __call__(self, recipient_id: str | None = None) -> tuple[int, dict[str, str], Any]:
        if recipient_id is None:
            self.n += 1
            recipient_id = f"r-{self.n:06d}"
        async with self.http.delete(f"/recipients/{recipient_id}") as resp:
            body = await resp.read()
            return resp.status, dict(resp.headers), orjson.loads(body) if body else None


# -- Retry-After formats ---------------------------------------------------------------


async def test_retry_after_seconds_is_whole_and_at_least_one() -> None:
    async with sandbox(rate_per_second=200, burst=1) as (_, http, _clock):
        call = Caller(http)
        assert (await call())[0] == 204
        status, headers, body = await call()
        assert (status, headers["Retry-After"]) == (429, "1")
        assert body["retry_after_seconds"] == 1


async def test_retry_after_fractional_has_millisecond_precision() -> None:
    async with sandbox(rate_per_second=200, burst=1, retry_after_format="fractional") as (
        _,
        http,
        clock,
    ):
        call = Caller(http)
        assert (await call())[0] == 204
        status, headers, _ = await call()
        assert (status, headers["Retry-After"]) == (429, "0.005")
        clock.now += 0.004
        assert (await call())[1]["Retry-After"] == "0.001"
        clock.now += 0.001
        assert (await call())[0] == 204


async def test_retry_after_http_date_points_past_the_wait() -> None:
    async with sandbox(rate_per_second=0.5, burst=1, retry_after_format="http-date") as (
        _,
        http,
        _clock,
    ):
        call = Caller(http)
        await call()
        before = time.time()
        status, headers, _ = await call()
        after = time.time()
        assert status == 429
        at = parsedate_to_datetime(headers["Retry-After"]).timestamp()
        assert before + 2.0 <= at <= after + 3.0


async def test_retry_after_none_sends_no_header_and_no_hint() -> None:
    async with sandbox(rate_per_second=1, burst=1, retry_after_format="none") as (
        running,
        http,
        clock,
    ):
        call = Caller(http)
        await call()
        status, headers, body = await call()
        assert status == 429
        assert "Retry-After" not in headers
        assert "retry_after_seconds" not in body
        # Nothing was announced, so hammering is rude but breaks no announced wait.
        clock.now += 0.5
        assert (await call())[0] == 429
        assert running.state.stats()["requests_during_announced_wait"] == 0


# -- limiter shapes end to end ---------------------------------------------------------


async def test_gcra_refuses_one_millisecond_early_over_http() -> None:
    async with sandbox(
        window="gcra", rate_per_second=10, burst=1, retry_after_format="fractional"
    ) as (_, http, clock):
        call = Caller(http)
        assert (await call())[0] == 204
        clock.now += 0.099
        status, headers, _ = await call()
        assert (status, headers["Retry-After"]) == (429, "0.001")
        clock.now += 0.001
        assert (await call())[0] == 204


async def test_sliding_window_over_http() -> None:
    async with sandbox(
        window="sliding", rate_per_second=1, window_seconds=3.0, retry_after_format="fractional"
    ) as (_, http, clock):
        call = Caller(http)
        for _ in range(3):
            assert (await call())[0] == 204
            clock.now += 1.0
        # 3 in (now - 3, now] would be exceeded only if the first had not left yet.
        assert (await call())[0] == 204
        status, headers, _ = await call()
        assert (status, headers["Retry-After"]) == (429, "1.000")


async def test_quota_exhaustion_answers_429_until_its_window_resets() -> None:
    async with sandbox(rate_per_second=100, burst=10, quotas=((3, 10.0),)) as (
        running,
        http,
        clock,
    ):
        call = Caller(http)
        for _ in range(3):
            assert (await call())[0] == 204
        clock.now += 4.2
        status, headers, body = await call()
        assert (status, body["error"], headers["Retry-After"]) == (429, "quota_exceeded", "6")
        clock.now += 5.8
        assert (await call())[0] == 204
        stats = running.state.stats()
        assert (stats["quota_limited"], stats["rate_limited"], stats["executions"]) == (1, 1, 4)


# -- rate-limit header styles ----------------------------------------------------------


async def test_ietf_headers_without_quotas_read_as_before() -> None:
    async with sandbox(rate_per_second=1, burst=2, ratelimit_headers="ietf") as (_, http, _c):
        call = Caller(http)
        _, headers, _ = await call()
        assert headers["RateLimit-Policy"] == '"default";q=2;w=2'
        assert headers["RateLimit"] == '"default";r=1;t=1'


async def test_ietf_headers_list_several_policies_on_every_response() -> None:
    async with sandbox(
        rate_per_second=200, burst=200, quotas=((5, 10.0), (3000, 3600.0)), ratelimit_headers="ietf"
    ) as (running, http, clock):
        call = Caller(http)
        policy = '"default";q=200;w=1, "10s";q=5;w=10, "hour";q=3000;w=3600'
        status, headers, _ = await call()
        assert status == 204
        assert headers["RateLimit-Policy"] == policy
        # 199/200 left of the rate, 4/5 of the 10 s quota: the quota is the tighter one.
        assert headers["RateLimit"] == '"10s";r=4;t=10'

        gone = running.state.population[0]
        status, headers, _ = await call(gone)
        assert status == 404
        assert (headers["RateLimit-Policy"], headers["RateLimit"]) == (policy, '"10s";r=3;t=10')

        for _ in range(3):
            await call()
        clock.now += 2.5
        status, headers, _ = await call()
        assert status == 429
        assert (headers["RateLimit-Policy"], headers["RateLimit"]) == (policy, '"10s";r=0;t=8')


async def test_x_ratelimit_headers_describe_the_tightest_policy() -> None:
    async with sandbox(
        rate_per_second=2, burst=2, quotas=((100, 60.0),), ratelimit_headers="x-ratelimit"
    ) as (_, http, _clock):
        call = Caller(http)
        _, headers, _ = await call()
        assert "RateLimit" not in headers
        assert (
            headers["X-RateLimit-Limit"],
            headers["X-RateLimit-Remaining"],
            headers["X-RateLimit-Reset"],
        ) == ("2", "1", "1")
        await call()
        status, headers, _ = await call()
        assert (status, headers["X-RateLimit-Remaining"]) == (429, "0")


async def test_x_ratelimit_epoch_reset_is_a_unix_time() -> None:
    async with sandbox(
        rate_per_second=100, burst=100, quotas=((2, 30.0),), ratelimit_headers="x-ratelimit-epoch"
    ) as (_, http, clock):
        call = Caller(http)
        await call()
        clock.now += 10.0
        before = time.time()
        status, headers, _ = await call()
        after = time.time()
        assert status == 204
        assert (headers["X-RateLimit-Limit"], headers["X-RateLimit-Remaining"]) == ("2", "0")
        reset = int(headers["X-RateLimit-Reset"])
        assert before + 20 <= reset <= after + 21


async def test_headers_follow_every_limiter_shape() -> None:
    for window in ("gcra", "sliding", "second"):
        async with sandbox(window=window, rate_per_second=5, burst=5, ratelimit_headers=True) as (
            _,
            http,
            _clock,
        ):
            _, headers, _ = await Caller(http)()
            assert headers["RateLimit-Policy"] == '"default";q=5;w=1', window
            assert headers["RateLimit"].startswith('"default";r=4;t='), window


# -- announced waits -------------------------------------------------------------------


async def test_requests_during_an_announced_wait_are_counted_after_the_grace() -> None:
    async with sandbox(rate_per_second=1, burst=1, quotas=((50, 100.0),)) as (
        running,
        http,
        clock,
    ):
        call = Caller(http)
        assert (await call())[0] == 204
        clock.now += 0.3
        status, headers, _ = await call()
        assert (status, headers["Retry-After"]) == (429, "1")  # announces until +1.3
        clock.now += 0.04
        # In flight when the 429 left: not the client's fault. Refused, it announces
        # again, until +1.34.
        assert (await call())[0] == 429
        assert running.state.stats()["requests_during_announced_wait"] == 0
        clock.now += 0.75
        assert (await call())[0] == 204  # +1.09: a token is back, but the client was told 1 s
        assert running.state.stats()["requests_during_announced_wait"] == 1
        clock.now += 0.3
        assert (await call())[0] == 429  # +1.39: both announced waits are over
        assert running.state.stats()["requests_during_announced_wait"] == 1
        async with http.get("/_sandbox/stats") as resp:
            assert (await resp.json())["requests_during_announced_wait"] == 1


async def test_a_pause_storm_is_not_an_announced_wait() -> None:
    async with sandbox() as (running, http, clock):
        running.state.apply_control({"pause_seconds": 10})
        call = Caller(http)
        for _ in range(3):
            assert (await call())[0] == 429
            clock.now += 1.0
        stats = running.state.stats()
        assert (stats["requests_during_pause"], stats["requests_during_announced_wait"]) == (3, 0)


@pytest.mark.parametrize("fmt", ["fractional", "http-date"])
async def test_the_announced_wait_is_the_header_value_not_the_true_wait(fmt: str) -> None:
    async with sandbox(rate_per_second=200, burst=1, retry_after_format=fmt) as (
        running,
        http,
        clock,
    ):
        call = Caller(http)
        await call()
        await call()  # the true wait is 5 ms
        clock.now += 0.06
        await call()
        expected = 0 if fmt == "fractional" else 1  # http-date rounds up to whole seconds
        assert running.state.stats()["requests_during_announced_wait"] == expected
