"""Secrets stay secret (issue 3, point 7).

A full run with ``--log-level debug`` against a partner that fails now and then (so the
error paths log too), every error answer the API gives a client that is wrong in some
way, the CLI's output, a service whose partner rejects its token, and the ledger file:
neither the trigger token nor the partner token appears in any of them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.faults.harness import KEYS, Fault, FaultService, fault_service, verify
from tests.e2e.harness import E2E

pytestmark = pytest.mark.e2e

POPULATION = 300


def leaks(text: str, secrets: dict[str, str]) -> list[str]:
    return [name for name, value in secrets.items() if value in text]


async def error_answers(svc: FaultService, secrets: dict[str, str]) -> list[tuple[int, str]]:
    """Provoke every kind of error answer; return (status, body) of each."""
    good = {"Authorization": f"Bearer {secrets['trigger token']}"}
    json_ct = {**good, "Content-Type": "application/json"}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/runs", {"auth": False}),
        ("POST", "/v1/runs", {"auth": False, "headers": {"Authorization": "Bearer wrong"}}),
        # The right token in the wrong scheme, the partner's token, a token with a suffix.
        ("POST", "/v1/runs", {"auth": False, "headers": {
            "Authorization": f"Basic {secrets['trigger token']}"}}),
        ("POST", "/v1/runs", {"auth": False, "headers": {
            "Authorization": f"Bearer {secrets['partner token']}"}}),
        ("POST", "/v1/runs", {"auth": False, "headers": {
            "Authorization": f"Bearer {secrets['trigger token']}x"}}),
        ("GET", "/v1/runs", {"auth": False, "headers": {
            "Authorization": f"Bearer {secrets['partner token']}"}}),
        ("GET", "/v1/operations?state=ambiguous", {"auth": False}),
        ("POST", "/v1/runs", {"auth": False, "headers": json_ct, "data": b"{not json"}),
        ("POST", "/v1/runs", {"auth": False, "headers": {**good, "Content-Type": "text/plain"},
                              "data": b"hello"}),
        ("POST", "/v1/runs", {"auth": False, "headers": json_ct, "data": b"[1, 2]"}),
        ("POST", "/v1/runs", {"auth": False, "headers": json_ct,
                              "data": b'{"recipient_ids": "r-1", "token": "x"}'}),
        ("POST", "/v1/runs", {"auth": False, "headers": json_ct,
                              "data": b'{"recipient_ids": ["' + b"x" * 300_000 + b'"]}'}),
        ("GET", "/v1/runs?limit=abc", {}),
        ("GET", "/v1/runs/run_nope", {}),
        ("GET", "/v1/runs/run_nope?wait=later", {}),
        ("GET", "/v1/operations/op_nope", {}),
        ("GET", "/v1/operations", {}),
        ("POST", "/v1/operations/op_nope/resolve", {"json": {"outcome": "deleted"}}),
        ("DELETE", "/v1/runs", {}),
        ("GET", "/nowhere", {}),
    ]
    answers = []
    for method, path, spec in cases:
        kwargs = dict(spec)
        auth = kwargs.pop("auth", True)
        kwargs.setdefault("headers", good if auth else {})
        async with svc.e2e.http.request(method, f"{svc.url}{path}", **kwargs) as resp:
            body = (await resp.read()).decode(errors="replace")
            headers = "\n".join(f"{k}: {v}" for k, v in resp.headers.items())
            assert resp.status >= 400, (method, path, resp.status, body)
            assert not leaks(body + headers, secrets), (method, path, body, headers)
            answers.append((resp.status, body))
    return answers


async def test_no_token_in_debug_logs_or_error_bodies(e2e: E2E, fault: Fault) -> None:
    secrets = {"trigger token": e2e.trigger_token, "partner token": e2e.partner_token}
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 1000, "--fault-5xx", 0.05, "--fault-reset-after-act",
                                0.03, "--fault-timeout-after-act", 0.03, "--hang-seconds", 2)
    svc = fault_service(e2e, sandbox, KEYS.overrides,
                        {"partner": {"request_timeout_seconds": 0.8}},
                        global_args=("--log-level", "debug"))
    await svc.start()
    answers = await error_answers(svc, secrets)
    statuses = {status for status, _ in answers}
    assert {400, 401, 404, 405, 413, 415} <= statuses, answers

    run_id = await svc.open_run()
    v = await verify(e2e, svc, sandbox, run_id, KEYS, fault)
    for injected in ("injected_5xx", "injected_resets", "injected_timeouts"):
        assert v.stats[injected], v.stats

    # The CLI, with the trigger token in its environment, and with a wrong one.
    await svc.start()
    wrong = {**e2e.env, "CLEANUP_TRIGGER_TOKEN": "not-the-token"}
    outputs = [await e2e.cli("runs", "--url", svc.url),
               await e2e.cli("runs", "--url", svc.url, run_id),
               await e2e.cli("ambiguous", "--url", svc.url),
               await e2e.cli("check-config", str(svc.config_path)),
               await e2e.cli("trigger", "--url", svc.url, "r-000001", env=wrong),
               await e2e.cli("runs", "--url", svc.url, env=wrong)]
    assert [code for code, _, _ in outputs] == [0, 0, 0, 0, 1, 1], outputs
    await svc.stop()
    for code, out, err in outputs:
        assert not leaks(out + err, secrets), (code, out, err)

    lines = list(svc.all_lines())
    # Debug logging was on (the ledger's driver logs every statement at DEBUG).
    assert any(" DEBUG " in line for line in lines), lines[:5]
    leaked = [(line, leaks(line, secrets)) for line in lines if leaks(line, secrets)]
    assert not leaked, leaked[:3]
    for path in svc.data_dir.iterdir():
        if path.is_file():
            assert not leaks(path.read_bytes().decode(errors="replace"), secrets), path
    fault.record.notes.update({"log_lines": len(lines), "error_answers": len(answers)})


async def test_no_token_in_logs_when_the_partner_rejects_it(e2e: E2E, fault: Fault) -> None:
    """The partner answers 401 to a wrong token: the operations fail with a reason, and
    neither that token nor the right one shows up anywhere."""
    sandbox = await e2e.sandbox("--recipients", 50, "--seed", fault.seed, "--rate", 1000)
    wrong = "wrong-" + e2e.partner_token[::-1]
    secrets = {"trigger token": e2e.trigger_token, "partner token": e2e.partner_token,
               "wrong partner token": wrong}
    env = {**e2e.env, "CUSTOMER_API_TOKEN": wrong}
    svc = fault_service(e2e, sandbox, KEYS.overrides, {"source": {"kind": "inline"}},
                        name="rejected", global_args=("--log-level", "debug"), env=env)
    await svc.start()
    run_id = await svc.open_run(recipient_ids=[f"r-{i:06d}" for i in range(1, 11)])
    run = await svc.wait_done(run_id)
    assert run["counts"]["failed"] == 10, run
    ops = await svc.operations(run_id)
    assert {op["reason"] for op in ops} == {"partner answered HTTP 401"}, ops
    stats = await sandbox.stats()
    assert stats["unauthorized"] == 10, stats
    assert stats["executions"] == 0, stats
    await svc.stop()
    lines = list(svc.all_lines())
    leaked = [(line, leaks(line, secrets)) for line in lines if leaks(line, secrets)]
    assert not leaked, leaked[:3]
    r = fault.record
    r.runs, r.processes, r.operations, r.duplicates = 1, len(svc.history), 10, stats["duplicates"]
    r.notes.update({"failed": 10, "log_lines": len(lines)})
