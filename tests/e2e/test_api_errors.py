"""Bad input against the running service (issue #2, test 7).

Each request is refused with the right status and a JSON error; after each one the
process still answers, and no run was written.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

MAX_BODY = 1024
JSON = {"Content-Type": "application/json"}

# (what, method, path, request options, expected status, a fragment of the error message)
CASES = [
    ("no token", "POST", "/v1/runs", {"auth": False}, 401, "bearer token"),
    ("wrong token", "POST", "/v1/runs", {"headers": {"Authorization": "Bearer nope"}}, 401,
     "bearer token"),
    ("wrong scheme", "POST", "/v1/runs", {"headers": {"Authorization": "Basic dTpw"}}, 401,
     "bearer token"),
    ("read API without token", "GET", "/v1/runs", {"auth": False}, 401, "bearer token"),
    ("oversized body", "POST", "/v1/runs",
     {"data": b'{"schedule": "' + b"x" * (4 * MAX_BODY) + b'"}', "headers": JSON}, 413,
     f"larger than {MAX_BODY} bytes"),
    ("malformed JSON", "POST", "/v1/runs", {"data": b'{"schedule": ', "headers": JSON}, 400,
     "not valid JSON"),
    ("JSON that is not an object", "POST", "/v1/runs", {"json": ["weekly"]}, 400,
     "JSON object"),
    ("wrong content type", "POST", "/v1/runs",
     {"data": b'{"schedule": "weekly"}', "headers": {"Content-Type": "text/plain"}}, 415,
     "application/json"),
    ("unknown field", "POST", "/v1/runs", {"json": {"schedule": "w", "force": True}}, 400,
     "unknown field(s): force"),
    ("slot without UTC offset", "POST", "/v1/runs",
     {"json": {"scheduled_for": "2026-01-05T02:00:00"}}, 400, "UTC offset"),
    ("IDs not a list", "POST", "/v1/runs", {"json": {"recipient_ids": "r-000001"}}, 400,
     "recipient_ids"),
    ("IDs beside an http source", "POST", "/v1/runs", {"json": {"recipient_ids": ["r-1"]}},
     400, "recipient_ids is refused: source.kind is 'http'"),
    ("unknown run", "GET", "/v1/runs/run_nope", {}, 404, "no run run_nope"),
    ("operations of an unknown run", "GET", "/v1/runs/run_nope/operations", {}, 404,
     "no run run_nope"),
    ("unknown operation", "GET", "/v1/operations/op_nope", {}, 404, "no operation op_nope"),
    ("limit out of range", "GET", "/v1/runs?limit=0", {}, 400, "limit"),
    ("wrong method", "DELETE", "/v1/runs", {}, 405, "not allowed"),
]


async def test_bad_requests_are_refused_and_change_nothing(e2e):
    sandbox = await e2e.sandbox("--recipients", 10)
    svc = e2e.service(sandbox, {"service": {"max_body_bytes": MAX_BODY}})
    sp = await svc.start()

    for what, method, path, options, expected, fragment in CASES:
        status, doc = await svc.request(method, path, **options)
        assert status == expected, (what, status, doc)
        assert isinstance(doc, dict), (what, doc)  # JSON, never a traceback or HTML
        assert fragment in doc["error"], (what, doc)
        status, _ = await svc.request("GET", "/healthz", auth=False)
        assert status == 200, f"service down after: {what}"
        status, runs = await svc.request("GET", "/v1/runs")
        assert (status, runs) == (200, {"runs": []}), f"a run was written after: {what}"

    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 200, doc
    assert sp.proc.returncode is None
    assert not any("Traceback" in line for line in sp.lines), sp.tail()
    # Nothing reached the partner: no scan began, no DELETE was sent.
    stats = await sandbox.stats()
    assert stats["pages_served"] == 0, stats
    assert stats["requests"] == 0, stats
    m = await svc.metrics()
    assert m.get("cleanup_ticks_total", result="opened") == 0

    # The same service takes a good trigger afterwards.
    run_id = await svc.open_run()
    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)
