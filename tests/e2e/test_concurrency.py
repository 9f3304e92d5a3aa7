"""Concurrency follows latency, against a real partner process whose latency depends on
its load. What must hold: a partner that slows down under load is not pushed into
timeouts; a slow but healthy one still gets its full rate; when limits.concurrency is
what bounds the pace, a metric and one log line say so."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.e2e


async def test_a_partner_that_slows_under_load_is_not_pushed_into_timeouts(e2e) -> None:
    # 20 ms alone, 60 ms more per request already in hand: 32 in flight would take 1.9 s,
    # past the 1 s timeout, and every timeout would be an ambiguous attempt.
    sandbox = await e2e.sandbox("--recipients", 300, "--rate", 0, "--latency-ms", 20,
                                "--latency-per-inflight-ms", 60)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 500.0, "concurrency": 32},
                                "partner": {"request_timeout_seconds": 1.0}})
    await svc.start()
    run = await svc.wait_done(await svc.open_run())
    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    assert all(op["state"] in ("deleted", "already_absent") for op in ops)
    assert all(op["attempts"] == 1 for op in ops)  # no timeout, no retry
    # Never as many in hand as would take the latency past half the timeout.
    assert 0.02 + 0.06 * (stats["max_in_flight"] - 1) <= 1.0, stats
    m = await svc.metrics()
    assert m.get("cleanup_partner_responses_total", status="error") == 0


async def test_a_slow_but_healthy_partner_gets_its_full_rate(e2e) -> None:
    # 400 ms per DELETE at 25/s needs 10 in flight; the pool allows 24.
    sandbox = await e2e.sandbox("--recipients", 250, "--rate", 0, "--latency-ms", 400,
                                "--absent-share", 0)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 25.0, "concurrency": 24}})
    await svc.start()
    run = await svc.wait_done(await svc.open_run())
    await e2e.assert_complete(svc, run, sandbox)
    times = sorted(e["t"] for e in await sandbox.log())
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert rate >= 25.0 * 0.85, rate
    m = await svc.metrics()
    assert m.value("cleanup_limiter_concurrency_bound") == 0
    assert m.value("cleanup_limiter_concurrency_limit") >= 10


async def test_when_the_configured_maximum_bounds_the_pace_it_says_so(e2e) -> None:
    # 400 ms at 25/s needs 10 in flight; only 4 are allowed: 10/s at best.
    sandbox = await e2e.sandbox("--recipients", 60, "--rate", 0, "--latency-ms", 400)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 25.0, "concurrency": 4}})
    proc = await svc.start()
    run = await svc.wait_done(await svc.open_run())
    await e2e.assert_complete(svc, run, sandbox)
    m = await svc.metrics()
    assert m.value("cleanup_limiter_concurrency_bound") == 1
    bound = [line for line in proc.lines if re.search(r"\baction=concurrency_bound\b", line)]
    assert len(bound) == 1, bound
    assert "limits.concurrency = 4 bounds the pace" in bound[0]
