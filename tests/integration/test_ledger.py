"""The SQLite ledger on a real file, where it differs from any other backend: settlements
share a group commit (an outcome and its ack in one, an illegal settlement failing alone
within it), and everything survives a reopen of the file.

What every ledger backend must do is tests/contract/test_ledger.py's (run on this one too).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor.errors import IllegalTransition
from supervisor.model import Disposition, Run, Settled, Settlement
from supervisor.queue.courier import Courier
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState
from tests.helpers import HoldWriter, open_run

TICK = "weekly@2024-01-01T02:00:00+00:00"


async def message_count(db: Database) -> int:
    row = await db.read_one("SELECT COUNT(*) FROM messages")
    assert row is not None
    return int(row[0])


async def discovered_run(ledger: SqliteLedger, queue: SqliteQueue, ids: list[str]) -> Run:
    """A run whose operations are discovered, published and queued: ready to consume."""
    run = await open_run(ledger, TICK)
    await ledger.record_page(run.id, ids, None, 0)
    await Courier(ledger, queue).publish(await ledger.unpublished(1000))
    return run


async def test_an_outcome_and_its_ack_are_one_commit(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await discovered_run(ledger, queue, ["a"])
    [delivery] = await queue.receive(1, 60)
    op_id = delivery.message.operation_id
    attempt = await ledger.begin_attempt(op_id, "delete", owner=delivery.receipt, busy_s=30)
    commits = db.commits
    await ledger.settle([Settlement(op_id, OpState.DELETED, delivery, Disposition.ACK,
                                    attempt_id=attempt, status=204, outcome="deleted")])
    assert db.commits == commits + 1  # the outcome, the ack and the event: one commit
    assert await message_count(db) == 0


async def test_illegal_transition_raises_and_changes_nothing_while_its_batch_commits(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue, hold_writer: HoldWriter) -> None:
    run = await discovered_run(ledger, queue, ["a", "b"])
    da, db_ = await queue.receive(2, 60)
    before_ops = await ledger.list_operations(run.id, None, None, 10)

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
    assert op_a == before_ops[0]
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
    assert results[0] == Settled([])
    assert results[2] == Settled([])
    assert isinstance(results[1], IllegalTransition)
    assert db.commits == commits + 1  # one group commit for all three
    counts = await ledger.run_counts(run.id)
    assert counts == {OpState.DELETED: 3}
    assert await message_count(db) == 0


async def test_budget_memory_is_saved_and_replaced(ledger: SqliteLedger) -> None:
    """The in-process budget's memory (LocalBudget's MemoryStore): only this ledger keeps
    one; PostgreSQL's budget is shared through its own table."""
    key = "https://partner.example"
    assert await ledger.load_budget(key) is None
    data = {"limit": 10.0, "paused_until": None, "quota": {"used": 3, "window": "day"}}
    await ledger.save_budget(key, data)
    assert await ledger.load_budget(key) == data
    await ledger.save_budget(key, {"limit": 5.0})
    assert await ledger.load_budget(key) == {"limit": 5.0}  # replaced, not merged
    assert await ledger.load_budget("https://other.example") is None
    await ledger.save_budget("https://other.example", {})
    assert await ledger.load_budget("https://other.example") == {}
    assert await ledger.load_budget(key) == {"limit": 5.0}


async def test_everything_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    db = Database(path)
    await db.open()
    ledger = SqliteLedger(db, owns_queue=True)
    run = await open_run(ledger, TICK)
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
        [op] = await again.list_operations(run.id, None, None, 10)
        assert op.recipient_id == "a"
    finally:
        await db.close()
