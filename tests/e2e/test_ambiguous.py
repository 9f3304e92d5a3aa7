"""A partner without idempotency keys that acts, then times out (issue #2, test 9).

The simulator executes the DELETE and then holds the answer past the service's request
timeout, so the service cannot know whether it acted. Without idempotency keys a resend
could act twice: the operation must end ``ambiguous`` with its evidence, never be resent.
The reconciler is switched off (``probe_path = ""``) so the ambiguous state is what the
run ends with.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

POPULATION = 400


async def test_no_idempotency_keys_means_ambiguous_never_resent(e2e):
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 400, "--no-idempotency",
                                "--fault-timeout-after-act", 0.05, "--hang-seconds", 3)
    svc = e2e.service(sandbox, {"partner": {"idempotency_keys": False,
                                            "request_timeout_seconds": 1.0,
                                            "probe_path": ""}})
    await svc.start()
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)

    stats = await sandbox.stats()
    counts = run["counts"]
    hung = stats["injected_timeouts"]
    assert hung > 0, stats
    # Every hung DELETE is one ambiguous operation; nothing else is.
    assert counts["ambiguous"] == hung, (run, stats)
    assert counts["deleted"] + counts["already_absent"] + counts["ambiguous"] == POPULATION
    assert counts["failed"] == 0, run
    assert run["unfinished"] == 0, run
    assert run["discovered"] == POPULATION
    # Never resent: one request per recipient, each executed once.
    assert stats["requests"] == POPULATION, stats
    assert stats["executions"] == POPULATION, stats
    assert stats["duplicates"] == 0, stats
    assert stats["present"] == 0, stats  # the ambiguous ones did act

    ambiguous = await svc.operations(run_id, state="ambiguous")
    assert len(ambiguous) == hung
    status, across = await svc.request("GET", "/v1/operations?state=ambiguous")
    assert status == 200, across
    assert {op["id"] for op in across["operations"]} == {op["id"] for op in ambiguous}

    executed = {e["recipient_id"]: e for e in await sandbox.log()}
    for op in ambiguous:
        assert op["attempts"] == 1, op
        assert "not resent" in op["reason"], op
        detail = await svc.operation(op["id"])
        [attempt] = detail["attempts_log"]
        assert (attempt["kind"], attempt["status"], attempt["outcome"]) == \
            ("delete", None, "ambiguous"), attempt
        assert attempt["detail"].startswith("no answer"), attempt
        # The evidence: the partner did act, then hung.
        e = executed[op["recipient_id"]]
        assert (e["fault"], e["idempotency_key"]) == ("timeout", None), e

    m = await svc.metrics()
    assert m.value("cleanup_operations_ambiguous_total") == hung
    # Each operation counted once: the ambiguous ones under their own counter only.
    assert m.get("cleanup_operations_total", outcome="deleted") + \
        m.get("cleanup_operations_total", outcome="already_absent") == POPULATION - hung
    assert m.get("cleanup_partner_responses_total", status="error") == hung
