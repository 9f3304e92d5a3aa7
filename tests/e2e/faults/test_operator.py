"""No probe configured: unknown outcomes wait for an operator (issue 3, point 1).

The partner ignores idempotency keys and ``partner.probe_path = ""``: an attempt that
timed out or was reset after the partner acted must not be resent, and nothing can find
out whether it took effect. The operation stays ``ambiguous`` with its evidence, is listed
by the API (``GET /v1/operations?state=ambiguous``) and the CLI (``ambiguous``), counted
by ``cleanup_ambiguous_operations``, and an operator resolves it through the API or the
CLI (``resolve``); the attempts log records who decided and why.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.e2e.faults.harness import NO_KEYS, Fault, FaultService, fault_service, verify
from tests.e2e.harness import E2E

pytestmark = pytest.mark.e2e

POPULATION = 200


async def gauge(svc: FaultService, name: str, want: float, within_s: float = 5.0) -> float:
    """The gauge once it shows ``want``. The monitor refreshes ledger gauges once a second
    and publishes no event for it, so this is the one place the suite polls."""
    deadline = time.monotonic() + within_s
    while True:
        value = (await svc.metrics()).get(name)
        if value == want or time.monotonic() >= deadline:
            return value
        await asyncio.sleep(0.1)


async def ambiguous_listed(svc: FaultService) -> list[dict[str, Any]]:
    status, doc = await svc.request("GET", "/v1/operations?state=ambiguous&limit=1000")
    assert status == 200, doc
    assert doc["next_after"] is None, doc
    return list(doc["operations"])


async def test_without_a_probe_ambiguous_operations_wait_for_an_operator(
        e2e: E2E, fault: Fault) -> None:
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 1000, "--no-idempotency",
                                "--fault-timeout-after-act", 0.06, "--hang-seconds", 3,
                                "--fault-reset-after-act", 0.04)
    svc = fault_service(e2e, sandbox, NO_KEYS.overrides, {
        "partner": {"probe_path": "", "request_timeout_seconds": 1.2}})
    await svc.start()
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)

    stats = await sandbox.stats()
    injected = stats["injected_timeouts"] + stats["injected_resets"]
    assert injected >= 4, stats
    # Every attempt that may have acted, and only those, waits in ambiguous: the run is
    # done (they do not hold it open) and nothing was resent.
    assert run["counts"]["ambiguous"] == injected, (run, stats)
    assert stats["requests"] == POPULATION, stats

    listed = await ambiguous_listed(svc)
    assert len(listed) == injected
    assert {op["run_id"] for op in listed} == {run_id}
    faulted = {e["recipient_id"] for e in await sandbox.log() if e["fault"]}
    assert {op["recipient_id"] for op in listed} == faulted
    for op in listed:
        assert "not resent" in op["reason"], op
        log = (await svc.operation(op["id"]))["attempts_log"]
        assert [(a["kind"], a["status"], a["outcome"]) for a in log] == \
            [("delete", None, "ambiguous")], log
        assert log[0]["detail"].startswith("no answer: "), log

    code, out, err = await e2e.cli("ambiguous", "--url", svc.url, "--limit", "1000")
    assert code == 0, err
    assert all(op["id"] in out for op in listed), out
    assert await gauge(svc, "cleanup_ambiguous_operations", injected) == injected

    # An operator resolves one through the API ...
    first, second = listed[0], listed[1]
    status, doc = await svc.request("POST", f"/v1/operations/{first['id']}/resolve", json={
        "outcome": "deleted", "by": "alice", "reason": "checked in partner console"})
    assert (status, doc) == (200, {"id": first["id"], "state": "deleted"})
    # ... and one through the CLI.
    code, out, err = await e2e.cli("resolve", "--url", svc.url, second["id"], "deleted",
                                   "--by", "bob", "--reason", "gone in the partner console")
    assert code == 0, (out, err)
    for op, by, why in ((first, "alice", "checked in partner console"),
                        (second, "bob", "gone in the partner console")):
        view = await svc.operation(op["id"])
        assert view["state"] == "deleted", view
        assert view["reason"] == f"resolved by operator {by}: {why}", view
        last = view["attempts_log"][-1]
        assert (last["kind"], last["outcome"], last["detail"]) == \
            ("operator", "deleted", f"operator {by}: {why}"), view
        assert view["attempts_log"][0]["outcome"] == "ambiguous", view

    # A decision is taken once, for an ambiguous operation, with who and why.
    path = f"/v1/operations/{first['id']}/resolve"
    body = {"outcome": "deleted", "by": "alice", "reason": "again"}
    assert (await svc.request("POST", path, json=body))[0] == 409
    third = listed[2]["id"]
    for bad in ({"outcome": "gone", "by": "alice", "reason": "x"},
                {"outcome": "deleted", "reason": "x"},
                {"outcome": "deleted", "by": "alice", "reason": ""}):
        status, doc = await svc.request("POST", f"/v1/operations/{third}/resolve", json=bad)
        assert status == 400, (bad, doc)
    status, _ = await svc.request("POST", "/v1/operations/op_nope/resolve", json=body)
    assert status == 404

    left = injected - 2
    assert len(await ambiguous_listed(svc)) == left
    assert await gauge(svc, "cleanup_ambiguous_operations", left) == left
    v = await verify(e2e, svc, sandbox, run_id, NO_KEYS, fault, probing=False,
                     allow_ambiguous=True, operator_rows=2)
    assert v.run["counts"]["ambiguous"] == left
    assert v.ledger.attempts["probe"] == 0
    fault.record.notes.update({"injected": injected, "resolved": 2})
