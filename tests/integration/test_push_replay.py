"""Push deliveries cannot be replayed into harm (REVIEW-SECURITY M3, M4): a captured signed
delivery sent again, however often and however spelt, is answered from memory and never
reaches the ledger; Infrai's own redelivery of a message counts one receive; copies under
other message IDs cannot poison an operation someone holds (a retry wait, an attempt in
the air); and the pool keeps nothing per delivery. Real app on loopback, real SQLite
ledger, the partner simulator."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from supervisor.model import Disposition, Message, Settlement
from supervisor.push import PushEntry, parse_delivery
from supervisor.states import OpState
from tests.helpers import writer_held

from .test_push import Rig, delivery_body, push_rig, signed

# Long enough that a retry wait is still in force while the test replays into it.
SLOW_BACKOFF = (60.0, 60.0)
COPIES = 25  # past queue.max_receives (20), as in the review's probe


def replayed_total() -> float:
    return REGISTRY.get_sample_value("cleanup_push_deliveries_total",
                                     {"result": "replayed"}) or 0.0


async def receives(rig: Rig, m: Message) -> int:
    row = await rig.db.read_one("SELECT receives FROM operations WHERE id = ?",
                                (m.operation_id,))
    assert row is not None
    return int(row[0])


async def in_retry_wait(rig: Rig, m: Message) -> tuple[bytes, dict[str, str], int, str]:
    """Deliver ``m`` once against a failing partner: the operation waits for its retry
    (30-60 s). What a capture holds: the body and headers, and what they were answered."""
    rig.sandbox.state.apply_control({"fault_5xx": 1.0})
    body = delivery_body(m)
    headers = signed(body)
    status, answer_headers, doc = await rig.post(body, headers)
    assert status == 503, doc
    op = await rig.ledger.get_operation(m.operation_id)
    assert op is not None
    assert op.state is OpState.RETRY_WAIT
    assert (op.due_at or 0) - time.time() > 20
    rig.sandbox.state.apply_control({"fault_5xx": 0.0})  # a resend now would succeed
    return body, headers, int(answer_headers["Retry-After"]), doc["error"]


async def test_a_captured_delivery_replayed_25_times_in_a_retry_wait_changes_nothing(
        tmp_path: Path) -> None:
    async with push_rig(tmp_path, backoff_s=SLOW_BACKOFF) as rig:
        m = rig.messages[0]
        body, headers, retry_after, error = await in_retry_wait(rig, m)
        before, count = await rig.written(), await receives(rig, m)
        requests, replays = rig.partner_requests(), replayed_total()
        # The same signature however it is spelt: bare, upper case, inside a rotation list.
        digest = headers["X-Infrai-Signature"].removeprefix("sha256=")
        spellings = [headers, {**headers, "X-Infrai-Signature": digest},
                     {**headers, "X-Infrai-Signature": digest.upper()},
                     {**headers, "X-Infrai-Signature": f"sha256={'0' * 64}, sha256={digest}"}]
        answers = await asyncio.gather(*(rig.post(body, spellings[i % len(spellings)])
                                         for i in range(COPIES)))
        for status, answer_headers, doc in answers:
            # Answered as the original was: deliver again later, no sooner than told.
            assert status == 503, doc
            assert doc["error"] == error
            assert 1 <= int(answer_headers["Retry-After"]) <= retry_after
        assert replayed_total() - replays == COPIES
        # Not a byte of the ledger changed: no receive counted, nothing failed or sent.
        assert await rig.written() == before
        assert await receives(rig, m) == count
        assert await rig.state(m) is OpState.RETRY_WAIT
        assert rig.partner_requests() == requests


async def test_copies_under_other_message_ids_cannot_poison_a_retry_wait(
        tmp_path: Path) -> None:
    """Copies the cache cannot know (each with a message ID and signature of its own) are
    counted, and all 25 counts land in one group commit, past max_receives: the operation
    still waits for its retry, since a retry not yet due is somebody's."""
    async with push_rig(tmp_path, backoff_s=SLOW_BACKOFF) as rig:
        m = rig.messages[0]
        await in_retry_wait(rig, m)
        attempts = len(await rig.ledger.attempts(m.operation_id))
        copies = [parse_delivery(delivery_body(m, message_id=f"copy-{i}"))
                  for i in range(COPIES)]
        async with writer_held(rig.db) as release:
            tasks = [asyncio.create_task(PushEntry(rig.pool, rig.queue).handle_pushed(d)) for d in copies]
            await asyncio.sleep(0)  # each has queued its receive behind the held writer
            await release()
        outcomes = await asyncio.gather(*tasks)
        assert {(o.status, o.result) for o in outcomes} == {(503, "retry")}
        op = await rig.ledger.get_operation(m.operation_id)
        assert op is not None
        assert op.state is OpState.RETRY_WAIT, op.reason
        assert (op.due_at or 0) - time.time() > 20  # its wait, not cut short by a copy
        assert len(await rig.ledger.attempts(m.operation_id)) == attempts
        assert rig.partner_requests() == 1


async def test_replays_and_redeliveries_during_an_attempt_leave_it_alone(
        tmp_path: Path) -> None:
    """While the first delivery's DELETE is in the air: the captured request replayed, the
    message delivered again by Infrai (signed anew), and copies under 25 other message IDs.
    None closes the live attempt, makes the operation ambiguous or sends a second DELETE;
    Infrai's redeliveries of the one message count one receive."""
    async with push_rig(tmp_path) as rig:
        m = rig.messages[0]
        state = rig.sandbox.state
        state.apply_control({"latency_ms": 5000})  # the first DELETE stays in the air
        body = delivery_body(m)
        now = int(time.time())
        first = asyncio.create_task(rig.post(body, signed(body, ts=str(now))))
        async with asyncio.timeout(10):
            await state.wait_until(lambda: state.stats()["requests"] >= 1)
        state.apply_control({"latency_ms": 0})
        replays = await asyncio.gather(*(rig.post(body, signed(body, ts=str(now)))
                                         for _ in range(COPIES)))
        assert {(a[0], a[2]["error"]) for a in replays} == {
            (503, "a copy of this delivery is being worked")}
        assert await receives(rig, m) == 1
        # Infrai's own redeliveries: a new timestamp, so a new signature, the same message.
        for later in (1, 2, 3):
            status, _, doc = await rig.post(body, signed(body, ts=str(now + later)))
            assert (status, doc["error"]) == (503, "the operation is in flight"), doc
        assert await receives(rig, m) == 1
        others = [delivery_body(m, message_id=f"copy-{i}") for i in range(COPIES)]
        answers = await asyncio.gather(*(rig.post(b) for b in others))
        assert {a[0] for a in answers} == {503}
        assert await receives(rig, m) > 20  # counted: each is a message of its own
        # All of that while the DELETE was still in the air, or this test proves nothing.
        op = await rig.ledger.get_operation(m.operation_id)
        assert op is not None
        assert (op.state, op.unfinished_attempt) == (OpState.IN_FLIGHT, True)
        [live] = await rig.ledger.attempts(m.operation_id)
        assert (live.finished_at, live.outcome) == (None, None)

        status, _, doc = await first
        assert status == 200, doc
        op = await rig.ledger.get_operation(m.operation_id)
        assert op is not None
        assert (op.state, op.attempts) == (OpState.DELETED, 1)
        [attempt] = await rig.ledger.attempts(m.operation_id)
        assert attempt.outcome == "deleted"
        assert state.stats()["requests"] == 1
        assert state.executions_of(m.recipient_id) == 1
        # The replay of a settled delivery is its 200, still without the ledger.
        before = await rig.written()
        status, _, doc = await rig.post(body, signed(body, ts=str(now)))
        assert (status, doc["ok"]) == (200, True), doc
        assert await rig.written() == before


@pytest.mark.parametrize("deliveries", [10_000])
async def test_the_pool_keeps_nothing_per_pushed_delivery(tmp_path: Path,
                                                           deliveries: int) -> None:
    """10,000 deliveries through the push entry and the real ledger: some settle at the
    partner, most are deferred (a retry not yet due), some find their operation settled.
    What the pool and its queue track stays flat, at nothing once each is answered."""
    async with push_rig(tmp_path) as rig:
        settled, waiting = rig.messages[:4], rig.messages[4:]
        for m in settled:
            status, _, doc = await rig.post(delivery_body(m))
            assert status == 200, doc
        for m in waiting:  # an attempt answered 503: its retry is due in an hour
            d = parse_delivery(delivery_body(m))
            await rig.ledger.note_received([d], 30)
            attempt = await rig.ledger.begin_attempt(m.operation_id, "delete", owner=d.receipt)
            await rig.ledger.settle([Settlement(
                m.operation_id, OpState.RETRY_WAIT, d, Disposition.RETRY, delay_s=3600,
                attempt_id=attempt, status=503, outcome="transient", detail="HTTP 503")])
        pool, queue = rig.pool, rig.queue
        entry = PushEntry(pool, queue)
        sizes = []
        batch = 100
        for start in range(0, deliveries, batch):
            chunk = [parse_delivery(delivery_body(rig.messages[i % len(rig.messages)],
                                                  message_id=f"m-{i}"))
                     for i in range(start, start + batch)]
            outcomes = await asyncio.gather(*(entry.handle_pushed(d) for d in chunk))
            assert {o.status for o in outcomes} <= {200, 503}, outcomes
            if (start + batch) % 1000 == 0:
                sizes.append((len(pool.settler.moved), len(pool.fetcher.held), len(queue._open),
                              len(pool._phases)))
        assert len(sizes) == deliveries // 1000
        assert set(sizes) == {(0, 0, 0, 0)}, sizes
        for m in waiting:
            assert await rig.state(m) is OpState.RETRY_WAIT
        assert rig.partner_requests() == len(settled)
