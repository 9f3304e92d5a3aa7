"""What the rate budget learnt survives the process: a restart during a long Retry-After
pause sends nothing before the pause ends, and a SIGKILL does not forget it either.

Real processes and real signals; the partner's own request counter is the evidence.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

pytestmark = pytest.mark.e2e

PAUSE_S = 900.0


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_a_restart_during_a_long_pause_sends_nothing_before_it_ends(e2e, stop) -> None:
    sandbox = await e2e.sandbox("--recipients", 400, "--rate", 0)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 50.0, "concurrency": 4},
                                "partner": {"max_retry_after_seconds": PAUSE_S}})
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=40)
    began = time.time()
    await sandbox.control(pause_seconds=PAUSE_S)  # every DELETE: 429, Retry-After: 900
    before = await sandbox.stats()
    await sandbox.wait(requests_during_pause=1)
    paused_until = await svc.paused_until()
    assert began + PAUSE_S - 1 <= paused_until <= began + PAUSE_S + 2

    if stop == "sigterm":
        svc.current.send(signal.SIGTERM)
        assert await svc.current.wait_exit() == 0
    else:
        await svc.kill()
    # The partner is healthy again: only the service's memory of the pause holds it now.
    await sandbox.control(pause_seconds=0)
    settled = await sandbox.stats()
    await svc.start()
    assert await svc.paused_until() == pytest.approx(paused_until, abs=0.01)
    # A full second of a 50/s budget: nothing may reach the partner.
    await asyncio.sleep(1.5)  # the absence of requests has no event to wait for
    after = await sandbox.stats()
    assert after["requests"] == settled["requests"], (before, settled, after)
    run = await svc.run(run_id)
    assert run["state"] != "done"
