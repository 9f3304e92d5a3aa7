"""Push delivery: signed deliveries POSTed to a real app on loopback, as Infrai would (the
emulator does not push), worked by the consumer pool against the partner simulator; and
``infrai push subscribe``. The 2xx is the ack: sent only once the ledger committed."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cleanup_sandbox import SandboxConfig, run_sandbox
from cleanup_sandbox.infrai import Emulator
from cleanup_sandbox.server import RunningSandbox
from supervisor import cli
from supervisor.apistate import ApiState
from supervisor.budget.base import Feedback, Outcome
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig, ServiceConfig
from supervisor.configtypes import Secret
from supervisor.consumer import ConsumerPool
from supervisor.http import create_app
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.push import SubscribeRefused, Subscription, check_url, subscribe
from supervisor.infrai.settings import InfraiConfig
from supervisor.model import Delivery, Message, Published
from supervisor.partner import PartnerClient
from supervisor.push import PushedQueue, PushEntry, PushReceiver, PushSettings
from supervisor.queue.settings import QueueConfig
from supervisor.reconcile import Reconciler
from supervisor.runs import RunOpener, RunWatch
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.states import OpState
from tests.helpers import infrai_config

from .http_app import load_config, running_api

SECRET = "push-secret-for-tests"
KEY = "ifr_push_key"
N = 8
MAX_BODY = 8192


def signature(body: bytes, ts: str, secret: str = SECRET) -> str:
    return hmac.new(secret.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()


def signed(body: bytes, ts: str | None = None, secret: str = SECRET,
           prefix: str = "sha256=") -> dict[str, str]:
    ts = str(int(time.time())) if ts is None else ts
    return {"X-Infrai-Signature": prefix + signature(body, ts, secret),
            "X-Infrai-Timestamp": ts, "Content-Type": "application/json"}


def delivery_body(m: Message, message_id: str | None = None, field_name: str = "payload",
                  as_text: bool = False) -> bytes:
    payload: Any = {"run_id": m.run_id, "operation_id": m.operation_id,
                    "recipient_id": m.recipient_id}
    if as_text:
        payload = orjson.dumps(payload).decode()
    return orjson.dumps({"message_id": message_id or f"m-{m.operation_id}",
                         field_name: payload})


@dataclass
class Rig:
    client: TestClient[web.Request, web.Application]
    db: Database
    ledger: SqliteLedger
    queue: PushedQueue
    budget: LocalBudget
    pool: ConsumerPool
    sandbox: RunningSandbox
    messages: list[Message]
    acked_in_state: list[OpState | None] = field(default_factory=list)

    async def post(self, body: bytes, headers: dict[str, str] | None = None,
                   queue: str = "ops") -> tuple[int, dict[str, str], dict[str, Any]]:
        async with self.client.post(f"/v1/push/{queue}", data=body,
                                    headers=signed(body) if headers is None else headers,
                                    skip_auto_headers={"Content-Type"}) as resp:
            raw = await resp.read()
            assert resp.content_type == "application/json", raw[:200]
            return resp.status, dict(resp.headers), orjson.loads(raw)

    async def written(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """Every operation and attempt row: to prove a rejected delivery wrote nothing."""
        ops = await self.db.read("SELECT * FROM operations ORDER BY id")
        attempts = await self.db.read("SELECT * FROM attempts ORDER BY id")
        return [tuple(r) for r in ops], [tuple(r) for r in attempts]

    async def state(self, m: Message) -> OpState:
        op = await self.ledger.get_operation(m.operation_id)
        assert op is not None
        return op.state

    def partner_requests(self) -> int:
        return int(self.sandbox.state.stats()["requests"])


@asynccontextmanager
async def push_rig(tmp_path: Path, limits: LimitsConfig | None = None,
                   max_wait_s: float = 5.0, backoff_s: tuple[float, float] = (0.05, 0.2),
                   ) -> AsyncIterator[Rig]:
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        cfg = Config(service=ServiceConfig(data_dir=tmp_path, max_body_bytes=MAX_BODY),
                     queue=QueueConfig(poll_interval_seconds=0.05),
                     partner=PartnerConfig(base_url=sandbox.url,
                                           backoff_initial_seconds=backoff_s[0],
                                           backoff_max_seconds=backoff_s[1]),
                     limits=limits or LimitsConfig(rate_per_second=200, concurrency=4))
        db = Database(cfg.ledger_path)
        await db.open()
        ledger = SqliteLedger(db, owns_queue=False)  # Infrai's queue: ack after commit
        opened = await ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
        assert opened.run is not None
        await ledger.record_page(opened.run.id, [f"r-{i:06d}" for i in range(1, N + 1)],
                                 None, 0)
        messages = await ledger.unpublished(100)
        # What the publisher did: each operation's message is out there, at Infrai.
        await ledger.record_published([Published(m.operation_id, f"m-{m.operation_id}",
                                                 time.time()) for m in messages])
        budget = LocalBudget(cfg.limits, key="test")
        partner = PartnerClient(cfg.partner, cfg.limits.concurrency)
        await partner.start()
        settings = PushSettings(secret=Secret(SECRET), visibility_timeout_s=30,
                                max_wait_s=max_wait_s)
        queue = PushedQueue(settings.visibility_timeout_s, settings.max_wait_s)
        pool = ConsumerPool(cfg, ledger, queue, budget, partner, on_settled=lambda: None)
        state = ApiState(config=cfg, ledger=ledger,
                         opener=RunOpener(cfg, ledger, asyncio.Event()),
                         reconciler=Reconciler(cfg.partner, ledger, queue, budget, partner),
                         ready=lambda: (True, {}), runs_changed=RunWatch(),
                         current_rate=lambda: budget.snapshot().rate,
                         push=PushReceiver(settings, {"ops": PushEntry(pool, queue)}))
        client: TestClient[web.Request, web.Application] = TestClient(
            TestServer(create_app(state), host="127.0.0.1", port=0))
        await client.start_server()
        rig = Rig(client, db, ledger, queue, budget, pool, sandbox, messages)
        ack = queue.ack

        async def ack_seeing_the_ledger(deliveries: Sequence[Delivery]) -> None:
            for d in deliveries:  # what the ledger says at the moment of the ack
                op = await ledger.get_operation(d.message.operation_id)
                rig.acked_in_state.append(op.state if op else None)
            await ack(deliveries)

        queue.ack = ack_seeing_the_ledger  # type: ignore[method-assign]
        try:
            yield rig
        finally:
            await client.close()
            await partner.close()
            await db.close()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with push_rig(tmp_path) as r:
        yield r


async def test_a_signed_delivery_is_acked_only_after_its_outcome_commits(rig: Rig) -> None:
    m = rig.messages[0]
    status, headers, doc = await rig.post(delivery_body(m))
    assert status == 200, doc
    assert doc["ok"] is True
    assert doc["operation_id"] == m.operation_id
    assert "Retry-After" not in headers
    # The ack (the 2xx) came after the commit: the ledger said deleted when it was given.
    assert rig.acked_in_state == [OpState.DELETED]
    assert await rig.state(m) is OpState.DELETED
    assert rig.sandbox.state.executions_of(m.recipient_id) == 1
    assert rig.sandbox.state.stats()["executions"] == 1


@pytest.mark.parametrize("variant", ["bare hex", "upper case", "body field", "payload as text"])
async def test_tolerated_signature_and_body_variants_are_accepted(rig: Rig, variant: str) -> None:
    m = rig.messages[1]
    body = delivery_body(m, field_name="body" if variant == "body field" else "payload",
                         as_text=variant == "payload as text")
    headers = signed(body, prefix="" if variant == "bare hex" else "sha256=")
    if variant == "upper case":
        headers["X-Infrai-Signature"] = headers["X-Infrai-Signature"].upper()
    status, _, doc = await rig.post(body, headers)
    assert status == 200, doc
    assert await rig.state(m) is OpState.DELETED


def _rejections(body: bytes) -> dict[str, tuple[dict[str, str], str]]:
    now = int(time.time())
    good = signed(body)
    return {
        "unsigned": ({"Content-Type": "application/json"}, "missing X-Infrai-Signature"),
        "no timestamp": ({"X-Infrai-Signature": good["X-Infrai-Signature"]},
                         "missing X-Infrai-Timestamp"),
        "wrong secret": (signed(body, secret="not-the-secret"), "X-Infrai-Signature does not"),
        "not hex": ({**good, "X-Infrai-Signature": "sha256=zz"}, "X-Infrai-Signature does not"),
        # The timestamp is signed: a fresh one on an old signature does not verify.
        "timestamp swapped": ({**signed(body, ts=str(now - 1000)),
                               "X-Infrai-Timestamp": str(now)}, "X-Infrai-Signature does not"),
        "replayed (stale)": (signed(body, ts=str(now - 400)), "beyond the 300 s tolerance"),
        "from the future": (signed(body, ts=str(now + 400)), "beyond the 300 s tolerance"),
        "milliseconds, stale": (signed(body, ts=str((now - 400) * 1000)), "300 s tolerance"),
        "timestamp not a number": (signed(body, ts="yesterday"), "X-Infrai-Timestamp must be"),
    }


@pytest.mark.parametrize("case", list(_rejections(b"")))
async def test_unsigned_wrong_and_stale_deliveries_are_401_and_write_nothing(
        rig: Rig, case: str) -> None:
    body = delivery_body(rig.messages[0])
    headers, expected = _rejections(body)[case]
    before = await rig.written()
    status, _, doc = await rig.post(body, headers)
    assert status == 401, doc
    assert expected in doc["error"], doc
    assert "X-Infrai-" in doc["error"]  # names the header
    assert await rig.written() == before
    assert rig.partner_requests() == 0


async def test_a_tampered_body_is_401(rig: Rig) -> None:
    body = delivery_body(rig.messages[0])
    headers = signed(body)
    before = await rig.written()
    status, _, doc = await rig.post(delivery_body(rig.messages[1]), headers)
    assert status == 401
    assert "X-Infrai-Signature" in doc["error"]
    assert await rig.written() == before


async def test_an_oversized_delivery_is_413_and_writes_nothing(rig: Rig) -> None:
    m = rig.messages[0]
    body = orjson.dumps({"message_id": "m-big", "payload": {
        "run_id": m.run_id, "operation_id": m.operation_id, "recipient_id": m.recipient_id,
        "padding": "x" * (MAX_BODY + 1)}})
    before = await rig.written()
    status, _, doc = await rig.post(body)
    assert status == 413, doc
    assert str(MAX_BODY) in doc["error"]
    assert await rig.written() == before
    assert rig.partner_requests() == 0


@pytest.mark.parametrize(("doc", "named"), [
    (b"{", "not valid JSON"),
    (b"[]", "JSON object"),
    ({"payload": {}}, "message_id"),
    ({"message_id": "", "payload": {}}, "message_id"),
    ({"message_id": "m-1"}, "payload (or body)"),
    ({"message_id": "m-1", "payload": [1]}, "payload (or body)"),
    ({"message_id": "m-1", "payload": {"run_id": "x", "recipient_id": "r"}},
     "payload.operation_id"),
    ({"message_id": "m-1", "body": {"run_id": "x", "operation_id": "o", "recipient_id": 7}},
     "body.recipient_id"),
])
async def test_malformed_deliveries_are_400_naming_the_field(
        rig: Rig, doc: bytes | dict[str, Any], named: str) -> None:
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    before = await rig.written()
    status, _, answer = await rig.post(body)
    assert status == 400, answer
    assert named in answer["error"], answer
    assert await rig.written() == before


async def test_an_unknown_queue_is_404(rig: Rig) -> None:
    before = await rig.written()
    status, _, doc = await rig.post(delivery_body(rig.messages[0]), queue="elsewhere")
    assert status == 404
    assert "elsewhere" in doc["error"]
    assert await rig.written() == before


async def test_a_duplicate_delivery_of_a_settled_operation_is_acked_without_a_call(
        rig: Rig) -> None:
    m = rig.messages[2]
    body = delivery_body(m)
    now = int(time.time())
    assert (await rig.post(body, signed(body, ts=str(now))))[0] == 200
    requests = rig.partner_requests()
    # At-least-once: Infrai delivers it again (signed anew), or another copy of it.
    copy = delivery_body(m, message_id="m-copy")
    for again, headers in ((body, signed(body, ts=str(now + 1))), (copy, signed(copy))):
        status, _, doc = await rig.post(again, headers)
        assert status == 200, doc
    # The very request replayed: answered as it was, from memory, not even acked again.
    status, _, doc = await rig.post(body, signed(body, ts=str(now)))
    assert (status, doc["ok"]) == (200, True), doc
    assert rig.partner_requests() == requests
    assert rig.sandbox.state.executions_of(m.recipient_id) == 1
    assert rig.acked_in_state == [OpState.DELETED] * 3


async def test_while_paused_deliveries_are_429_with_retry_after_and_nothing_is_sent(
        rig: Rig) -> None:
    rig.budget.pause(time.time() + 30, "the partner said Retry-After: 30")
    before = await rig.written()
    status, headers, doc = await rig.post(delivery_body(rig.messages[3]))
    assert status == 429, doc
    assert 29 <= int(headers["Retry-After"]) <= 30
    assert doc["retry_after"] == headers["Retry-After"]
    # Not even counted as received: a long pause must not turn into a poison message.
    assert await rig.written() == before
    assert rig.partner_requests() == 0


async def test_no_token_within_the_bound_is_429(tmp_path: Path) -> None:
    """At 1 request/s with three requests ahead, the next token is ~3 s away: past the
    1.5 s bound, so the delivery is refused at once instead of holding the connection."""
    async with push_rig(tmp_path, LimitsConfig(rate_per_second=1, concurrency=4),
                        max_wait_s=1.5) as rig:
        first = await rig.budget.acquire()
        waiters = [asyncio.create_task(rig.budget.acquire()) for _ in range(2)]
        try:
            await asyncio.sleep(0)  # both run until they hold a slot and wait for a token
            assert rig.budget.snapshot().in_flight == 3
            before = await rig.written()
            status, headers, doc = await rig.post(delivery_body(rig.messages[0]))
            assert status == 429, doc
            assert "no token within 1.5 s" in doc["error"]
            assert int(headers["Retry-After"]) >= 2
            assert await rig.written() == before
            assert rig.partner_requests() == 0
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            rig.budget.release(first, Feedback(Outcome.OTHER))


async def test_a_partner_5xx_is_a_non_2xx_with_retry_after_then_redelivered(rig: Rig) -> None:
    m = rig.messages[4]
    rig.sandbox.state.apply_control({"fault_5xx": 1.0})
    status, headers, doc = await rig.post(delivery_body(m))
    assert status == 503, doc
    assert int(headers["Retry-After"]) >= 1
    op = await rig.ledger.get_operation(m.operation_id)
    assert op is not None
    assert op.state is OpState.RETRY_WAIT
    assert rig.sandbox.state.stats()["injected_5xx"] == 1
    # The courier's "publish again, then ack this copy" only noted the wait: the answer
    # is a non-2xx, so Infrai keeps the message; the ledger names it as the live one.
    assert rig.acked_in_state == [OpState.RETRY_WAIT]
    # Infrai delivers it again once the retry is due; the partner has recovered.
    rig.sandbox.state.apply_control({"fault_5xx": 0.0})
    await asyncio.sleep(max(0.0, (op.due_at or 0.0) - time.time()))  # the retry's own wait
    status, _, doc = await rig.post(delivery_body(m))
    assert status == 200, doc
    assert await rig.state(m) is OpState.DELETED
    assert rig.sandbox.state.executions_of(m.recipient_id) == 1


async def test_a_running_pool_takes_pushes_and_drains(rig: Rig) -> None:
    """As the service runs it: the pool's fetcher finds nothing to pull, pushed
    deliveries are worked alongside, and stop() drains."""
    task = asyncio.create_task(rig.pool.run())
    try:
        answers = await asyncio.gather(*(rig.post(delivery_body(m)) for m in rig.messages))
        assert [a[0] for a in answers] == [200] * N
        assert rig.sandbox.state.stats()["executions"] == N
        assert rig.sandbox.state.stats()["duplicates"] == 0
    finally:
        summary = await rig.pool.stop(1.0)
        await asyncio.wait([task], timeout=5)
    assert task.done()
    assert summary["cut_off"] == 0
    for m in rig.messages:
        assert await rig.state(m) is OpState.DELETED


async def test_push_not_configured_is_404(tmp_path: Path) -> None:
    async with running_api(load_config(tmp_path)) as api:
        body = b'{"message_id": "m", "payload": {}}'
        async with api.client.post("/v1/push/ops", data=body, headers=signed(body)) as resp:
            assert resp.status == 404
            assert "not configured" in (await resp.json())["error"]


# -- infrai push subscribe -----------------------------------------------------------------


def subscription(url: str = "https://cleanup.example.com/v1/push/ops",
                 secret: str = SECRET) -> Subscription:
    return Subscription(queue="ops", url=url, visibility_timeout=60, max_retries=5,
                        dead_letter_queue="ops-dlq", secret=Secret(secret))


def envelope(data: Any, ok: bool = True, status: int = 200, code: str = "") -> web.Response:
    error = None if ok else {"code": code, "message": code.lower(), "hint": ""}
    return web.json_response({"ok": ok, "data": data if ok else None, "error": error,
                              "metadata": {"request_id": "0190-test", "cost_usd": 0,
                                           "latency_ms": 1, "vendor": "stand-in",
                                           "cache_hit": False}}, status=status)


@dataclass
class StandIn:
    """A loopback aiohttp server standing in for Infrai's push_subscribe."""

    refuse_url_field: bool = False
    answer_id: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            body = orjson.loads(await request.read())
            self.requests.append({"method": request.method, "path": request.path,
                                  "headers": dict(request.headers), "body": body})
            if self.refuse_url_field and "url" in body:
                return envelope(None, ok=False, status=400, code="INVALID_ARGUMENT")
            if not self.answer_id:
                return envelope({"queue": body.get("queue")})
            return envelope({"id": f"sub_{len(self.requests)}", "queue": body.get("queue")})

        app = web.Application()
        app.router.add_post("/v1/queue/push_subscribe/{queue}", handle)
        return app


@asynccontextmanager
async def stand_in_client(stand_in: StandIn) -> AsyncIterator[InfraiClient]:
    server = TestServer(stand_in.app(), host="127.0.0.1", port=0)
    await server.start_server()
    client = InfraiClient(InfraiConfig(base_url=str(server.make_url("/")), token=Secret(KEY),
                                       backoff_initial_seconds=0.01))
    await client.start()
    try:
        yield client
    finally:
        await client.close()
        await server.close()


async def test_subscribe_against_the_emulator(emulator: Emulator) -> None:
    """The emulator does not emulate push: it answers push_subscribe 404 (the command
    then says "this Infrai has no push_subscribe route"). Should it learn the route, this
    test must change to read the ID it answers."""
    client = InfraiClient(infrai_config(emulator))
    await client.start()
    try:
        with pytest.raises(InfraiError) as refused:
            await subscribe(client, subscription())
        assert refused.value.status == 404, refused.value
        calls = [c for c in emulator.calls if "push_subscribe" in str(c["route"])]
        assert len(calls) == 1  # one call: a 404 is not retried, nor tried with "endpoint"
    finally:
        await client.close()


async def test_subscribe_sends_the_documented_shape_and_reads_the_id() -> None:
    stand_in = StandIn()
    async with stand_in_client(stand_in) as client:
        out = await subscribe(client, subscription())
        again = await subscribe(client, subscription())
        rotated = await subscribe(client, subscription(secret="a-new-secret"))
    assert out == {"id": "sub_1", "queue": "ops", "url": "https://cleanup.example.com/v1/push/ops",
                   "visibility_timeout": 60, "max_retries": 5, "dead_letter_queue": "ops-dlq"}
    assert SECRET not in orjson.dumps(out).decode()
    first, second, third = stand_in.requests
    assert (first["method"], first["path"]) == ("POST", "/v1/queue/push_subscribe/ops")
    assert first["headers"]["Authorization"] == f"Bearer {KEY}"
    body = first["body"]
    assert body == {"url": "https://cleanup.example.com/v1/push/ops", "queue": "ops",
                    "secret": SECRET, "visibility_timeout": 60, "max_retries": 5,
                    "dead_letter_queue": "ops-dlq", "idempotency_key": body["idempotency_key"]}
    assert first["headers"]["Idempotency-Key"] == body["idempotency_key"]
    # Subscribing twice sends the same key (one subscription); a new secret, a new one.
    assert second["body"]["idempotency_key"] == body["idempotency_key"]
    assert third["body"]["idempotency_key"] != body["idempotency_key"]
    assert rotated["id"] == "sub_3"
    assert again["id"] == "sub_2"  # the stand-in does not dedupe; Infrai replays by key


async def test_subscribe_falls_back_to_the_endpoint_field() -> None:
    stand_in = StandIn(refuse_url_field=True)
    async with stand_in_client(stand_in) as client:
        out = await subscribe(client, subscription())
    assert out["id"] == "sub_2"
    assert "endpoint" in stand_in.requests[1]["body"]
    assert "url" not in stand_in.requests[1]["body"]


async def test_an_answer_without_an_id_is_still_a_subscription() -> None:
    async with stand_in_client(StandIn(answer_id=False)) as client:
        out = await subscribe(client, subscription())
    assert (out["id"], out["queue"]) == (None, "ops")


@pytest.mark.parametrize(("url", "why"), [
    ("http://cleanup.example.com/v1/push/ops", "not https"),
    ("https://10.1.2.3/v1/push/ops", "private or loopback"),
    ("https://127.0.0.1:8443/v1/push/ops", "private or loopback"),
    ("https://[::1]/v1/push/ops", "private or loopback"),
    ("https://localhost/v1/push/ops", "private or loopback"),
    ("https://cleanup.example.com/v1/runs", "must end with /v1/push/ops"),
])
def test_urls_infrai_cannot_deliver_to_are_refused(url: str, why: str) -> None:
    with pytest.raises(SubscribeRefused, match=why):
        check_url(url, "ops")


@contextmanager
def stand_in_thread(stand_in: StandIn) -> Iterator[str]:
    """The stand-in on its own loop, for the command (which runs its own loop)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(stand_in.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_the_command_subscribes(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    stand_in = StandIn()
    with stand_in_thread(stand_in) as url:
        monkeypatch.delenv("CLEANUP_CONFIG", raising=False)
        for var, value in {"INFRAI_API_KEY": KEY, "INFRAI_PUSH_SECRET": SECRET,
                           "CLEANUP_TRIGGER_TOKEN": "a-trigger-token-0123456789abcdef0",
                           "CLEANUP__INFRAI__BASE_URL": url, "CLEANUP__INFRAI__QUEUE": "ops",
                           "CLEANUP__INFRAI__PUSH_URL": f"{url}/v1/push/{{queue}}",
                           "CLEANUP__INFRAI__PUSH_VISIBILITY_TIMEOUT": "45"}.items():
            monkeypatch.setenv(var, value)
        # An http URL on loopback: Infrai could never deliver there.
        assert cli.main(["infrai", "push", "subscribe"]) == 2
        assert "not https" in capsys.readouterr().err
        assert stand_in.requests == []
        assert cli.main(["infrai", "push", "subscribe", "--allow-private"]) == 0
    out = capsys.readouterr().out
    doc = orjson.loads(out)
    assert doc["subscription"]["id"] == "sub_1"
    assert SECRET not in out
    [request] = stand_in.requests
    assert request["body"]["url"] == f"{url}/v1/push/ops"
    assert request["body"]["visibility_timeout"] == 45
    assert request["body"]["secret"] == SECRET
