"""The HTTP API on a real aiohttp server (loopback, port 0) around a real SQLite ledger."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from supervisor import config as config_module
from supervisor.errors import StorageError
from supervisor.http import MAX_INLINE_IDS
from supervisor.model import Settlement
from supervisor.queue.courier import Courier
from supervisor.readcaps import holder_of
from supervisor.states import OpState
from tests.helpers import eventually

from .http_app import AUTH, TOKEN, Api, load_config, running_api

SLOT = "2024-01-01T02:00:00+00:00"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with running_api(load_config(tmp_path)) as running:
        yield running


async def call(api: Api, method: str, path: str, *, body: bytes | None = None,
               headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any]:
    """One request; every answer, error or not, must be JSON without a traceback."""
    async with api.client.request(method, path, data=body, headers=headers, **kw) as resp:
        raw = await resp.read()
        assert resp.content_type == "application/json", (resp.status, raw[:200])
        assert b"Traceback" not in raw
        doc = orjson.loads(raw)
        if resp.status >= 400:
            assert isinstance(doc.get("error"), str)
            assert doc["error"]
        return resp.status, doc


async def tick(api: Api, doc: Any = None, *, headers: dict[str, str] | None = None,
               auth: bool = True) -> tuple[int, Any]:
    hdrs = {"Content-Type": "application/json", **(AUTH if auth else {}), **(headers or {})}
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc if doc is not None else {})
    return await call(api, "POST", "/v1/runs", body=body, headers=hdrs)


def inline(*ids: str, slot: str | None = SLOT, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"recipient_ids": list(ids), **extra}
    if slot is not None:
        doc["scheduled_for"] = slot
    return doc


# -- authentication ------------------------------------------------------------------------


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}", TOKEN, f"Token {TOKEN}",
])
async def test_missing_or_wrong_token_is_401_and_writes_nothing(api: Api, header: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    status, doc = await call(api, "POST", "/v1/runs", body=orjson.dumps(inline("r-1")),
                             headers=headers)
    assert status == 401
    assert doc == {"error": "missing or wrong bearer token"}
    assert await api.counts() == (0, 0, 0)


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN} "])
async def test_right_token_in_any_case_of_scheme(api: Api, header: str) -> None:
    status, _ = await tick(api, inline("r-1"), headers={"Authorization": header})
    assert status == 201


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/run_x", "/v1/runs/run_x/operations",
                                  "/v1/operations/op_x", "/v1/operations?state=ambiguous"])
async def test_every_read_needs_the_token(api: Api, path: str) -> None:
    status, _ = await call(api, "GET", path)
    assert status == 401


async def test_a_non_ascii_authorization_header_is_401_not_500(api: Api) -> None:
    """Header bytes that are not valid UTF-8 must not crash the constant-time compare."""
    port = api.client.port
    assert port is not None
    body = orjson.dumps(inline("r-1"))
    request = (b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer \xff\xfe caf\xc3\xa9\r\nConnection: close\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
        await writer.wait_closed()
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.split()[1] in (b"400", b"401"), answer[:300]
    assert await api.counts() == (0, 0, 0)


async def test_health_needs_no_token(api: Api) -> None:
    assert await call(api, "GET", "/healthz") == (200, {"ok": True})
    status, doc = await call(api, "GET", "/readyz")
    assert status == 200
    assert doc["ready"] is True


# -- body validation ----------------------------------------------------------------------------


async def test_oversized_body_is_413(api: Api) -> None:
    limit = api.state.config.service.max_body_bytes
    big = orjson.dumps(inline(*[f"r-{i:06d}" for i in range(limit // 8)]))
    assert len(big) > limit
    status, doc = await tick(api, big)
    assert status == 413
    assert str(limit) in doc["error"]
    assert await api.counts() == (0, 0, 0)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/jsonx", "multipart/form-data"])
async def test_wrong_content_type_is_415(api: Api, content_type: str) -> None:
    status, _ = await call(api, "POST", "/v1/runs", body=orjson.dumps(inline("r-1")),
                           headers={**AUTH, "Content-Type": content_type})
    assert status == 415
    assert await api.counts() == (0, 0, 0)


async def test_json_content_type_with_charset_is_fine(api: Api) -> None:
    status, _ = await call(api, "POST", "/v1/runs", body=orjson.dumps(inline("r-1")),
                           headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert status == 201


@pytest.mark.parametrize(("body", "fragment"), [
    (b"{", "not valid JSON"),
    (b'{"recipient_ids": ["a",]}', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b'"x"', "must be a JSON object"),
    (b"1", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{"recipient_ids": ["a"], "dry_run": true}', "unknown field(s): dry_run"),
    (b'{"recipient_ids": "a"}', "recipient_ids must be a list"),
    (b'{"recipient_ids": {"a": 1}}', "recipient_ids must be a list"),
    (b'{"recipient_ids": [1]}', "recipient_ids[0] is not a valid ID (not_a_string)"),
    (b'{"recipient_ids": [null]}', "(not_a_string)"),
    (b'{"recipient_ids": [["a"]]}', "(not_a_string)"),
    (b'{"recipient_ids": ["ok", ""]}', "recipient_ids[1] is not a valid ID (empty)"),
    (b'{"recipient_ids": ["a\\u0000b"]}', "(control_character)"),
    (b'{"recipient_ids": ["a\\nb"]}', "(control_character)"),
    (b'{"recipient_ids": ["a\\ud800"]}', "not valid JSON"),  # a lone surrogate
    (b'{"schedule": "", "recipient_ids": ["a"]}', "schedule must be a string"),
    (b'{"schedule": 7, "recipient_ids": ["a"]}', "schedule must be a string"),
    (b'{"schedule": "a\\tb", "recipient_ids": ["a"]}', "schedule must be a string"),
    # One rule for schedule names (L10): what exclusions cannot name is not accepted.
    (b'{"schedule": "weekly ", "recipient_ids": ["a"]}', "schedule must be a string"),
    (b'{"schedule": "w\\u00f6chentlich", "recipient_ids": ["a"]}', "schedule must be a string"),
    (b'{"schedule": "a@b", "recipient_ids": ["a"]}', "schedule must be a string"),
    (b'{"scheduled_for": "yesterday", "recipient_ids": ["a"]}', "ISO 8601"),
    (b'{"scheduled_for": "2024-01-01T02:00:00", "recipient_ids": ["a"]}', "UTC offset"),
    (b'{"scheduled_for": true, "recipient_ids": ["a"]}', "ISO 8601"),
    (b'{"scheduled_for": 1e300, "recipient_ids": ["a"]}', "out of range"),
    (b'{}', "recipient_ids is required"),
])
async def test_malformed_ticks_are_400_and_write_nothing(api: Api, body: bytes,
                                                         fragment: str) -> None:
    status, doc = await tick(api, body)
    assert status == 400, doc
    assert fragment in doc["error"]
    assert await api.counts() == (0, 0, 0)


async def test_a_10_kb_recipient_id_is_400(api: Api) -> None:
    status, doc = await tick(api, inline("ok", "x" * 10_240))
    assert (status, doc["error"]) == (400, "recipient_ids[1] is not a valid ID (too_long)")


async def test_too_many_inline_ids_is_400(api: Api, tmp_path: Path) -> None:
    async with running_api(load_config(tmp_path / "big", service__max_body_bytes="4000000")) as big:
        status, doc = await tick(big, inline(*[f"r{i}" for i in range(MAX_INLINE_IDS + 1)]))
        assert status == 400
        assert "more than" in doc["error"]


@pytest.mark.parametrize("slot", [
    "0001-01-01T00:00:00+01:00",  # a valid ISO time whose UTC instant is before year 1
    "9999-12-31T23:59:59-01:00",  # ... or after year 9999
    -1e15,
])
async def test_a_slot_outside_the_representable_range_is_400(api: Api, slot: Any) -> None:
    status, doc = await tick(api, inline("r-1", slot=slot))
    assert status == 400, doc
    assert await api.counts() == (0, 0, 0)


@pytest.mark.parametrize("key", ["", "x" * 201, "caf\u00e9", "a b"])
async def test_bad_idempotency_key_is_400(api: Api, key: str) -> None:
    status, _ = await tick(api, inline("r-1", slot=None),
                           headers={"Idempotency-Key": key.encode().decode("latin-1")})
    assert status == 400
    assert await api.counts() == (0, 0, 0)


# -- opening runs ---------------------------------------------------------------------------


async def test_a_repeated_tick_is_201_then_200_with_the_same_run(api: Api) -> None:
    status, first = await tick(api, inline("r-1", "r-2"))
    assert status == 201
    assert first["created"] is True
    assert first["run"]["state"] == "scanning"
    assert first["run"]["tick_key"] == f"weekly@{SLOT}"
    assert api.scan_wakeup.is_set()  # the scanner is woken for a new run
    status, again = await tick(api, inline("r-1", "r-2"))
    assert status == 200
    assert again["created"] is False
    assert again["run"]["id"] == first["run"]["id"]
    assert (await api.counts())[0] == 1


async def test_the_same_slot_in_another_notation_is_the_same_tick(api: Api) -> None:
    _, first = await tick(api, inline("r-1", slot="2024-01-01T03:00:00+01:00"))
    status, again = await tick(api, inline("r-1", slot=SLOT))
    _, unix = await tick(api, inline("r-1", slot=1704074400))  # type: ignore[arg-type]
    assert status == 200
    assert again["run"]["id"] == first["run"]["id"] == unix["run"]["id"]


async def test_idempotency_key_dedupes_a_tick_without_a_slot(api: Api) -> None:
    s1, first = await tick(api, inline("r-1", slot=None), headers={"Idempotency-Key": "cron-42"})
    s2, again = await tick(api, inline("r-1", slot=None), headers={"Idempotency-Key": "cron-42"})
    assert (s1, s2) == (201, 200)
    assert again["run"]["id"] == first["run"]["id"]
    assert first["run"]["tick_key"] == "weekly#cron-42"


async def test_an_unkeyed_retry_returns_the_recent_run(api: Api) -> None:
    s1, first = await tick(api, inline("r-1", slot=None))
    s2, again = await tick(api, inline("r-1", slot=None))
    assert (s1, s2) == (201, 200)
    assert again["run"]["id"] == first["run"]["id"]


async def test_overlap_is_409_with_the_active_run(api: Api) -> None:
    _, first = await tick(api, inline("r-1"))
    before = await api.counts()
    status, doc = await tick(api, inline("r-2", slot="2024-01-08T02:00:00+00:00"))
    assert status == 409
    assert doc["active_run"] == first["run"]["id"]
    assert await api.counts() == before


async def test_overlap_allow_opens_a_second_run(tmp_path: Path) -> None:
    async with running_api(load_config(tmp_path, schedule__overlap="allow")) as api:
        assert (await tick(api, inline("r-1")))[0] == 201
        assert (await tick(api, inline("r-1", slot="2024-01-08T02:00:00+00:00")))[0] == 201


async def test_not_accepting_is_503(api: Api) -> None:
    api.state.accepting = False
    status, doc = await tick(api, inline("r-1"))
    assert status == 503
    assert "shutting down" in doc["error"]
    assert await api.counts() == (0, 0, 0)
    # Authentication still comes first: no information for a caller without the token.
    assert (await tick(api, inline("r-1"), auth=False))[0] == 401


async def test_http_source_needs_no_ids(tmp_path: Path) -> None:
    async with running_api(load_config(tmp_path, source__kind="http",
                                       source__url="http://127.0.0.1:9/c")) as api:
        status, doc = await tick(api, {"scheduled_for": SLOT})
        assert status == 201
        run = await api.ledger.get_run(doc["run"]["id"])
        assert run is not None
        assert run.source == {"kind": "http"}


# -- reading runs and operations ---------------------------------------------------------------


async def _run_with_operations(api: Api, n: int) -> str:
    ids = [f"r-{i:03d}" for i in range(n)]
    _, doc = await tick(api, inline(*ids))
    run_id: str = doc["run"]["id"]
    # What the scanner does with the inline source: one committed page.
    await api.ledger.record_page(run_id, ids, None, 0)
    return run_id


async def test_operations_page_with_after_and_next_after(api: Api) -> None:
    run_id = await _run_with_operations(api, 7)
    seen: list[str] = []
    after = ""
    pages = 0
    while True:
        status, doc = await call(api, "GET", f"/v1/runs/{run_id}/operations",
                                 params={"limit": "3", "after": str(after)}, headers=AUTH)
        assert status == 200
        pages += 1
        seen += [op["recipient_id"] for op in doc["operations"]]
        if doc["next_after"] is None:
            break
        after = doc["next_after"]
    assert seen == [f"r-{i:03d}" for i in range(7)]
    assert pages == 3
    op = doc["operations"][-1]
    assert set(op) == {"id", "run_id", "recipient_id", "state", "attempts", "reason",
                       "created_at", "updated_at"}
    assert op["state"] == "discovered"


async def test_operations_filtered_by_state(api: Api) -> None:
    run_id = await _run_with_operations(api, 3)
    batch = await api.ledger.unpublished(1)
    await Courier(api.ledger, api.queue).publish(batch)
    status, doc = await call(api, "GET", f"/v1/runs/{run_id}/operations",
                             params={"state": "queued"}, headers=AUTH)
    assert status == 200
    assert [op["id"] for op in doc["operations"]] == [batch[0].operation_id]
    assert doc["next_after"] is None
    status, doc = await call(api, "GET", "/v1/operations", params={"state": "discovered"},
                             headers=AUTH)
    assert status == 200
    assert len(doc["operations"]) == 2


@pytest.mark.parametrize("query", [{"state": "gone"}, {"limit": "0"}, {"limit": "1001"},
                                   {"limit": "x"}, {"after": "op_1;"}, {"after": "x" * 201}])
async def test_bad_operation_queries_are_400(api: Api, query: dict[str, str]) -> None:
    run_id = await _run_with_operations(api, 1)
    status, _ = await call(api, "GET", f"/v1/runs/{run_id}/operations", params=query,
                           headers=AUTH)
    assert status == 400


async def test_unknown_run_and_operation_are_404(api: Api) -> None:
    for path in ("/v1/runs/run_nope", "/v1/runs/run_nope/operations", "/v1/operations/op_nope"):
        status, doc = await call(api, "GET", path, headers=AUTH)
        assert status == 404, path
        assert "nope" in doc["error"]


async def test_unknown_route_and_method_are_json(api: Api) -> None:
    assert (await call(api, "GET", "/nope", headers=AUTH))[0] == 404
    assert (await call(api, "DELETE", "/v1/runs", headers=AUTH))[0] == 405


async def test_run_view_and_list(api: Api) -> None:
    run_id = await _run_with_operations(api, 2)
    status, doc = await call(api, "GET", f"/v1/runs/{run_id}", headers=AUTH)
    assert status == 200
    assert doc["id"] == run_id
    assert doc["state"] == "draining"
    assert doc["discovered"] == 2
    assert doc["counts"]["discovered"] == 2
    assert doc["unfinished"] == 2
    status, listed = await call(api, "GET", "/v1/runs", headers=AUTH)
    assert status == 200
    assert [r["id"] for r in listed["runs"]] == [run_id]


async def test_operation_view_with_attempts(api: Api) -> None:
    await _run_with_operations(api, 1)
    [message] = await api.ledger.unpublished(1)
    attempt = await api.ledger.begin_attempt(message.operation_id, "delete")
    await api.ledger.settle([Settlement(message.operation_id, OpState.DELETED, None,
                                        attempt_id=attempt, status=204, outcome="deleted",
                                        detail="HTTP 204")])
    status, doc = await call(api, "GET", f"/v1/operations/{message.operation_id}", headers=AUTH)
    assert status == 200
    assert doc["state"] == "deleted"
    assert [(a["n"], a["status"], a["outcome"]) for a in doc["attempts_log"]] == [
        (1, 204, "deleted")]


async def test_attempts_log_is_paged(api: Api) -> None:
    """An operation probed for weeks has hundreds of rows: a page of them, and a cursor."""
    await _run_with_operations(api, 1)
    [message] = await api.ledger.unpublished(1)
    op_id = message.operation_id
    attempt = await api.ledger.begin_attempt(op_id, "delete")
    await api.ledger.settle([Settlement(op_id, OpState.AMBIGUOUS, None, attempt_id=attempt,
                                        outcome="ambiguous")])
    for i in range(6):
        await api.ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                         f"inconclusive {i}")
    details: list[str | None] = []
    after: str | None = "0"
    pages = 0
    while after is not None:
        status, doc = await call(api, "GET", f"/v1/operations/{op_id}", headers=AUTH,
                                 params={"attempts_limit": "3", "attempts_after": after})
        assert status == 200
        assert len(doc["attempts_log"]) <= 3
        details += [a["detail"] for a in doc["attempts_log"]]
        after, pages = doc["attempts_next"], pages + 1
    assert pages == 3
    assert details == [None, *[f"inconclusive {i}" for i in range(6)]]
    status, doc = await call(api, "GET", f"/v1/operations/{op_id}", headers=AUTH)
    assert (len(doc["attempts_log"]), doc["attempts_next"]) == (7, None)  # default: 100
    for query in ({"attempts_limit": "0"}, {"attempts_limit": "1001"},
                  {"attempts_after": "-1"}, {"attempts_after": "x"}):
        status, doc = await call(api, "GET", f"/v1/operations/{op_id}", headers=AUTH,
                                 params=query)
        assert status == 400, query
        assert next(iter(query)) in doc["error"]


# -- long-poll ---------------------------------------------------------------------------------


async def test_wait_done_returns_when_the_run_finishes(api: Api) -> None:
    run_id = await _run_with_operations(api, 0)
    started = time.monotonic()
    request = asyncio.create_task(call(api, "GET", f"/v1/runs/{run_id}",
                                       params={"wait": "done", "timeout": "30"}, headers=AUTH))
    done, _ = await asyncio.wait({request}, timeout=0.2)
    assert not done  # long-polling: the run is still draining
    assert await api.ledger.finish_runs() == [run_id]
    # The monitor notifies after every pass; keep doing what it does until the handler,
    # whose wait may have begun after a notification, has seen one.
    while not request.done():
        await api.notify_runs_changed()
        await asyncio.wait({request}, timeout=0.05)
    status, doc = await request
    assert status == 200
    assert doc["state"] == "done"
    assert doc["finished_at"] is not None
    assert time.monotonic() - started < 10  # woken by the notification, not the 30 s timeout


async def test_wait_done_times_out_with_the_current_state(api: Api) -> None:
    run_id = await _run_with_operations(api, 1)
    status, doc = await call(api, "GET", f"/v1/runs/{run_id}",
                             params={"wait": "done", "timeout": "0"}, headers=AUTH)
    assert (status, doc["state"]) == (200, "draining")


async def test_wait_done_on_a_done_run_returns_at_once(api: Api) -> None:
    run_id = await _run_with_operations(api, 0)
    await api.ledger.finish_runs()
    status, doc = await call(api, "GET", f"/v1/runs/{run_id}",
                             params={"wait": "done", "timeout": "60"}, headers=AUTH)
    assert (status, doc["state"]) == (200, "done")


async def test_many_long_polls_on_one_run_cost_one_read_per_monitor_pass(tmp_path: Path) -> None:
    """Issue 17, M7: a waiter reads nothing itself; the monitor reads each watched run once
    per pass for all of them (it used to be one read per waiter per notification)."""
    async with running_api(load_config(tmp_path, api__max_long_polls_per_token="200",
                                       api__max_long_polls="200")) as api:
        run_id = await _run_with_operations(api, 1)
        polls = [asyncio.create_task(call(api, "GET", f"/v1/runs/{run_id}", headers=AUTH,
                                          params={"wait": "done", "timeout": "30"}))
                 for _ in range(90)]  # the test client holds at most 100 connections
        await eventually(lambda: api.state.long_polls.held == 90, within_s=10.0, every_s=0.005)
        before = api.db.reads
        for _ in range(20):
            await api.notify_runs_changed()
            for _ in range(5):  # let every waiter wake and look again
                await asyncio.sleep(0)
        # One read of the run per pass, and its counts once (reused within a second).
        assert api.db.reads - before <= 20 + 2, api.db.reads - before
        assert not any(p.done() for p in polls)
        [message] = await api.ledger.unpublished(1)
        attempt = await api.ledger.begin_attempt(message.operation_id, "delete")
        await api.ledger.settle([Settlement(message.operation_id, OpState.DELETED, None,
                                            attempt_id=attempt, outcome="deleted")])
        assert await api.ledger.finish_runs() == [run_id]
        before = api.db.reads
        while not all(p.done() for p in polls):
            await api.notify_runs_changed()
            await asyncio.wait(polls, timeout=0.05)
        answers = [await p for p in polls]
        assert {(status, doc["state"], doc["counts"]["deleted"], doc["unfinished"])
                for status, doc in answers} == {(200, "done", 1, 0)}
        # The run read again and counted once more (it is done now), for all 90.
        assert api.db.reads - before <= 2 * 3, api.db.reads - before
        assert api.state.long_polls.held == 0
        assert api.state.runs_changed.watched() == []


async def test_long_polls_are_capped_per_token_and_in_all_with_retry_after(
        tmp_path: Path) -> None:
    viewer = "viewer-token-for-the-read-caps-test-0123456789"
    cfg = config_module.load(None, environ={
        "CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_STATUS_TOKEN": viewer,
        "CLEANUP__SERVICE__DATA_DIR": str(tmp_path), "CLEANUP__API__MAX_LONG_POLLS": "3",
        "CLEANUP__API__MAX_LONG_POLLS_PER_TOKEN": "2"})
    as_viewer = {"Authorization": f"Bearer {viewer}"}
    async with running_api(cfg) as api:
        run_id = await _run_with_operations(api, 1)
        path, wait = f"/v1/runs/{run_id}", {"wait": "done", "timeout": "30"}

        def poll(headers: dict[str, str]) -> asyncio.Task[tuple[int, Any]]:
            return asyncio.create_task(call(api, "GET", path, headers=headers, params=wait))

        held = [poll(AUTH), poll(AUTH)]
        await eventually(lambda: api.state.long_polls.held == 2, within_s=10.0, every_s=0.005)
        async with api.client.get(path, headers=AUTH, params=wait) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "5"
            assert "for this token" in (await resp.json())["error"]
        # Not waiting is never capped, nor is another token below the total.
        assert (await call(api, "GET", path, headers=AUTH))[0] == 200
        held.append(poll(as_viewer))
        await eventually(lambda: api.state.long_polls.held == 3, within_s=10.0, every_s=0.005)
        async with api.client.get(path, headers=as_viewer, params=wait) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "5"
            assert "in all" in (await resp.json())["error"]
        assert not any(p.done() for p in held)  # the refused ones took no one's place
        [message] = await api.ledger.unpublished(1)
        attempt = await api.ledger.begin_attempt(message.operation_id, "delete")
        await api.ledger.settle([Settlement(message.operation_id, OpState.DELETED, None,
                                            attempt_id=attempt, outcome="deleted")])
        await api.ledger.finish_runs()
        while not all(p.done() for p in held):
            await api.notify_runs_changed()
            await asyncio.wait(held, timeout=0.05)
        assert [(await p)[0] for p in held] == [200, 200, 200]
        assert api.state.long_polls.held == 0  # released: the next one is answered
        assert (await call(api, "GET", path, headers=AUTH, params=wait))[0] == 200


async def test_exclusions_reads_are_capped_with_retry_after(tmp_path: Path) -> None:
    async with running_api(load_config(tmp_path, api__max_exclusion_reads="4",
                                       api__max_exclusion_reads_per_token="1")) as api:
        await _run_with_operations(api, 3)
        path = "/v1/exclusions?schedule=weekly"
        # A read of this token already held open (a stream being written).
        with api.state.exclusion_reads.hold(holder_of(AUTH["Authorization"])):
            for fmt in ("json", "jsonl"):
                async with api.client.get(f"{path}&format={fmt}", headers=AUTH) as resp:
                    assert resp.status == 429
                    assert resp.headers["Retry-After"] == "5"
                    assert "exclusions reads" in (await resp.json())["error"]
        status, doc = await call(api, "GET", path, headers=AUTH)
        assert status == 200
        assert len(doc["exclusions"]) == 3
        assert api.state.exclusion_reads.held == 0


@pytest.mark.parametrize("query", [{"wait": "forever"}, {"wait": "done", "timeout": "61"},
                                   {"wait": "done", "timeout": "-1"}])
async def test_bad_wait_is_400(api: Api, query: dict[str, str]) -> None:
    run_id = await _run_with_operations(api, 0)
    assert (await call(api, "GET", f"/v1/runs/{run_id}", params=query, headers=AUTH))[0] == 400


def test_port_zero_binds_loopback_only() -> None:
    # Guard for the fixtures above: they never listen beyond 127.0.0.1.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[0] == "127.0.0.1"


async def test_an_unhealthy_ledger_refuses_triggers_with_503(api: Api) -> None:
    async def broken(conn: Any) -> None:
        await conn.execute("INSERT INTO no_such_table VALUES (1)")

    with pytest.raises(StorageError):
        await api.db.write(broken)
    status, doc = await tick(api, inline("r-1"))
    assert status == 503
    assert "ledger" in doc["error"]
    assert await api.counts() == (0, 0, 0)


async def test_a_read_the_ledger_cannot_answer_is_503_not_500(api: Api) -> None:
    # The reader connection gone (the file's database away): the client asked nothing
    # wrong and may ask again.
    assert api.db._reader is not None
    await api.db._reader.close()
    status, doc = await call(api, "GET", "/v1/runs", headers=AUTH)
    assert status == 503, doc
    assert "ledger" in doc["error"]
