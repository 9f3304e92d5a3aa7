"""BatchClient (supervisor/batch/client.py) against partners answering what real partners
and middleboxes send: the simulator for the request's shape, and a loopback server for
nonsense (bodies that are not JSON, results that are not a list, statuses that are not
statuses, results for ids never sent, a job reference that is not one). Nonsense never
raises and never reads as success: an item without a readable result has none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web

from supervisor.batch.client import BatchClient
from supervisor.batchsettings import BatchConfig
from supervisor.config import PartnerConfig
from supervisor.partner import PartnerClient, Verdict


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
    assert got.items == {"a": 200, "b": 404, "f": 429}  # the first result for a kept
    assert got.strays == 1  # zz was never sent
    assert got.problem is None
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
