"""The Infrai adapter against the emulator on loopback: the envelope, retries, blocking
refusals, idempotent publish, the size limit, queue creation, dead-letter redrive."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cleanup_sandbox.infrai import Emulator
from supervisor import metrics
from supervisor.configtypes import Secret
from supervisor.errors import MessageTooLarge, QueueBlocked, QueueError
from supervisor.infrai.queue import InfraiQueue
from supervisor.infrai.settings import InfraiConfig
from supervisor.model import Message
from tests.helpers import EMU_KEY, infrai_config, msg


@pytest.fixture
def emulator_options() -> dict[str, Any]:
    return {"seed": 3}


def config(emulator: Emulator, **overrides: Any) -> InfraiConfig:
    return infrai_config(emulator, **{"queue": "work", **overrides})


@pytest.fixture
async def queue(emulator: Emulator) -> AsyncIterator[InfraiQueue]:
    q = InfraiQueue(config(emulator))
    await q.start()
    try:
        yield q
    finally:
        await q.close()


def calls(emulator: Emulator, route: str) -> list[dict[str, object]]:
    return [c for c in emulator.calls if c["capability"] == route]


async def test_queues_are_created_with_their_dead_letter_queue_once(
        emulator: Emulator, queue: InfraiQueue) -> None:
    await queue.publish([msg(1)])
    await queue.publish([msg(2)])
    created = calls(emulator, "queue.create")
    assert [c["queue"] for c in created] == ["work-dlq", "work"]
    queues = emulator.state.stats()
    assert "work" in queues


async def test_an_existing_queue_is_kept_when_create_conflicts(emulator: Emulator) -> None:
    emulator.config = emulator.config.__class__(api_key=EMU_KEY, create_existing="conflict")
    for _ in range(2):  # two service lives: the second finds the queues there
        q = InfraiQueue(config(emulator, dead_letter_queue="work-dlq"))
        await q.start()
        try:
            await q.publish([msg(1)])
        finally:
            await q.close()
    assert len(await _drain(emulator)) == 2


async def _drain(emulator: Emulator) -> list[Message]:
    q = InfraiQueue(config(emulator, create_queues=False))
    await q.start()
    try:
        got = await q.receive(10, 30)
        return [d.message for d in got]
    finally:
        await q.close()


async def test_ok_false_on_a_200_and_garbage_are_failures_retried(
        emulator: Emulator, queue: InfraiQueue) -> None:
    await queue.publish([msg(0)])  # queues exist
    emulator.set_faults(error_ok_false_200_share=1.0)
    with pytest.raises(QueueError, match=r"not ok|INTERNAL"):
        await queue.publish([msg(1)])
    emulator.set_faults(error_ok_false_200_share=0.0, garbage_share=1.0)
    with pytest.raises(QueueError, match="envelope"):
        await queue.receive(1, 30)
    emulator.set_faults(garbage_share=0.0)
    got = await queue.receive(10, 30)
    # The publishes that failed on their answer never stored a message.
    assert [d.message for d in got] == [msg(0)]


async def test_5xx_bursts_and_resets_are_retried_under_one_key(
        emulator: Emulator, queue: InfraiQueue) -> None:
    await queue.publish([msg(0)])
    emulator.set_faults(error_next=3)
    [mid] = await queue.publish([msg(1)])
    emulator.set_faults(reset_after_share=0.7)
    # Acts, then the connection drops: a retry replays the first answer by its key (and
    # may be reset itself: then the call fails, and still stored one message).
    with contextlib.suppress(QueueError):
        await queue.publish([msg(2)])
    emulator.set_faults(reset_after_share=0.0)
    publishes = [c for c in calls(emulator, "queue.publish") if c["idempotency_key"]]
    keys_for_2 = {c["idempotency_key"] for c in publishes
                  if str(c["idempotency_key"]).startswith("pub-op_2-")}
    assert len(keys_for_2) == 1  # every retry carried the same key
    got = await queue.receive(10, 30)
    by_op = [d.message.operation_id for d in got]
    assert sorted(by_op) == ["op_0", "op_1", "op_2"]  # one message each, none doubled
    assert mid in {d.message_id for d in got}


async def test_429_waits_out_its_retry_after(emulator: Emulator, queue: InfraiQueue) -> None:
    await queue.publish([msg(0)])
    emulator.set_faults(rate_limit_next=1, retry_after=0.3, retry_after_format="fractional")
    started = time.monotonic()
    got = await queue.receive(1, 30)
    assert time.monotonic() - started >= 0.3
    assert [d.message for d in got] == [msg(0)]
    [limited, ok] = calls(emulator, "queue.consume")[-2:]
    assert (limited["status"], ok["status"]) == (429, 200)


@pytest.mark.parametrize(("fault", "code"), [("unauthorized", "UNAUTHORIZED"),
                                        ("credit_exhausted", "INSUFFICIENT_CREDIT")])
async def test_a_refusal_blocks_until_it_clears(emulator: Emulator, queue: InfraiQueue,
                                                fault: str, code: str) -> None:
    await queue.publish([msg(0)])
    emulator.set_faults(**{fault: True})
    tries = len(emulator.calls)
    with pytest.raises(QueueBlocked) as info:
        await queue.receive(1, 30)
    assert info.value.code == code
    assert len(emulator.calls) == tries + 1  # not retried: only an operator can fix it
    assert not queue.healthy
    assert metrics.TRANSPORT_BLOCKED.labels(code)._value.get() == 1
    emulator.set_faults(**{fault: False})
    [d] = await queue.receive(1, 30)  # resumes, nothing lost
    assert d.message == msg(0)
    assert queue.healthy
    assert metrics.TRANSPORT_BLOCKED.labels(code)._value.get() == 0


async def test_a_message_over_256_kb_is_refused_before_it_is_sent(
        emulator: Emulator, queue: InfraiQueue) -> None:
    before = len(calls(emulator, "queue.publish"))
    with pytest.raises(MessageTooLarge, match="op_1"):
        await queue.publish([msg(1, recipient="x" * (256 * 1024))])
    assert len(calls(emulator, "queue.publish")) == before


async def test_a_wrong_shaped_message_is_acked_and_dropped(
        emulator: Emulator, queue: InfraiQueue) -> None:
    await queue.publish([msg(1)])
    emulator.state.publish("work", {"hello": "not ours"})
    got = await queue.receive(10, 30)
    assert [d.message for d in got] == [msg(1)]
    emulator.advance(61)
    again = await queue.receive(10, 30)
    assert [d.message for d in again] == [msg(1)]  # the foreign one is gone for good


async def test_dead_letters_are_redriven(emulator: Emulator) -> None:
    q = InfraiQueue(config(emulator, nack_path="/v1/queue/nack", max_retries=1))
    emulator.config = emulator.config.__class__(api_key=EMU_KEY, nack_route="/v1/queue/nack")
    await q.start()
    try:
        await q.publish([msg(1)])
        nacks = 0
        while got := await q.receive(1, 30):  # nacked until Infrai dead-letters it
            await q.nack(got[0], 0)
            nacks += 1
            assert nacks <= 2
        assert nacks >= 1
        result = await q.channel.redrive_dead_letters()
        assert result["moved"] == 1
        [d] = await q.receive(1, 30)
        assert d.message == msg(1)
    finally:
        await q.close()


async def test_an_unknown_refusal_code_does_not_become_a_metric_label() -> None:
    # Review L4: Infrai's own error text named the series; any text it sends must not
    # grow them. A real server on loopback answering 403 with a code of its own.
    from aiohttp import web

    from supervisor.infrai.client import InfraiClient

    codes = iter(f"WEIRD_{i}\nX" for i in range(5))

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"ok": False, "error": {"code": next(codes)}}, status=403)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = InfraiClient(InfraiConfig(base_url=f"http://127.0.0.1:{port}", token=Secret(EMU_KEY),
                                       queue="work"))
    await client.start()
    try:
        for _ in range(5):
            with pytest.raises(QueueBlocked):
                await client.call("queue.consume", "v1/queue/consume", {})
    finally:
        await client.close()
        await runner.cleanup()
    labels = {s.labels["reason"] for family in metrics.TRANSPORT_BLOCKED.collect()
              for s in family.samples}
    assert not any(label.startswith("WEIRD") for label in labels)
    assert metrics.TRANSPORT_BLOCKED.labels("FORBIDDEN")._value.get() == 1
