"""The SQLite ledger on a real file: run dedup, idempotent discovery, the state machine at the
storage boundary, attempts, settlement with the ack in the same transaction, finishing runs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.errors import IllegalTransition, OperationBusy
from supervisor.ledger.base import Disposition, Published, Run, Settlement
from supervisor.ledger.database import Database
from supervisor.ledger.sqlite import SqliteLedger, new_operation_id
from supervisor.queue.base import Delivery
from supervisor.queue.courier import Courier
from supervisor.queue.sqlite import SqliteQueue
from supervisor.states import OpState, RunState

from .conftest import HoldWriter

INLINE = {"kind": "inline"}


async def open_run(ledger: SqliteLedger, tick: str = "weekly@2024-01-01T02:00:00+00:00",
                   **kw: Any) -> Run:
    kw.setdefault("skip_if_unfinished", False)
    result = await ledger.open_run(tick, kw.pop("schedule", "weekly"), None, INLINE, **kw)
    assert result.run is not None
    return result.run


async def message_count(db: Database) -> int:
    row = await db.read_one("SELECT COUNT(*) FROM messages")
    assert row is not None
    return int(row[0])


async def discovered_run(ledger: SqliteLedger, queue: SqliteQueue, ids: list[str]) -> Run:
    """A run whose operations are discovered, published and queued: ready to consume."""
    run = await open_run(ledger)
    await ledger.record_page(run.id, ids, None, 0)
    batch = await ledger.unpublished(1000)
    await Courier(ledger, queue).publish(batch)
    return run


async def take(queue: SqliteQueue, lease_s: float = 60.0) -> Delivery:
    deliveries = await queue.receive(1, lease_s)
    assert len(deliveries) == 1
    return deliveries[0]


# -- runs ------------------------------------------------------------------------------------


async def test_a_tick_delivered_twice_opens_one_run(ledger: SqliteLedger) -> None:
    first = await ledger.open_run("weekly@slot-1", "weekly", 1.0e9, INLINE, True)
    second = await ledger.open_run("weekly@slot-1", "weekly", 1.0e9, INLINE, True)
    assert first.created
    assert not second.created
    assert first.run is not None
    assert second.run is not None
    assert second.run.id == first.run.id
    assert first.run.state is RunState.SCANNING
    assert first.run.scheduled_for == 1.0e9
    assert len(await ledger.list_runs(10)) == 1


async def test_reuse_within_matches_a_recent_run_of_the_same_schedule(ledger: SqliteLedger) -> None:
    first = await open_run(ledger, "weekly@a")
    again = await ledger.open_run("weekly@b", "weekly", None, INLINE, False, reuse_within_s=600)
    assert not again.created
    assert again.run is not None
    assert again.run.id == first.id
    other = await ledger.open_run("daily@b", "daily", None, INLINE, False, reuse_within_s=600)
    assert other.created  # another schedule is not a retry of this one
    fresh = await ledger.open_run("weekly@c", "weekly", None, INLINE, False)
    assert fresh.created  # no reuse window: a different tick key is a different run


async def test_overlap_skip_while_a_run_is_unfinished(ledger: SqliteLedger) -> None:
    busy = await open_run(ledger, "weekly@1")
    skipped = await ledger.open_run("weekly@2", "weekly", None, INLINE, skip_if_unfinished=True)
    assert skipped.run is None
    assert not skipped.created
    assert skipped.skipped_for is not None
    assert skipped.skipped_for.id == busy.id
    # The same tick again is a duplicate, not an overlap: it returns its run.
    dup = await ledger.open_run("weekly@1", "weekly", None, INLINE, skip_if_unfinished=True)
    assert dup.run is not None
    assert dup.run.id == busy.id
    allowed = await ledger.open_run("weekly@3", "weekly", None, INLINE, skip_if_unfinished=False)
    assert allowed.created
    assert len(await ledger.list_runs(10)) == 2


async def test_a_finished_run_does_not_block_the_next_tick(ledger: SqliteLedger) -> None:
    run = await open_run(ledger, "weekly@1")
    await ledger.record_page(run.id, [], None, 0)
    assert await ledger.finish_runs() == [run.id]
    nxt = await ledger.open_run("weekly@2", "weekly", None, INLINE, skip_if_unfinished=True)
    assert nxt.created


async def test_list_runs_newest_first_with_before(ledger: SqliteLedger) -> None:
    ids = [(await open_run(ledger, f"weekly@{i}")).id for i in range(3)]
    listed = [r.id for r in await ledger.list_runs(10)]
    assert listed == ids[::-1]
    assert [r.id for r in await ledger.list_runs(10, before=ids[2])] == [ids[1], ids[0]]
    assert [r.id for r in await ledger.list_runs(1)] == [ids[2]]


# -- discovery -------------------------------------------------------------------------------


async def test_record_page_is_idempotent_and_ids_are_stable(ledger: SqliteLedger) -> None:
    run = await open_run(ledger)
    first = await ledger.record_page(run.id, ["a", "b", "c"], "3", 1)
    assert (first.new_operations, first.run_state) == (3, RunState.SCANNING)
    assigned = [(op.recipient_id, op.id)
                for _, op in await ledger.list_operations(run.id, None, 0, 100)]
    again = await ledger.record_page(run.id, ["a", "b", "c"], "3", 0)  # re-read after a crash
    assert again.new_operations == 0
    rows = await ledger.list_operations(run.id, None, 0, 100)
    # The IDs assigned at discovery survive the re-read.
    assert [(op.recipient_id, op.id) for _, op in rows] == assigned
    assert [r for r, _ in assigned] == ["a", "b", "c"]
    assert all(op.state is OpState.DISCOVERED and op.attempts == 0 for _, op in rows)
    stored = await ledger.get_run(run.id)
    assert stored is not None
    assert stored.discovered == 3
    assert stored.scan_cursor == "3"
    assert stored.scan_pages == 2
    assert stored.skipped_candidates == 1


async def test_operation_ids_are_unique_and_time_ordered() -> None:
    ids = [new_operation_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(i.startswith("op_") for i in ids)
    later = new_operation_id()
    # The millisecond prefix orders IDs made at different times.
    assert all(i[:15] <= later[:15] for i in ids)


async def test_the_last_page_starts_the_drain_and_later_pages_are_refused(
        ledger: SqliteLedger) -> None:
    run = await open_run(ledger)
    await ledger.record_page(run.id, ["a"], "1", 0)
    last = await ledger.record_page(run.id, ["b"], None, 0)
    assert last.run_state is RunState.DRAINING
    stored = await ledger.get_run(run.id)
    assert stored is not None
    assert stored.scan_finished_at is not None
    with pytest.raises(ValueError, match="not scanning"):
        await ledger.record_page(run.id, ["c"], None, 0)
    # Refused as a whole: no operation for "c" was left behind.
    assert [op.recipient_id for _, op in await ledger.list_operations(run.id, None, 0, 10)] == [
        "a", "b"]
    assert ledger.healthy


async def test_same_recipient_in_two_runs_is_two_operations(ledger: SqliteLedger) -> None:
    one = await open_run(ledger, "weekly@1")
    two = await open_run(ledger, "weekly@2")
    await ledger.record_page(one.id, ["a"], None, 0)
    await ledger.record_page(two.id, ["a"], None, 0)
    assert await ledger.run_counts(one.id) == {OpState.DISCOVERED: 1}
    assert await ledger.run_counts(two.id) == {OpState.DISCOVERED: 1}


async def test_scan_failure_and_abandon(ledger: SqliteLedger) -> None:
    run = await open_run(ledger)
    await ledger.record_scan_failure(run.id, "boom", give_up=False)
    stored = await ledger.get_run(run.id)
    assert stored is not None
    assert (stored.scan_failures, stored.last_error, stored.state) == (1, "boom", RunState.SCANNING)
    await ledger.record_scan_failure(run.id, "x" * 5000, give_up=True)
    stored = await ledger.get_run(run.id)
    assert stored is not None
    assert stored.state is RunState.DRAINING
    assert stored.last_error is not None
    assert stored.last_error.startswith("scan abandoned")
    assert len(stored.last_error) <= 1000
    assert await ledger.runs_to_scan() == []


async def test_outbox_unpublished_then_queued(ledger: SqliteLedger, queue: SqliteQueue) -> None:
    run = await open_run(ledger)
    await ledger.record_page(run.id, ["a", "b"], None, 0)
    batch = await ledger.unpublished(10)
    assert [(m.run_id, m.recipient_id) for m in batch] == [(run.id, "a"), (run.id, "b")]
    await Courier(ledger, queue).publish(batch)
    assert await ledger.unpublished(10) == []
    assert await ledger.run_counts(run.id) == {OpState.QUEUED: 2}


# -- attempts and settlement -------------------------------------------------------------------


async def test_settle_ack_removes_the_message_in_the_same_transaction(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    run = await discovered_run(ledger, queue, ["a"])
    delivery = await take(queue)
    op_id = delivery.message.operation_id
    attempt = await ledger.begin_attempt(op_id, "delete", owner=delivery.receipt, busy_s=30)
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert (op.state, op.attempts, op.unfinished_attempt) == (OpState.IN_FLIGHT, 1, True)
    commits = db.commits
    leftover = await ledger.settle([Settlement(
        op_id, OpState.DELETED, delivery, Disposition.ACK, attempt_id=attempt, status=204,
        outcome="deleted", detail="HTTP 204")])
    assert leftover == []  # the queue is in this database: nothing left for the transport
    assert db.commits == commits + 1  # outcome and ack: one commit
    assert await message_count(db) == 0
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert (op.state, op.unfinished_attempt) == (OpState.DELETED, False)
    [a] = await ledger.attempts(op_id)
    assert (a.n, a.kind, a.status, a.outcome, a.detail) == (1, "delete", 204, "deleted", "HTTP 204")
    assert a.finished_at is not None
    assert await ledger.run_counts(run.id) == {OpState.DELETED: 1}


async def test_settle_retry_parks_the_message_and_keep_leaves_it(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a", "b"])
    d1, d2 = await queue.receive(2, 60)
    a1 = await ledger.begin_attempt(d1.message.operation_id, "delete")
    a2 = await ledger.begin_attempt(d2.message.operation_id, "delete")
    await ledger.settle([
        Settlement(d1.message.operation_id, OpState.RETRY_WAIT, d1, Disposition.RETRY, delay_s=60,
                   attempt_id=a1, status=503, outcome="transient", detail="HTTP 503"),
        Settlement(d2.message.operation_id, OpState.RETRY_WAIT, d2, Disposition.KEEP,
                   attempt_id=a2, status=429, outcome="throttled", detail="HTTP 429",
                   refund_attempt=True),
    ])
    stats = await queue.stats()
    assert (stats.depth, stats.parked, stats.leased) == (0, 1, 1)
    assert await message_count(db) == 2
    op2 = await ledger.get_operation(d2.message.operation_id)
    assert op2 is not None
    assert op2.attempts == 0
    # The parked retry cannot be acked with the lease it no longer holds.
    await queue.ack([d1])
    assert await message_count(db) == 2


async def test_illegal_transition_raises_and_changes_nothing_while_its_batch_commits(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue, hold_writer: HoldWriter) -> None:
    run = await discovered_run(ledger, queue, ["a", "b"])
    da, db_ = await queue.receive(2, 60)
    before_ops = await ledger.list_operations(run.id, None, 0, 10)

    async with hold_writer() as release:
        illegal = asyncio.create_task(ledger.settle([Settlement(
            da.message.operation_id, OpState.DELETED, da, Disposition.ACK)]))  # queued -> deleted
        legal = asyncio.create_task(ledger.begin_attempt(db_.message.operation_id, "delete"))
        await asyncio.sleep(0)  # both are queued behind the held batch
        commits = await release()
    with pytest.raises(IllegalTransition) as info:
        await illegal
    assert (info.value.current, info.value.target) == (OpState.QUEUED, OpState.DELETED)
    await legal
    assert db.commits == commits + 1  # the legal write shared the illegal one's batch
    assert db.healthy

    op_a = await ledger.get_operation(da.message.operation_id)
    assert op_a is not None
    assert op_a == before_ops[0][1]
    assert await message_count(db) == 2  # its message was not acked
    op_b = await ledger.get_operation(db_.message.operation_id)
    assert op_b is not None
    assert op_b.state is OpState.IN_FLIGHT


async def test_concurrent_settlements_share_one_batch_and_only_an_illegal_one_fails(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue, hold_writer: HoldWriter) -> None:
    run = await discovered_run(ledger, queue, ["a", "b", "c"])
    da, db_, dc = await queue.receive(3, 60)
    for d in (da, db_, dc):
        await ledger.begin_attempt(d.message.operation_id, "delete")
    # b is settled once already: settling it again (deleted -> deleted) is illegal.
    await ledger.settle([Settlement(db_.message.operation_id, OpState.DELETED, db_)])

    async with hold_writer() as release:
        settles = [asyncio.create_task(ledger.settle([Settlement(
            d.message.operation_id, OpState.DELETED, d, Disposition.ACK)]))
            for d in (da, db_, dc)]
        await asyncio.sleep(0)  # all three queued behind the held batch, as one batch
        commits = await release()
    results = await asyncio.gather(*settles, return_exceptions=True)
    assert results[0] == []
    assert results[2] == []
    assert isinstance(results[1], IllegalTransition)
    assert db.commits == commits + 1  # one group commit for all three
    counts = await ledger.run_counts(run.id)
    assert counts == {OpState.DELETED: 3}
    assert await message_count(db) == 0


async def test_an_illegal_settlement_in_a_group_undoes_the_whole_group(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a", "b"])
    da, db_ = await queue.receive(2, 60)
    attempt = await ledger.begin_attempt(da.message.operation_id, "delete")
    with pytest.raises(IllegalTransition):
        await ledger.settle([
            Settlement(da.message.operation_id, OpState.DELETED, da, attempt_id=attempt,
                       status=204, outcome="deleted", detail="HTTP 204"),
            Settlement(db_.message.operation_id, OpState.DELETED, db_),  # still queued
        ])
    op = await ledger.get_operation(da.message.operation_id)
    assert op is not None
    assert op.state is OpState.IN_FLIGHT
    assert op.unfinished_attempt
    assert await message_count(db) == 2


async def test_terminal_states_refuse_every_move(ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a"])
    d = await take(queue)
    op_id = d.message.operation_id
    await ledger.begin_attempt(op_id, "delete")
    await ledger.settle([Settlement(op_id, OpState.ALREADY_ABSENT, d)])
    for target in OpState:
        with pytest.raises(IllegalTransition):
            await ledger.settle([Settlement(op_id, target, None)])
    with pytest.raises(IllegalTransition):
        await ledger.begin_attempt(op_id, "delete")


async def test_unknown_operation_is_a_key_error(ledger: SqliteLedger) -> None:
    with pytest.raises(KeyError):
        await ledger.begin_attempt("op_nope", "delete")
    assert ledger.healthy


async def test_attempts_are_written_before_they_are_sent_and_superseded(
        ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a"])
    d = await take(queue)
    op_id = d.message.operation_id
    first = await ledger.begin_attempt(op_id, "delete")
    # A redelivery after a crash finds the attempt open and resends with the same key.
    second = await ledger.begin_attempt(op_id, "delete", supersedes_open=True)
    assert second != first
    a1, a2 = await ledger.attempts(op_id)
    assert (a1.n, a1.outcome) == (1, "unknown")
    assert a1.detail is not None
    assert "no outcome recorded" in a1.detail
    assert (a2.n, a2.outcome, a2.finished_at) == (2, None, None)
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert op.attempts == 2
    assert op.unfinished_attempt


async def test_an_operation_in_flight_elsewhere_is_busy(ledger: SqliteLedger,
                                                        queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a"])
    d = await take(queue)
    op_id = d.message.operation_id
    await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)
    with pytest.raises(OperationBusy) as info:
        await ledger.begin_attempt(op_id, "delete", owner="lease-2", busy_s=30)
    assert info.value.until > time.time()
    # The holder itself may go again (a throttled retry of its own attempt).
    await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert op.attempts == 2


async def test_a_hold_that_ran_out_can_be_taken_over(ledger: SqliteLedger,
                                                     queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a"])
    d = await take(queue)
    op_id = d.message.operation_id
    await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=0.01)
    await asyncio.sleep(0.05)  # the hold is a wall-clock deadline: let it pass
    await ledger.begin_attempt(op_id, "delete", owner="lease-2", busy_s=30)


# -- evidence, ambiguity and redrive ---------------------------------------------------------


async def _ambiguous(ledger: SqliteLedger, queue: SqliteQueue) -> tuple[Run, str]:
    run = await discovered_run(ledger, queue, ["a"])
    d = await take(queue)
    op_id = d.message.operation_id
    attempt = await ledger.begin_attempt(op_id, "delete")
    await ledger.settle([Settlement(op_id, OpState.AMBIGUOUS, d, reason="reset after send",
                                    attempt_id=attempt, outcome="ambiguous",
                                    detail="no answer: ServerDisconnectedError")])
    return run, op_id


async def test_ambiguous_does_not_hold_the_run_open(ledger: SqliteLedger,
                                                    queue: SqliteQueue) -> None:
    run, op_id = await _ambiguous(ledger, queue)
    assert await ledger.finish_runs() == [run.id]
    assert [op.id for op in await ledger.ambiguous_due(time.time() + 1, 10)] == [op_id]
    assert await ledger.ambiguous_due(0.0, 10) == []  # not settled long enough yet
    assert [op.id for _, op in await ledger.operations_in_state(OpState.AMBIGUOUS, 0, 10)] == [
        op_id]


async def test_evidence_moves_an_ambiguous_operation(db: Database, ledger: SqliteLedger,
                                                     queue: SqliteQueue) -> None:
    _, op_id = await _ambiguous(ledger, queue)
    must_publish = await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                                "inconclusive: probe HTTP 500")
    assert must_publish is False
    requeued = await ledger.record_evidence(op_id, "probe", OpState.QUEUED, "present again",
                                            "probe HTTP 200", status=200)
    assert requeued is False  # the queue is in this database: the message is already there
    assert await message_count(db) == 1
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert op.state is OpState.QUEUED
    kinds = [(a.kind, a.outcome) for a in await ledger.attempts(op_id)]
    assert kinds == [("delete", "ambiguous"), ("probe", "ambiguous"), ("probe", "queued")]
    with pytest.raises(IllegalTransition):
        await ledger.record_evidence(op_id, "operator", OpState.DELETED, "x", "y")


async def test_finish_runs_waits_for_every_unfinished_operation(
        ledger: SqliteLedger, queue: SqliteQueue) -> None:
    run = await discovered_run(ledger, queue, ["a", "b"])
    da, db_ = await queue.receive(2, 60)
    await ledger.begin_attempt(da.message.operation_id, "delete")
    await ledger.settle([Settlement(da.message.operation_id, OpState.DELETED, da)])
    assert await ledger.finish_runs() == []
    await ledger.begin_attempt(db_.message.operation_id, "delete")
    await ledger.settle([Settlement(db_.message.operation_id, OpState.FAILED, db_,
                                    reason="partner answered HTTP 400")])
    assert await ledger.finish_runs() == [run.id]
    assert await ledger.finish_runs() == []
    done = await ledger.get_run(run.id)
    assert done is not None
    assert done.state is RunState.DONE
    assert done.finished_at is not None
    failed = await ledger.get_operation(db_.message.operation_id)
    assert failed is not None
    assert failed.reason == "partner answered HTTP 400"


async def test_a_scanning_run_is_never_finished(ledger: SqliteLedger) -> None:
    await open_run(ledger)
    assert await ledger.finish_runs() == []


async def test_overdue_is_decided_from_ledger_age_alone(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a", "b", "c"])
    held = await take(queue)
    await ledger.note_received([held], 60)  # a consumer holds it: not overdue
    now = time.time()
    overdue = {m.operation_id for m in await ledger.overdue(now + 1, now, 10)}
    assert held.message.operation_id not in overdue
    assert len(overdue) == 2  # the others: nothing has delivered them since they were due
    assert await ledger.overdue(now - 60, now - 60, 10) == []  # within the grace
    assert await ledger.overdue(None, now, 10) == []  # the age rule off: none unposted


async def test_a_retry_without_a_live_message_is_overdue_when_due(
        db: Database, ledger: SqliteLedger) -> None:
    """Without transactional ack the settle leaves no live message for a retry; the
    courier publishes one, unless the wait is too long for the transport: then redrive
    publishes it when it is due, and not before."""
    mine = SqliteLedger(db, owns_queue=False)
    run = await open_run(mine)
    await mine.record_page(run.id, ["a"], None, 0)
    [m] = await mine.unpublished(10)
    await mine.record_published([Published(m.operation_id, "m-1", time.time())])
    delivery = Delivery(m, "m-1", "receipt-1")
    [got] = await mine.note_received([delivery], 60)
    assert got.receives == 1
    attempt = await mine.begin_attempt(m.operation_id, "delete", owner="receipt-1", busy_s=30)
    [left] = await mine.settle([Settlement(m.operation_id, OpState.RETRY_WAIT, delivery,
                                           Disposition.RETRY, delay_s=0.3, attempt_id=attempt,
                                           status=503, outcome="transient", detail="HTTP 503")])
    assert left.delivery == delivery  # the transport must still ack it: ack after commit
    now = time.time()
    assert await mine.overdue(0, now, 10) == []  # not due yet
    [due] = await mine.overdue(None, now + 1, 10)
    assert due.operation_id == m.operation_id
    # The old message, delivered again before any repost, becomes the live one again; its
    # receive count started again with the outcome.
    [again] = await mine.note_received([delivery], 60)
    assert again.receives == 1
    assert await mine.overdue(None, now + 1, 10) == []  # a message is live: not redrive's
    # A later repost makes another message the live one and starts the poison count again
    # (a deliberate move is no failed delivery); a copy still counts as received.
    await mine.record_published([Published(m.operation_id, "m-2", time.time())])
    [copy] = await mine.note_received([delivery], 60)
    assert copy.receives == 1


async def test_stats(ledger: SqliteLedger, queue: SqliteQueue) -> None:
    empty = await ledger.stats()
    assert empty.current_run is None
    assert empty.ambiguous == 0
    run = await discovered_run(ledger, queue, ["a", "b"])
    stats = await ledger.stats()
    assert stats.current_run is not None
    assert stats.current_run.id == run.id
    assert stats.ambiguous == 0
    assert stats.current_run_by_state == {OpState.QUEUED: 2}
    d = await take(queue)
    await ledger.begin_attempt(d.message.operation_id, "delete")
    await ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                    reason="timeout")])
    assert (await ledger.stats()).ambiguous == 1


async def test_everything_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    db = Database(path)
    await db.open()
    ledger = SqliteLedger(db, owns_queue=True)
    run = await open_run(ledger)
    await ledger.record_page(run.id, ["a"], "c1", 0)
    await ledger.close()
    await ledger.close()  # safe twice

    db = Database(path)
    await db.open()
    try:
        again = SqliteLedger(db, owns_queue=True)
        stored = await again.get_run(run.id)
        assert stored is not None
        assert stored.scan_cursor == "c1"
        assert [r.id for r in await again.runs_to_scan()] == [run.id]
    finally:
        await db.close()
