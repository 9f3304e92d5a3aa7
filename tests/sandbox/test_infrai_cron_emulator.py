"""The Infrai emulator's cron/scheduling surface, over real loopback HTTP (no mocks).

Time never passes by sleeping: the emulator runs on a frozen clock that tests jump with
``Emulator.advance`` (which runs the scheduler step at once), and the cron target is a real
aiohttp server on loopback that records every scheduled POST. Only the per-attempt timeouts
are real time, as a network call cannot run on the emulator's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from cleanup_sandbox.infrai import CONTROL_HEADER, Emulator, EmulatorConfig, start_emulator
from cleanup_sandbox.infrai.__main__ import build_parser
from tests.helpers import free_port

KEY = "ifr_pk_proj_test"
CONTROL = "control-secret"
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z, a Tuesday
ISO_T0 = "2023-11-14T22:13:20.000Z"
IDS = ("cron_id", "id", "job_id")


@dataclass(frozen=True)
class Hit:
    path: str
    headers: Mapping[str, str]
    body: bytes


class Target:
    """The cron target: a loopback receiver answering from a script of (status, body, delay)."""

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self.script: list[tuple[int, bytes, float]] = []
        self.default: tuple[int, bytes, float] = (200, b"ok", 0.0)
        self.release = asyncio.Event()  # ends every delayed answer at teardown
        self.arrived = asyncio.Event()
        self.base = ""

    def url(self, path: str = "/tick") -> str:
        return self.base + path

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(Hit(request.path, request.headers.copy(), await request.read()))
        self.arrived.set()
        status, body, delay = self.script.pop(0) if self.script else self.default
        if delay:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), delay)
        return web.Response(status=status, body=body)


class Reply:
    def __init__(self, status: int, headers: Mapping[str, str], raw: bytes) -> None:
        self.status, self.headers = status, headers
        self.body: Any = orjson.loads(raw)
        self.data: Any = self.body["data"]
        error = self.body["error"] or {}
        self.code: str | None = error.get("code")
        self.message: str = error.get("message", "")


class Client:
    def __init__(self, http: aiohttp.ClientSession, emulator: Emulator, target: Target) -> None:
        self.http = http
        self.emulator = emulator
        self.target = target

    async def call(self, path: str, body: object = None, *, method: str = "POST", key: str | None = KEY,
                   headers: Mapping[str, str] | None = None) -> Reply:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        data = b"" if body is None else orjson.dumps(body)
        async with self.http.request(method, path, data=data, headers=sent) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def ok(self, path: str, body: object = None, **kwargs: Any) -> Any:
        reply = await self.call(path, body, **kwargs)
        assert (reply.status, reply.body["ok"]) == (200, True), reply.body
        return reply.data

    async def control(self, method: str, path: str, body: object = None) -> Any:
        data = b"" if body is None else orjson.dumps(body)
        async with self.http.request(method, f"/_emulator/{path}", data=data,
                                     headers={CONTROL_HEADER: CONTROL}) as resp:
            assert resp.status == 200, await resp.text()
            return orjson.loads(await resp.read())

    async def job(self, schedule: str | None = "* * * * *", **fields: Any) -> Any:
        body = {"name": "job", "url": self.target.url(), **fields}
        if schedule is not None:
            body["schedule"] = schedule
        return await self.ok("/v1/cron/create", body)

    async def runs(self, cron_id: str) -> list[dict[str, Any]]:
        return list((await self.ok(f"/v1/cron/runs/list/{cron_id}", method="GET"))["items"])

    async def advance(self, seconds: float) -> None:
        self.emulator.advance(seconds)
        await self.emulator.cron.drain()

    async def trigger(self, cron_id: str, **kwargs: Any) -> Any:
        data = await self.ok(f"/v1/cron/trigger/{cron_id}", **kwargs)
        await self.emulator.cron.drain()
        return data


@contextlib.asynccontextmanager
async def setup(**overrides: Any) -> AsyncIterator[Client]:
    config = EmulatorConfig(**{"api_key": KEY, "control_key": CONTROL, "cron_allow_private_targets": True,
                               **overrides})
    target, app = Target(), web.Application()
    app.router.add_post("/{tail:.*}", target.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        target.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        emu = await start_emulator(config, now=lambda: T0)
        try:
            async with aiohttp.ClientSession(emu.url) as http:
                yield Client(http, emu, target)
        finally:
            target.release.set()
            await emu.close()
    finally:
        await runner.cleanup()


def without_ids(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in IDS}


# -- create and list ----------------------------------------------------------------------


async def test_both_field_styles_and_path_families_give_the_same_record() -> None:
    async with setup() as c:
        url, zone = c.target.url(), "Europe/Berlin"
        table = await c.ok("/v1/cron/create", {"name": "weekly", "schedule": "0 9 * * 1", "url": url,
                                               "retries": 2, "payload": {"k": [1]}, "timezone": zone})
        curl = await c.ok("/v1/scheduling/cron/create", {
            "name": "weekly", "cron_expr": "0 9 * * 1", "task_type": "http_url", "task_url": url,
            "retry": 2, "timeout_seconds": 300, "payload": {"k": [1]}, "timezone": zone})
        sdk = await c.ok("/v1/scheduling/cron", {"name": "weekly", "cron_expr": "0  9 * * 1", "task": url,
                                                 "retry": 2, "payload": {"k": [1]}, "timezone": zone})
        for record in (table, curl, sdk):
            assert record["cron_id"] == record["id"] == record["job_id"]
            assert record["cron_id"].startswith("cron_")
        assert len({table["cron_id"], curl["cron_id"], sdk["cron_id"]}) == 3
        assert without_ids(table) == without_ids(curl) == without_ids(sdk) == {
            "name": "weekly", "schedule": "0 9 * * 1", "run_at": None, "url": url, "timezone": zone,
            "enabled": True, "payload": {"k": [1]}, "retries": 2, "timeout_seconds": 300.0,
            "task_type": "http_url", "created_at": ISO_T0,
            # Monday 09:00 in Berlin (CET) is 08:00 UTC.
            "next_run_at": "2023-11-20T08:00:00.000Z",
        }
        ids = [table["cron_id"], curl["cron_id"], sdk["cron_id"]]
        for path in ("/v1/cron/list", "/v1/scheduling/cron/list", "/v1/scheduling/cron"):
            items = (await c.ok(path, method="GET"))["items"]
            assert [item["cron_id"] for item in items] == ids
            assert items[0] == table
        # The documented defaults: UTC, the SDK's retry=3 and timeout_seconds=300, no payload.
        bare = await c.ok("/v1/cron/create", {"schedule": "*/5 * * * *", "http_url": url})
        assert (bare["name"], bare["timezone"], bare["retries"], bare["timeout_seconds"], bare["payload"],
                bare["next_run_at"]) == (None, "UTC", 3, 300.0, {}, "2023-11-14T22:15:00.000Z")
        assert [e["capability"] for e in c.emulator.calls] == [
            "cron.create", "scheduling.cron.create", "scheduling.cron.create", "cron.list",
            "scheduling.cron.list", "scheduling.cron.list", "cron.create"]
        assert c.emulator.calls[0]["cron_id"] == table["cron_id"]


async def test_an_idempotency_key_replays_the_created_job() -> None:
    async with setup() as c:
        body = {"name": "once", "schedule": "* * * * *", "url": c.target.url(), "idempotency_key": "k1"}
        first = await c.ok("/v1/cron/create", body)
        replay = await c.call("/v1/cron/create", body)
        assert (replay.data, replay.headers["Idempotent-Replayed"]) == (first, "true")
        unkeyed = {k: v for k, v in body.items() if k != "idempotency_key"}
        assert await c.ok("/v1/cron/create", unkeyed, headers={"Idempotency-Key": "k1"}) == first
        assert len((await c.ok("/v1/cron/list", method="GET"))["items"]) == 1
        assert c.emulator.calls[-2]["replayed"] is True
        # Without a key the same name is another job (cron_create_existing_name="new").
        other = await c.ok("/v1/cron/create", unkeyed)
        assert other["cron_id"] != first["cron_id"]
        await c.advance(40)
        assert sorted(h.headers["X-Infrai-Cron-Id"] for h in c.target.hits) == sorted(
            [first["cron_id"], other["cron_id"]])
    async with setup(require_create_keys=True) as c:
        reply = await c.call("/v1/cron/create", {"schedule": "* * * * *", "url": c.target.url()})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        assert "idempotency_key" in reply.message


async def test_an_existing_name_conflicts_returns_or_replaces_per_config() -> None:
    async with setup(cron_create_existing_name="conflict") as c:
        await c.job(name="n")
        reply = await c.call("/v1/cron/create", {"name": "n", "schedule": "0 * * * *", "url": c.target.url()})
        assert (reply.status, reply.code) == (409, "CRON_EXISTS")
    async with setup(cron_create_existing_name="existing") as c:
        first = await c.job(name="n")
        assert await c.job("0 * * * *", name="n") == first
    async with setup(cron_create_existing_name="replace") as c:
        first = await c.job(name="n")
        again = await c.job("0 * * * *", name="n", payload={"v": 2})
        assert again["cron_id"] == first["cron_id"]
        assert (again["schedule"], again["payload"], again["next_run_at"]) == (
            "0 * * * *", {"v": 2}, "2023-11-14T23:00:00.000Z")
        assert len((await c.ok("/v1/cron/list", method="GET"))["items"]) == 1


async def test_create_validation_names_the_field() -> None:
    async with setup() as c:
        base = {"name": "v", "schedule": "* * * * *", "url": c.target.url()}
        cases: list[tuple[dict[str, Any], str]] = [
            ({"schedule": "0 9 * *"}, "schedule"), ({"schedule": "61 * * * *"}, "schedule"),
            ({"schedule": None, "cron_expr": "every day"}, "cron_expr"), ({"schedule": None}, "schedule"),
            ({"cron_expr": "0 * * * *"}, "cron_expr"),  # disagrees with schedule
            ({"timezone": "Mars/Olympus_Mons"}, "timezone"), ({"timezone": ""}, "timezone"),
            ({"url": None}, "url"), ({"url": "not a url"}, "url"),
            ({"url": None, "task_url": "ftp://example.com/x"}, "task_url"),
            ({"schedule": None, "run_at": "tomorrow"}, "run_at"),
            ({"run_at": "2024-01-01T00:00:00Z"}, "run_at"),  # next to a schedule
            ({"retries": -1}, "retries"), ({"retry": 11}, "retry"), ({"retries": 1.5}, "retries"),
            ({"timeout_seconds": 901}, "timeout_seconds"), ({"timeout_seconds": 0}, "timeout_seconds"),
            ({"task_type": "lambda"}, "task_type"), ({"headers": {"X-A": 1}}, "headers"),
            ({"enabled": "yes"}, "enabled"), ({"name": 7}, "name"),
        ]
        for change, field in cases:
            body = {k: v for k, v in {**base, **change}.items() if v is not None}
            reply = await c.call("/v1/cron/create", body)
            assert (reply.status, reply.code) == (400, "VALIDATION_ERROR"), (change, reply.body)
            assert reply.message.startswith(f"{field}:"), (change, reply.message)
        assert (await c.ok("/v1/cron/list", method="GET"))["items"] == []
        # Any JSON payload is stored and sent as is.
        record = await c.job(payload=[1, "two", None])
        await c.trigger(record["cron_id"])
        assert c.target.hits[-1].body == b'[1,"two",null]'


EXTENDED = {
    "0 9 L * *": "2023-11-30T09:00:00.000Z",  # last day of the month
    "0 9 15W * *": "2023-11-15T09:00:00.000Z",  # weekday nearest the 15th
    "0 9 * * 1#3": "2023-11-20T09:00:00.000Z",  # third Monday
    "30 0 9 * * *": "2023-11-15T09:00:30.000Z",  # six fields, seconds first
    "@daily": "2023-11-15T00:00:00.000Z",
}


async def test_extended_cron_syntax_is_rejected_evaluated_or_stored_per_config() -> None:
    async with setup() as c:
        for expr in EXTENDED:
            reply = await c.call("/v1/cron/create", {"cron_expr": expr, "url": c.target.url()})
            assert (reply.status, reply.code) == (400, "VALIDATION_ERROR"), expr
            assert reply.message.startswith("cron_expr:")
        # Names, ranges, lists and steps are standard 5-field syntax.
        record = await c.job("0 9-17/4 * JAN,NOV mon-fri")
        assert record["next_run_at"] == "2023-11-15T09:00:00.000Z"
    async with setup(cron_extended_syntax="accept") as c:
        for expr, due in EXTENDED.items():
            assert (await c.job(expr))["next_run_at"] == due, expr
        reply = await c.call("/v1/cron/create", {"schedule": "0 9 * * 5L", "url": c.target.url()})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")  # croniter cannot evaluate it
        await c.advance(86400 * 40)
        assert c.target.hits  # and they fire
    async with setup(cron_extended_syntax="store") as c:
        for expr in (*EXTENDED, "0 9 * * 5L"):
            record = await c.job(expr)
            assert (record["schedule"], record["next_run_at"], record["enabled"]) == (expr, None, True)
        reply = await c.call("/v1/cron/create", {"schedule": "not cron at all", "url": c.target.url()})
        assert reply.status == 400
        await c.advance(86400 * 40)
        assert c.target.hits == []


async def test_private_targets_are_refused_unless_overridden() -> None:
    async with setup(cron_allow_private_targets=False) as c:
        private = (c.target.url(), "https://127.0.0.1/x", "https://localhost/x", "https://10.1.2.3/x",
                   "https://[::1]/x", "https://192.168.1.9/x", "https://intranet/x", "https://nas.local/x",
                   "http://example.com/x")
        for url in private:
            for field in ("url", "task_url"):
                reply = await c.call("/v1/cron/create", {"schedule": "* * * * *", field: url})
                assert (reply.status, reply.code) == (400, "VALIDATION_ERROR"), url
                assert reply.message.startswith(f"{field}:")
        record = await c.ok("/v1/cron/create", {"schedule": "* * * * *", "task": "https://example.com/hook"})
        assert record["url"] == "https://example.com/hook"
    async with setup() as c:
        assert (await c.job())["url"].startswith("http://127.0.0.1:")


# -- the scheduler ------------------------------------------------------------------------


async def test_a_due_tick_posts_the_payload_and_a_jump_fires_only_the_latest_slot() -> None:
    async with setup() as c:
        job = await c.job(payload={"hello": "world"})
        await c.advance(39)
        assert c.target.hits == []
        await c.advance(1)
        (hit,) = c.target.hits
        assert hit.body == b'{"hello":"world"}'
        assert hit.headers["Content-Type"] == "application/json"
        assert hit.headers["X-Infrai-Cron-Id"] == job["cron_id"]
        assert hit.headers["X-Infrai-Scheduled-For"] == "2023-11-14T22:14:00.000Z"
        assert "X-Infrai-Signature" not in hit.headers
        # Ten slots pass at once (to 22:24:30): one run, for the latest of them.
        await c.advance(630)
        assert [h.headers["X-Infrai-Scheduled-For"] for h in c.target.hits[1:]] == [
            "2023-11-14T22:24:00.000Z"]
        first, second = await c.runs(job["cron_id"])
        assert {k: first[k] for k in ("cron_id", "scheduled_for", "started_at", "finished_at", "status",
                                      "http_status", "attempt", "output", "trigger")} == {
            "cron_id": job["cron_id"], "scheduled_for": "2023-11-14T22:14:00.000Z",
            "started_at": "2023-11-14T22:14:00.000Z", "finished_at": "2023-11-14T22:14:00.000Z",
            "status": "succeeded", "http_status": 200, "attempt": 1, "output": "ok", "trigger": "schedule"}
        assert first["run_id"].startswith("run_")
        assert first["run_id"] != second["run_id"]
        assert second["scheduled_for"] == "2023-11-14T22:24:00.000Z"
        listed = (await c.ok("/v1/cron/list", method="GET"))["items"][0]
        assert listed["next_run_at"] == "2023-11-14T22:25:00.000Z"


async def test_pause_skips_due_ticks_and_resume_does_not_backfill() -> None:
    async with setup() as c:
        job = await c.job("*/5 * * * *")
        cron_id = job["cron_id"]
        assert job["next_run_at"] == "2023-11-14T22:15:00.000Z"
        paused = await c.ok(f"/v1/cron/pause/{cron_id}")
        assert (paused["enabled"], paused["next_run_at"]) == (False, None)
        await c.advance(100)  # 22:15:00, a due slot
        await c.advance(400)  # 22:21:40, past 22:20:00 too
        assert c.target.hits == []
        resumed = await c.ok(f"/v1/cron/resume/{cron_id}")
        assert (resumed["enabled"], resumed["next_run_at"]) == (True, "2023-11-14T22:25:00.000Z")
        await c.emulator.cron.drain()
        assert c.target.hits == []
        assert await c.runs(cron_id) == []
        await c.advance(199)
        assert c.target.hits == []
        await c.advance(1)
        assert [h.headers["X-Infrai-Scheduled-For"] for h in c.target.hits] == ["2023-11-14T22:25:00.000Z"]
        # Resuming a running job, or pausing twice, changes nothing.
        assert (await c.ok(f"/v1/cron/resume/{cron_id}"))["next_run_at"] == "2023-11-14T22:30:00.000Z"
        await c.ok(f"/v1/cron/pause/{cron_id}")
        assert (await c.ok(f"/v1/cron/pause/{cron_id}"))["enabled"] is False
        assert [e["capability"] for e in c.emulator.calls[-4:]] == [
            "cron.runs.list", "cron.resume", "cron.pause", "cron.pause"]


async def test_trigger_runs_now_even_when_paused_and_replays_by_key() -> None:
    async with setup() as c:
        job = await c.job("0 0 1 1 *")
        cron_id = job["cron_id"]
        data = await c.trigger(cron_id)
        assert {k: data[k] for k in (*IDS, "triggered", "scheduled_for")} == {
            **dict.fromkeys(IDS, cron_id), "triggered": True, "scheduled_for": ISO_T0}
        (hit,) = c.target.hits
        assert hit.headers["X-Infrai-Scheduled-For"] == ISO_T0
        (run,) = await c.runs(cron_id)
        assert (run["run_id"], run["trigger"], run["status"]) == (data["run_id"], "manual", "succeeded")
        await c.ok(f"/v1/cron/pause/{cron_id}")
        keyed = await c.trigger(cron_id, headers={"Idempotency-Key": "t1"})
        assert await c.trigger(cron_id, headers={"Idempotency-Key": "t1"}) == keyed
        assert len(c.target.hits) == 2
        record = (await c.ok("/v1/cron/list", method="GET"))["items"][0]
        assert (record["enabled"], record["next_run_at"]) == (False, None)


async def test_a_failing_target_is_retried_and_each_attempt_recorded() -> None:
    async with setup() as c:
        c.target.script = [(500, b"boom", 0.0), (200, b"fine", 0.0)]
        job = await c.job(retries=2)
        await c.trigger(job["cron_id"])
        first, second = await c.runs(job["cron_id"])
        assert (first["attempt"], first["status"], first["http_status"], first["output"]) == (
            1, "failed", 500, "boom")
        assert (second["attempt"], second["status"], second["http_status"], second["output"]) == (
            2, "succeeded", 200, "fine")
        assert first["scheduled_for"] == second["scheduled_for"]
        assert [h.headers["X-Infrai-Scheduled-For"] for h in c.target.hits] == [ISO_T0, ISO_T0]
        # Always failing: retries + 1 attempts, then it stops; a redirect is no success.
        c.target.default = (302, b"", 0.0)
        job = await c.job(retry=1)
        await c.trigger(job["cron_id"])
        assert [(r["attempt"], r["status"], r["http_status"]) for r in await c.runs(job["cron_id"])] == [
            (1, "failed", 302), (2, "failed", 302)]
        # Nobody listening: failed without a status, the error kept.
        closed = f"http://127.0.0.1:{free_port()}/x"
        job = await c.job(url=closed, retries=0)
        await c.trigger(job["cron_id"])
        (run,) = await c.runs(job["cron_id"])
        assert (run["status"], run["http_status"]) == ("failed", None)
        assert run["error"]


async def test_retries_wait_for_the_backoff_on_the_emulator_clock() -> None:
    async with setup(cron_retry_backoff_seconds=60) as c:
        c.target.default = (503, b"busy", 0.0)
        job = await c.job("0 0 1 1 *", retries=1)
        await c.trigger(job["cron_id"])
        assert len(c.target.hits) == 1
        await c.advance(59)
        assert len(c.target.hits) == 1
        await c.advance(1)
        assert [r["attempt"] for r in await c.runs(job["cron_id"])] == [1, 2]
        assert (await c.control("GET", "cron"))["pending_retries"] == []


async def test_a_target_slower_than_the_timeout_times_out_and_is_retried() -> None:
    async with setup(cron_timeout_seconds=0.2) as c:
        c.target.default = (200, b"late", 30.0)  # held until teardown
        job = await c.job(retries=1, timeout_seconds=300)  # clamped to the 0.2 s ceiling
        await c.trigger(job["cron_id"])
        runs = await c.runs(job["cron_id"])
        assert [(r["attempt"], r["status"], r["http_status"], r["output"]) for r in runs] == [
            (1, "timeout", None, ""), (2, "timeout", None, "")]
        assert all(r["finished_at"] is not None and r["duration_ms"] >= 150 for r in runs)
        assert len(c.target.hits) == 2


async def test_run_output_is_truncated_to_the_limit() -> None:
    async with setup() as c:
        job = await c.job()
        for size, truncated in ((4096, False), (5000, True)):
            c.target.script = [(200, b"x" * size, 0.0)]
            await c.trigger(job["cron_id"])
            run = (await c.runs(job["cron_id"]))[-1]
            assert (len(run["output"]), run["output_truncated"]) == (4096, truncated)
    async with setup(cron_output_limit_bytes=10) as c:
        c.target.script = [(500, "é".encode() * 6, 0.0)]  # 12 bytes; the cut falls inside the 6th
        job = await c.job(retries=0)
        await c.trigger(job["cron_id"])
        (run,) = await c.runs(job["cron_id"])
        assert (run["output"], run["output_truncated"], run["status"]) == ("é" * 5, True, "failed")


async def test_run_at_fires_exactly_once() -> None:
    async with setup() as c:
        job = await c.job(None, run_at="2023-11-14T22:15:20Z")
        assert (job["schedule"], job["run_at"], job["next_run_at"]) == (
            None, "2023-11-14T22:15:20.000Z", "2023-11-14T22:15:20.000Z")
        await c.advance(119)
        assert c.target.hits == []
        await c.advance(1)
        await c.advance(86400 * 3)
        (hit,) = c.target.hits
        assert hit.headers["X-Infrai-Scheduled-For"] == "2023-11-14T22:15:20.000Z"
        assert (await c.ok("/v1/cron/list", method="GET"))["items"][0]["next_run_at"] is None
        # An offset is converted to UTC. An instant already past fires once, at the next step:
        # here the background poll's, as nothing moves the clock.
        offset = await c.job(None, run_at="2023-12-01T00:00:00+01:00")
        assert offset["run_at"] == "2023-11-30T23:00:00.000Z"
        c.target.arrived.clear()
        await c.job(None, run_at="2020-01-01T00:00:00Z")
        await asyncio.wait_for(c.target.arrived.wait(), 5)
        await c.emulator.cron.drain()
        assert len(c.target.hits) == 2
        await c.advance(3600)
        assert len(c.target.hits) == 2


async def test_jitter_delays_the_post_but_not_the_slot() -> None:
    async with setup(cron_jitter_seconds=30) as c:
        job = await c.job()
        model_job = c.emulator.cron.model.jobs[job["cron_id"]]
        assert model_job.fire_at is not None
        jitter = model_job.fire_at - (T0 + 40)  # the slot, 22:14:00
        assert 0 <= jitter <= 30
        await c.advance(40 + jitter - 0.01)
        assert c.target.hits == []
        await c.advance(0.02)
        assert [h.headers["X-Infrai-Scheduled-For"] for h in c.target.hits] == ["2023-11-14T22:14:00.000Z"]


async def test_signature_and_custom_headers() -> None:
    async with setup(cron_signature_header="X-Infrai-Signature", cron_signature_prefix="sha256=") as c:
        signed = await c.job(secret="s3cret", payload={"a": 1},
                             headers={"X-Custom": "yes", "Content-Type": "text/plain"})
        assert not {"secret", "headers"} & set(signed)
        await c.trigger(signed["cron_id"])
        unsigned = await c.job()
        await c.trigger(unsigned["cron_id"])
        first, second = c.target.hits
        expected = hmac.new(b"s3cret", b'{"a":1}', hashlib.sha256).hexdigest()
        assert first.headers["X-Infrai-Signature"] == f"sha256={expected}"
        assert (first.headers["X-Custom"], first.headers["Content-Type"]) == ("yes", "application/json")
        assert "X-Infrai-Signature" not in second.headers


# -- auth, faults, the call log, other routes ----------------------------------------------


async def test_cron_calls_are_authenticated_faulted_and_logged() -> None:
    async with setup() as c:
        for path, method in (("/v1/cron/create", "POST"), ("/v1/cron/list", "GET"),
                             ("/v1/scheduling/cron/list", "GET"), ("/v1/cron/pause/x", "POST")):
            reply = await c.call(path, {}, method=method, key="wrong")
            assert (reply.status, reply.code, reply.headers["WWW-Authenticate"]) == (
                401, "UNAUTHORIZED", "Bearer")
        job = await c.job()
        cron_id = job["cron_id"]
        c.emulator.set_faults(credit_exhausted=True)
        for path, method in (("/v1/cron/create", "POST"), ("/v1/cron/list", "GET"),
                             (f"/v1/cron/trigger/{cron_id}", "POST")):
            reply = await c.call(path, {"schedule": "* * * * *", "url": c.target.url()}, method=method)
            assert (reply.status, reply.code) == (402, "INSUFFICIENT_CREDIT")
            assert reply.body["error"]["hint"]
        c.emulator.set_faults(credit_exhausted=False, error_next=1)
        assert (await c.call("/v1/cron/list", method="GET")).status == 503
        await c.emulator.cron.drain()
        assert c.target.hits == []
        assert len((await c.ok("/v1/cron/list", method="GET"))["items"]) == 1
        c.emulator.set_faults(error_next=0)
        start = len(c.emulator.calls)
        await c.ok(f"/v1/cron/pause/{cron_id}")
        await c.ok(f"/v1/cron/resume/{cron_id}")
        await c.trigger(cron_id)
        await c.runs(cron_id)
        assert await c.ok(f"/v1/cron/delete/{cron_id}", method="DELETE") == {
            **dict.fromkeys(IDS, cron_id), "deleted": True}
        entries = c.emulator.calls[start:]
        assert [(e["capability"], e["route"], e["cron_id"]) for e in entries] == [
            ("cron.pause", "/v1/cron/pause/{id}", cron_id),
            ("cron.resume", "/v1/cron/resume/{id}", cron_id),
            ("cron.trigger", "/v1/cron/trigger/{id}", cron_id),
            ("cron.runs.list", "/v1/cron/runs/list/{id}", cron_id),
            ("cron.delete", "/v1/cron/delete/{id}", cron_id),
        ]
        assert entries[2]["run_id"]
        assert c.emulator.runtime.calls["/v1/cron/create"] == 3
        # Gone: every operation on it answers 404, as does a second delete (by POST too).
        for path, method in ((f"/v1/cron/delete/{cron_id}", "POST"), (f"/v1/cron/runs/list/{cron_id}", "GET"),
                             (f"/v1/cron/trigger/{cron_id}", "POST")):
            reply = await c.call(path, method=method)
            assert (reply.status, reply.code) == (404, "CRON_NOT_FOUND")
        job = await c.job()
        await c.ok(f"/v1/cron/delete/{job['cron_id']}")  # POST accepted
        reply = await c.call("/v1/cron/create", method="GET")
        assert (reply.status, reply.code, reply.headers["Allow"]) == (405, "METHOD_NOT_ALLOWED", "POST")
        # The operations exist under /v1/cron only, as in every source.
        for path in ("/v1/scheduling/cron/pause/x", "/v1/cron/update/x", "/v1/cron/get/x",
                     "/v1/cron/delete/"):
            assert (await c.call(path)).code == "NOT_FOUND"


async def test_resume_update_and_get_routes_are_configurable() -> None:
    async with setup(cron_resume_route="/v1/cron/enable", cron_update_route="/v1/cron/update/{id}",
                     cron_get_route="/v1/cron/get/{id}") as c:
        job = await c.job("*/5 * * * *")
        cron_id = job["cron_id"]
        await c.ok(f"/v1/cron/pause/{cron_id}")
        assert (await c.call(f"/v1/cron/resume/{cron_id}")).code == "NOT_FOUND"
        reply = await c.call("/v1/cron/enable", {})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        assert (await c.ok("/v1/cron/enable", {"job_id": cron_id}))["enabled"] is True
        hourly = await c.ok(f"/v1/cron/update/{cron_id}", {"cron_expr": "0 * * * *", "retry": 0})
        assert [hourly[k] for k in ("cron_id", "schedule", "retries", "next_run_at", "url")] == [
            cron_id, "0 * * * *", 0, "2023-11-14T23:00:00.000Z", c.target.url()]
        one_shot = await c.ok(f"/v1/cron/update/{cron_id}", {"run_at": "2023-11-15T00:00:00Z"})
        assert (one_shot["schedule"], one_shot["next_run_at"]) == (None, "2023-11-15T00:00:00.000Z")
        reply = await c.call(f"/v1/cron/update/{cron_id}", {"timezone": "Nowhere/Land"})
        assert reply.message.startswith("timezone:")
        assert await c.ok(f"/v1/cron/get/{cron_id}", method="GET") == one_shot
        assert [e["capability"] for e in c.emulator.calls[-4:]] == [
            "cron.update", "cron.update", "cron.update", "cron.get"]
    async with setup(cron_resume_route=None) as c:
        job = await c.job()
        assert (await c.call(f"/v1/cron/resume/{job['cron_id']}")).code == "NOT_FOUND"


async def test_control_surface_shows_jobs_and_runs_and_ticks_on_demand() -> None:
    async with setup(cron_poll_seconds=0) as c:
        job = await c.job()
        c.emulator.state.advance(40)  # the clock alone: with polling off, nothing runs yet
        await c.emulator.cron.drain()  # a run the move had started would finish here
        assert c.target.hits == []
        ticked = await c.control("POST", "cron/tick", {"wait": True})
        assert (len(ticked["started"]), ticked["in_flight"]) == (1, 0)
        assert len(c.target.hits) == 1
        assert (await c.control("POST", "cron/tick"))["started"] == []
        await c.control("POST", "clock", {"advance_seconds": 60})  # moving the clock ticks too
        await c.emulator.cron.drain()
        assert len(c.target.hits) == 2
        seen = await c.control("GET", "cron")
        (listed,) = seen["jobs"]
        assert (listed["cron_id"], listed["next_run_at"]) == (job["cron_id"], "2023-11-14T22:16:00.000Z")
        assert [r["status"] for r in listed["runs"]] == ["succeeded", "succeeded"]
        assert (seen["now"], seen["in_flight"], seen["pending_retries"]) == (
            "2023-11-14T22:15:00.000Z", 0, [])
        async with c.http.post("/_emulator/cron/tick", data=b"[]", headers={CONTROL_HEADER: CONTROL}) as resp:
            assert resp.status == 400
        async with c.http.get("/_emulator/cron", headers={CONTROL_HEADER: "wrong"}) as resp:
            assert resp.status == 401


def test_cron_config_validation_and_flags() -> None:
    for bad, complaint in (
        ({"cron_resume_route": "/v1/cron/pause/{id}"}, "shadows"),
        ({"cron_update_route": "/v1/cron/list"}, "shadows"),
        ({"cron_get_route": "/v2/cron/{id}"}, "under /v1/"),
        ({"cron_get_route": "/v1/cron/x{id}"}, "segment"),
        ({"cron_update_route": "/v1/cron/resume/{id}"}, "differ"),
        ({"nack_route": "/v1/cron/trigger/now"}, "cron route"),
        ({"cron_timeout_seconds": 901}, "cron_timeout_seconds"),
        ({"cron_extended_syntax": "ignore"}, "cron_extended_syntax"),
        ({"cron_create_existing_name": "upsert"}, "cron_create_existing_name"),
        ({"cron_default_retries": 11}, "cron_default_retries"),
        ({"cron_output_limit_bytes": -1}, "cron_output_limit_bytes"),
    ):
        with pytest.raises(ValueError, match=complaint):
            EmulatorConfig(api_key=KEY, **bad)
    assert EmulatorConfig(api_key=KEY, cron_resume_route="/v1/cron/{id}/resume").cron_resume_route
    text = build_parser().format_help()
    for flag in ("--cron-resume-route", "--cron-allow-private-targets", "--cron-extended-syntax",
                 "--cron-output-limit-bytes", "--cron-poll-seconds"):
        assert flag in text
