"""The issue's failing case, end to end: a partner announcing ``X-RateLimit-Reset`` in
epoch milliseconds (a fixed window of 50/s) once stopped every deletion, the pause saved
and kept across restarts. Real processes (the sandbox partner, the service); the partner's
own record and the service's metrics are the evidence.
"""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = pytest.mark.e2e

RATE = 50
N = 500  # 10 s at the partner's limit: long enough to cross many windows


@pytest.mark.parametrize("dialect", ["x-ratelimit-epoch-ms", "x-ratelimit-epoch"])
async def test_a_fixed_window_announced_in_epoch_time_is_drained(e2e, dialect) -> None:
    sandbox = await e2e.sandbox("--recipients", N, "--rate", RATE, "--window", "second",
                                "--ratelimit-headers", dialect, "--absent-share", 0)
    # The ceiling twice the partner's limit: only its headers keep the pace.
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 2.0 * RATE}})
    await svc.start()
    run_id = await svc.open_run()
    # Drained (the old reading paused every worker for 56,000 years): the run ends.
    run = await svc.wait_done(run_id, within_s=90)
    _, stats = await e2e.assert_complete(svc, run, sandbox)
    m = await svc.metrics()
    # Whatever pause a spent window caused ended within the window, not in 56,000 years.
    assert m.value("cleanup_limiter_paused_until_timestamp_seconds") < time.time() + 2
    assert m.get("cleanup_partner_header_ignored_total", 0.0,
                 header="X-RateLimit-Reset") == 0.0
    # Paced by the headers, not by 429s: at a ceiling of twice the partner's limit, a
    # service that misread them would be refused about every other request.
    assert stats["rate_limited"] <= N // 10, stats


async def test_a_saved_pause_longer_than_allowed_is_dropped_at_the_restart(e2e) -> None:
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 0, "--absent-share", 0)
    # A life that allowed absurd pauses, as one that read milliseconds as seconds did.
    lax = e2e.service(sandbox, {"limits": {"rate_per_second": 50.0, "concurrency": 4},
                                "partner": {"max_retry_after_seconds": 1e13}})
    await lax.start()
    run_id = await lax.open_run()
    await sandbox.wait(executions=20)
    await sandbox.control(pause_seconds=1.8e12)  # 429, Retry-After: 1800000000000
    await sandbox.wait(requests_during_pause=1)
    assert await lax.paused_until() > time.time() + 1e12
    lax.current.send(signal.SIGTERM)
    assert await lax.current.wait_exit() == 0
    await sandbox.control(pause_seconds=0)

    # The same data dir with the default bound (900 s): the saved pause is not honoured.
    svc = e2e.service(sandbox)
    sp = await svc.start()
    await sp.wait_for_line(r"\baction=budget_pause_dropped\b")
    run = await svc.wait_done(run_id, within_s=60)
    await e2e.assert_complete(svc, run, sandbox)
