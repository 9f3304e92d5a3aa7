"""The partner API simulator, exercised over real loopback HTTP.

Synchronisation goes through /_sandbox/wait or the in-process state, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cleanup_sandbox import RunningSandbox, SandboxConfig, SandboxState, run_sandbox
from cleanup_sandbox.__main__ import main as cli_main
from cleanup_sandbox.limits import FixedWindow, TokenBucket

REPO_ROOT = Path(__file__).resolve().parents[2]
VALID_ID = re.compile(r"r-\d{6}")


@contextlib.asynccontextmanager
async def sandbox(**overrides: Any) -> AsyncIterator[tuple[RunningSandbox, aiohttp.ClientSession]]:
    async with (
        run_sandbox(SandboxConfig(**overrides)) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield running, http


async def delete(
    http: aiohttp.ClientSession, recipient_id: str, key: str | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    if key is not None:
        headers["Idempotency-Key"] = key
    async with http.delete(f"/recipients/{recipient_id}", headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def get_json(http: aiohttp.ClientSession, path: str, **headers: str) -> tuple[int, Any]:
    async with http.get(path, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def control(http: aiohttp.ClientSession, **changes: object) -> tuple[int, Any]:
    async with http.post("/_sandbox/control", data=orjson.dumps(changes)) as resp:
        return resp.status, orjson.loads(await resp.read())


def absent_ids(state: SandboxState) -> list[str]:
    return [rid for rid in state.population if not state.is_present(rid)]


# -- auth and the basic delete contract ----------------------------------------------


async def test_token_is_required_except_on_sandbox_endpoints() -> None:
    async with sandbox(token="s3cret") as (running, http):
        status, headers, body = await delete(http, "r-000001")
        assert status == 401
        assert headers["WWW-Authenticate"] == "Bearer"
        assert orjson.loads(body)["error"] == "unauthorized"
        status, _, _ = await delete(http, "r-000001", Authorization="Bearer wrong")
        assert status == 401
        status, _ = await get_json(http, "/recipients/r-000001")
        assert status == 401
        status, _ = await get_json(http, "/stale-recipients")
        assert status == 401

        status, stats = await get_json(http, "/_sandbox/stats")
        assert status == 200
        assert stats["unauthorized"] == 2
        assert stats["executions"] == 0
        assert running.state.is_present("r-000001")

        status, _, _ = await delete(http, "r-000001", Authorization="Bearer s3cret")
        assert status == 204


async def test_second_delete_without_key_is_a_duplicate_execution() -> None:
    async with sandbox() as (running, http):
        assert (await delete(http, "r-000001"))[0] == 204
        status, _, body = await delete(http, "r-000001")
        assert status == 404
        assert orjson.loads(body) == {"error": "not_found", "id": "r-000001"}

        stats = running.state.stats()
        assert stats["executions"] == 2
        assert stats["duplicates"] == 1
        assert stats["deleted"] == 1
        assert stats["absent_answers"] == 1
        assert [e.result for e in running.state.log] == ["deleted", "absent"]


async def test_absent_and_unknown_recipients_answer_404_and_probe_agrees() -> None:
    async with sandbox() as (running, http):
        gone = absent_ids(running.state)[0]
        assert (await delete(http, gone))[0] == 404
        assert (await delete(http, "not-a-listed-id"))[0] == 404
        present = next(rid for rid in running.state.population if running.state.is_present(rid))
        assert await get_json(http, f"/recipients/{present}") == (200, {"id": present})
        assert (await get_json(http, f"/recipients/{gone}"))[0] == 404
        assert running.state.stats()["duplicates"] == 0


# -- idempotency -----------------------------------------------------------------------


async def test_same_key_replays_the_first_response_without_executing() -> None:
    async with sandbox() as (running, http):
        gone = absent_ids(running.state)[0]
        first = await delete(http, "r-000001", key="k-1")
        second = await delete(http, "r-000001", key="k-1")
        assert first[0] == second[0] == 204
        assert "Idempotent-Replayed" not in first[1]
        assert second[1]["Idempotent-Replayed"] == "true"

        first = await delete(http, gone, key="k-2")
        second = await delete(http, gone, key="k-2")
        assert first[0] == second[0] == 404
        assert first[2] == second[2]

        stats = running.state.stats()
        assert stats["replays"] == 2
        assert stats["executions"] == 2
        assert stats["duplicates"] == 0


async def test_key_still_in_progress_answers_409() -> None:
    # The latency holds the first request inside the handler after it claimed the key.
    async with sandbox(latency_ms=800) as (running, http):
        first = asyncio.create_task(delete(http, "r-000001", key="k-held"))
        status, _ = await get_json(http, "/_sandbox/wait?requests=1&timeout=10")
        assert status == 200
        assert running.state.idempotency.in_progress("k-held")

        status, _, body = await delete(http, "r-000001", key="k-held")
        assert status == 409
        assert orjson.loads(body)["error"] == "idempotency_key_in_use"

        assert (await first)[0] == 204
        stats = running.state.stats()
        assert stats["executions"] == 1
        assert stats["conflicts"] == 1


async def test_requests_log_shows_what_was_in_the_air_at_once() -> None:
    # Two DELETEs of one recipient overlap (the first held by the latency); one of
    # another recipient does not overlap with either.
    async with sandbox(latency_ms=500) as (running, http):
        first = asyncio.create_task(delete(http, "r-000001", key="k-1"))
        status, _ = await get_json(http, "/_sandbox/wait?requests=1&timeout=10")
        assert status == 200
        second = asyncio.create_task(delete(http, "r-000001", key="k-1"))
        other = asyncio.create_task(delete(http, "r-000002", key="k-2"))
        statuses = sorted(r[0] for r in await asyncio.gather(first, second, other))
        assert statuses == [204, 204, 409]
        status, entries = await get_json(http, "/_sandbox/requests")
        assert status == 200
        assert sorted((e["recipient_id"], e["overlapping"]) for e in entries) == [
            ("r-000001", 0), ("r-000001", 1), ("r-000002", 0)]
        assert all(e["answered"] >= e["arrived"] for e in entries)
        assert sorted(e["status"] for e in entries) == [204, 204, 409]
        assert running.state.stats()["overlapping_requests"] == 1
        status, rest = await get_json(http, "/_sandbox/requests?since=2")
        assert [e["seq"] for e in rest] == [3]


async def test_key_reused_for_another_recipient_answers_422() -> None:
    async with sandbox() as (running, http):
        assert (await delete(http, "r-000001", key="k-1"))[0] == 204
        status, _, body = await delete(http, "r-000002", key="k-1")
        assert status == 422
        assert orjson.loads(body)["error"] == "idempotency_key_reused"
        assert running.state.executions_of("r-000002") == 0
        assert running.state.stats()["executions"] == 1


async def test_keys_are_ignored_but_logged_when_idempotency_is_off() -> None:
    async with sandbox(honour_idempotency_keys=False) as (running, http):
        assert (await delete(http, "r-000001", key="k-1"))[0] == 204
        assert (await delete(http, "r-000001", key="k-1"))[0] == 404
        stats = running.state.stats()
        assert (stats["replays"], stats["executions"], stats["duplicates"]) == (0, 2, 1)
        assert [e.idempotency_key for e in running.state.log] == ["k-1", "k-1"]


async def test_oversized_key_is_rejected_without_executing() -> None:
    async with sandbox() as (running, http):
        assert (await delete(http, "r-000001", key="k" * 256))[0] == 400
        assert running.state.stats()["executions"] == 0


# -- rate limiting and storms ----------------------------------------------------------


async def test_bucket_overflow_answers_429_with_retry_after_seconds() -> None:
    async with sandbox(rate_per_second=1, burst=1) as (running, http):
        assert (await delete(http, "r-000001"))[0] == 204
        status, headers, body = await delete(http, "r-000002")
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert orjson.loads(body)["error"] == "rate_limited"
        stats = running.state.stats()
        assert stats["rate_limited"] == 1
        assert stats["executions"] == 1
        assert stats["max_rate_observed_1s"] == 2


async def test_bucket_overflow_answers_429_with_retry_after_http_date() -> None:
    async with sandbox(rate_per_second=1, burst=1, retry_after_format="http-date") as (_, http):
        assert (await delete(http, "r-000001"))[0] == 204
        status, headers, _ = await delete(http, "r-000002")
        assert status == 429
        retry_at = parsedate_to_datetime(headers["Retry-After"])
        now = datetime.now(UTC)
        assert now <= retry_at + timedelta(seconds=1)
        assert retry_at <= now + timedelta(seconds=3)


async def test_ratelimit_headers_advertise_the_quota() -> None:
    async with sandbox(rate_per_second=1, burst=2, ratelimit_headers=True) as (_, http):
        _, headers, _ = await delete(http, "r-000001")
        assert headers["RateLimit-Policy"] == '"default";q=2;w=2'
        assert headers["RateLimit"].startswith('"default";r=1;t=')
        await delete(http, "r-000002")
        status, headers, _ = await delete(http, "r-000003")
        assert status == 429
        assert headers["RateLimit"].startswith('"default";r=0;t=')


async def test_minute_window_counts_requests_per_fixed_minute() -> None:
    async with sandbox(rate_per_second=2 / 60, window="minute") as (running, http):
        assert (await delete(http, "r-000001"))[0] == 204
        assert (await delete(http, "r-000002"))[0] == 204
        status, headers, _ = await delete(http, "r-000003")
        assert status == 429
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert running.state.stats()["rate_limited"] == 1


async def test_pause_storm_answers_429_and_counts_requests_during_pause() -> None:
    async with sandbox() as (running, http):
        status, snapshot = await control(http, pause_seconds=30)
        assert status == 200
        assert snapshot["pause_remaining"] > 29
        status, headers, body = await delete(http, "r-000001")
        assert status == 429
        assert headers["Retry-After"] in {"29", "30"}
        assert orjson.loads(body)["error"] == "paused"
        stats = running.state.stats()
        assert stats["requests_during_pause"] == 1
        assert stats["rate_limited"] == 1
        assert stats["executions"] == 0

        assert (await control(http, pause_seconds=0))[0] == 200
        assert (await delete(http, "r-000001"))[0] == 204
        assert running.state.stats()["requests_during_pause"] == 1


async def test_control_changes_limits_and_rejects_bad_input() -> None:
    async with sandbox(rate_per_second=1, burst=1) as (running, http):
        assert (await control(http, rate_per_second=0))[0] == 200
        for i in range(1, 6):
            assert (await delete(http, f"r-00000{i}"))[0] in {204, 404}
        assert running.state.stats()["rate_limited"] == 0

        assert (await control(http, fault_5xx=2))[0] == 400
        assert (await control(http, bogus=1))[0] == 400
        assert (await control(http, fault_5xx=True))[0] == 400
        assert (await control(http, rate_per_second=5, burst=0.5))[0] == 400
        async with http.post("/_sandbox/control", data=b"{nope") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"] == "invalid_json"
        assert running.state.tunables.fault_5xx == 0.0


# -- faults ----------------------------------------------------------------------------


async def test_injected_5xx_happens_before_acting_and_is_not_stored() -> None:
    async with sandbox(fault_5xx=1.0) as (running, http):
        assert (await delete(http, "r-000001", key="k-1"))[0] == 503
        assert running.state.stats()["executions"] == 0
        assert (await control(http, fault_5xx=0))[0] == 200
        status, headers, _ = await delete(http, "r-000001", key="k-1")
        assert status == 204
        assert "Idempotent-Replayed" not in headers
        assert running.state.stats()["replays"] == 0


async def test_timeout_after_act_executes_then_hangs_and_retry_replays() -> None:
    async with sandbox(fault_timeout_after_act=1.0, hang_seconds=30) as (running, http):
        hung = asyncio.create_task(delete(http, "r-000001", key="k-1"))
        status, stats = await get_json(http, "/_sandbox/wait?executions=1&timeout=10")
        assert status == 200
        assert stats["deleted"] == 1
        assert not hung.done()

        assert (await control(http, fault_timeout_after_act=0))[0] == 200
        status, headers, _ = await delete(http, "r-000001", key="k-1")
        assert status == 204
        assert headers["Idempotent-Replayed"] == "true"
        assert running.state.log[0].fault == "timeout"
        hung.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hung


async def test_reset_after_act_executes_then_drops_the_connection() -> None:
    async with sandbox(fault_reset_after_act=1.0) as (running, http):
        with pytest.raises(aiohttp.ClientConnectionError):
            await delete(http, "r-000001")
        # aiohttp silently retries a DELETE once after a dropped connection, so a
        # key-less client hits the partner twice: exactly what the sandbox must expose.
        assert running.state.executions_of("r-000001") == 2
        assert running.state.stats()["duplicates"] == 1

        status, headers, _ = await delete(http, "r-000002", key="k-2")
        assert (status, headers["Idempotent-Replayed"]) == (204, "true")
        assert running.state.executions_of("r-000002") == 1


async def test_fault_draws_are_seeded() -> None:
    def outcomes(seed: int) -> list[bool]:
        state = SandboxState(SandboxConfig(seed=seed, fault_5xx=0.5))
        return [state.plan_faults().fail_before for _ in range(64)]

    assert outcomes(7) == outcomes(7)
    assert outcomes(7) != outcomes(8)


# -- paging ----------------------------------------------------------------------------


async def collect_pages(http: aiohttp.ClientSession, limit: int) -> tuple[list[Any], list[str]]:
    items: list[Any] = []
    cursors: list[str] = []
    cursor: str | None = None
    while True:
        query = f"/stale-recipients?limit={limit}" + (f"&cursor={cursor}" if cursor else "")
        status, page = await get_json(http, query)
        assert status == 200
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return items, cursors
        cursors.append(cursor)


async def test_paging_covers_every_stale_id_once_and_is_stable() -> None:
    async with sandbox(recipients=1234) as (running, http):
        items, cursors = await collect_pages(http, 100)
        ids = [item["id"] for item in items]
        assert ids == running.state.population
        assert len(set(ids)) == 1234
        assert ids[0] == "r-000001"
        assert len(cursors) == 12
        assert running.state.stats()["pages_served"] == 13

        # Same cursor, same page, even after deletions in between.
        _, before = await get_json(http, f"/stale-recipients?limit=100&cursor={cursors[3]}")
        await delete(http, before["items"][0]["id"])
        _, after = await get_json(http, f"/stale-recipients?limit=100&cursor={cursors[3]}")
        assert before == after

        _, default_page = await get_json(http, "/stale-recipients")
        assert len(default_page["items"]) == 500
        _, clamped = await get_json(http, "/stale-recipients?limit=99999")
        assert len(clamped["items"]) == 1234
        assert clamped["next_cursor"] is None
        assert (await get_json(http, "/stale-recipients?cursor=!!bogus"))[0] == 400
        assert (await get_json(http, "/stale-recipients?limit=0"))[0] == 400


async def test_garbage_share_adds_garbage_without_replacing_real_ids() -> None:
    async with sandbox(recipients=500, garbage_share=0.2) as (running, http):
        items, _ = await collect_pages(http, 64)
        assert len(items) == 600
        valid = [
            item["id"]
            for item in items
            if isinstance(item, dict)
            and isinstance(item.get("id"), str)
            and VALID_ID.fullmatch(item["id"])
        ]
        assert valid == running.state.population
        assert running.state.stats()["garbage_listed"] == 100
        garbage = [
            item for item in items if not isinstance(item, dict) or item.get("id") not in valid
        ]
        assert len(garbage) == 100
        assert any(isinstance(g, dict) and g.get("id") is None for g in garbage)

    again = SandboxState(SandboxConfig(recipients=500, garbage_share=0.2))
    assert again.listing == items


def test_population_is_seeded() -> None:
    first = SandboxState(SandboxConfig())
    assert absent_ids(first) == absent_ids(SandboxState(SandboxConfig()))
    assert absent_ids(first) != absent_ids(SandboxState(SandboxConfig(seed=8)))
    assert len(absent_ids(first)) == 150
    assert first.stats()["present"] == 2850


# -- observation endpoints -------------------------------------------------------------


async def test_wait_returns_once_thresholds_are_reached() -> None:
    async with sandbox() as (_, http):
        waiter = asyncio.create_task(
            get_json(http, "/_sandbox/wait?executions=3&pages=1&timeout=20")
        )
        for i in range(1, 4):
            await delete(http, f"r-00000{i}")
        assert not waiter.done()
        await get_json(http, "/stale-recipients?limit=1")
        status, stats = await waiter
        assert status == 200
        assert stats["executions"] == 3
        assert stats["pages_served"] == 1

        status, body = await get_json(http, "/_sandbox/wait?executions=99&timeout=0")
        assert status == 408
        assert body["error"] == "timeout"
        assert (await get_json(http, "/_sandbox/wait?executions=-1"))[0] == 400
        # Any integer counter of the stats is a target; a name it does not count is
        # refused, never taken as reached (a typo once waited on nothing).
        status, stats = await get_json(http, "/_sandbox/wait?requests=3&deleted=3&timeout=0")
        assert (status, stats["deleted"]) == (200, 3)
        status, body = await get_json(http, "/_sandbox/wait?batch_request=1&timeout=0")
        assert status == 400
        assert "batch_request is not a counter" in body["message"], body
        assert (await get_json(http, "/_sandbox/wait?pause_remaining=1"))[0] == 400


async def test_log_lists_executions_as_json_or_json_lines() -> None:
    async with sandbox() as (_, http):
        await delete(http, "r-000001", key="k-1")
        await delete(http, "r-000001")
        status, entries = await get_json(http, "/_sandbox/log")
        assert status == 200
        assert [(e["recipient_id"], e["idempotency_key"], e["result"]) for e in entries] == [
            ("r-000001", "k-1", "deleted"),
            ("r-000001", None, "absent"),
        ]
        assert entries[0]["t"] <= entries[1]["t"]
        async with http.get("/_sandbox/log?format=jsonl&since=1") as resp:
            lines = (await resp.read()).splitlines()
        assert [orjson.loads(line)["seq"] for line in lines] == [2]


async def test_unknown_routes_and_methods_answer_json() -> None:
    async with sandbox() as (_, http):
        assert await get_json(http, "/nope") == (
            404,
            {"error": "not_found", "message": "Not Found"},
        )
        async with http.put("/recipients/r-000001") as resp:
            assert resp.status == 405
            assert resp.content_type == "application/json"


# -- pure pieces -----------------------------------------------------------------------


def test_token_bucket_refills_at_rate() -> None:
    bucket = TokenBucket(rate_per_second=2, burst=2, now=0.0)
    assert bucket.acquire(0.0) is None
    assert bucket.acquire(0.0) is None
    assert bucket.acquire(0.0) == pytest.approx(0.5)
    assert bucket.acquire(0.25) == pytest.approx(0.25)
    assert bucket.acquire(0.5) is None
    assert TokenBucket(rate_per_second=0, burst=0, now=0.0).acquire(0.0) is None


def test_fixed_window_resets_each_minute() -> None:
    window = FixedWindow(rate_per_second=1 / 60, now=100.0)
    assert window.acquire(100.0) is None
    assert window.acquire(130.0) == pytest.approx(30.0)
    assert window.acquire(160.0) is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="fault_5xx"):
        SandboxConfig(fault_5xx=1.5)
    with pytest.raises(ValueError, match="burst"):
        SandboxConfig(rate_per_second=10, burst=0)
    assert "s3cret" not in repr(SandboxConfig(token="s3cret"))


# -- the CLI as a real process ---------------------------------------------------------


async def test_cli_prints_one_json_line_and_exits_zero_on_sigterm() -> None:
    env = {
        **os.environ,
        "SANDBOX_TOKEN": "cli-token",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cleanup_sandbox",
        "--port",
        "0",
        "--recipients",
        "10",
        "--token-env",
        "SANDBOX_TOKEN",
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        announced = orjson.loads(await proc.stdout.readline())
        assert announced["pid"] == proc.pid
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", announced["url"])
        async with aiohttp.ClientSession(announced["url"]) as http:
            assert (await delete(http, "r-000001"))[0] == 401
            status, _, _ = await delete(http, "r-000001", Authorization="Bearer cli-token")
            assert status in {204, 404}
            assert (await get_json(http, "/_sandbox/stats"))[1]["population"] == 10
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rest, errors = await proc.communicate()
    assert proc.returncode == 0, errors.decode()
    assert rest == b""


def test_cli_refuses_a_missing_token_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SANDBOX_TEST_UNSET_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli_main(["--token-env", "SANDBOX_TEST_UNSET_TOKEN"])
    assert exited.value.code == 2
    assert "SANDBOX_TEST_UNSET_TOKEN" in capsys.readouterr().err
