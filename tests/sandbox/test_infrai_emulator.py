"""The Infrai queue emulator, exercised over real loopback HTTP (no mocks).

Time never passes by sleeping: the emulator runs on a frozen clock and tests jump it with
``Emulator.advance`` or POST /_emulator/clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import pytest

from cleanup_sandbox.infrai import CONTROL_HEADER, Emulator, EmulatorConfig, start_emulator
from cleanup_sandbox.infrai.__main__ import build_parser
from cleanup_sandbox.infrai.__main__ import main as cli_main

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "ifr_pk_proj_test"
CONTROL = "control-secret"
T0 = 1_700_000_000.0
UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
NACK = "/v1/queue/nack"
EXTEND = "/v1/queue/extend"


class Reply:
    def __init__(self, status: int, headers: Mapping[str, str], raw: bytes) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw
        self.body: Any = orjson.loads(raw)

    @property
    def data(self) -> Any:
        return self.body["data"]

    @property
    def code(self) -> str | None:
        error = self.body["error"]
        return None if error is None else str(error["code"])


class Client:
    def __init__(self, http: aiohttp.ClientSession, emulator: Emulator) -> None:
        self.http = http
        self.emulator = emulator

    async def call(
        self,
        path: str,
        body: object = None,
        *,
        key: str | None = KEY,
        headers: Mapping[str, str] | None = None,
        raw: bytes | None = None,
        method: str = "POST",
    ) -> Reply:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (b"" if body is None else orjson.dumps(body))
        async with self.http.request(method, path, data=data, headers=sent) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def ok(self, path: str, body: object = None, **kwargs: Any) -> Any:
        reply = await self.call(path, body, **kwargs)
        assert (reply.status, reply.body["ok"]) == (200, True), reply.body
        assert reply.body["error"] is None
        return reply.data

    async def control(self, method: str, path: str, body: object = None, key: str = CONTROL) -> Any:
        data = b"" if body is None else orjson.dumps(body)
        async with self.http.request(
            method, f"/_emulator/{path}", data=data, headers={CONTROL_HEADER: key}
        ) as resp:
            assert resp.status == 200, await resp.text()
            return orjson.loads(await resp.read())

    async def create(self, name: str, **options: object) -> Any:
        return await self.ok("/v1/queue/create", {"name": name, **options})

    async def publish(self, queue: str, payload: object = None, **fields: object) -> str:
        data = await self.ok("/v1/queue/publish", {"queue": queue, "payload": payload or {"n": 1}, **fields})
        return str(data["message_id"])

    async def consume(self, queue: str, **fields: object) -> list[dict[str, Any]]:
        data = await self.ok("/v1/queue/consume", {"queue": queue, **fields})
        return list(data if isinstance(data, list) else data["messages"])

    async def ids(self, queue: str, **fields: object) -> list[str]:
        return [m["message_id"] for m in await self.consume(queue, **fields)]

    async def ack(self, queue: str, message_id: str) -> Reply:
        return await self.call("/v1/queue/ack", {"queue": queue, "message_id": message_id})


@contextlib.asynccontextmanager
async def emulator(**overrides: Any) -> AsyncIterator[Client]:
    config = EmulatorConfig(**{"api_key": KEY, "control_key": CONTROL, **overrides})
    emu = await start_emulator(config, now=lambda: T0)
    try:
        async with aiohttp.ClientSession(emu.url) as http:
            yield Client(http, emu)
    finally:
        await emu.close()


def queue_stats(c: Client, name: str) -> dict[str, int]:
    return c.emulator.state.stats()[name]


# -- envelope, auth, discovery ------------------------------------------------------------


async def test_every_answer_is_an_envelope_and_a_bad_key_is_401() -> None:
    async with emulator() as c:
        for key, scheme in ((None, None), ("wrong", None), (KEY, "Basic")):
            headers = {"Authorization": f"{scheme} {key}"} if scheme else None
            reply = await c.call("/v1/queue/create", {"name": "q"}, key=key if not scheme else None,
                                 headers=headers)
            assert reply.status == 401
            assert reply.code == "UNAUTHORIZED"
            assert reply.headers["WWW-Authenticate"] == "Bearer"
            assert reply.body["ok"] is False
            assert reply.body["data"] is None
            assert set(reply.body["error"]) == {"code", "message", "hint"}
        reply = await c.call("/v1/queue/create", {"name": "q"})
        assert (reply.status, reply.body["ok"]) == (200, True)
        meta = reply.body["metadata"]
        assert UUID7.fullmatch(meta["request_id"])
        assert meta["request_id"] == reply.headers["X-Request-Id"]
        assert (meta["cost_usd"], meta["vendor"], meta["cache_hit"]) == (0.0001, "emulator", False)
        assert isinstance(meta["latency_ms"], int)
        # The key appears in no log, config repr or stats.
        assert KEY not in repr(c.emulator.config)
        assert KEY not in orjson.dumps(c.emulator.calls).decode()
        assert [e["status"] for e in c.emulator.calls] == [401, 401, 401, 200]


async def test_forbidden_mode_overrides_and_the_unauthorized_fault() -> None:
    async with emulator(auth_failure="forbidden") as c:
        reply = await c.call("/v1/queue/create", {"name": "q"}, key="nope")
        assert (reply.status, reply.code) == (403, "FORBIDDEN")
        assert "WWW-Authenticate" not in reply.headers
    async with emulator(auth_status=498, auth_code="BAD_KEY") as c:
        reply = await c.call("/v1/queue/create", {"name": "q"}, key=None)
        assert (reply.status, reply.code) == (498, "BAD_KEY")
        await c.ok("/v1/queue/create", {"name": "q"})
        c.emulator.set_faults(unauthorized=True)
        reply = await c.call("/v1/queue/create", {"name": "q"})
        assert (reply.status, reply.code) == (498, "BAD_KEY")
        assert c.emulator.calls[-1]["fault"] == "unauthorized"


async def test_discovery_is_public_and_lists_only_configured_routes() -> None:
    async with emulator(credit_exhausted=True, error_share=1.0) as c:
        data = await c.ok("/v1/discovery", method="GET", key=None)
        listed = {(cap["id"], cap["method"], cap["path"]) for cap in data["capabilities"]}
        assert listed == {
            ("queue.create", "POST", "/v1/queue/create"),
            ("queue.publish", "POST", "/v1/queue/publish"),
            ("queue.consume", "POST", "/v1/queue/consume"),
            ("queue.ack", "POST", "/v1/queue/ack"),
            ("queue.dlq.redrive", "POST", "/v1/queue/dlq/redrive/{queue}"),
        }
        detail = await c.ok("/v1/discovery/queue.publish", method="GET", key=None)
        assert "payload" in detail["parameters"]
        assert (await c.call("/v1/discovery/queue.nack", method="GET", key=None)).status == 404
        assert c.emulator.calls == []  # discovery is neither faulted nor logged
    async with emulator(nack_route=NACK, extend_route=EXTEND) as c:
        data = await c.ok("/v1/discovery", method="GET", key=None)
        ids = {cap["id"]: cap["path"] for cap in data["capabilities"]}
        assert (ids["queue.nack"], ids["queue.extend"]) == (NACK, EXTEND)


async def test_unknown_routes_and_methods_answer_envelopes() -> None:
    async with emulator() as c:
        for path in (NACK, EXTEND, "/v1/queue/list"):
            reply = await c.call(path, {"queue": "q", "message_id": "m"})
            assert (reply.status, reply.code, reply.body["ok"]) == (404, "NOT_FOUND", False)
            assert UUID7.fullmatch(reply.body["metadata"]["request_id"])
        reply = await c.call("/v1/queue/publish", method="GET")
        assert (reply.status, reply.code) == (405, "METHOD_NOT_ALLOWED")
        reply = await c.call("/elsewhere", method="GET")
        assert (reply.status, reply.code) == (404, "NOT_FOUND")


# -- queue.create -------------------------------------------------------------------------


async def test_create_returns_the_queue_record_and_checks_its_options() -> None:
    async with emulator() as c:
        data = await c.create("work")
        assert data == {
            "name": "work",
            "type": "standard",
            "dead_letter_queue": None,
            "max_retries": 3,
            "visibility_timeout_default": 30.0,
            "message_retention_days": 4.0,
            "enable_priority": False,
            "created_at": "2023-11-14T22:13:20.000Z",
        }
        reply = await c.call("/v1/queue/create", {"name": "w2", "dead_letter_queue": "missing-dlq"})
        assert (reply.status, reply.code) == (404, "QUEUE_NOT_FOUND")
        assert "missing-dlq" in reply.body["error"]["message"]
        for field, value in (("message_retention_days", 31), ("type", "lifo"), ("max_retries", -1),
                             ("visibility_timeout_default", 43201), ("name", "")):
            reply = await c.call("/v1/queue/create", {"name": "w3", field: value})
            assert (reply.status, reply.code) == (400, "VALIDATION_ERROR"), field
            assert field in reply.body["error"]["message"]
        await c.create("dlq", type="fifo")
        data = await c.create("w4", dead_letter_queue="dlq", max_retries=5,
                              message_retention_days=30, visibility_timeout_default=60)
        assert (data["dead_letter_queue"], data["max_retries"]) == ("dlq", 5)
        # Creating it again answers the existing queue, unchanged.
        c.emulator.advance(10)
        assert await c.create("w4", max_retries=1) == data


async def test_create_existing_conflict_and_strict_creation_keys() -> None:
    async with emulator(create_existing="conflict", require_create_keys=True) as c:
        reply = await c.call("/v1/queue/create", {"name": "q"})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        assert "idempotency_key" in reply.body["error"]["message"]
        await c.create("q", idempotency_key="k1")
        await c.ok("/v1/queue/create", {"name": "r"}, headers={"Idempotency-Key": "k2"})
        # A retry with the same key replays; a fresh call with a new key conflicts.
        replay = await c.call("/v1/queue/create", {"name": "q", "idempotency_key": "k1"})
        assert (replay.status, replay.headers["Idempotent-Replayed"]) == (200, "true")
        reply = await c.call("/v1/queue/create", {"name": "q", "idempotency_key": "k3"})
        assert (reply.status, reply.code) == (409, "QUEUE_EXISTS")


async def test_strict_mode_logs_canonical_bodies_and_epoch_timestamps() -> None:
    async with emulator(strict_canonical=True, timestamp_format="epoch") as c:
        data = await c.ok("/v1/queue/create", raw=b'{"name":"q","type":"standard"}\n')
        assert data["created_at"] == T0
        await c.ok("/v1/queue/create", raw=b'{"type": "standard", "name": "q"}')
        assert [e["canonical"] for e in c.emulator.calls] == [True, False]


# -- publish, consume, ack ----------------------------------------------------------------


async def test_publish_consume_ack_round_trip_with_any_key_order() -> None:
    async with emulator() as c:
        await c.create("q")
        raw = b'{ "payload": {"b": 2, "a": [1, 2]},\n  "queue": "q" }'
        first = (await c.ok("/v1/queue/publish", raw=raw))["message_id"]
        second = await c.ok("/v1/queue/publish", {"queue": "q", "body": {"variant": 8}})
        assert first.startswith("msg_")
        assert first != second["message_id"]
        messages = await c.consume("q", max_messages=5)
        assert messages == [
            {"message_id": first, "payload": {"b": 2, "a": [1, 2]}},
            {"message_id": second["message_id"], "payload": {"variant": 8}},
        ]
        assert await c.consume("q") == []  # both leased
        reply = await c.ack("q", first)
        assert reply.data == {"message_id": first, "acked": True}
        stats = queue_stats(c, "q")
        assert (stats["visible"], stats["leased"], stats["acked"], stats["published"]) == (0, 1, 1, 2)


async def test_publish_validation_unknown_queues_and_auto_create() -> None:
    async with emulator() as c:
        await c.create("q")
        for body, field in (({"payload": {}}, "queue"), ({"queue": "q"}, "payload"),
                            ({"queue": "q", "payload": [1]}, "payload"),
                            ({"queue": "q", "payload": {}, "headers": {"a": 1}}, "headers"),
                            ({"queue": "q", "payload": {}, "priority": "high"}, "priority")):
            reply = await c.call("/v1/queue/publish", body)
            assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
            assert field in reply.body["error"]["message"]
        reply = await c.call("/v1/queue/publish", raw=b"[not json")
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        reply = await c.call("/v1/queue/publish", {"queue": "nope", "payload": {}})
        assert (reply.status, reply.code) == (404, "QUEUE_NOT_FOUND")
        reply = await c.call("/v1/queue/consume", {"queue": "nope"})
        assert (reply.status, reply.code) == (404, "QUEUE_NOT_FOUND")
    async with emulator(auto_create=True) as c:
        message_id = await c.publish("made-on-the-fly")
        assert await c.ids("made-on-the-fly") == [message_id]


async def test_payload_of_256_kb_is_accepted_and_one_byte_more_refused() -> None:
    async with emulator() as c:
        await c.create("q")
        envelope = len(b'{"d":""}')
        fits = {"d": "x" * (262144 - envelope)}
        assert len(orjson.dumps(fits)) == 262144
        await c.publish("q", fits)
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {"d": "x" * (262145 - envelope)}})
        assert (reply.status, reply.code) == (413, "PAYLOAD_TOO_LARGE")
        assert queue_stats(c, "q")["published"] == 1
    async with emulator(payload_size_accounting="request", max_payload_bytes=64) as c:
        await c.create("q")
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {"d": "x" * 40}})
        assert reply.status == 413  # the payload fits, the whole request does not


async def test_delay_bounds_and_delayed_visibility() -> None:
    async with emulator() as c:
        # Retention counts from publication, so the default 4 days would drop a 7-day delay.
        await c.create("q", message_retention_days=8)
        late = await c.publish("q", delay_seconds=604800)
        for delay in (604801, -1):
            reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {}, "delay_seconds": delay})
            assert (reply.status, reply.code) == (400, "INVALID_DELAY")
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {}, "delay_seconds": "soon"})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        soon = await c.publish("q", delay_seconds=60)
        assert queue_stats(c, "q")["delayed"] == 2
        assert await c.ids("q") == []
        c.emulator.advance(59)
        assert await c.ids("q") == []
        c.emulator.advance(1)
        assert await c.ids("q") == [soon]
        await c.ack("q", soon)
        c.emulator.advance(604800 - 60)
        assert await c.ids("q", visibility_timeout=10) == [late]


async def test_consume_clamps_batch_and_lease_and_orders_oldest_visible_first() -> None:
    async with emulator(message_extras=True) as c:
        await c.create("q")
        ids = [await c.publish("q", {"i": i}) for i in range(12)]
        got = await c.consume("q", max_messages=50, visibility_timeout=10**6)
        assert [m["message_id"] for m in got] == ids[:10]
        assert set(got[0]) == {"message_id", "payload", "receive_count", "enqueued_at", "headers",
                               "message_group_id"}
        assert got[0]["enqueued_at"] == "2023-11-14T22:13:20.000Z"
        reply = await c.call("/v1/queue/consume", {"queue": "q", "max_messages": 0})
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")
        c.emulator.advance(43199)
        assert await c.ids("q", max_messages=10) == ids[10:]
        c.emulator.advance(1)  # the 12 h cap, not the 10**6 asked for
        assert await c.ids("q", max_messages=10) == ids[:10]


async def test_lease_expiry_redelivers_with_an_incremented_count() -> None:
    async with emulator(message_extras=True) as c:
        await c.create("q", visibility_timeout_default=45)
        message_id = await c.publish("q", headers={"trace": "t1"})
        (first,) = await c.consume("q")
        assert (first["receive_count"], first["headers"]) == (1, {"trace": "t1"})
        moved = await c.control("POST", "clock", {"advance_seconds": 44.5})
        assert moved["offset"] == 44.5
        assert await c.consume("q") == []
        await c.control("POST", "clock", {"advance_seconds": 0.5})
        (again,) = await c.consume("q", visibility_timeout=5)
        assert (again["message_id"], again["receive_count"]) == (message_id, 2)
        c.emulator.advance(5)
        (third,) = await c.consume("q")
        assert third["receive_count"] == 3
        stats = queue_stats(c, "q")
        assert (stats["deliveries"], stats["redeliveries"], stats["lease_expiries"]) == (3, 2, 2)


async def test_priority_queues_deliver_higher_first() -> None:
    async with emulator() as c:
        await c.create("p", enable_priority=True)
        await c.create("plain")
        by_priority = {p: await c.publish("p", {"p": p}, priority=p) for p in (1, 5, 3)}
        assert await c.ids("p", max_messages=3) == [by_priority[5], by_priority[3], by_priority[1]]
        plain = [await c.publish("plain", priority=p) for p in (1, 5, 3)]
        assert await c.ids("plain", max_messages=3) == plain
    async with emulator(priority_order="lower_first") as c:
        await c.create("p", enable_priority=True)
        low, high = await c.publish("p", priority=9), await c.publish("p", priority=-2)
        assert await c.ids("p", max_messages=2) == [high, low]


async def test_retention_removes_old_messages() -> None:
    async with emulator() as c:
        await c.create("q", message_retention_days=1)
        old = [await c.publish("q"), await c.publish("q")]
        c.emulator.advance(3600)
        keep = await c.publish("q")
        # Leased or not, a message past its retention is gone.
        assert await c.ids("q", max_messages=2, visibility_timeout=43200) == old
        c.emulator.advance(86400 - 3600)
        stats = queue_stats(c, "q")
        assert (stats["retention_expired"], stats["leased"], stats["visible"]) == (2, 0, 1)
        assert await c.ids("q") == [keep]


# -- ack variants -------------------------------------------------------------------------


async def test_ack_of_unknown_ids_answers_acked_false_or_404() -> None:
    async with emulator() as c:
        await c.create("q")
        message_id = await c.publish("q")
        await c.ids("q")
        assert (await c.ack("q", message_id)).data["acked"] is True
        again = await c.ack("q", message_id)
        assert (again.status, again.data) == (200, {"message_id": message_id, "acked": False})
        assert (await c.ack("q", "msg_never")).data["acked"] is False
        assert (await c.ack("nope", message_id)).code == "QUEUE_NOT_FOUND"
    async with emulator(ack_unknown="not_found") as c:
        await c.create("q")
        message_id = await c.publish("q")
        await c.ids("q")
        await c.ack("q", message_id)
        reply = await c.ack("q", message_id)
        assert (reply.status, reply.code) == (404, "MESSAGE_NOT_FOUND")


async def test_ack_after_the_lease_expired_is_accepted_or_rejected() -> None:
    async with emulator() as c:
        await c.create("q")
        message_id = await c.publish("q")
        await c.ids("q", visibility_timeout=10)
        c.emulator.advance(10)
        assert (await c.ack("q", message_id)).data["acked"] is True
        assert await c.ids("q") == []
    async with emulator(ack_expired="reject") as c:
        await c.create("q")
        message_id = await c.publish("q")
        never_delivered = await c.publish("q", delay_seconds=100)
        await c.ids("q", visibility_timeout=10)
        c.emulator.advance(10)
        reply = await c.ack("q", message_id)
        assert (reply.status, reply.code) == (409, "LEASE_EXPIRED")
        assert (await c.ack("q", never_delivered)).code == "LEASE_EXPIRED"
        # Still there; whoever leases it next may ack it.
        assert await c.ids("q") == [message_id]
        assert (await c.ack("q", message_id)).data["acked"] is True


# -- nack, DLQ, redrive, extend -----------------------------------------------------------


async def test_n_nacks_with_max_retries_n_dead_letter_and_redrive_brings_it_back() -> None:
    async with emulator(nack_route=NACK, message_extras=True) as c:
        await c.create("jobs/dlq")
        await c.create("jobs/main q", dead_letter_queue="jobs/dlq", max_retries=3)
        source = "jobs/main q"
        message_id = await c.publish(source)
        for attempt in range(1, 4):
            (m,) = await c.consume(source)
            assert m["receive_count"] == attempt
            data = await c.ok(NACK, {"queue": source, "message_id": message_id})
            assert data == {"message_id": message_id, "nacked": True, "dead_lettered": attempt == 3}
        assert await c.consume(source) == []
        assert queue_stats(c, source)["dlq"] == 1
        assert queue_stats(c, "jobs/dlq")["visible"] == 1
        moved = await c.ok("/v1/queue/dlq/redrive/" + quote(source, safe=""))
        assert moved == {"moved": 1}
        (back,) = await c.consume(source)
        assert (back["message_id"], back["receive_count"]) == (message_id, 1)
        assert queue_stats(c, source)["redriven"] == 1
        # A nack with a delay hides it for that long.
        await c.ok(NACK, {"queue": source, "message_id": message_id, "delay_seconds": 30})
        assert await c.consume(source) == []
        c.emulator.advance(30)
        assert [m["message_id"] for m in await c.consume(source)] == [message_id]
        reply = await c.call("/v1/queue/dlq/redrive/" + quote("jobs/dlq", safe=""))
        assert (reply.status, reply.code) == (400, "VALIDATION_ERROR")  # a DLQ has no DLQ


async def test_dead_letter_threshold_exceed_and_drop_without_dlq() -> None:
    async with emulator(nack_route=NACK, dlq_threshold="exceed") as c:
        await c.create("dlq")
        await c.create("q", dead_letter_queue="dlq", max_retries=1)
        message_id = await c.publish("q")
        for dead in (False, True):
            await c.ids("q")
            data = await c.ok(NACK, {"queue": "q", "message_id": message_id})
            assert data["dead_lettered"] is dead
        await c.create("alone", max_retries=0)
        lost = await c.publish("alone")
        await c.ids("alone")
        await c.ok(NACK, {"queue": "alone", "message_id": lost})
        assert queue_stats(c, "alone")["dropped"] == 1


async def test_redrive_by_dlq_name_without_resetting_counts() -> None:
    async with emulator(nack_route=NACK, redrive_target="dlq", redrive_resets_count=False,
                        message_extras=True) as c:
        await c.create("dlq")
        await c.create("a", dead_letter_queue="dlq", max_retries=1)
        await c.create("b", dead_letter_queue="dlq", max_retries=1)
        for queue in ("a", "b"):
            message_id = await c.publish(queue)
            await c.ids(queue)
            await c.ok(NACK, {"queue": queue, "message_id": message_id})
        redrive = {"queue": "dlq", "idempotency_key": "r1"}
        assert await c.ok("/v1/queue/dlq/redrive/dlq", redrive) == {"moved": 2}
        (m,) = await c.consume("a")
        assert m["receive_count"] == 2
        # Its budget was not reset: the next failure sends it straight back.
        data = await c.ok(NACK, {"queue": "a", "message_id": m["message_id"]})
        assert data["dead_lettered"] is True
        # The same key again replays the first answer instead of moving anything.
        assert await c.ok("/v1/queue/dlq/redrive/dlq", {"idempotency_key": "r1"}) == {"moved": 2}
        assert queue_stats(c, "dlq")["visible"] == 1


async def test_lease_expiries_can_count_toward_max_retries() -> None:
    async with emulator(expiry_counts_toward_max_retries=True) as c:
        await c.create("dlq")
        await c.create("q", dead_letter_queue="dlq", max_retries=2)
        message_id = await c.publish("q")
        await c.ids("q", visibility_timeout=5)
        c.emulator.advance(5)
        assert await c.ids("q", visibility_timeout=5) == [message_id]
        c.emulator.advance(5)
        assert await c.ids("q") == []
        assert await c.ids("dlq") == [message_id]
    async with emulator() as c:
        await c.create("dlq")
        await c.create("q", dead_letter_queue="dlq", max_retries=1)
        await c.publish("q")
        for _ in range(3):
            assert len(await c.ids("q", visibility_timeout=5)) == 1
            c.emulator.advance(5)
        assert queue_stats(c, "q")["dlq"] == 0


async def test_extend_route_prolongs_a_live_lease_only() -> None:
    async with emulator(extend_route=EXTEND) as c:
        await c.create("q")
        message_id = await c.publish("q")
        await c.ids("q", visibility_timeout=30)
        c.emulator.advance(20)
        data = await c.ok(EXTEND, {"queue": "q", "message_id": message_id, "visibility_timeout": 60})
        assert data == {"message_id": message_id, "visible_at": "2023-11-14T22:14:40.000Z"}
        c.emulator.advance(59)
        assert await c.ids("q") == []
        c.emulator.advance(1)
        reply = await c.call(EXTEND, {"queue": "q", "message_id": message_id, "visibility_timeout": 60})
        assert (reply.status, reply.code) == (409, "LEASE_EXPIRED")
        reply = await c.call(EXTEND, {"queue": "q", "message_id": "msg_x", "visibility_timeout": 1})
        assert (reply.status, reply.code) == (404, "MESSAGE_NOT_FOUND")


# -- FIFO ---------------------------------------------------------------------------------


async def test_fifo_dedup_within_five_minutes_and_accepted_after() -> None:
    async with emulator() as c:
        await c.create("f", type="fifo")
        first = await c.publish("f", {"v": 1}, deduplication_id="d1")
        c.emulator.advance(299)
        assert await c.publish("f", {"v": 2}, deduplication_id="d1") == first
        assert queue_stats(c, "f")["published"] == 1
        c.emulator.advance(1)
        later = await c.publish("f", {"v": 3}, deduplication_id="d1")
        assert later != first
        assert queue_stats(c, "f")["deduplicated"] == 1
    async with emulator(dedup_window_seconds=10) as c:
        # Past the generic idempotency window, the FIFO window still dedups by idempotency_key.
        await c.create("f", type="fifo")
        first = await c.publish("f", idempotency_key="k")
        c.emulator.advance(60)
        assert await c.publish("f", idempotency_key="k") == first


async def test_fifo_delivers_in_order_per_message_group() -> None:
    async with emulator(nack_route=NACK) as c:
        await c.create("f", type="fifo")
        a1 = await c.publish("f", message_group_id="a")
        a2 = await c.publish("f", message_group_id="a")
        b1 = await c.publish("f", message_group_id="b")
        assert await c.ids("f") == [a1]
        assert await c.ids("f", max_messages=5) == [b1]  # group a waits for a1
        await c.ok(NACK, {"queue": "f", "message_id": a1})
        assert await c.ids("f", max_messages=5) == [a1, a2]


# -- idempotency --------------------------------------------------------------------------


async def test_idempotent_publish_retry_returns_the_same_id_and_one_message() -> None:
    async with emulator() as c:
        await c.create("q")
        body = {"queue": "q", "payload": {"x": 1}, "idempotency_key": "pub-1"}
        first = await c.call("/v1/queue/publish", body)
        replay = await c.call("/v1/queue/publish", body)
        assert replay.data == first.data
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.body["metadata"]["request_id"] != first.body["metadata"]["request_id"]
        by_header = await c.call("/v1/queue/publish", {"queue": "q", "payload": {"x": 1}},
                                 headers={"Idempotency-Key": "pub-1"})
        assert by_header.data == first.data
        # Replay mode: a different body under the same key still answers the first result.
        other = await c.call("/v1/queue/publish", {**body, "payload": {"x": 2}})
        assert other.data == first.data
        assert queue_stats(c, "q")["published"] == 1
        assert [e["idempotency_key"] for e in c.emulator.calls[-4:]] == ["pub-1"] * 4
        assert c.emulator.calls[-1]["message_ids"] == [first.data["message_id"]]
        c.emulator.advance(86400)
        assert await c.publish("q", idempotency_key="pub-1") != first.data["message_id"]


async def test_key_reuse_conflict_and_precedence_between_body_and_header() -> None:
    async with emulator(key_reuse="conflict") as c:
        await c.create("q")
        await c.publish("q", {"x": 1}, idempotency_key="k")
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {"x": 2}, "idempotency_key": "k"})
        assert (reply.status, reply.code) == (409, "IDEMPOTENCY_CONFLICT")
        # Same key on another route is another key.
        message_id = await c.publish("q", {"x": 1}, idempotency_key="k")
        assert (await c.call("/v1/queue/ack", {"queue": "q", "message_id": message_id,
                                               "idempotency_key": "k"})).status == 200
    for precedence, expected in (("body", "in-body"), ("header", "in-header")):
        async with emulator(idempotency_precedence=precedence) as c:
            await c.create("q")
            await c.ok("/v1/queue/publish", {"queue": "q", "payload": {}, "idempotency_key": "in-body"},
                       headers={"Idempotency-Key": "in-header"})
            assert c.emulator.calls[-1]["idempotency_key"] == expected
            assert len(c.emulator.state.idempotency) == 1  # the create had no key


# -- injected faults ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "seconds", "expected"),
    [("seconds", 1.5, "2"), ("seconds", 3, "3"), ("fractional", 1.5, "1.500"),
     ("http-date", 2, None), ("none", 1, None)],
)
async def test_rate_limited_calls_carry_retry_after_in_each_format(
    fmt: str, seconds: float, expected: str | None
) -> None:
    async with emulator() as c:
        await c.control("POST", "faults", {"rate_limit_next": 2, "retry_after": seconds,
                                           "retry_after_format": fmt})
        for _ in range(2):
            reply = await c.call("/v1/queue/create", {"name": "q"})
            assert (reply.status, reply.code, reply.body["ok"]) == (429, "RATE_LIMITED", False)
            header = reply.headers.get("Retry-After")
            if fmt == "http-date":
                assert header is not None
                wait = (parsedate_to_datetime(header) - datetime.now(UTC)).total_seconds()
                assert 0 < wait <= seconds + 1
            else:
                assert header == expected
        assert (await c.control("GET", "faults"))["rate_limit_next"] == 0
        await c.create("q")


async def test_credit_exhausted_then_restored() -> None:
    async with emulator() as c:
        await c.control("POST", "faults", {"credit_exhausted": True})
        reply = await c.call("/v1/queue/create", {"name": "q"})
        assert (reply.status, reply.code) == (402, "INSUFFICIENT_CREDIT")
        assert "POST /v1/account/topup" in reply.body["error"]["hint"]
        await c.control("POST", "faults", {"credit_exhausted": False})
        await c.create("q")
        assert [e["fault"] for e in c.emulator.calls] == ["credit_exhausted", None]


async def test_injected_errors_ok_false_on_200_and_garbage_do_not_act() -> None:
    async with emulator() as c:
        await c.create("q")
        c.emulator.set_faults(error_next=1)
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {}})
        assert (reply.status, reply.code, reply.body["ok"]) == (503, "SERVICE_UNAVAILABLE", False)
        c.emulator.set_faults(error_ok_false_200_share=1.0)
        reply = await c.call("/v1/queue/publish", {"queue": "q", "payload": {}})
        assert (reply.status, reply.body["ok"], reply.code) == (200, False, "INTERNAL")
        c.emulator.set_faults(error_ok_false_200_share=0.0, garbage_share=1.0)
        for _ in range(6):
            async with c.http.post("/v1/queue/publish", data=orjson.dumps({"queue": "q", "payload": {}}),
                                   headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200
                raw = await resp.read()
            with contextlib.suppress(orjson.JSONDecodeError):
                assert "ok" not in orjson.loads(raw)
        assert queue_stats(c, "q")["published"] == 0
        faults = [e["fault"] for e in c.emulator.calls[1:]]
        assert faults == ["error", "ok_false"] + ["garbage"] * 6
        with pytest.raises(ValueError, match="error_share"):
            c.emulator.set_faults(error_share=2.0)
        with pytest.raises(ValueError, match="not fault fields"):
            c.emulator.set_faults(api_key="x")


async def test_reset_before_acting_and_after_acting() -> None:
    async with emulator() as c:
        await c.create("q")
        c.emulator.set_faults(reset_share=1.0)
        with pytest.raises(aiohttp.ClientConnectionError):
            await c.call("/v1/queue/publish", {"queue": "q", "payload": {}})
        assert queue_stats(c, "q")["published"] == 0
        c.emulator.set_faults(reset_share=0.0, reset_after_share=1.0)
        body = {"queue": "q", "payload": {"n": 1}, "idempotency_key": "once"}
        with pytest.raises(aiohttp.ClientConnectionError):
            await c.call("/v1/queue/publish", body)
        entry = c.emulator.calls[-1]
        assert (entry["fault"], entry["status"], entry["ok"]) == ("reset_after", None, True)
        c.emulator.set_faults(reset_after_share=0.0)
        # The client saw a reset, yet the message exists; its keyed retry replays the same id.
        assert queue_stats(c, "q")["published"] == 1
        retried = await c.ok("/v1/queue/publish", body)
        assert [retried["message_id"]] == entry["message_ids"]
        assert await c.ids("q") == entry["message_ids"]


async def test_duplicate_share_redelivers_leased_and_recently_acked_messages() -> None:
    async with emulator() as c:
        await c.create("q")
        first = await c.publish("q")
        second = await c.publish("q")
        assert await c.ids("q") == [first]
        c.emulator.set_faults(duplicate_share=1.0)
        assert await c.ids("q", max_messages=2) == [second, first]
        assert c.emulator.calls[-1]["fault"] == "duplicate"
        await c.ack("q", first)
        await c.ack("q", second)
        # Acked within the last minute: still a candidate for a duplicate delivery.
        (again,) = await c.ids("q")
        assert again in {first, second}
        c.emulator.advance(61)
        assert await c.ids("q") == []
        assert queue_stats(c, "q")["duplicates_injected"] == 2


async def test_latency_is_added_and_reported() -> None:
    async with emulator(latency_ms=25) as c:
        reply = await c.call("/v1/queue/create", {"name": "q"})
        assert reply.body["metadata"]["latency_ms"] >= 25


async def test_fault_draws_are_seeded() -> None:
    async def statuses(seed: int) -> list[int]:
        async with emulator(seed=seed, error_share=0.5) as c:
            return [(await c.call("/v1/queue/create", {"name": "q"})).status for _ in range(24)]

    assert await statuses(3) == await statuses(3)
    assert await statuses(3) != await statuses(4)


# -- the control surface ------------------------------------------------------------------


async def test_call_log_and_stats_over_http() -> None:
    async with emulator(nack_route=NACK) as c:
        await c.create("q")
        message_id = await c.publish("q", idempotency_key="p1")
        await c.ids("q")
        await c.ack("q", message_id)
        await c.call("/v1/queue/publish", {"queue": "q"})
        entries = await c.control("GET", "log")
        assert [e["route"] for e in entries] == [
            "/v1/queue/create", "/v1/queue/publish", "/v1/queue/consume", "/v1/queue/ack",
            "/v1/queue/publish",
        ]
        required = {"t", "route", "status", "ok", "code", "queue", "message_ids", "idempotency_key", "fault"}
        assert all(required <= set(e) for e in entries)
        publish = entries[1]
        assert (publish["status"], publish["ok"], publish["queue"], publish["message_ids"],
                publish["idempotency_key"], publish["t"]) == (200, True, "q", [message_id], "p1", T0)
        assert (entries[-1]["status"], entries[-1]["code"]) == (400, "VALIDATION_ERROR")
        assert [e["seq"] for e in await c.control("GET", "log?since=3")] == [4, 5]
        stats = await c.control("GET", "stats")
        assert stats["queues"]["q"]["acked"] == 1
        assert stats["calls"]["/v1/queue/publish"] == 2
        assert stats["total_calls"] == 5
        assert (await c.control("POST", "reset_log")) == {"cleared": 5}
        assert await c.control("GET", "log") == []
        stats = await c.control("GET", "stats")
        assert (stats["total_calls"], stats["calls_in_log"]) == (5, {})


async def test_control_surface_needs_its_own_key_and_is_off_without_one() -> None:
    async with emulator() as c:
        for key in ("wrong", KEY):
            async with c.http.get("/_emulator/stats", headers={CONTROL_HEADER: key}) as resp:
                assert resp.status == 401
        async with c.http.post("/_emulator/faults", data=b'{"error_share": 7}',
                               headers={CONTROL_HEADER: CONTROL}) as resp:
            assert resp.status == 400
        async with c.http.post("/_emulator/faults", data=b'{"max_batch": 1}',
                               headers={CONTROL_HEADER: CONTROL}) as resp:
            assert resp.status == 400
        async with c.http.post("/_emulator/clock", data=b'{"advance_seconds": -1}',
                               headers={CONTROL_HEADER: CONTROL}) as resp:
            assert resp.status == 400
        assert (await c.control("GET", "faults"))["error_share"] == 0.0
    async with (
        emulator(control_key=None) as c,
        c.http.get("/_emulator/stats", headers={CONTROL_HEADER: CONTROL}) as resp,
    ):
        assert resp.status == 404


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="api_key"):
        EmulatorConfig(api_key="")
    for bad, complaint in (
        ({"rate_limit_share": 1.5}, "rate_limit_share"),
        ({"error_next": True}, "error_next"),
        ({"max_batch": 2.5}, "max_batch"),
        ({"consume_shape": "list"}, "consume_shape"),
        ({"nack_route": "/v1/queue/publish"}, "route"),
        ({"nack_route": "/v1/n", "extend_route": "/v1/n"}, "differ"),
        ({"max_retention_days": 31}, "max_retention_days"),
        ({"default_visibility_timeout": 50000}, "default_visibility_timeout"),
        ({"retry_after_format": "minutes"}, "retry_after_format"),
    ):
        with pytest.raises(ValueError, match=complaint):
            EmulatorConfig(api_key=KEY, **bad)
    assert EmulatorConfig(api_key=KEY, retry_after=2).retry_after == 2.0


# -- the CLI ------------------------------------------------------------------------------


async def test_cli_prints_its_url_and_exits_zero_on_sigterm() -> None:
    env = {**os.environ, "EMU_KEY": "cli-key", "EMU_CONTROL": "cli-control"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cleanup_sandbox.infrai", "--port", "0", "--key-env", "EMU_KEY",
        "--control-key-env", "EMU_CONTROL", "--nack-route", NACK, "--consume-shape", "bare",
        "--auto-create", "--retry-after", "2.5",
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        announced = orjson.loads(await proc.stdout.readline())
        assert announced["pid"] == proc.pid
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", announced["url"])
        auth = {"Authorization": "Bearer cli-key"}
        async with aiohttp.ClientSession(announced["url"]) as http:
            async with http.post("/v1/queue/publish", json={"queue": "q", "payload": {}}) as resp:
                assert resp.status == 401
            async with http.post("/v1/queue/publish", json={"queue": "q", "payload": {}},
                                 headers=auth) as resp:
                assert resp.status == 200
            async with http.post("/v1/queue/consume", json={"queue": "q"}, headers=auth) as resp:
                assert len((await resp.json())["data"]) == 1
            async with http.get("/_emulator/faults", headers={CONTROL_HEADER: "cli-control"}) as resp:
                assert (await resp.json())["retry_after"] == 2.5
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rest, errors = await proc.communicate()
    assert proc.returncode == 0, errors.decode()
    assert rest == b""
    assert b"cli-key" not in errors


def test_cli_refuses_a_missing_key_and_documents_every_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("INFRAI_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli_main([])
    assert exited.value.code == 2
    assert "INFRAI_API_KEY" in capsys.readouterr().err
    text = build_parser().format_help()
    for flag in ("--ack-expired", "--no-redrive-resets-count", "--duplicate-share", "--extend-route"):
        assert flag in text
