"""The simulator's batch endpoints (docs/batch.md) over real loopback HTTP.

The sandbox runs on an injected clock that the test steps: jobs progress, expire and
refill the limiter exactly when the test says, and nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from cleanup_sandbox import RunningSandbox, SandboxConfig, SandboxState, run_sandbox
from cleanup_sandbox.__main__ import build_parser, config_from_args
from cleanup_sandbox.batch import BATCH_KEY

BATCH = "/recipients/batch-delete"
ARCHIVE = "/recipients/batch-archive"
JOBS = "/recipients/batch-jobs"


class FakeClock:
    def __init__(self, now: float = 5000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def sandbox(
    **overrides: Any,
) -> AsyncIterator[tuple[RunningSandbox, aiohttp.ClientSession, FakeClock]]:
    clock = FakeClock()
    # Unlimited unless a test limits it: the clock stands still, so no token ever refills.
    settings: dict[str, Any] = {"recipients": 200, "absent_share": 0.1, "rate_per_second": 0}
    config = SandboxConfig(**{**settings, **overrides})
    async with (
        run_sandbox(config, clock=clock) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield running, http, clock


async def post(
    http: aiohttp.ClientSession, path: str, payload: object, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    # aiohttp warns about raw bytes this large; a stream of them reads alike.
    data: bytes | io.BytesIO = io.BytesIO(raw) if len(raw) > 512 * 1024 else raw
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with http.post(path, data=data, headers=headers) as resp:
        body = await resp.read()
        return resp.status, dict(resp.headers), orjson.loads(body) if body else None


async def get(http: aiohttp.ClientSession, path: str) -> tuple[int, dict[str, str], Any]:
    async with http.get(path) as resp:
        return resp.status, dict(resp.headers), orjson.loads(await resp.read())


def present(state: SandboxState, count: int) -> list[str]:
    return [rid for rid in state.population if state.is_present(rid)][:count]


def absent(state: SandboxState, count: int) -> list[str]:
    return [rid for rid in state.population if not state.is_present(rid)][:count]


def executions(state: SandboxState) -> dict[str, int]:
    return dict(Counter(execution.recipient_id for execution in state.log))


# -- per_item ----------------------------------------------------------------------------


async def test_per_item_answers_each_id_in_request_order_and_deletes_the_present() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        state = running.state
        live, gone = present(state, 3), absent(state, 2)
        ids = [live[0], gone[0], live[1], "no-such-id", gone[1], live[2]]
        status, _, body = await post(http, BATCH, {"ids": ids}, key="b-1")
        assert status == 200
        assert body == {"results": [
            {"id": ids[0], "status": 200}, {"id": ids[1], "status": 404},
            {"id": ids[2], "status": 200}, {"id": ids[3], "status": 404},
            {"id": ids[4], "status": 404}, {"id": ids[5], "status": 200},
        ]}
        assert not any(state.is_present(rid) for rid in live)
        # Every id reached the execution log once, with the batch's key, like a DELETE.
        assert executions(state) == dict.fromkeys(ids, 1)
        assert {e.idempotency_key for e in state.log} == {"b-1"}
        requests = {e.recipient_id: e.status for e in state.requests_log}
        assert requests == {rid: (200 if rid in live else 404) for rid in ids}
        stats = state.stats()
        assert (stats["batch_requests"], stats["batch_items"], stats["deleted"]) == (1, 6, 3)


async def test_per_item_throttles_and_fails_items_without_deleting_them() -> None:
    async with sandbox(batch_shape="per_item", absent_share=0.0,
                       batch_item_throttle_share=0.3, batch_item_error_share=0.2) as (
        running, http, _clock,
    ):
        state = running.state
        ids = present(state, 100)
        _, _, body = await post(http, BATCH, {"ids": ids})
        by_status: dict[int, list[str]] = {}
        for result in body["results"]:
            by_status.setdefault(result["status"], []).append(result["id"])
        assert set(by_status) == {200, 422, 429}
        assert all(state.is_present(rid) for rid in by_status[422] + by_status[429])
        assert not any(state.is_present(rid) for rid in by_status[200])
        assert sum(executions(state).values()) == len(by_status[200])
        stats = state.stats()
        assert stats["batch_item_throttled"] == len(by_status[429])
        assert stats["batch_item_errors"] == len(by_status[422])

        # A failure belongs to its id and stays; a throttled item goes through in time.
        failed, throttled = by_status[422], by_status[429]
        for _ in range(20):
            _, _, again = await post(http, BATCH, {"ids": failed + throttled})
            assert [r["status"] for r in again["results"][: len(failed)]] == [422] * len(failed)
            throttled = [r["id"] for r in again["results"][len(failed):] if r["status"] == 429]
            if not throttled:
                break
        assert throttled == []
        assert all(state.executions_of(rid) <= 1 for rid in ids)


async def test_the_same_seed_throttles_the_same_items() -> None:
    outcomes = []
    for _ in range(2):
        async with sandbox(batch_shape="per_item", batch_item_throttle_share=0.5,
                           batch_item_error_share=0.1) as (running, http, _clock):
            _, _, body = await post(http, BATCH, {"ids": running.state.population[:50]})
            outcomes.append(body)
    assert outcomes[0] == outcomes[1]


# -- accepted ----------------------------------------------------------------------------


async def test_accepted_answers_204_whatever_each_ids_state() -> None:
    async with sandbox(batch_shape="accepted") as (running, http, _clock):
        state = running.state
        live, gone = present(state, 4), absent(state, 2)
        status, _, body = await post(http, ARCHIVE, {"ids": [*live, *gone, "no-such-id"]})
        assert (status, body) == (204, None)
        assert not any(state.is_present(rid) for rid in live)
        assert executions(state) == dict.fromkeys([*live, *gone, "no-such-id"], 1)
        # The contract's default batch.path plays the configured shape too.
        more = present(state, 2)
        assert (await post(http, BATCH, {"ids": more}))[0] == 204
        assert not any(state.is_present(rid) for rid in more)


async def test_accepted_silently_leaves_a_share_of_present_ids() -> None:
    async with sandbox(batch_shape="accepted", absent_share=0.0,
                       batch_silent_miss_share=0.25) as (running, http, _clock):
        state = running.state
        ids = present(state, 100)
        assert (await post(http, ARCHIVE, {"ids": ids}))[0] == 204
        missed = [rid for rid in ids if state.is_present(rid)]
        assert 0 < len(missed) < len(ids)
        assert state.stats()["batch_silent_misses"] == len(missed)
        # A silent miss is never logged as an execution: only a probe can tell.
        assert not any(state.executions_of(rid) for rid in missed)
        for rid in missed:
            assert (await get(http, f"/recipients/{rid}"))[0] == 200


# -- routes by shape ---------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "closed"), [
    ("", [BATCH, ARCHIVE, JOBS]),
    ("per_item", [ARCHIVE, JOBS]),
    ("accepted", [JOBS]),
    ("job", [ARCHIVE]),
])
async def test_endpoints_of_another_shape_answer_404_as_json(shape: str, closed: list[str]) -> None:
    async with sandbox(batch_shape=shape) as (running, http, _clock):
        ids = present(running.state, 1)
        for path in closed:
            status, headers, body = await post(http, path, {"ids": ids, "tag": "b"})
            assert (status, body["error"]) == (404, "not_found"), path
            assert headers["Content-Type"].startswith("application/json")
        if shape != "job":
            assert (await get(http, f"{JOBS}/job-000001"))[0] == 404
            assert (await get(http, f"{JOBS}?tag=b"))[0] == 404
        assert running.state.is_present(ids[0])
        assert running.state.stats()["executions"] == 0


# -- whole-batch quirks (every shape) ----------------------------------------------------


@pytest.mark.parametrize(("shape", "path"), [
    ("per_item", BATCH), ("accepted", ARCHIVE), ("job", JOBS)])
async def test_whole_batch_refusals_do_nothing(shape: str, path: str) -> None:
    async with sandbox(batch_shape=shape, batch_max_items=5, batch_bad_id_pattern=r"^bad-",
                       batch_duplicates="error", batch_job_seconds=0) as (running, http, clock):
        state = running.state
        ids = present(state, 6)
        status, _, body = await post(http, path, {"ids": ids})
        assert (status, body["error"], body["max_items"]) == (413, "too_many_items", 5)
        status, _, body = await post(http, path, {"ids": [ids[0], "bad-7", ids[1]]})
        assert (status, body["error"], body["id"]) == (400, "invalid_id", "bad-7")
        status, _, body = await post(http, path, {"ids": [ids[0], ids[1], ids[0]]})
        assert (status, body["error"], body["id"]) == (400, "duplicate_id", ids[0])
        clock.now += 10
        assert (await get(http, "/_sandbox/stats"))[2]["executions"] == 0
        assert all(state.is_present(rid) for rid in ids)


async def test_duplicates_once_act_once_and_answer_404_for_the_repeat() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        a, b = present(running.state, 2)
        _, _, body = await post(http, BATCH, {"ids": [a, b, a]})
        assert body["results"] == [
            {"id": a, "status": 200}, {"id": b, "status": 200}, {"id": a, "status": 404}]
        assert (running.state.executions_of(a), running.state.stats()["batch_duplicate_ids"]) == (1, 1)


async def test_duplicates_once_in_an_accepted_batch_act_once() -> None:
    async with sandbox(batch_shape="accepted") as (running, http, _clock):
        a, b = present(running.state, 2)
        assert (await post(http, ARCHIVE, {"ids": [a, a, b, a]}))[0] == 204
        assert executions(running.state) == {a: 1, b: 1}


@pytest.mark.parametrize(("payload", "error"), [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    ({"id": ["r-000001"]}, "invalid_ids"),
    ({"ids": "r-000001"}, "invalid_ids"),
    ({"ids": ["r-000001", 2]}, "invalid_ids"),
    ({"ids": []}, "invalid_ids"),
    ({"ids": ["r-000001"], "tag": 7}, "invalid_tag"),
    ({"ids": ["r-" + "x" * 1000] * 1100}, "body_too_large"),
])
async def test_bad_input_is_a_clear_400(payload: object, error: str) -> None:
    async with sandbox(batch_shape="per_item", batch_max_items=5000) as (running, http, _clock):
        status, _, body = await post(http, BATCH, payload)
        assert (status, body["error"]) == (400, error)
        assert body["message"]
        assert running.state.stats()["executions"] == 0


# -- idempotency -------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "path"), [
    ("per_item", BATCH), ("accepted", ARCHIVE), ("job", JOBS)])
async def test_same_key_replays_and_other_ids_under_it_are_refused(shape: str, path: str) -> None:
    async with sandbox(batch_shape=shape, batch_job_seconds=0) as (running, http, clock):
        state = running.state
        ids = present(state, 3)
        first = await post(http, path, {"ids": ids, "tag": "b-1"}, key="b-1")
        clock.now += 1
        again = await post(http, path, {"ids": ids, "tag": "b-1"}, key="b-1")
        assert (again[0], again[2]) == (first[0], first[2])
        assert "Idempotent-Replayed" not in first[1]
        assert again[1]["Idempotent-Replayed"] == "true"
        assert executions(state) == dict.fromkeys(ids, 1)

        status, _, body = await post(http, path, {"ids": ids[:2], "tag": "b-1"}, key="b-1")
        assert (status, body["error"]) == (422, "idempotency_key_reused")
        # A single DELETE cannot reuse a batch's key either.
        async with http.delete(f"/recipients/{ids[0]}", headers={"Idempotency-Key": "b-1"}) as r:
            assert r.status == 422
        stats = state.stats()
        assert (stats["replays"], stats["key_mismatches"], stats["executions"]) == (1, 2, 3)
        assert stats["batch_jobs_submitted"] == (1 if shape == "job" else 0)


async def test_keys_are_ignored_when_the_partner_does_not_honour_them() -> None:
    async with sandbox(batch_shape="per_item", honour_idempotency_keys=False) as (
        running, http, _clock,
    ):
        ids = present(running.state, 2)
        await post(http, BATCH, {"ids": ids}, key="k")
        _, headers, body = await post(http, BATCH, {"ids": ids}, key="k")
        assert "Idempotent-Replayed" not in headers
        assert [r["status"] for r in body["results"]] == [404, 404]
        assert executions(running.state) == dict.fromkeys(ids, 2)


# -- faults ------------------------------------------------------------------------------


async def test_an_injected_5xx_does_nothing() -> None:
    async with sandbox(batch_shape="per_item", fault_5xx=1.0) as (running, http, _clock):
        ids = present(running.state, 3)
        status, _, body = await post(http, BATCH, {"ids": ids}, key="k")
        assert (status, body["error"]) == (503, "unavailable")
        assert running.state.stats()["executions"] == 0
        # Nothing was stored under the key: the resend acts.
        running.state.apply_control({"fault_5xx": 0})
        _, headers, body = await post(http, BATCH, {"ids": ids}, key="k")
        assert "Idempotent-Replayed" not in headers
        assert [r["status"] for r in body["results"]] == [200, 200, 200]


async def test_a_reset_after_acting_loses_the_answer_but_the_key_replays_it() -> None:
    async with sandbox(batch_shape="per_item", fault_reset_after_act=1.0) as (
        running, http, _clock,
    ):
        state = running.state
        ids = present(state, 3)
        with pytest.raises(aiohttp.ClientError):
            await post(http, BATCH, {"ids": ids}, key="k")
        assert not any(state.is_present(rid) for rid in ids)
        assert {e.fault for e in state.log} == {"reset"}
        state.apply_control({"fault_reset_after_act": 0})
        status, headers, body = await post(http, BATCH, {"ids": ids}, key="k")
        assert (status, headers["Idempotent-Replayed"]) == (200, "true")
        assert [r["status"] for r in body["results"]] == [200, 200, 200]
        assert executions(state) == dict.fromkeys(ids, 1)


async def test_a_timeout_after_acting_holds_the_answer_back_and_the_key_replays_it() -> None:
    async with sandbox(batch_shape="accepted", fault_timeout_after_act=1.0, hang_seconds=60) as (
        running, http, _clock,
    ):
        state = running.state
        ids = present(state, 2)
        hanging = asyncio.create_task(post(http, ARCHIVE, {"ids": ids}, key="k"))
        async with asyncio.timeout(10):
            await state.wait_until(lambda: state.counters.executions == 2)
        # Acted, and the answer is held back: nothing has been sent yet.
        assert not hanging.done()
        assert not any(state.is_present(rid) for rid in ids)
        status, headers, _ = await post(http, ARCHIVE, {"ids": ids}, key="k")
        assert (status, headers["Idempotent-Replayed"]) == (204, "true")
        assert (state.stats()["injected_timeouts"], state.stats()["executions"]) == (1, 2)
        hanging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hanging


# -- jobs --------------------------------------------------------------------------------


async def test_a_job_runs_on_the_clock_deleting_as_it_goes() -> None:
    async with sandbox(batch_shape="job", batch_job_seconds=10,
                       batch_job_result_ttl_seconds=100) as (running, http, clock):
        state = running.state
        live, gone = present(state, 3), absent(state, 1)
        ids = [*live, *gone]
        status, _, body = await post(http, JOBS, {"ids": ids, "tag": "b-7"})
        assert (status, body) == (202, {"job_id": "job-000001"})
        path = f"{JOBS}/job-000001"

        before = time.time()
        status, _, job = await get(http, path)
        after = time.time()
        assert (status, job["status"], job["progress"], job["tag"]) == (200, "pending", 0.0, "b-7")
        assert "results" not in job
        assert before + 109 <= job["expires_at"] <= after + 110

        clock.now += 5  # half the job: the first two items
        _, _, job = await get(http, path)
        assert (job["status"], job["progress"]) == ("running", 0.5)
        assert [state.is_present(rid) for rid in live] == [False, False, True]

        clock.now += 5
        _, _, job = await get(http, path)
        assert (job["status"], job["progress"]) == ("finished", 1.0)
        assert job["results"] == [
            {"id": live[0], "status": 200}, {"id": live[1], "status": 200},
            {"id": live[2], "status": 200}, {"id": gone[0], "status": 404}]
        assert executions(state) == dict.fromkeys(ids, 1)
        stats = state.stats()
        assert (stats["batch_jobs_submitted"], stats["batch_jobs_finished"]) == (1, 1)


async def test_a_job_progresses_for_a_probe_without_being_polled() -> None:
    async with sandbox(batch_shape="job", batch_job_seconds=3) as (running, http, clock):
        ids = present(running.state, 2)
        await post(http, JOBS, {"ids": ids, "tag": "b"})
        assert (await get(http, f"/recipients/{ids[0]}"))[0] == 200
        clock.now += 3
        assert (await get(http, f"/recipients/{ids[0]}"))[0] == 404
        assert (await get(http, "/_sandbox/stats"))[2]["batch_jobs_finished"] == 1


@pytest.mark.parametrize(("share", "expected"), [(0.5, "partial_success"), (1.0, "failed")])
async def test_failing_items_make_a_job_partial_or_failed(share: float, expected: str) -> None:
    async with sandbox(batch_shape="job", batch_item_error_share=share, absent_share=0.0,
                       batch_job_seconds=1) as (running, http, clock):
        ids = present(running.state, 20)
        _, _, body = await post(http, JOBS, {"ids": ids, "tag": "b"})
        clock.now += 1
        _, _, job = await get(http, f"{JOBS}/{body['job_id']}")
        assert job["status"] == expected
        failed = [r["id"] for r in job["results"] if r["status"] == 422]
        assert failed
        assert all(running.state.is_present(rid) for rid in failed)
        assert {r["status"] for r in job["results"]} <= {200, 422}
        assert running.state.stats()["batch_item_errors"] == len(failed)


async def test_a_jobs_results_expire_after_the_ttl() -> None:
    async with sandbox(batch_shape="job", batch_job_seconds=2,
                       batch_job_result_ttl_seconds=30) as (running, http, clock):
        _, _, body = await post(http, JOBS, {"ids": present(running.state, 2), "tag": "b"})
        path = f"{JOBS}/{body['job_id']}"
        clock.now += 2 + 29.5
        assert (await get(http, path))[2]["status"] == "finished"
        clock.now += 0.5
        status, _, gone = await get(http, path)
        assert (status, gone["error"]) == (404, "not_found")
        assert (await get(http, f"{JOBS}?tag=b"))[2] == {"jobs": []}
        assert running.state.stats()["batch_jobs_expired"] == 1


async def test_jobs_beyond_the_limit_are_refused_until_one_finishes() -> None:
    async with sandbox(batch_shape="job", batch_max_jobs=2, batch_job_seconds=10) as (
        running, http, clock,
    ):
        ids = present(running.state, 3)
        assert (await post(http, JOBS, {"ids": ids[:1]}))[0] == 202
        clock.now += 4
        assert (await post(http, JOBS, {"ids": ids[1:2]}))[0] == 202
        status, headers, body = await post(http, JOBS, {"ids": ids[2:]}, key="k")
        assert (status, body["error"], headers["Retry-After"]) == (429, "too_many_jobs", "6")
        assert running.state.is_present(ids[2])
        clock.now += 6
        # The refusal stored nothing under the key: the resend is submitted.
        status, headers, body = await post(http, JOBS, {"ids": ids[2:]}, key="k")
        assert (status, body, "Idempotent-Replayed" in headers) == (202, {"job_id": "job-000003"}, False)
        stats = running.state.stats()
        assert (stats["batch_jobs_refused"], stats["batch_jobs_submitted"]) == (1, 3)


async def test_jobs_are_found_by_their_tag() -> None:
    async with sandbox(batch_shape="job", batch_job_seconds=5) as (running, http, clock):
        ids = present(running.state, 3)
        await post(http, JOBS, {"ids": ids[:1], "tag": "b-1"})
        await post(http, JOBS, {"ids": ids[1:2], "tag": "b-2"})
        clock.now += 5
        await post(http, JOBS, {"ids": ids[2:], "tag": "b-1"})
        status, _, body = await get(http, f"{JOBS}?tag=b-1")
        assert (status, body) == (200, {"jobs": [
            {"job_id": "job-000001", "tag": "b-1", "status": "finished"},
            {"job_id": "job-000003", "tag": "b-1", "status": "pending"}]})
        assert (await get(http, f"{JOBS}?tag=never-sent"))[2] == {"jobs": []}
        status, _, body = await get(http, JOBS)
        assert (status, body["error"]) == (400, "invalid_parameter")
        assert (await get(http, f"{JOBS}/job-999999"))[0] == 404


async def test_a_job_of_no_duration_finishes_at_once_and_in_process_advance_agrees() -> None:
    async with sandbox(batch_shape="job", batch_job_seconds=0) as (running, http, clock):
        ids = present(running.state, 2)
        await post(http, JOBS, {"ids": [*ids, ids[0]], "tag": "b"})
        running.app[BATCH_KEY].advance(clock())
        assert not any(running.state.is_present(rid) for rid in ids)
        _, _, job = await get(http, f"{JOBS}/job-000001")
        assert [r["status"] for r in job["results"]] == [200, 200, 404]


# -- rate limiting -----------------------------------------------------------------------


async def test_item_cost_takes_a_token_per_id_or_none_at_all() -> None:
    async with sandbox(batch_shape="per_item", batch_cost="item", rate_per_second=10,
                       burst=10, retry_after_format="fractional", absent_share=0.0) as (
        running, http, clock,
    ):
        state = running.state
        ids = present(state, 30)
        assert (await post(http, BATCH, {"ids": ids[:6]}))[0] == 200
        status, headers, body = await post(http, BATCH, {"ids": ids[6:12]})
        # 4 tokens left: 2 more take 0.2 s, and nothing of the 6 was taken or done.
        assert (status, body["error"], headers["Retry-After"]) == (429, "rate_limited", "0.200")
        assert all(state.is_present(rid) for rid in ids[6:12])
        clock.now += 0.2
        assert (await post(http, BATCH, {"ids": ids[6:12]}))[0] == 200
        # A batch dearer than the bucket could ever hold is refused as too large.
        clock.now += 100
        status, _, body = await post(http, BATCH, {"ids": ids[12:23]})
        assert (status, body["error"], body["cost"]) == (413, "batch_over_rate_limit", 11)
        assert state.stats()["executions"] == 12


async def test_request_cost_takes_one_token_per_batch() -> None:
    async with sandbox(batch_shape="per_item", rate_per_second=10, burst=3,
                       absent_share=0.0) as (running, http, _clock):
        ids = present(running.state, 40)
        for start in range(0, 30, 10):
            assert (await post(http, BATCH, {"ids": ids[start:start + 10]}))[0] == 200
        status, _, body = await post(http, BATCH, {"ids": ids[30:]})
        assert (status, body["error"]) == (429, "rate_limited")
        assert running.state.stats()["executions"] == 30


async def test_item_cost_counts_against_quotas_too() -> None:
    async with sandbox(batch_shape="accepted", batch_cost="item", quotas=((5, 60.0),)) as (
        running, http, clock,
    ):
        ids = present(running.state, 10)
        assert (await post(http, ARCHIVE, {"ids": ids[:3]}))[0] == 204
        status, headers, body = await post(http, ARCHIVE, {"ids": ids[3:6]})
        assert (status, body["error"], headers["Retry-After"]) == (429, "quota_exceeded", "60")
        clock.now += 60
        assert (await post(http, ARCHIVE, {"ids": ids[3:6]}))[0] == 204


async def test_job_reads_cost_one_request_each() -> None:
    async with sandbox(batch_shape="job", rate_per_second=1, burst=3,
                       ratelimit_headers="x-ratelimit") as (running, http, _clock):
        _, headers, body = await post(http, JOBS, {"ids": present(running.state, 5), "tag": "b"})
        assert headers["X-RateLimit-Remaining"] == "2"
        status, headers, _ = await get(http, f"{JOBS}/{body['job_id']}")
        assert (status, headers["X-RateLimit-Remaining"]) == (200, "1")
        assert (await get(http, f"{JOBS}?tag=b"))[0] == 200
        status, headers, body = await get(http, f"{JOBS}?tag=b")
        assert (status, body["error"], headers["Retry-After"]) == (429, "rate_limited", "1")


# -- configuration -----------------------------------------------------------------------


def test_cli_flags_reach_every_batch_field() -> None:
    parser = build_parser()
    args = parser.parse_args([
        "--batch", "job", "--batch-max-items", "50", "--batch-item-throttle-share", "0.1",
        "--batch-item-error-share", "0.2", "--batch-silent-miss-share", "0.3",
        "--batch-max-jobs", "7", "--batch-job-seconds", "1.5",
        "--batch-job-result-ttl-seconds", "60", "--batch-bad-id-pattern", "^x",
        "--batch-duplicates", "error", "--batch-cost", "item",
    ])
    config = config_from_args(parser, args, {})
    assert (config.batch_shape, config.batch_max_items, config.batch_item_throttle_share,
            config.batch_item_error_share, config.batch_silent_miss_share,
            config.batch_max_jobs, config.batch_job_seconds,
            config.batch_job_result_ttl_seconds, config.batch_bad_id_pattern,
            config.batch_duplicates, config.batch_cost) == (
        "job", 50, 0.1, 0.2, 0.3, 7, 1.5, 60.0, "^x", "error", "item")
    assert config_from_args(parser, parser.parse_args([]), {}).batch_shape == ""


@pytest.mark.parametrize(("field", "value"), [
    ("batch_shape", "bulk"), ("batch_max_items", 0), ("batch_max_jobs", True),
    ("batch_item_throttle_share", 1.5), ("batch_item_error_share", -0.1),
    ("batch_silent_miss_share", float("nan")), ("batch_job_seconds", -1),
    ("batch_job_result_ttl_seconds", float("inf")), ("batch_bad_id_pattern", "(unclosed"),
    ("batch_duplicates", "twice"), ("batch_cost", "byte"),
])
def test_config_names_the_bad_batch_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**{field: value})


def test_the_services_plural_cost_names_are_read_alike() -> None:
    assert SandboxConfig(batch_cost="items").batch_cost == "item"  # type: ignore[arg-type]
    assert SandboxConfig(batch_cost="requests").batch_cost == "request"  # type: ignore[arg-type]
