"""A quota longer than a second, end to end: with a short window, everything it must do.

The service is configured with the partner's quota (25 per 3 s, the partner enforcing the
same): when it runs out, operations wait (not failed, not counted as attempts, no 429
provoked), the projected finish moves past the reset, the quota gauge shows 0, and the
drain resumes by itself when the window frees.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import E2E
from tests.helpers import Metrics, eventually

pytestmark = pytest.mark.e2e

LIMIT, WINDOW_S, POPULATION = 25, 3.0, 60


async def test_a_spent_quota_holds_the_drain_until_its_window_frees(e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 200, "--burst", 10,
                                "--quota", f"{LIMIT}/{WINDOW_S:g}", "--absent-share", 0)
    svc = e2e.service(sandbox, {"limits": {
        "rate_per_second": 100.0,
        "quota": [{"name": "short", "limit": LIMIT, "period_seconds": WINDOW_S}]}})
    await svc.start()
    started = time.time()
    run_id = await svc.open_run()
    await sandbox.wait(executions=LIMIT)

    # Spent: the gauge says so and the projection moves past the window's end, which the
    # monitor publishes within a refresh (about a second).
    async def spent() -> Metrics | None:
        m = await svc.metrics()
        return m if (m.get("cleanup_limiter_quota_remaining", -1, policy="short") == 0 and
                     m.get("cleanup_run_projected_finish_timestamp_seconds") > 0) else None

    # Polling a scrape, as Prometheus would; failing the test if not within the bound.
    m = await eventually(spent, within_s=4.0, what="the spent quota on /metrics", every_s=0.1)
    assert m.value("cleanup_limiter_quota_remaining", policy="short") == 0
    reset = m.value("cleanup_limiter_quota_reset_timestamp_seconds", policy="short")
    assert reset >= started + WINDOW_S
    assert m.value("cleanup_run_projected_finish_timestamp_seconds") >= reset

    run = await svc.wait_done(run_id)
    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    assert stats["rate_limited"] == 0, stats  # we waited; the partner never had to refuse
    assert all(op["state"] == "deleted" for op in ops)
    assert all(op["attempts"] == 1 for op in ops)  # a wait is not an attempt

    # The partner's own timeline, by arrival as its quota counts (an execution's time
    # also holds the partner's own scheduling, which a loaded machine stretches): never
    # more than the quota in any window, and the drain came back by itself after each
    # window (60 = 25 + 25 + 10: three windows).
    assert stats["quota_limited"] == 0, stats
    times = sorted(r["arrived"] for r in await sandbox.requests() if r["status"] != 429)
    assert len(times) == POPULATION
    for i, t in enumerate(times):
        assert sum(1 for u in times[i:] if u < t + WINDOW_S) <= LIMIT
    assert times[-1] - times[0] >= 2 * WINDOW_S * 0.95
