"""Completion events: the ledger outbox written with each state change, delivered to three
sinks (an Infrai queue on the emulator, two signed webhooks on loopback aiohttp servers),
one of them down for a while. Every event reaches every sink, once after dedup by event ID,
in order; deletions never wait on a sink; lag rises for the down sink only; a new relay on
the same ledger resumes at the stored cursor; delivered events are pruned in batches."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import REGISTRY

from cleanup_sandbox import SandboxConfig, run_sandbox
from cleanup_sandbox.infrai import Emulator
from cleanup_sandbox.state import recipient_ids
from supervisor import composition
from supervisor.authsettings import TriggerConfig
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig, ServiceConfig
from supervisor.configtypes import Secret
from supervisor.errors import IllegalTransition
from supervisor.events.relay import REFRESH_S, EventRelay, SinkWorker
from supervisor.events.settings import EventsConfig, SinkConfig
from supervisor.events.sinks import (
    SinkError,
    WebhookSink,
    batch_body,
    idempotency_key,
    signature,
)
from supervisor.infrai.channel import InfraiChannel
from supervisor.infrai.settings import InfraiConfig
from supervisor.model import Event, Settlement
from supervisor.queue.settings import QueueConfig
from supervisor.service import Service
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.states import OpState
from tests.helpers import HoldWriter, eventually, infrai_config, open_run
from tests.receivers import HOOK_SECRET as SECRET
from tests.receivers import Hook

EVENTS_QUEUE = "cleanup-events"
_names = itertools.count()


def unique(prefix: str) -> str:
    """Sink names unique in this process: the metrics registry is global."""
    return f"{prefix}-{next(_names)}"


def sample(name: str, sink: str) -> float:
    value = REGISTRY.get_sample_value(name, {"sink": sink})
    return 0.0 if value is None else value


def events_config(*sinks: SinkConfig, **kw: Any) -> EventsConfig:
    kw.setdefault("poll_interval_seconds", 0.05)
    kw.setdefault("backoff_initial_seconds", 0.02)
    kw.setdefault("backoff_max_seconds", 0.2)
    return EventsConfig(sink=sinks, **kw)


def webhook(name: str, hook: Hook, **kw: Any) -> SinkConfig:
    return SinkConfig(name=name, kind="webhook", url=hook.url, secret_env="HOOK_SECRET",
                      secret=Secret(SECRET), timeout_seconds=2.0, **kw)


@asynccontextmanager
async def running(relay: EventRelay) -> AsyncIterator[list[asyncio.Task[None]]]:
    """The relay's components as the supervisor runs them: one task each."""
    await relay.start()
    tasks = [asyncio.create_task(x.run(), name=x.name)
             for x in relay.components() if x.run is not None]
    try:
        yield tasks
        for t in tasks:  # none may have died meanwhile
            assert not t.done(), (t.get_name(), t.exception() if not t.cancelled() else None)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await relay.close()


async def operation_ids(ledger: SqliteLedger, run_id: str) -> list[str]:
    return [op.id for op in await ledger.list_operations(run_id, None, None, 10_000)]


async def settle(ledger: SqliteLedger, op_id: str, target: OpState) -> float:
    """One attempt and its outcome, as a consumer worker records them; returns how long
    the settlement took."""
    attempt = await ledger.begin_attempt(op_id, "delete")
    began = time.monotonic()
    await ledger.settle([Settlement(op_id, target, None, attempt_id=attempt,
                                    outcome=target.value)])
    return time.monotonic() - began


async def all_events(ledger: SqliteLedger) -> list[Event]:
    return await ledger.events_after(0, 100_000)


def first_seen(ids: list[str]) -> list[str]:
    """Dedup by event ID, keeping the first delivery: what a receiver keeps."""
    return list(dict.fromkeys(ids))


def new_relay(config: EventsConfig, ledger: SqliteLedger,
              infrai: InfraiConfig | None = None, refresh_s: float = REFRESH_S) -> EventRelay:
    """A relay over the sinks the composition root builds for ``config``."""
    sinks = composition.build_sinks(config, infrai or InfraiConfig())
    return EventRelay(config, ledger, sinks, refresh_s=refresh_s)


async def drain_queue(queue: InfraiChannel, into: list[dict[str, Any]]) -> None:
    while True:
        items = await queue.consume(10, 30)
        if not items:
            return
        for item in items:
            payload = item.get("payload", item.get("body"))
            if isinstance(payload, str | bytes):
                payload = orjson.loads(payload)
            into += payload["events"]
            await queue.ack_id(item["message_id"])


# -- the outbox, in the transaction of each change -------------------------------------------


async def test_each_event_commits_with_its_change_in_the_group_commit(
        db: Database, ledger: SqliteLedger, hold_writer: HoldWriter) -> None:
    """SQLite's part: a state change and its event are one commit, an illegal settlement
    sharing a group commit with a legal one leaves only the legal one's event, and one
    writer keeps the outbox gapless. (Which changes write which events, the cursors,
    backlog and pruning: tests/contract/test_ledger.py, on every backend.)"""
    run = await open_run(ledger, ids=[f"r-{i}" for i in range(4)])
    ops = await operation_ids(ledger, run.id)
    attempt = await ledger.begin_attempt(ops[0], "delete")
    commits = db.commits
    await ledger.settle([Settlement(ops[0], OpState.DELETED, None, attempt_id=attempt)])
    assert db.commits == commits + 1  # state change and event: one commit
    attempt = await ledger.begin_attempt(ops[1], "delete")
    async with hold_writer() as release:
        legal = asyncio.ensure_future(ledger.settle([Settlement(ops[1], OpState.DELETED, None,
                                                                attempt_id=attempt)]))
        illegal = asyncio.ensure_future(ledger.settle([Settlement(ops[2], OpState.DELETED,
                                                                  None)]))
        await asyncio.sleep(0.05)  # both join the batch after the held one
        commits = await release()
    await legal
    assert db.commits == commits + 1
    with pytest.raises(IllegalTransition):
        await illegal
    for op in ops[2:]:
        await settle(ledger, op, OpState.FAILED)
    assert await ledger.finish_runs() == [run.id]
    every = await all_events(ledger)
    assert [(e.operation_id, e.outcome) for e in every] == [
        (ops[0], "deleted"), (ops[1], "deleted"), (ops[2], "failed"), (ops[3], "failed"),
        (None, None)]
    assert [e.seq for e in every] == list(range(1, len(every) + 1))  # gapless, in order


async def test_the_relay_prunes_what_every_configured_sink_took(ledger: SqliteLedger) -> None:
    run = await open_run(ledger, ids=[f"r-{i}" for i in range(25)])
    for op in await operation_ids(ledger, run.id):
        await settle(ledger, op, OpState.DELETED)
    hook = Hook()
    a, b = unique("prune-a"), unique("prune-b")
    config = events_config(webhook(a, hook), webhook(b, hook), retain_seconds=0,
                           prune_batch=4)
    relay = new_relay(config, ledger)
    await ledger.save_event_cursor(a, 25)
    await ledger.save_event_cursor(b, 18)
    assert await relay.prune() == 18  # 4 + 4 + 4 + 4 + 2: bounded batches
    assert [e.seq for e in await ledger.events_after(0, 100)] == list(range(19, 26))


# -- delivery -------------------------------------------------------------------------------


async def test_three_sinks_one_down_every_event_reaches_every_sink_once_in_order(
        ledger: SqliteLedger, emulator: Emulator) -> None:
    up, down = Hook(), Hook()
    await up.start()  # `down` refuses connections: nothing listens on its port yet
    q, a, b = unique("queue"), unique("hook-up"), unique("hook-down")
    config = events_config(
        SinkConfig(name=q, kind="infrai", queue=EVENTS_QUEUE, batch_size=7),
        webhook(a, up, batch_size=5), webhook(b, down, batch_size=10))
    relay = new_relay(config, ledger, infrai_config(emulator), refresh_s=0.05)
    failures_before = {s: sample("cleanup_events_sink_failures_total", s) for s in (q, a, b)}
    delivered_before = {s: sample("cleanup_events_delivered_total", s) for s in (q, a, b)}
    run = await open_run(ledger, ids=[f"r-{i:03d}" for i in range(60)])
    ops = await operation_ids(ledger, run.id)
    targets = [OpState.DELETED, OpState.DELETED, OpState.ALREADY_ABSENT, OpState.FAILED,
               OpState.AMBIGUOUS]
    async with running(relay):
        # Deletions go on at full speed while `down` refuses every connection: the
        # settle path only writes rows, it never waits on a sink.
        took = await asyncio.gather(*(settle(ledger, op, targets[i % len(targets)])
                                      for i, op in enumerate(ops)))
        assert max(took) < 1.0, max(took)
        for op in ops[4::5]:  # the ambiguous ones are resolved later: events too
            await ledger.record_evidence(op, "probe", OpState.DELETED, "probe: gone", "404")
        assert await ledger.finish_runs() == [run.id]
        expected = [e.id for e in await all_events(ledger)]
        assert len(expected) == 60 + 12 + 1
        assert down.events == []  # every settlement committed with that sink down
        # The other two take everything; the down one's lag grows, theirs is 0.
        await eventually(lambda: up.ids()[-1:] == expected[-1:], what="the up webhook")
        await eventually(lambda: sample("cleanup_events_sink_lag_events", b) == len(expected)
                         and sample("cleanup_events_sink_lag_events", a) == 0
                         and sample("cleanup_events_sink_lag_events", q) == 0,
                         what="the lag gauges")
        first_age = sample("cleanup_events_sink_lag_seconds", b)
        await asyncio.sleep(0.3)  # let the down sink's lag age
        assert sample("cleanup_events_sink_lag_seconds", b) > max(first_age, 0.2)
        assert sample("cleanup_events_sink_lag_seconds", a) == 0
        assert sample("cleanup_events_sink_lag_seconds", q) == 0
        # It listens again but answers 503 for a while, then recovers.
        down.status = 503
        await down.start()
        await eventually(lambda: down.refused >= 2, what="503s")
        down.status = 200
        await eventually(lambda: sample("cleanup_events_sink_lag_events", b) == 0
                         and sample("cleanup_events_sink_lag_seconds", b) == 0,
                         what="the down sink to catch up")
    await up.stop()
    await down.stop()
    queued: list[dict[str, Any]] = []
    async with composition.infrai_session(infrai_config(emulator, create_queues=False),
                                          EVENTS_QUEUE) as channel:
        await drain_queue(channel, queued)
    for sink_ids in ([e["id"] for e in queued], up.ids(), down.ids()):
        assert first_seen(sink_ids) == expected  # every event, in order, once after dedup
    assert up.bad_signatures == down.bad_signatures == 0
    assert all(len(ids) <= 5 for _, ids in up.requests)  # its batch size
    assert sample("cleanup_events_sink_failures_total", b) - failures_before[b] >= 3
    assert sample("cleanup_events_sink_failures_total", a) == failures_before[a]
    assert sample("cleanup_events_sink_failures_total", q) == failures_before[q]
    for s in (q, a, b):
        assert sample("cleanup_events_delivered_total", s) - delivered_before[s] == len(expected)
    # What a receiver sees: identifiers and an outcome, never more.
    settled = next(e for e in queued if e["kind"] == "operation.settled")
    assert set(settled) == {"id", "kind", "at", "run_id", "operation_id", "recipient_id",
                            "outcome"}
    finished = queued[-1]
    assert finished["kind"] == "run.finished"
    assert finished["counts"] == {"deleted": 36, "already_absent": 12, "failed": 12}


async def test_a_new_relay_resumes_at_the_stored_cursor(ledger: SqliteLedger) -> None:
    hook = Hook()
    await hook.start()
    name = unique("resume")
    config = events_config(webhook(name, hook, batch_size=4))
    run = await open_run(ledger, ids=[f"r-{i:03d}" for i in range(30)])
    ops = await operation_ids(ledger, run.id)
    for op in ops[:10]:
        await settle(ledger, op, OpState.DELETED)
    first = new_relay(config, ledger)
    async with running(first):
        await eventually(lambda: len(hook.events) == 10, what="the first ten")
        await eventually(lambda: first.workers[0].cursor == 10, what="the cursor")
    assert await ledger.event_cursor(name) == 10
    for op in ops[10:20]:
        await settle(ledger, op, OpState.DELETED)
    second = new_relay(config, ledger)  # a restart: a new instance
    async with running(second):
        await eventually(lambda: len(hook.events) == 20, what="the next ten")
        await eventually(lambda: second.workers[0].cursor == 20, what="the cursor")
    assert hook.ids() == [e.id for e in await all_events(ledger)]  # nothing sent twice

    # Stopped while a batch is in the air (the receiver took it, its answer is lost):
    # that batch, and only that one, is sent again.
    for op in ops[20:30]:
        await settle(ledger, op, OpState.DELETED)
    gate = hook.hold = asyncio.Event()
    third = new_relay(config, ledger)
    async with running(third):
        await asyncio.wait_for(hook.held.wait(), 10)
    in_flight = hook.requests[-1][1]
    assert len(in_flight) == 4
    assert await ledger.event_cursor(name) == 20
    hook.hold = None
    gate.set()  # the receiver's handler ends; its answer goes nowhere
    fourth = new_relay(config, ledger)
    async with running(fourth):
        await eventually(lambda: fourth.workers[0].cursor == 30, what="the last ten")
    await hook.stop()
    expected = [e.id for e in await all_events(ledger)]
    assert first_seen(hook.ids()) == expected
    again = [i for i in hook.ids() if hook.ids().count(i) > 1]
    assert set(again) == set(in_flight)
    assert len(hook.ids()) == len(expected) + len(in_flight)


async def test_the_service_runs_a_sink_and_its_events_follow_the_deletions(
        tmp_path: Path) -> None:
    """The wiring: a configured sink runs under the supervisor, a settlement wakes it, the
    monitor's finished run is an event too, and a stop ends the sink with the rest."""
    hook = Hook()
    await hook.start()
    name = unique("service")
    ids = recipient_ids(12)
    async with run_sandbox(SandboxConfig(recipients=12, absent_share=0.25,
                                         rate_per_second=0)) as sandbox:
        config = Config(
            service=ServiceConfig(data_dir=tmp_path / "var", listen="127.0.0.1:0",
                                  shutdown_grace_seconds=2),
            trigger=TriggerConfig(token=Secret("trigger-token")),
            queue=QueueConfig(poll_interval_seconds=0.05),
            partner=PartnerConfig(base_url=sandbox.url, probe_path=""),
            limits=LimitsConfig(rate_per_second=200, concurrency=4),
            events=events_config(webhook(name, hook), poll_interval_seconds=2.0))
        service = Service(config)
        task = asyncio.create_task(service.run())
        try:
            async with asyncio.timeout(10):
                await service.started.wait()
            async with aiohttp.ClientSession() as http, http.post(
                    f"{service.url}/v1/runs", json={"recipient_ids": ids},
                    headers={"Authorization": "Bearer trigger-token"}) as resp:
                assert resp.status == 201, await resp.text()
            # Each settlement wakes the sink: its events do not wait for the next poll.
            await eventually(lambda: len(hook.events) >= 12, within_s=1.5,
                             what="the settled events, before the sink's next poll")
            await eventually(lambda: any(e["kind"] == "run.finished" for e in hook.events),
                             what="the run.finished event")
        finally:
            service.request_stop()
            assert await asyncio.wait_for(task, 15) == 0
            await hook.stop()
    settled = [e for e in hook.events if e["kind"] == "operation.settled"]
    assert sorted(e["recipient_id"] for e in settled) == ids
    assert {e["outcome"] for e in settled} <= {"deleted", "already_absent"}
    assert len(first_seen(hook.ids())) == len(hook.ids()) == 13
    assert hook.events[-1]["kind"] == "run.finished"


async def test_webhook_requests_are_signed_and_keyed_by_event_id(ledger: SqliteLedger) -> None:
    hook = Hook(signed="body")
    await hook.start()
    run = await open_run(ledger, ids=["r-1", "r-2", "r-3"])
    ops = await operation_ids(ledger, run.id)
    await settle(ledger, ops[0], OpState.DELETED)
    sink = WebhookSink(webhook(unique("signed"), hook, signed="body"))
    await sink.start()
    try:
        [one] = await all_events(ledger)
        assert await sink.deliver([one]) == 1
        for op in ops[1:]:
            await settle(ledger, op, OpState.DELETED)
        three = await all_events(ledger)
        assert await sink.deliver(three) == 3
    finally:
        await sink.close()
        await hook.stop()
    assert hook.bad_signatures == 0
    # One event: its own ID is the key; a batch: first..last, the same on every retry.
    assert hook.requests == [(one.id, [one.id]),
                             (f"{three[0].id}..{three[-1].id}", [e.id for e in three])]
    assert idempotency_key(three) == f"{three[0].id}..{three[-1].id}"


async def test_a_receivers_error_text_is_escaped_bounded_and_its_url_tokens_cut(
        ledger: SqliteLedger) -> None:
    """Issue 17, L8: what a sink answers goes into logs; it cannot forge a line there, nor
    fill it, and a token in a sink's URL does not reach it through aiohttp's errors."""
    hook = Hook()
    hook.status = 500
    hook.refusal = "oops\n2026-01-01 INFO supervisor: operator logged in\x1b[2J" + "x" * 5000
    await hook.start()
    run = await open_run(ledger, ids=["r-1"])
    await settle(ledger, (await operation_ids(ledger, run.id))[0], OpState.DELETED)
    [event] = await all_events(ledger)
    sink = WebhookSink(webhook(unique("chatty"), hook))
    await sink.start()
    try:
        with pytest.raises(SinkError) as refused:
            await sink.deliver([event])
    finally:
        await sink.close()
        await hook.stop()
    text = str(refused.value)
    assert text.startswith("HTTP 500: oops\\n2026-01-01 INFO"), text
    assert "\n" not in text
    assert "\x1b" not in text
    assert len(text) < 300
    secret_url = "http://user:pw-secret@127.0.0.1:99999/hooks/sk_live_TOKEN?sig=TOKEN2"
    sink = WebhookSink(SinkConfig(name=unique("bad-url"), kind="webhook", url=secret_url,
                                  secret_env="HOOK_SECRET", secret=Secret(SECRET)))
    await sink.start()
    try:
        with pytest.raises(SinkError) as failed:
            await sink.deliver([event])
    finally:
        await sink.close()
    text = str(failed.value)
    assert "http://127.0.0.1:99999/..." in text, text
    assert "TOKEN" not in text, text
    assert "pw-secret" not in text, text


async def test_a_wrong_secret_is_refused_and_retried_not_skipped(ledger: SqliteLedger) -> None:
    hook = Hook(secret="another-secret")
    await hook.start()
    name = unique("wrong-secret")
    relay = new_relay(events_config(webhook(name, hook)), ledger)
    run = await open_run(ledger, ids=["r-1"])
    await settle(ledger, (await operation_ids(ledger, run.id))[0], OpState.DELETED)
    async with running(relay):
        await eventually(lambda: hook.bad_signatures >= 2, what="refusals")
        assert relay.workers[0].cursor == 0  # nothing acknowledged, nothing skipped
    await hook.stop()
    assert hook.events == []


def test_signature_is_hmac_sha256_of_timestamp_and_raw_body() -> None:
    body = b'{"events":[]}'
    mac = hmac.new(b"k", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert signature(b"k", "1700000000", body) == f"sha256={mac}"
    plain = hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert signature(b"k", "1700000000", body, "body") == f"sha256={plain}"


def test_a_batch_too_large_for_one_delivery_is_cut_to_fit() -> None:
    events = [Event(seq=i, id=f"ev_{i:04d}", kind="operation.settled", at=1.7e9, run_id="run_1",
                    operation_id=f"op_{i}", recipient_id="r" * 200, outcome="deleted")
              for i in range(1, 41)]
    n, payload, raw = batch_body(events, max_bytes=3000)
    assert 1 <= n < 40
    assert len(raw) <= 3000
    assert [e["id"] for e in payload["events"]] == [f"ev_{i:04d}" for i in range(1, n + 1)]
    assert batch_body(events[:1], max_bytes=10)[0] == 1  # one always goes


def test_backoff_is_capped_jittered_and_honours_retry_after() -> None:
    config = EventsConfig(backoff_initial_seconds=0.5, backoff_max_seconds=8.0)
    worker = SinkWorker(WebhookSink(SinkConfig(name="x", kind="webhook", url="http://x/",
                                               secret=Secret("s"))),
                        ledger_stub(), config, 10, rng=lambda: 1.0)
    delays = []
    for failures in range(1, 9):
        worker.failures = failures
        delays.append(worker.backoff(None))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    worker.rng = lambda: 0.0
    assert worker.backoff(None) == 4.0  # jitter over the upper half
    assert worker.backoff(3.0) == 3.0  # the receiver's wait, not jittered
    assert worker.backoff(600.0) == 8.0  # capped
    assert worker.backoff(0.0) == 0.5  # never a hot loop


def ledger_stub() -> Any:
    return object()
