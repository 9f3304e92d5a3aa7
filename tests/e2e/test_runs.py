"""A whole run against the partner simulator, and tick deduplication (issue #2, tests 1-2)."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime

import pytest

pytestmark = pytest.mark.e2e

CEILING = 300.0


async def test_full_run_deletes_every_candidate_once(e2e):
    sandbox = await e2e.sandbox("--recipients", 1500, "--absent-share", 0.05,
                                "--rate", 400, "--burst", 10)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": CEILING, "concurrency": 8}})
    await svc.start()
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 200, doc

    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)

    ops, stats = await e2e.assert_complete(svc, run, sandbox)
    assert stats["initially_absent"] == 75  # 5 % of 1500: some candidates are already gone
    assert run["counts"]["already_absent"] == 75
    assert run["counts"]["deleted"] == 1425
    assert run["scan"]["pages"] == 3  # 1500 candidates, 500 a page, each page read once
    assert stats["pages_served"] == 3
    # Paced under the partner's limit: no 429 was ever needed, no attempt was repeated.
    assert stats["rate_limited"] == 0, stats
    assert stats["requests"] == 1500, stats
    assert all(op["attempts"] == 1 for op in ops)
    # The ceiling holds (a little slack for loopback jitter bunching arrivals).
    assert stats["max_rate_observed_1s"] <= CEILING * 1.1 + 5, stats

    # The audit trail of one operation of each outcome.
    for state, status_code, outcome in (("deleted", 204, "deleted"),
                                        ("already_absent", 404, "absent")):
        op = await svc.operation(next(o["id"] for o in ops if o["state"] == state))
        assert [(a["n"], a["kind"], a["status"], a["outcome"]) for a in op["attempts_log"]] \
            == [(1, "delete", status_code, outcome)], op

    m = await svc.metrics()
    assert m.value("cleanup_operations_total", outcome="deleted") == 1425
    assert m.value("cleanup_operations_total", outcome="already_absent") == 75
    assert m.value("cleanup_partner_responses_total", status="204") == 1425
    assert m.value("cleanup_partner_responses_total", status="404") == 75
    assert m.get("cleanup_partner_responses_total", status="429") == 0
    assert m.value("cleanup_limiter_ceiling_per_second") == CEILING


async def test_repeated_tick_opens_one_run(e2e):
    # A slow candidate scan (two pages, one second each) keeps the run unfinished while
    # the ticks below arrive: the run cannot be done before its scan ends.
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 400, "--page-delay-ms", 1000)
    svc = e2e.service(sandbox, {"source": {"page_size": 100}})
    await svc.start()

    slot = datetime(2026, 1, 5, 2, 0, tzinfo=UTC)
    status, first = await svc.trigger(schedule="nightly", scheduled_for=slot.isoformat())
    assert status == 201, first
    assert first["created"] is True
    run_id = first["run"]["id"]
    assert first["run"]["tick_key"] == "nightly@2026-01-05T02:00:00+00:00"

    # The same tick again, in any spelling of the same instant: the same run, not created.
    for same_slot in (slot.isoformat(), "2026-01-05T03:00:00+01:00", slot.timestamp()):
        status, again = await svc.trigger(schedule="nightly", scheduled_for=same_slot)
        assert status == 200, again
        assert again == {"created": False, "run": first["run"] | {"state": again["run"]["state"]}}

    # A caller's Idempotency-Key stands in for a slot; a tick with neither is matched to a
    # run of its schedule opened in the last ten minutes (a cron caller retrying its POST).
    status, again = await svc.trigger(schedule="nightly")
    assert (status, again["created"], again["run"]["id"]) == (200, False, run_id)

    # A different tick while that run is unfinished is skipped (overlap = skip).
    status, other = await svc.trigger(schedule="nightly",
                                      scheduled_for="2026-01-12T02:00:00+00:00")
    assert status == 409, other
    assert other["active_run"] == run_id
    status, keyed = await svc.request("POST", "/v1/runs", json={"schedule": "nightly"},
                                      headers={"Idempotency-Key": "cron-call-42"})
    assert status == 409, keyed
    status, runs = await svc.request("GET", "/v1/runs")
    assert [r["id"] for r in runs["runs"]] == [run_id]

    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)

    # Once done, a repeat of the old tick still opens nothing ...
    status, late = await svc.trigger(schedule="nightly", scheduled_for=slot.isoformat())
    assert (status, late["created"], late["run"]["id"]) == (200, False, run_id)
    assert late["run"]["state"] == "done"
    # ... and the next tick opens the next run (which reads the same source again: a
    # trigger names no recipients of its own unless the source is inline).
    await sandbox.control(page_delay_ms=0)
    status, nxt = await svc.trigger(schedule="nightly", scheduled_for="2026-01-12T02:00:00Z")
    assert status == 201, nxt
    assert nxt["run"]["id"] != run_id
    second = await svc.wait_done(nxt["run"]["id"])
    assert second["discovered"] == 200
    assert second["counts"]["already_absent"] == 200  # deleted by the first run

    # A tick keyed by the caller's Idempotency-Key, sent twice: one run.
    key = {"Idempotency-Key": "cron-call-42"}
    status, keyed = await svc.request("POST", "/v1/runs", headers=key,
                                      json={"schedule": "nightly"})
    assert (status, keyed["created"], keyed["run"]["tick_key"]) == \
        (201, True, "nightly#cron-call-42"), keyed
    status, again = await svc.request("POST", "/v1/runs", headers=key,
                                      json={"schedule": "nightly"})
    assert (status, again["created"], again["run"]["id"]) == (200, False, keyed["run"]["id"])
    await svc.wait_done(keyed["run"]["id"])

    status, runs = await svc.request("GET", "/v1/runs")
    assert [r["id"] for r in runs["runs"]] == [keyed["run"]["id"], nxt["run"]["id"], run_id]
    stats = await sandbox.stats()
    assert stats["pages_served"] == 6  # each run's source was scanned exactly once
    assert stats["executions"] == 600  # 200 by each run: the later ones find them absent
    assert stats["duplicates"] == 200  # recipients asked for again (by later runs, on purpose)


async def test_a_cron_caller_holding_only_the_tick_token_opens_runs_and_nothing_else(e2e):
    sandbox = await e2e.sandbox("--recipients", 20, "--rate", 400)
    svc = e2e.service(sandbox)
    tick = secrets.token_urlsafe(24)
    svc.env["CLEANUP_TICK_TOKEN"] = tick
    await svc.start()
    env = {k: v for k, v in e2e.env.items() if k != "CLEANUP_TRIGGER_TOKEN"}
    env["CLEANUP_TICK_TOKEN"] = tick
    code, out, err = await e2e.cli("trigger", "--url", svc.url, env=env)
    assert code == 0, (out, err)
    run_id = json.loads(out)["run"]["id"]
    code, out, _ = await e2e.cli("trigger", "--url", svc.url, "victim-1", env=env)
    assert code != 0
    assert "recipient_ids is refused" in json.loads(out)["error"]
    status, doc = await svc.request("GET", "/v1/runs", auth=False,
                                    headers={"Authorization": f"Bearer {tick}"})
    assert (status, doc) == (403, {"error": "the tick token may not read the API"})
    await e2e.assert_complete(svc, await svc.wait_done(run_id), sandbox)
