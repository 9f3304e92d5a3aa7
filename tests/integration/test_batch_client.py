"""BatchClient (supervisor/batch/client.py) against partners answering what real partners
and middleboxes send: the simulator for the request's shape, and a loopback server for
nonsense (bodies that are not JSON, results that are not a list, statuses that are not
statuses, results for ids never sent, a job reference that is not one), and Salesforce's
``{success, errors}`` verdicts matched by id or by position. Nonsense never raises and
never reads as success: an item without a readable result has none, and the answer's
``problem`` says why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web

from supervisor.batch.client import BatchClient
from supervisor.batchsettings import BatchConfig
from supervisor.config import PartnerConfig
from supervisor.partner import PartnerClient, Verdict, classify


@asynccontextmanager
async def partner(answer: Any, status: int = 200, headers: dict[str, str] | None = None,
                  **batch: Any) -> AsyncIterator[tuple[BatchClient, list[web.Request],
                                                       list[bytes]]]:
    seen: list[web.Request] = []
    bodies: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request)
        bodies.append(await request.read())
        body = answer if isinstance(answer, bytes) else orjson.dumps(answer)
        return web.Response(body=body, status=status, headers=headers,
                            content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = PartnerClient(PartnerConfig(base_url=f"http://127.0.0.1:{port}"), pool_size=2)
    await client.start()
    try:
        yield BatchClient(client, BatchConfig(**{"shape": "per_item", **batch})), seen, bodies
    finally:
        await client.close()
        await runner.cleanup()


async def test_per_item_results_are_read_by_id_and_nonsense_entries_are_no_result() -> None:
    results = {"results": [
        {"id": "a", "status": 200}, {"id": "b", "status": 404}, {"id": "c", "status": True},
        {"id": "d", "status": 999}, {"id": "e", "status": "200"}, "garbage",
        {"id": "f", "status": 429}, {"id": "a", "status": 500},  # a second result for a
        {"id": "zz", "status": 200}]}
    async with partner(results) as (client, seen, bodies):
        got = await client.send(["a", "b", "c", "d", "e", "f"], "bat_1")
    assert got.whole.verdict is Verdict.DELETED
    # a's two results disagree: it has none (held ambiguous and probed, not settled on
    # either).
    assert got.items == {"b": 404, "f": 429}
    assert got.strays == 1  # zz was never sent
    assert got.codes == {}
    assert got.problem is not None
    assert "result 5 has no 'id' string: 'garbage'" in got.problem
    assert "the result for 'c': 'status' is not an HTTP status: True" in got.problem
    assert got.problem.endswith("(and 2 more)")  # e, and a's disagreeing results
    assert seen[0].headers["Idempotency-Key"] == "bat_1"
    assert orjson.loads(bodies[0]) == {"ids": ["a", "b", "c", "d", "e", "f"]}


async def test_a_2xx_that_is_not_the_promised_shape_is_a_problem_not_a_success() -> None:
    for body in (b"<html>ok</html>", orjson.dumps({"results": "all good"}),
                 orjson.dumps([1, 2, 3]), b""):
        async with partner(body) as (client, _, _):
            got = await client.send(["a"], "bat_1")
        assert got.items is None, body
        assert got.problem, body


async def test_ids_in_the_query_or_the_path_are_encoded() -> None:
    async with partner({"results": []}, ids_in="query", method="DELETE",
                       path="/contacts?allOrNone=false") as (client, seen, bodies):
        await client.send(["a b", "c/d"], "bat_1")
    assert seen[0].method == "DELETE"
    assert seen[0].path_qs == "/contacts?allOrNone=false&ids=a%20b,c%2Fd"
    assert bodies[0] == b""
    async with partner({"results": []}, ids_in="path",
                       path="/contacts/{ids}/delete") as (client, seen, _):
        await client.send(["x", "y"], "bat_1")
    assert seen[0].raw_path == "/contacts/x,y/delete"


async def test_a_whole_batch_429_carries_its_retry_after_and_an_absurd_one_is_clamped() -> None:
    async with partner({}, status=429, headers={"Retry-After": "9999999"}) as (client, _, _):
        got = await client.send(["a"], "bat_1")
    assert got.whole.verdict is Verdict.THROTTLED
    assert got.whole.retry_after_s == PartnerConfig().max_retry_after_seconds
    assert got.items is None


async def test_a_job_reference_must_be_a_non_empty_string_or_number() -> None:
    for answer, ref in (({"job_id": "J-1"}, "J-1"), ({"job_id": 42}, "42"),
                        ({"job_id": ""}, None), ({"job_id": True}, None),
                        ({"job_id": {"x": 1}}, None), ({}, None)):
        async with partner(answer, status=202, shape="job") as (client, _, bodies):
            got = await client.send(["a"], "bat_7")
        assert got.job_ref == ref, answer
        assert (got.problem is None) == (ref is not None), answer
        assert orjson.loads(bodies[0]) == {"ids": ["a"], "tag": "bat_7"}


async def test_job_status_reads_progress_and_results_and_a_404_is_gone() -> None:
    running = {"status": "running", "progress": 0.5, "expires_at": 1.8e9}
    async with partner(running, shape="job") as (client, seen, _):
        state = await client.poll("J/1")
    assert (state.done, state.status, state.progress, state.expires_at) == \
        (False, "running", 0.5, 1.8e9)
    assert seen[0].raw_path == "/recipients/batch-jobs/J%2F1"
    done = {"status": "partial_success", "results": [{"id": "a", "status": 200},
                                                     {"id": "b", "status": 422}]}
    async with partner(done, shape="job") as (client, _, _):
        state = await client.poll("J1")
    assert state.done
    assert state.items == {"a": 200, "b": 422}
    async with partner({"error": "not found"}, status=404, shape="job") as (client, _, _):
        assert (await client.poll("J1")).gone
    async with partner(b"nonsense", shape="job") as (client, _, _):
        state = await client.poll("J1")
    assert not state.done
    assert state.problem


async def test_a_lookup_finds_our_tag_or_says_it_cannot_tell() -> None:
    listing = {"jobs": [{"job_id": "J0", "tag": "other"}, {"job_id": "J1", "tag": "bat_9"}]}
    async with partner(listing, shape="job") as (client, seen, _):
        found = await client.lookup("bat_9")
    assert (found.known, found.found, found.job_ref) == (True, True, "J1")
    assert seen[0].path_qs == "/recipients/batch-jobs?tag=bat_9"
    async with partner({"jobs": []}, shape="job") as (client, _, _):
        found = await client.lookup("bat_9")
    assert (found.known, found.found) == (True, False)
    for answer, status in (({"jobs": "none"}, 200), ({}, 500)):
        async with partner(answer, status=status, shape="job") as (client, _, _):
            found = await client.lookup("bat_9")
        assert not found.known, answer
    async with partner({}, shape="job", job_lookup_path="") as (client, seen, _):
        found = await client.lookup("bat_9")
    assert not found.known
    assert seen == []


# -- verdicts that are not HTTP statuses (item_verdict = "success") -------------------


def _failed(code: object, **extra: object) -> dict[str, object]:
    return {"success": False, "errors": [{"statusCode": code, "message": "m", "fields": []}],
            **extra}


async def test_success_verdicts_map_each_code_onto_the_status_the_sender_knows() -> None:
    results = {"results": [
        {"id": "ok", "success": True, "errors": []},
        {"id": "gone", **_failed("ENTITY_IS_DELETED")},
        {"id": "nf", **_failed("NOT_FOUND")},
        {"id": "lock", **_failed("UNABLE_TO_LOCK_ROW")},
        {"id": "limit", **_failed("REQUEST_LIMIT_EXCEEDED")},
        {"id": "bad", **_failed("INVALID_ID_FIELD")},
        {"id": "bare", "success": False},  # no errors at all
        {"id": "null", "success": False, "errors": None},
        {"id": "empty", "success": False, "errors": [{"message": "no code"}]},
        # Several errors: the first code decides.
        {"id": "two", "success": False, "errors": [{"statusCode": "UNABLE_TO_LOCK_ROW"},
                                                   {"statusCode": "INVALID_ID_FIELD"}]}]}
    ids = ["ok", "gone", "nf", "lock", "limit", "bad", "bare", "null", "empty", "two"]
    async with partner(results, item_verdict="success") as (client, _, _):
        got = await client.send(ids, "bat_1")
    assert got.problem is None
    assert got.items == {"ok": 200, "gone": 404, "nf": 404, "lock": 503, "limit": 429,
                         "bad": 422, "bare": 422, "null": 422, "empty": 422, "two": 503}
    assert got.codes == {"gone": "ENTITY_IS_DELETED", "nf": "NOT_FOUND",
                         "lock": "UNABLE_TO_LOCK_ROW", "limit": "REQUEST_LIMIT_EXCEEDED",
                         "bad": "INVALID_ID_FIELD", "two": "UNABLE_TO_LOCK_ROW"}
    # The classes the ledger already has: done, already absent, retried, throttled on
    # its own, failed for good.
    assert {rid: classify(s, None) for rid, s in got.items.items()
            if rid in ("ok", "gone", "lock", "limit", "bad")} == {
        "ok": Verdict.DELETED, "gone": Verdict.ABSENT, "lock": Verdict.TRANSIENT,
        "limit": Verdict.THROTTLED, "bad": Verdict.TERMINAL}


async def test_the_code_lists_and_the_fields_are_the_partners_own() -> None:
    # Firebase-like: missing users count as deleted; a partner with its own field names.
    results = {"outcomes": [
        {"uid": "a", "ok": False, "problems": [{"code": "USER_NOT_FOUND"}]},
        {"uid": "b", "ok": False, "problems": [{"code": "QUOTA_EXCEEDED"}]},
        {"uid": "c", "ok": False, "problems": [{"code": "INTERNAL_ERROR"}]},
        {"uid": "d", "ok": False, "problems": [{"code": "ENTITY_IS_DELETED"}]},
        {"uid": "e", "ok": True}]}
    async with partner(results, item_verdict="success", results_field="outcomes",
                       item_id_field="uid", item_success_field="ok",
                       item_errors_field="problems", item_error_code_field="code",
                       absent_codes=("USER_NOT_FOUND",), throttled_codes=("QUOTA_EXCEEDED",),
                       retry_codes=("INTERNAL_ERROR",)) as (client, _, _):
        got = await client.send(["a", "b", "c", "d", "e"], "bat_1")
    # ENTITY_IS_DELETED is not in this partner's lists: a permanent failure.
    assert got.items == {"a": 404, "b": 429, "c": 503, "d": 422, "e": 200}
    assert got.problem is None


@pytest.mark.parametrize(("entry", "why"), [
    ({"success": "true"}, "'success' is not a boolean: 'true'"),
    ({"success": None}, "'success' is not a boolean: None"),
    ({"success": 1}, "'success' is not a boolean: 1"),
    ({"success": False, "errors": {"statusCode": "X"}}, "'errors' is not an array"),
    ({"success": False, "errors": "ENTITY_IS_DELETED"}, "'errors' is not an array"),
    ({"success": False, "errors": ["ENTITY_IS_DELETED"]}, "'errors' holds a non-object"),
    ({"success": False, "errors": [{"statusCode": 404}]}, "'statusCode' is not a string: 404"),
    ({"success": False, "errors": [{"statusCode": ["X"]}]}, "'statusCode' is not a string"),
])
async def test_a_success_verdict_that_cannot_be_read_is_no_result_and_a_problem(
        entry: dict[str, Any], why: str) -> None:
    results = {"results": [{"id": "a", **entry}, {"id": "b", "success": True}]}
    async with partner(results, item_verdict="success") as (client, _, _):
        got = await client.send(["a", "b"], "bat_1")
    assert got.items == {"b": 200}  # a is held ambiguous, never taken for a success
    assert got.problem is not None
    assert got.problem.startswith(f"the result for 'a': {why}")
    assert ";" not in got.problem  # b's result was fine


async def test_duplicate_results_for_one_id_are_a_problem_and_kept_only_if_they_agree() -> None:
    results = {"results": [
        {"id": "a", "success": True}, {"id": "b", **_failed("ENTITY_IS_DELETED")},
        {"id": "a", "success": True}, {"id": "b", "success": True}]}
    async with partner(results, item_verdict="success") as (client, _, _):
        got = await client.send(["a", "b"], "bat_1")
    assert got.items == {"a": 200}
    assert got.problem == "2 results for 'a'; 2 results for 'b' that disagree: it has none"
    # One of two unreadable: the other alone is not the partner's whole word.
    results = {"results": [{"id": "c", "success": "yes"}, {"id": "c", "success": True}]}
    async with partner(results, item_verdict="success") as (client, _, _):
        got = await client.send(["c"], "bat_1")
    assert got.items == {}
    assert got.problem == ("the result for 'c': 'success' is not a boolean: 'yes'; "
                           "2 results for 'c' that disagree: it has none")


async def test_salesforce_collections_matched_by_position_ids_in_the_query() -> None:
    # sObject Collections delete: DELETE with ids in the query, HTTP 200 whatever each
    # item did, a bare array in request order; failures carry no id (or a null one),
    # and a 15-character id sent comes back in its 18-character form.
    short, long_ = "001RM000003oLrH", "001RM000003oLrHYAU"
    answer = [{"id": long_, "success": True, "errors": []},
              _failed("ENTITY_IS_DELETED"),
              {"id": None, **_failed("REQUEST_LIMIT_EXCEEDED")},
              {"id": "b", "success": True, "errors": []},
              _failed("INVALID_ID_FIELD")]
    async with partner(answer, item_verdict="success", item_order="position",
                       results_field="", method="DELETE", ids_in="query",
                       path="/services/data/v60.0/composite/sobjects?allOrNone=false") as (
            client, seen, _):
        got = await client.send([short, "a", "t", "b", "x"], "bat_1")
    assert seen[0].method == "DELETE"
    assert seen[0].query["ids"] == f"{short},a,t,b,x"
    assert got.problem is None
    assert got.strays == 0
    assert got.items == {short: 200, "a": 404, "t": 429, "b": 200, "x": 422}
    assert got.codes == {"a": "ENTITY_IS_DELETED", "t": "REQUEST_LIMIT_EXCEEDED",
                         "x": "INVALID_ID_FIELD"}


@pytest.mark.parametrize(("answer", "why"), [
    ([{"success": True}] * 2, "2 results for 3 ids sent: not matched by position"),
    ([{"success": True}] * 4, "4 results for 3 ids sent: not matched by position"),
    ([], "0 results for 3 ids sent"),
    ([{"id": "a", "success": True}, {"id": "c", "success": True}, {"id": "b", "success": True}],
     "result 1 names 'c' where 'b' was sent: not in request order"),
])
async def test_position_results_that_do_not_line_up_hold_every_item_ambiguous(
        answer: list[Any], why: str) -> None:
    async with partner({"results": answer}, item_verdict="success",
                       item_order="position") as (client, _, _):
        got = await client.send(["a", "b", "c"], "bat_1")
    assert got.items == {}  # each item: "answered with no result for it", probed
    assert got.problem is not None
    assert why in got.problem


async def test_position_order_reads_status_verdicts_and_nonsense_entries_too() -> None:
    answer = {"results": [{"status": 200}, "garbage", {"id": None, "status": 404}]}
    async with partner(answer, item_order="position") as (client, _, _):
        got = await client.send(["a", "b", "c"], "bat_1")
    assert got.items == {"a": 200, "c": 404}
    assert got.problem == "the result for 'b': not an object: 'garbage'"


async def test_a_finished_jobs_success_verdicts_carry_their_codes() -> None:
    done = {"status": "partial_success", "results": [
        {"id": "a", "success": True}, {"id": "b", **_failed("ENTITY_IS_DELETED")},
        {"id": None, **_failed("INVALID_ID_FIELD")}]}
    async with partner(done, shape="job", item_verdict="success") as (client, _, _):
        state = await client.poll("J1")
    assert state.done
    assert state.items == {"a": 200, "b": 404}
    assert state.codes == {"b": "ENTITY_IS_DELETED"}
    assert state.problem is not None
    assert "result 2 has no 'id' string" in state.problem


async def test_a_bare_array_answer_needs_results_field_empty() -> None:
    answer = [{"id": "a", "success": True}]
    async with partner(answer, item_verdict="success") as (client, _, _):
        got = await client.send(["a"], "bat_1")
    assert (got.items, got.problem) == (None, "no 'results' array in the answer")
    async with partner({"results": answer}, item_verdict="success",
                       results_field="") as (client, _, _):
        got = await client.send(["a"], "bat_1")
    assert (got.items, got.problem) == (None, "no array of results in the answer")
