"""SIGTERM during a drain (issue #2, test 5), the grace limit, and a second signal.

The partner's latency is raised through ``/_sandbox/control`` right before the signal, so
requests are provably in the air when it lands: the simulator counts a request when it
arrives and executes it only after the latency.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest

pytestmark = pytest.mark.e2e

POPULATION = 800
CONCURRENCY = 8


async def _slow_requests_in_the_air(sandbox, latency_ms: float) -> dict:
    """Make every new DELETE take ``latency_ms``; return once one such request arrived."""
    await sandbox.control(latency_ms=latency_ms)
    before = await sandbox.stats()
    await sandbox.wait(requests=before["requests"] + 1)
    return before


async def _draining(e2e, grace: float):
    """A service draining a run, 40 % done, with the given shutdown grace."""
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 400, "--latency-ms", 20)
    svc = e2e.service(sandbox, {"service": {"shutdown_grace_seconds": grace},
                                "limits": {"concurrency": CONCURRENCY}})
    sp = await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=int(POPULATION * 0.4))
    return sandbox, svc, sp, run_id


async def test_sigterm_lets_requests_in_the_air_finish_and_exits_0(e2e):
    # A grace far above the slow requests' 1.5 s: a loaded machine's start and exit
    # must not pass for a cut-off.
    grace = 10.0
    sandbox, svc, sp, run_id = await _draining(e2e, grace)
    await _slow_requests_in_the_air(sandbox, latency_ms=1500)

    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    await sp.wait_for_line(r"\baction=stopping\b")
    # Draining: triggers are refused, readiness drops, the process still answers.
    status, doc = await svc.trigger(schedule="other")
    assert status == 503, doc
    assert "error" in doc
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 503, doc
    assert doc["checks"]["accepting"] is False
    status, _ = await svc.request("GET", "/healthz", auth=False)
    assert status == 200

    assert await sp.wait_exit() == 0
    elapsed = time.monotonic() - signalled
    # It waited for the slow requests (1.5 s each) and no longer than the grace period.
    assert 1.0 <= elapsed < grace, elapsed
    stopped = await sp.wait_for_line(r"\baction=stopped\b")
    assert re.search(rf"{CONCURRENCY} workers, 0 cut off at the grace limit", stopped), stopped

    # Nothing in the air was lost: every DELETE the partner executed has its outcome in the
    # ledger, no attempt is left open, no lease is left held.
    at_exit = await sandbox.stats()
    ledger = svc.ledger()
    settled = ledger.states.get("deleted", 0) + ledger.states.get("already_absent", 0)
    assert settled == at_exit["executions"], (ledger, at_exit)
    assert at_exit["executions"] == at_exit["requests"], at_exit  # every request completed
    assert ledger.open_attempts == 0, ledger
    assert ledger.states.get("in_flight", 0) == 0, ledger
    assert ledger.leased == 0, ledger
    assert ledger.messages == POPULATION - settled, ledger

    await sandbox.control(latency_ms=0)
    await svc.start()
    run = await svc.wait_done(run_id)
    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    assert stats["replays"] == 0  # nothing had to be resent
    assert all(op["attempts"] == 1 for op in ops)


async def test_sigterm_cuts_off_requests_outlasting_the_grace(e2e):
    grace = 1.0
    sandbox, svc, sp, run_id = await _draining(e2e, grace)
    # Requests far longer than the grace and its slack, so waiting them out cannot pass.
    await _slow_requests_in_the_air(sandbox, latency_ms=12000)

    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    assert await sp.wait_exit() == 0
    elapsed = time.monotonic() - signalled
    assert grace <= elapsed < grace + 6.0, elapsed  # not the 12 s they need
    stopped = await sp.wait_for_line(r"\baction=stopped\b")
    cut = int(re.search(r"(\d+) cut off at the grace limit", stopped).group(1))
    assert 1 <= cut <= CONCURRENCY, stopped

    # The cut-off requests may yet act: their attempts stay open (so the restart resends
    # them with the same key), but their messages were handed back, not left leased.
    ledger = svc.ledger()
    assert ledger.open_attempts == cut, ledger
    assert ledger.states.get("in_flight", 0) == cut, ledger
    assert ledger.leased == 0, ledger

    await sandbox.control(latency_ms=0)
    await svc.start()
    run = await svc.wait_done(run_id)
    ops, _ = await e2e.assert_complete(svc, run, sandbox)
    for op in [op for op in ops if op["attempts"] > 1]:
        log = (await svc.operation(op["id"]))["attempts_log"]
        assert log[0]["outcome"] == "unknown", log
        assert log[-1]["outcome"] in ("deleted", "absent"), log


async def test_second_sigterm_exits_at_once_with_1(e2e):
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 400, "--latency-ms", 20)
    svc = e2e.service(sandbox, {"service": {"shutdown_grace_seconds": 20.0}})
    sp = await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=int(POPULATION * 0.4))
    await _slow_requests_in_the_air(sandbox, latency_ms=12000)

    sp.send(signal.SIGTERM)
    await sp.wait_for_line(r"\baction=stopping\b")
    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    assert await sp.wait_exit() == 1
    assert time.monotonic() - signalled < 6.0  # not the 12 s the requests in the air need
    assert any("action=signal_forced" in line for line in sp.lines)
    assert not any("action=stopped" in line for line in sp.lines)

    # Whatever was committed stays; what was in the air is resent with the same key.
    await sandbox.control(latency_ms=0)
    await svc.start()
    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)


async def test_sigterm_mid_scan_keeps_the_committed_pages(e2e):
    pages = 10
    sandbox = await e2e.sandbox("--recipients", 1000, "--rate", 400, "--page-delay-ms", 300)
    svc = e2e.service(sandbox, {"source": {"page_size": 100}})
    sp = await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(pages=3)

    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    assert await sp.wait_exit() == 0
    # The page being read is abandoned, not waited for.
    assert time.monotonic() - signalled < 2.5 + 3.0  # a loaded machine's exit
    ledger = svc.ledger()
    assert ledger.open_attempts == 0, ledger
    assert ledger.leased == 0, ledger

    await svc.start()
    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)
    assert run["scan"]["pages"] == pages, run
    stats = await sandbox.stats()
    assert pages <= stats["pages_served"] <= pages + 1, stats


async def test_sigterm_during_a_retry_after_pause_does_not_wait_it_out(e2e):
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 400)
    svc = e2e.service(sandbox, {"service": {"shutdown_grace_seconds": 20.0}})
    sp = await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=int(POPULATION * 0.3))
    before = await sandbox.stats()
    await sandbox.control(pause_seconds=16)
    await sandbox.wait(requests=before["requests"] + 1)  # a 429 with Retry-After: 16
    paused_until = await svc.paused_until()
    assert paused_until > time.time()

    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    assert await sp.wait_exit() == 0
    # Workers held by the pause have nothing in the air: they are not waited for.
    assert time.monotonic() - signalled < 8.0  # not the 16 s pause
    ledger = svc.ledger()
    assert ledger.open_attempts == 0, ledger  # the throttled attempts are recorded
    assert ledger.leased == 0, ledger
    assert ledger.states.get("in_flight", 0) == 0, ledger

    # The partner lifts its storm early, but the next process remembers the pause it
    # announced and sends nothing before it ends.
    await sandbox.control(pause_seconds=0)
    lifted = await sandbox.stats()
    await svc.start()
    assert await svc.paused_until() == pytest.approx(paused_until, abs=0.01)
    # Nothing reaches the partner until just before the pause ends (an absence has no
    # event to wait for: look again shortly before the deadline).
    await asyncio.sleep(max(0.0, paused_until - 0.5 - time.time()))
    assert (await sandbox.stats())["requests"] == lifted["requests"]
    run = await svc.wait_done(run_id)
    assert time.time() >= paused_until
    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    assert stats["requests_during_pause"] <= 8, stats
    assert all(op["attempts"] == 1 for op in ops)  # 429s are not failed attempts
