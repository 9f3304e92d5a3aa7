"""SIGKILL mid-scan and mid-drain, then a restart on the same data dir (issue #2, tests 3-4).

Nothing in progress survives a SIGKILL except what the ledger committed: the scan must
resume from the last committed cursor without a second operation for any recipient, and
requests that were in the air must be resent with the same Idempotency-Key so the partner
replays instead of deleting twice.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

pytestmark = pytest.mark.e2e


async def test_sigkill_mid_scan_resumes_from_the_committed_cursor(e2e):
    pages = 15
    sandbox = await e2e.sandbox("--recipients", 1500, "--rate", 400, "--page-delay-ms", 150)
    svc = e2e.service(sandbox, {"source": {"page_size": 100}})
    await svc.start()
    run_id = await svc.open_run()

    await sandbox.wait(pages=3)
    await svc.kill()
    before = await sandbox.stats()
    assert before["pages_served"] < pages, "the scan finished before the kill"

    await svc.start()
    run = await svc.wait_done(run_id)

    await e2e.assert_complete(svc, run, sandbox)
    # One operation per candidate even though a page may have been read twice.
    assert run["discovered"] == 1500
    # The cursor committed with each page: only pages read but not yet committed when the
    # process died are read again, not the whole listing.
    assert run["scan"]["pages"] == pages, run
    assert run["scan"]["failures"] == 0, run
    stats = await sandbox.stats()
    assert pages <= stats["pages_served"] <= pages + 2, stats
    started = svc.history[-1].lines
    assert any("action=scan_start" in line and "resumed" in line for line in started)


async def test_sigkill_mid_drain_three_times_never_deletes_twice(e2e):
    population = 1500
    # Each DELETE takes 20 ms, so every kill catches requests in the air.
    sandbox = await e2e.sandbox("--recipients", population, "--rate", 400, "--latency-ms", 20)
    # A generous request timeout: an attempt may hold its operation that long (plus slack)
    # against a second worker, but not against the restart of a process that is gone.
    svc = e2e.service(sandbox, {"partner": {"request_timeout_seconds": 20.0}})
    await svc.start()
    tick = {"schedule": "weekly", "scheduled_for": "2026-11-30T02:00:00+00:00"}
    run_id = await svc.open_run(**tick)

    for share in (0.3, 0.55, 0.8):
        await sandbox.wait(executions=int(population * share))
        await svc.kill()
        await svc.start()
        # The cron caller retrying its tick after the crash finds the same run.
        status, doc = await svc.trigger(**tick)
        assert (status, doc["created"], doc["run"]["id"]) == (200, False, run_id), doc
    restarted = time.monotonic()

    run = await svc.wait_done(run_id)
    # The last fifth of the run (300 deletes at up to 300/s) drains at once: the resends
    # of what the dead process had in the air do not wait out its lease or its attempt.
    assert time.monotonic() - restarted < 10.0
    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    # Each restart handed back at once what the killed process held (nothing waited out
    # a lease): at least the messages whose requests were in the air.
    for sp in svc.history[1:]:
        started = next(line for line in sp.lines if "action=started" in line)
        assert int(re.search(r"(\d+) leases handed back", started).group(1)) >= 1, started
    # Operations resent after a kill carry the attempt the dead process left open, closed
    # as unknown, then the outcome of the resend (a replay if the partner had acted).
    resent = [op for op in ops if op["attempts"] > 1]
    for op in resent:
        log = (await svc.operation(op["id"]))["attempts_log"]
        assert all(a["outcome"] is not None for a in log), log
        assert log[-1]["outcome"] in ("deleted", "absent"), log
        assert [a["n"] for a in log] == list(range(1, len(log) + 1)), log
        assert {a["outcome"] for a in log[:-1]} == {"unknown"}, log
    # The kills caught requests in the air (each takes 20 ms), and the partner had acted
    # on them: their resends were answered from its idempotency store.
    assert resent, "no kill caught a request in the air"
    replayed = [op for op in resent if "(replayed)" in (await svc.operation(op["id"])
                                                        )["attempts_log"][-1]["detail"]]
    assert len(replayed) == stats["replays"] > 0, stats
    assert svc.history[-1].proc.returncode is None
    svc.history[-1].send(signal.SIGTERM)
    assert await svc.history[-1].wait_exit() == 0


async def test_a_second_process_on_the_same_data_dir_is_refused(e2e):
    sandbox = await e2e.sandbox("--recipients", 10)
    svc = e2e.service(sandbox)
    first = await svc.start()
    second = await svc.spawn()
    assert await second.wait_exit() == 3
    assert any("another cleanup-supervisor uses" in line for line in second.lines), second.tail()
    # The first one is unaffected and still owns the ledger.
    assert first.proc.returncode is None
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)
