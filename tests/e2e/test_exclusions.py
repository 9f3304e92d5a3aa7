"""The digest rule (issue 11, point 5): while a run drains, the digest builder gets every
recipient of it with an explicit reason, paged or as JSON lines, and a gauge counts them."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from supervisor.exclusions import REASONS
from supervisor.states import OpState

pytestmark = pytest.mark.e2e

POPULATION = 600
VIEWER_TOKEN = "read-only-" + "v" * 24


def test_every_state_has_a_reason() -> None:
    assert set(REASONS) == set(OpState)


async def _paged(svc, schedule: str, limit: int, headers: dict | None = None,
                 ) -> tuple[list[dict], list[dict]]:
    out: list[dict] = []
    after = ""
    while True:
        status, doc = await svc.request(
            "GET", f"/v1/exclusions?schedule={schedule}&limit={limit}&after={after}",
            **({"headers": headers, "auth": False} if headers else {}))
        assert status == 200, doc
        out += doc["exclusions"]
        if doc["next_after"] is None:
            return doc["runs"], out
        after = doc["next_after"]


async def _scanned(sp, run_id: str) -> None:
    """Once the run's scan has recorded every page (its log line says so)."""
    await sp.wait_for_line(rf"scan of {run_id} finished\b")


async def _stream(e2e, svc, path: str, token: str) -> tuple[dict, list[dict], dict]:
    async with e2e.http.get(f"{svc.url}{path}", headers={
            "Authorization": f"Bearer {token}", "Accept": "application/x-ndjson"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
        return dict(resp.headers), lines[:-1], lines[-1]


async def test_exclusions_cover_every_recipient_of_the_run_while_it_drains(e2e):
    # A slow partner with a tenth of the recipients already gone: mid-drain the run has
    # pending, deleted and absent recipients at once.
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", 60, "--absent-share", 0.1)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 60.0},
                                "schedule": {"name": "weekly", "digest_cutoff_seconds": 3600}})
    svc.env["CLEANUP_STATUS_TOKEN"] = VIEWER_TOKEN
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(executions=150)
    status, run = await svc.request("GET", f"/v1/runs/{run_id}")
    assert status == 200, run
    assert run["scan"]["pages"] > 0

    # The digest builder holds the read-only token: it may read, never trigger or resolve.
    viewer = {"Authorization": f"Bearer {VIEWER_TOKEN}"}
    runs, paged = await _paged(svc, "weekly", limit=250, headers=viewer)
    [header] = runs
    assert header["id"] == run_id
    assert header["complete"] is True  # 600 IDs in two source pages: scanned by now
    assert header["digest_cutoff"] == pytest.approx(run["created_at"] + 3600, abs=1)
    ids = [e["recipient_id"] for e in paged]
    assert len(ids) == len(set(ids)) == POPULATION  # every recipient once, none missing
    assert all(e["reason"] == REASONS[OpState(e["state"])] for e in paged)
    assert {e["run_id"] for e in paged} == {run_id}
    reasons = {e["reason"] for e in paged}
    assert {"deletion_pending", "deleted", "absent_at_partner"} <= reasons, reasons
    # Deleted ones are what the partner executed: the digest may trust the reason.
    log = {e["recipient_id"] for e in await sandbox.log()}
    assert {e["recipient_id"] for e in paged if e["reason"] == "deleted"} <= log
    status, doc = await svc.request("POST", "/v1/runs", auth=False, headers=viewer, json={})
    assert (status, doc["error"]) == (403, "the viewer token may not open runs"), doc

    # The same set streamed as JSON lines, ending with a line that says it is whole.
    headers, lines, end = await _stream(e2e, svc, "/v1/exclusions?schedule=weekly",
                                        VIEWER_TOKEN)
    assert headers["Cleanup-Run-Id"] == run_id
    assert {e["recipient_id"] for e in lines} == set(ids)
    assert end["end"] is True
    assert end["count"] == len(lines) == POPULATION
    # A stream cut after some lines resumes after the last one it has.
    cut = lines[249]["operation_id"]
    _, rest, rest_end = await _stream(
        e2e, svc, f"/v1/exclusions?schedule=weekly&format=jsonl&after={cut}", VIEWER_TOKEN)
    assert [e["recipient_id"] for e in rest] == [e["recipient_id"] for e in lines[250:]]
    assert rest_end["count"] == POPULATION - 250
    # The gauge counts them by reason: all of them, once the monitor has refreshed.
    done = await svc.wait_done(run_id)
    deadline = time.monotonic() + 5
    while True:  # the monitor refreshes the gauge each second: nothing to await
        metrics = await svc.metrics()
        gauge = {r: metrics.get("cleanup_digest_exclusions", reason=r)
                 for r in set(REASONS.values())}
        if gauge["deleted"] == done["counts"]["deleted"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
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


async def test_runs_draining_together_are_all_excluded_and_a_foreign_cursor_is_a_409(e2e):
    # overlap = "allow": a second run of the schedule opens while the first still drains
    # (the partner does not answer, so neither finishes); both lists are the exclusions.
    svc = e2e.service(None, {"source": {"kind": "inline"}, "schedule": {"overlap": "allow"},
                             "partner": {"base_url": "http://127.0.0.1:9"}})
    sp = await svc.start()
    first = await svc.open_run(recipient_ids=[f"a-{i}" for i in range(30)])
    await _scanned(sp, first)
    status, doc = await svc.request("GET", "/v1/exclusions?schedule=e2e&limit=10")
    assert status == 200, doc
    assert [r["id"] for r in doc["runs"]] == [first]
    seen = [e["recipient_id"] for e in doc["exclusions"]]
    cursor = doc["next_after"]
    second = await svc.open_run(scheduled_for="2026-12-07T02:00:00+00:00",
                                recipient_ids=[f"b-{i}" for i in range(5)])
    await _scanned(sp, second)
    while cursor is not None:  # the same cursor goes on, through both runs in turn
        status, doc = await svc.request(
            "GET", f"/v1/exclusions?schedule=e2e&limit=10&after={cursor}")
        assert status == 200, doc
        assert [r["id"] for r in doc["runs"]] == [first, second]
        seen += [e["recipient_id"] for e in doc["exclusions"]]
        cursor = doc["next_after"]
    assert sorted(seen) == sorted([f"a-{i}" for i in range(30)] + [f"b-{i}" for i in range(5)])
    # A cursor from another schedule's run does not belong to this list.
    other = await svc.open_run(schedule="other", recipient_ids=["c-1"])
    await _scanned(sp, other)
    [op] = await svc.operations(other)
    status, doc = await svc.request("GET", f"/v1/exclusions?schedule=e2e&after={op['id']}")
    assert status == 409, doc
    assert "start again" in doc["error"]


# -- reads held open do not slow the drain (issue 17, M7) -------------------------------------

RATE = 100.0  # the partner's documented limit, and so the run's pace: N/R seconds a run
RUN_SIZE = 1200
LONG_POLLS = 500
STREAMS = 20


def _settle_rate(log: list[dict], prefix: str) -> tuple[int, float, float]:
    """How many of one run's recipients the partner executed, and how fast by its own
    clock: over the whole run, and over the middle 80 % of its executions (the steady
    drain, without the second the 500 connections take to open at the start)."""
    times = sorted(e["t"] for e in log if e["recipient_id"].startswith(prefix))
    lo, hi = len(times) // 10, len(times) - len(times) // 10 - 1
    return (len(times), (len(times) - 1) / (times[-1] - times[0]),
            (hi - lo) / (times[hi] - times[lo]))


# Exclusive: it compares a run's pace with an earlier one's; tests starting and stopping
# beside it in a parallel pass would load one run and not the other.
@pytest.mark.exclusive
async def test_500_long_polls_and_20_streams_leave_the_settle_rate_as_it_was(e2e):
    """A digest builder (or anyone with the viewer token) holding 500 long-polls and 20
    exclusions streams open during a run: the run settles as fast as the same run does
    with none, both at the partner's rate."""
    sandbox = await e2e.sandbox("--recipients", 10, "--rate", 0)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": RATE, "concurrency": 8},
                                "source": {"kind": "inline"},
                                "schedule": {"name": "weekly"}})
    svc.env["CLEANUP_STATUS_TOKEN"] = VIEWER_TOKEN
    await svc.start()
    viewer = {"Authorization": f"Bearer {VIEWER_TOKEN}"}

    quiet = await svc.open_run(recipient_ids=[f"quiet-{i:05d}" for i in range(RUN_SIZE)],
                               scheduled_for="2026-01-05T02:00:00+00:00")
    await svc.wait_done(quiet)

    loaded = await svc.open_run(recipient_ids=[f"loaded-{i:05d}" for i in range(RUN_SIZE)],
                                scheduled_for="2026-01-12T02:00:00+00:00")
    done = asyncio.Event()
    streamed = [0] * STREAMS

    async def long_poll() -> int:
        async with readers.get(f"{svc.url}/v1/runs/{loaded}?wait=done&timeout=60",
                               headers=viewer) as resp:
            body = await resp.read()
            assert resp.status == 200, body
            return int(orjson.loads(body)["state"] == "done")

    async def stream(i: int) -> None:
        while not done.is_set():  # one stream after another, for the whole run
            async with readers.get(f"{svc.url}/v1/exclusions?schedule=weekly&format=jsonl",
                                   headers=viewer) as resp:
                assert resp.status == 200, await resp.read()
                body = await resp.read()
            assert body.rstrip().rpartition(b"\n")[2].startswith(b'{"end":true'), body[-200:]
            streamed[i] += 1

    # A connection per read: the harness's session holds at most 100.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=90)) as readers:
        polls = [asyncio.create_task(long_poll()) for _ in range(LONG_POLLS)]
        streams = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
        try:
            finished = await svc.wait_done(loaded)  # the 501st long-poll (another token)
        finally:
            done.set()
            await asyncio.gather(*streams)
        answered = await asyncio.gather(*polls)
    assert sum(answered) == LONG_POLLS  # every one held to the end, answered "done"
    assert min(streamed) >= 1, streamed  # every stream kept reading while the run drained
    assert finished["counts"]["already_absent"] == RUN_SIZE

    log = await sandbox.log()
    n_quiet, quiet_whole, quiet_rate = _settle_rate(log, "quiet-")
    n_loaded, loaded_whole, loaded_rate = _settle_rate(log, "loaded-")
    assert (n_quiet, n_loaded) == (RUN_SIZE, RUN_SIZE)
    print(f"settle rate (middle 80 %, whole run): quiet {quiet_rate:.1f}/s, {quiet_whole:.1f}/s;"
          f" with {LONG_POLLS} long-polls and {STREAMS} streams ({sum(streamed)} streamed in "
          f"all) {loaded_rate:.1f}/s, {loaded_whole:.1f}/s; R = {RATE:g}/s, N/R = "
          f"{RUN_SIZE / RATE:.0f} s")
    # The quiet run is bound by the rate (a loaded machine may shave some off it).
    assert quiet_rate >= 0.75 * RATE, quiet_rate
    assert loaded_rate >= 0.9 * quiet_rate, (quiet_rate, loaded_rate)
