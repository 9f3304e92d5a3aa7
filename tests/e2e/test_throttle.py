"""A 429 storm in the middle of a drain (issue #2, test 6).

``POST /_sandbox/control {"pause_seconds": S}`` makes the partner answer every DELETE with
429 and a Retry-After for S seconds. The first 429 must pause *every* worker and cut the
shared rate once: only the wave of requests already granted may reach the partner during
the pause, and the run still ends with every operation terminal.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.e2e

POPULATION = 600
CEILING = 200.0
CONCURRENCY = 8
PAUSE_S = 2.0


@pytest.mark.parametrize("retry_after_format", ["seconds", "http-date"])
async def test_429_storm_pauses_every_worker_and_lowers_the_rate(e2e, retry_after_format):
    # The partner's own bucket (400/s) is above the ceiling: every 429 comes from the storm.
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 400, "--burst", 10,
                                "--retry-after-format", retry_after_format)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": CEILING,
                                           "concurrency": CONCURRENCY,
                                           "decrease_factor": 0.5, "probe_seconds": 60.0}})
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=int(POPULATION * 0.3))

    before = await sandbox.stats()
    storm_began = time.time()
    await sandbox.control(pause_seconds=PAUSE_S)
    # The storm's first 429 is on its way back to the service.
    await sandbox.wait(requests=before["requests"] + 1)
    paused_until = await svc.paused_until(PAUSE_S)
    # Every worker holds until the partner's Retry-After: not jittered, never earlier.
    # (An HTTP-date has whole seconds and the simulator rounds it up.)
    slack = 1.0 if retry_after_format == "seconds" else 2.0
    assert storm_began + PAUSE_S - 0.1 <= paused_until <= storm_began + PAUSE_S + slack, \
        (paused_until - storm_began)

    run = await svc.wait_done(run_id)
    ops, stats = await e2e.assert_complete(svc, run, sandbox)

    # The storm cost one wave of requests: each worker sent at most the one request it had
    # already been granted; the first 429 held all of them until the Retry-After passed.
    assert 1 <= stats["requests_during_pause"] <= CONCURRENCY, stats
    assert stats["rate_limited"] == stats["requests_during_pause"], stats
    assert stats["requests"] == POPULATION + stats["rate_limited"], stats
    # A throttled attempt is not a failed one: nothing was given up on, no attempt counted.
    assert all(op["attempts"] == 1 for op in ops)

    m = await svc.metrics()
    assert m.value("cleanup_partner_responses_total", status="429") == stats["rate_limited"]
    # The shared rate was cut below the ceiling, once for the whole wave (not once per
    # 429: eight cuts by half would leave under 1/s), and it climbs back slowly.
    rate = m.value("cleanup_limiter_rate_per_second")
    assert CEILING * 0.5 <= rate < CEILING, rate
    assert m.value("cleanup_limiter_ceiling_per_second") == CEILING
    # The pause is over.
    assert m.value("cleanup_limiter_paused_until_timestamp_seconds") < time.time()


async def test_ratelimit_headers_set_the_pace_after_the_first_wave(e2e):
    # The partner allows 50/s and says so in RateLimit / RateLimit-Policy headers, on every
    # answer, 429s included. The service starts at a far higher ceiling: its first wave of
    # requests (sent before any answer came back) meets 429s. Those 429s carry the
    # announcement that already lowered the rate: they must not cut it a second time.
    # (Each DELETE takes 300 ms and a 429 comes back at once: the first wave, sent at the
    # ceiling, outruns the partner's burst of 5 long before any success comes back. Once
    # the pace is right, that burst absorbs 250 ms of jitter.)
    announced = 20.0
    workers = 24
    sandbox = await e2e.sandbox("--recipients", 150, "--rate", announced, "--burst", 5,
                                "--latency-ms", 300, "--ratelimit-headers")
    # A slow climb back after a cut, so a cut shows in the rate at the end of the run.
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 1000.0, "concurrency": workers,
                                           "probe_seconds": 600.0}})
    await svc.start()
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)
    _, stats = await e2e.assert_complete(svc, run, sandbox)

    # At most the first wave was refused (the in-flight limit starts small and follows
    # latency, so the wave is often absorbed by the partner's burst); after it the service
    # paced by the announcement.
    assert stats["rate_limited"] <= workers, stats
    assert stats["max_rate_observed_1s"] <= announced + 10, stats
    m = await svc.metrics()
    # Paced by the announcement, a little under it (limits.headroom, 1 % by default).
    assert m.value("cleanup_limiter_rate_per_second") == pytest.approx(announced * 0.99)


async def test_an_unannounced_limit_is_learned_from_429s(e2e):
    # The documented limit (the ceiling) is wrong: the partner allows only 100/s. A few
    # throttle episodes teach the limiter; each costs at most one wave of 429s.
    sandbox = await e2e.sandbox("--recipients", 400, "--rate", 100, "--burst", 5)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 400.0,
                                           "concurrency": CONCURRENCY}})
    await svc.start()
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)
    ops, stats = await e2e.assert_complete(svc, run, sandbox)

    assert 1 <= stats["rate_limited"] <= 3 * CONCURRENCY, stats
    assert stats["requests"] == 400 + stats["rate_limited"], stats
    assert all(op["attempts"] == 1 for op in ops)  # throttled attempts are not failed ones
    m = await svc.metrics()
    rate = m.value("cleanup_limiter_rate_per_second")
    assert 50.0 <= rate <= 200.0, rate  # cut from 400 towards the real limit, not to the floor
    assert m.value("cleanup_partner_responses_total", status="429") == stats["rate_limited"]
