"""Verdicts that are not HTTP statuses, and ids outside a JSON body (docs/batch.md).

``--batch-verdict success`` answers each item as Salesforce's sObject Collections does
(``{"id", "success", "errors": [{"statusCode"}]}``), and ``--batch-result-ids
omit-on-error`` leaves the id out of every result but a deletion's, so only matching by
position reads them. Every batch endpoint also takes its ids as a comma list in the
query or in the path, under ``POST``, ``DELETE`` or ``PUT``. Over loopback HTTP on a
stepped clock, like test_sandbox_batch.py, whose helpers these tests share.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from yarl import URL

from cleanup_sandbox import SandboxConfig
from cleanup_sandbox.__main__ import build_parser, config_from_args
from tests.sandbox.test_sandbox_batch import (
    ARCHIVE,
    BATCH,
    JOBS,
    absent,
    executions,
    get,
    post,
    present,
    sandbox,
)


async def send(http: aiohttp.ClientSession, method: str, path: str, body: object = None,
               key: str | None = None) -> tuple[int, dict[str, str], Any]:
    """A batch request in any method, with or without a JSON body; ``path`` is sent as
    written (as the service sends it), not re-quoted."""
    headers = {} if key is None else {"Idempotency-Key": key}
    data = None if body is None else orjson.dumps(body)
    if data is not None:
        headers["Content-Type"] = "application/json"
    async with http.request(method, URL(path, encoded=True), data=data,
                            headers=headers) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), orjson.loads(raw) if raw else None


def ok(rid: str) -> dict[str, object]:
    return {"id": rid, "success": True, "errors": []}


def failed(rid: str | None, code: str, status: int) -> dict[str, object]:
    return {"id": rid, "success": False, "errors": [
        {"statusCode": code, "message": f"item answered as HTTP {status}", "fields": []}]}


# -- Salesforce's verdicts ---------------------------------------------------------------


async def test_success_verdicts_answer_each_id_in_request_order() -> None:
    async with sandbox(batch_shape="per_item", batch_verdict="success") as (
            running, http, _clock):
        state = running.state
        live, gone = present(state, 2), absent(state, 1)
        ids = [live[0], gone[0], "no-such-id", live[1], live[0]]
        status, _, body = await post(http, BATCH, {"ids": ids})
        assert status == 200
        # The repeat of live[0] in the same batch finds it gone, as a second DELETE would.
        assert body == {"results": [
            ok(live[0]), failed(gone[0], "ENTITY_IS_DELETED", 404),
            failed("no-such-id", "ENTITY_IS_DELETED", 404), ok(live[1]),
            failed(live[0], "ENTITY_IS_DELETED", 404)]}
        assert not any(state.is_present(rid) for rid in live)
        assert executions(state) == {live[0]: 1, gone[0]: 1, "no-such-id": 1, live[1]: 1}


async def test_throttled_and_failing_items_carry_salesforces_codes() -> None:
    async with sandbox(batch_shape="per_item", batch_verdict="success", absent_share=0.0,
                       batch_item_throttle_share=0.3, batch_item_error_share=0.2) as (
            running, http, _clock):
        state = running.state
        ids = present(state, 100)
        _, _, body = await post(http, BATCH, {"ids": ids})
        by_code: dict[str, list[str]] = {}
        for result in body["results"]:
            code = "" if result["success"] else result["errors"][0]["statusCode"]
            by_code.setdefault(code, []).append(result["id"])
        assert set(by_code) == {"", "REQUEST_LIMIT_EXCEEDED", "INVALID_ID_FIELD"}
        stats = state.stats()
        assert stats["batch_item_throttled"] == len(by_code["REQUEST_LIMIT_EXCEEDED"])
        assert stats["batch_item_errors"] == len(by_code["INVALID_ID_FIELD"])
        kept = by_code["REQUEST_LIMIT_EXCEEDED"] + by_code["INVALID_ID_FIELD"]
        assert all(state.is_present(rid) for rid in kept)
        assert not any(state.is_present(rid) for rid in by_code[""])


@pytest.mark.parametrize("verdict", ["status", "success"])
async def test_omit_on_error_leaves_the_id_out_of_every_result_but_a_deletion(
        verdict: str) -> None:
    async with sandbox(batch_shape="per_item", batch_verdict=verdict,
                       batch_result_ids="omit-on-error", absent_share=0.0,
                       batch_item_throttle_share=0.2, batch_item_error_share=0.2) as (
            running, http, _clock):
        ids = present(running.state, 60)
        _, _, body = await post(http, BATCH, {"ids": ids})
        results = body["results"]
        assert len(results) == len(ids)  # one per id sent, in request order
        done = [(r["status"] == 200) if verdict == "status" else r["success"]
                for r in results]
        assert True in done
        assert False in done
        for rid, result, deleted in zip(ids, results, done, strict=True):
            assert result["id"] == (rid if deleted else None), result
            assert running.state.is_present(rid) is not deleted


async def test_a_finished_jobs_results_take_the_same_format() -> None:
    async with sandbox(batch_shape="job", batch_verdict="success",
                       batch_result_ids="omit-on-error", batch_job_seconds=0,
                       batch_item_error_share=0.5, absent_share=0.0) as (
            running, http, _clock):
        state = running.state
        ids = [*present(state, 6), "no-such-id"]
        status, _, body = await post(http, JOBS, {"ids": ids, "tag": "b-1"})
        assert status == 202
        _, _, job = await get(http, f"{JOBS}/{body['job_id']}")
        assert job["status"] == "partial_success"
        expected = [ok(rid) if not state.is_present(rid)
                    else failed(None, "INVALID_ID_FIELD", 422) for rid in ids[:-1]]
        # no-such-id: absent, but drawn failing first, or else already deleted.
        assert job["results"][:-1] == expected
        assert job["results"][-1] in (failed(None, "ENTITY_IS_DELETED", 404),
                                      failed(None, "INVALID_ID_FIELD", 422))


async def test_a_replay_answers_the_same_verdicts() -> None:
    async with sandbox(batch_shape="per_item", batch_verdict="success") as (
            running, http, _clock):
        ids = present(running.state, 2) + absent(running.state, 1)
        first = await post(http, BATCH, {"ids": ids}, key="k-1")
        again = await post(http, BATCH, {"ids": ids}, key="k-1")
        assert again[2] == first[2]
        assert again[1]["Idempotent-Replayed"] == "true"
        assert [r["success"] for r in first[2]["results"]] == [True, True, False]


# -- ids in the query or the path --------------------------------------------------------


async def test_ids_in_the_query_of_a_delete_are_one_batch() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        state = running.state
        live, gone = present(state, 2), absent(state, 1)
        # Salesforce's own shape: other parameters beside the ids, DELETE without a body.
        path = f"{BATCH}?allOrNone=false&ids={live[0]},{gone[0]},{live[1]}"
        status, _, body = await send(http, "DELETE", path)
        assert status == 200
        assert body == {"results": [{"id": live[0], "status": 200},
                                    {"id": gone[0], "status": 404},
                                    {"id": live[1], "status": 200}]}
        assert executions(state) == dict.fromkeys([*live, gone[0]], 1)
        assert state.stats()["batch_requests"] == 1


async def test_ids_are_split_before_they_are_decoded() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        live = present(running.state, 1)[0]
        _, _, body = await send(http, "POST", f"{BATCH}?ids=a%2Cb,{live},c%20d")
        assert [r["id"] for r in body["results"]] == ["a,b", live, "c d"]
        _, _, body = await send(http, "PUT", f"{BATCH}/x%2Cy,z%2Fw")
        assert [r["id"] for r in body["results"]] == ["x,y", "z/w"]


@pytest.mark.parametrize(("shape", "path", "answered"), [
    ("per_item", BATCH, 200), ("accepted", ARCHIVE, 204), ("job", JOBS, 202)])
@pytest.mark.parametrize("method", ["POST", "DELETE", "PUT"])
async def test_every_endpoint_takes_its_ids_in_the_path_or_the_query(
        shape: str, path: str, answered: int, method: str) -> None:
    async with sandbox(batch_shape=shape, batch_job_seconds=0) as (running, http, clock):
        state = running.state
        ids = present(state, 4)
        tag = {"tag": "b-1"} if shape == "job" else None
        first = await send(http, method, f"{path}/{ids[0]},{ids[1]}", tag)
        second = await send(http, method, f"{path}?ids={ids[2]},{ids[3]}", tag)
        assert (first[0], second[0]) == (answered, answered)
        clock.now += 1
        await get(http, "/_sandbox/stats")  # a request brings the jobs up to the clock
        assert executions(state) == dict.fromkeys(ids, 1)
        if shape == "job":
            # The job's status is still read at its own path, and found by its tag.
            _, _, job = await get(http, f"{JOBS}/{first[2]['job_id']}")
            assert [r["id"] for r in job["results"]] == ids[:2]
            _, _, found = await get(http, f"{JOBS}?tag=b-1")
            assert len(found["jobs"]) == 2


async def test_a_key_replays_a_batch_whose_ids_came_in_the_query() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        ids = present(running.state, 2)
        first = await send(http, "DELETE", f"{BATCH}?ids={','.join(ids)}", key="k")
        again = await send(http, "DELETE", f"{BATCH}?ids={','.join(ids)}", key="k")
        assert (again[0], again[2]) == (first[0], first[2])
        assert again[1]["Idempotent-Replayed"] == "true"
        # The same key with the ids reordered is another request, refused.
        other = await send(http, "DELETE", f"{BATCH}/{ids[1]},{ids[0]}", key="k")
        assert (other[0], other[2]["error"]) == (422, "idempotency_key_reused")
        assert executions(running.state) == dict.fromkeys(ids, 1)


@pytest.mark.parametrize(("path", "body", "error"), [
    (f"{BATCH}?ids=a,,b", None, "invalid_ids"),
    (f"{BATCH}?ids=", None, "invalid_ids"),
    (f"{BATCH}/a,", None, "invalid_ids"),
    (f"{BATCH}?ids=a", {"ids": ["a"]}, "invalid_ids"),  # ids twice
    (f"{BATCH}/a", {"tag": 7}, "invalid_tag"),
    (f"{BATCH}?ids=a", b"{nope", "invalid_json"),
])
async def test_bad_ids_in_the_url_are_a_clear_400(path: str, body: object, error: str) -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        headers = {"Content-Type": "application/json"}
        data = body if isinstance(body, bytes) else None if body is None else orjson.dumps(body)
        async with http.post(path, data=data, headers=headers) as resp:
            status, doc = resp.status, orjson.loads(await resp.read())
        assert (status, doc["error"]) == (400, error)
        assert running.state.stats()["executions"] == 0


async def test_single_recipient_routes_are_untouched() -> None:
    async with sandbox(batch_shape="per_item") as (running, http, _clock):
        rid = present(running.state, 1)[0]
        assert (await get(http, f"/recipients/{rid}"))[0] == 200
        async with http.delete(f"/recipients/{rid}") as resp:
            assert resp.status in (200, 204)
        assert (await get(http, f"/recipients/{rid}"))[0] == 404
        assert running.state.stats()["batch_requests"] == 0


async def test_with_batches_off_a_delete_to_the_batch_path_is_404_not_a_recipient() -> None:
    async with sandbox() as (running, http, _clock):
        status, _, body = await send(http, "DELETE", f"{BATCH}?ids=a")
        assert (status, body["error"]) == (404, "not_found")
        assert "batch" in body["message"]
        assert running.state.stats()["executions"] == 0


# -- configuration -----------------------------------------------------------------------


def test_cli_flags_reach_the_verdict_fields() -> None:
    parser = build_parser()
    args = parser.parse_args(["--batch", "per_item", "--batch-verdict", "success",
                              "--batch-result-ids", "omit-on-error"])
    config = config_from_args(parser, args, {})
    assert (config.batch_verdict, config.batch_result_ids) == ("success", "omit-on-error")
    default = config_from_args(parser, parser.parse_args([]), {})
    assert (default.batch_verdict, default.batch_result_ids) == ("status", "always")


@pytest.mark.parametrize(("field", "value"), [
    ("batch_verdict", "boolean"), ("batch_result_ids", "never")])
def test_config_names_the_bad_verdict_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**{field: value})
