"""The digest rule (issue 11, point 5): while a run drains, the digest builder gets every
recipient of it with an explicit reason, paged or as JSON lines, and a gauge counts them."""

from __future__ import annotations

import orjson
import pytest

from supervisor.exclusions import REASONS
from supervisor.states import OpState

pytestmark = pytest.mark.e2e

POPULATION = 600


def test_every_state_has_a_reason() -> None:
    assert set(REASONS) == set(OpState)


async def _paged(svc, schedule: str, limit: int) -> tuple[dict, list[dict]]:
    out: list[dict] = []
    after = ""
    while True:
        status, doc = await svc.request(
            "GET", f"/v1/exclusions?schedule={schedule}&limit={limit}&after={after}")
        assert status == 200, doc
        out += doc["exclusions"]
        if doc["next_after"] is None:
            return doc["run"], out
        after = doc["next_after"]


async def test_exclusions_cover_every_recipient_of_the_run_while_it_drains(e2e):
    # A slow partner with a tenth of the recipients already gone: mid-drain the run has
    # pending, deleted and absent recipients at once.
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 60, "--absent-share", 0.1)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 60.0},
                                "schedule": {"name": "weekly", "digest_cutoff_seconds": 3600}})
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=150)
    status, run = await svc.request("GET", f"/v1/runs/{run_id}")
    assert status == 200, run
    assert run["scan"]["pages"] > 0

    header, paged = await _paged(svc, "weekly", limit=250)
    assert header["id"] == run_id
    assert header["complete"] is True  # 600 IDs in two source pages: scanned by now
    assert header["digest_cutoff"] == pytest.approx(run["created_at"] + 3600, abs=1)
    ids = [e["recipient_id"] for e in paged]
    assert len(ids) == len(set(ids)) == POPULATION  # every recipient once, none missing
    assert all(e["reason"] == REASONS[OpState(e["state"])] for e in paged)
    reasons = {e["reason"] for e in paged}
    assert {"deletion_pending", "deleted", "absent_at_partner"} <= reasons, reasons
    # Deleted ones are what the partner executed: the digest may trust the reason.
    log = {e["recipient_id"] for e in await sandbox.log()}
    assert {e["recipient_id"] for e in paged if e["reason"] == "deleted"} <= log

    # The same set streamed as JSON lines, asked for by Accept or by format.
    async with e2e.http.get(f"{svc.url}/v1/exclusions?schedule=weekly", headers={
            "Authorization": f"Bearer {e2e.trigger_token}",
            "Accept": "application/x-ndjson"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        assert resp.headers["Cleanup-Run-Id"] == run_id
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert {e["recipient_id"] for e in lines} == set(ids)
    assert len(lines) == POPULATION

    # The gauge counts them by reason: all of them, once the monitor has refreshed.
    done = await svc.wait_done(run_id)
    metrics = await svc.metrics()
    gauge = {r: metrics.get("cleanup_digest_exclusions", reason=r) for r in set(REASONS.values())}
    assert sum(gauge.values()) == POPULATION, gauge
    assert gauge["deleted"] == done["counts"]["deleted"], (gauge, done["counts"])
    assert gauge["absent_at_partner"] == done["counts"]["already_absent"]
    assert gauge["deletion_pending"] == 0


async def test_exclusions_refuse_bad_input_clearly(e2e):
    svc = e2e.service(None, {"source": {"kind": "inline"}})
    await svc.start()
    status, doc = await svc.request("GET", "/v1/exclusions?schedule=weekly", auth=False)
    assert status == 401, doc
    status, doc = await svc.request("GET", "/v1/exclusions?schedule=never")
    assert status == 404, doc
    assert "never" in doc["error"]
    status, doc = await svc.request("GET", "/v1/exclusions?format=csv")
    assert status == 400, doc
    assert "format" in doc["error"]
    status, doc = await svc.request("GET", "/v1/exclusions?after=%00")
    assert status == 400, doc
    assert "after" in doc["error"]
