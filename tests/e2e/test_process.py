"""The process an operator runs (issue 11, point 7): readiness reported without a poller,
start-up failures of the ledger exit 3, JSON logs, and a long-poll that cannot hold the
process past its grace period. Real `serve` processes, real signals."""

from __future__ import annotations

import asyncio
import signal
import time

import orjson
import pytest

from tests.helpers import eventually, free_port

pytestmark = pytest.mark.e2e

EXIT_STARTUP = 3


async def test_ready_gauge_reads_1_on_a_service_nothing_polls(e2e):
    # A container's HEALTHCHECK asks /healthz; nothing asks /readyz. The gauge must still
    # say ready, or CleanupNotReady pages on every healthy install.
    svc = e2e.service(None, {"source": {"kind": "inline"}})
    await svc.start()
    # A gauge refreshed each second: nothing to await.
    async def ready() -> bool:
        return (await svc.metrics()).value("cleanup_ready") == 1

    await eventually(ready, within_s=5.0, what="cleanup_ready to read 1", every_s=0.05)
    status, _ = await svc.request("GET", "/healthz", auth=False)
    assert status == 200


async def test_a_sqlite_ledger_that_cannot_open_exits_3_naming_the_file(e2e):
    svc = e2e.service(None, {"source": {"kind": "inline"}})
    (svc.data_dir / "cleanup.sqlite3").mkdir(parents=True)  # a directory where the file goes
    sp = await svc.spawn()
    assert await sp.wait_exit() == EXIT_STARTUP, sp.tail()
    assert "cannot open ledger" in sp.tail(), sp.tail()
    assert "cleanup.sqlite3" in sp.tail(), sp.tail()
    assert "Traceback" not in sp.tail()


async def test_a_postgres_ledger_that_cannot_be_reached_exits_3_without_the_password(e2e):
    password = "s3cret-in-the-dsn"
    svc = e2e.service(None, {"source": {"kind": "inline"},
                             "ledger": {"backend": "postgres", "schema": "unreachable"},
                             "queue": {"backend": "postgres"}})
    svc.env["CLEANUP_DATABASE_URL"] = (f"postgresql://postgres:{password}@127.0.0.1:"
                                       f"{free_port()}/postgres")
    sp = await svc.spawn()
    assert await sp.wait_exit() == EXIT_STARTUP, sp.tail()
    assert "PostgreSQL" in sp.tail(), sp.tail()
    assert password not in sp.tail()


async def test_json_logs_are_one_object_per_line_with_the_text_fields(e2e):
    sandbox = await e2e.sandbox("--recipients", 50, "--rate", 500)
    svc = e2e.service(sandbox, {"service": {"log_format": "json"}})
    sp = await svc.spawn()
    started = orjson.loads(await sp.wait_for_line(r'"action":"started"'))
    assert svc.url in started["message"]
    run_id = await svc.open_run()
    await svc.wait_done(run_id)
    await sp.wait_for_line(r'"action":"run_done"')
    sp.send(signal.SIGTERM)
    assert await sp.wait_exit() == 0
    docs = [orjson.loads(line) for line in sp.lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= d.keys() for d in docs), docs
    done = [d for d in docs if d.get("action") == "run_done"]
    assert done, docs
    assert done[0]["run_id"] == run_id, done
    assert done[0]["level"] == "INFO", done
    assert {d["action"] for d in docs if "action" in d} >= {"started", "signal", "stopping",
                                                             "stopped"}


async def test_a_long_poll_answers_when_the_drain_begins_and_cannot_hold_the_exit(e2e):
    grace = 3.0
    sandbox = await e2e.sandbox("--recipients", 3000, "--rate", 40)
    svc = e2e.service(sandbox, {"service": {"shutdown_grace_seconds": grace},
                                "limits": {"rate_per_second": 40.0}})
    sp = await svc.start()
    run_id = await svc.open_run()
    poll = asyncio.create_task(svc.request("GET", f"/v1/runs/{run_id}?wait=done&timeout=60"))
    await sandbox.wait(executions=40)  # the run is under way, far from done (75 s of work)
    assert not poll.done()
    signalled = time.monotonic()
    sp.send(signal.SIGTERM)
    async with asyncio.timeout(grace):
        status, doc = await poll
    # A wait it can no longer honour: 503, the run as it stands, and when to ask again.
    assert status == 503, doc
    assert doc["run"]["state"] != "done", doc
    assert doc["run"]["unfinished"] > 0, doc
    assert await sp.wait_exit() == 0
    # The drain's bound, not the long-poll's 60 s: the grace plus the two bounded writes.
    assert time.monotonic() - signalled < grace + 6.0 + 2.0


async def test_a_start_up_failure_is_a_json_line_too_with_json_logs(e2e):
    svc = e2e.service(None, {"source": {"kind": "inline"}, "service": {"log_format": "json"}})
    (svc.data_dir / "cleanup.sqlite3").mkdir(parents=True)
    sp = await svc.spawn()
    assert await sp.wait_exit() == EXIT_STARTUP, sp.tail()
    docs = [orjson.loads(line) for line in sp.lines]  # every line, the failure's too
    [failure] = [d for d in docs if d.get("action") == "exit_error"]
    assert failure["level"] == "ERROR"
    assert "cannot open ledger" in failure["message"]
