"""Redrive, lease extension and a corrupted ledger page, on real SQLite files and a real
partner simulator on loopback."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from cleanup_sandbox import SandboxConfig, run_sandbox
from supervisor import metrics
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig
from supervisor.consumer import ConsumerPool
from supervisor.errors import StorageError
from supervisor.model import Message, QueueStats
from supervisor.partner import PartnerClient
from supervisor.queue.courier import Courier
from supervisor.queue.settings import QueueConfig
from supervisor.redrive import Redriver
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState


async def _queued_run(ledger: SqliteLedger, queue: SqliteQueue, ids: list[str]) -> str:
    opened = await ledger.open_run("weekly@2026-11-30T02:00:00+00:00", "weekly", None,
                                   {"kind": "inline"}, skip_if_unfinished=False)
    assert opened.run is not None
    await ledger.record_page(opened.run.id, ids, None, 0)
    batch = await ledger.unpublished(100)
    await Courier(ledger, queue).publish(batch)
    return opened.run.id


async def test_redrive_publishes_what_the_queue_lost_and_counts_it(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    await _queued_run(ledger, queue, ["a", "b", "c"])
    # Two are delivered and held by a consumer; the transport loses the third (expired,
    # dead-lettered, deleted by hand). Only the ledger's age tells: nothing delivered it.
    held = await queue.receive(2, 60)
    await ledger.note_received(held, 60)
    lost = {r[0] for r in await db.read("SELECT operation_id FROM messages")} - \
        {d.message.operation_id for d in held}
    assert len(lost) == 1
    conn = sqlite3.connect(db.path)
    conn.execute("DELETE FROM messages WHERE operation_id = ?", (next(iter(lost)),))
    conn.commit()
    conn.close()
    before = metrics.REDRIVEN._value.get()
    redriver = Redriver(QueueConfig(redrive_grace_seconds=0.001), ledger, queue)
    await asyncio.sleep(0.01)  # the grace is wall-clock age of the operation, not a sync
    assert await redriver.sweep() == 1
    assert metrics.REDRIVEN._value.get() == before + 1
    assert {r[0] for r in await db.read("SELECT operation_id FROM messages")} >= lost
    # Just published: within any grace longer than the moment since (a deadline-free
    # check: the first sweeper's 1 ms grace may already have passed again).
    assert await Redriver(QueueConfig(redrive_grace_seconds=5.0), ledger, queue).sweep() == 0


async def test_a_corrupted_page_fails_commits_until_it_is_repaired(tmp_path: Path) -> None:
    path = tmp_path / "cleanup.sqlite3"
    db = Database(path)
    await db.open()
    await SqliteQueue(db).publish([Message("r", f"op_{i}", "x" * 200) for i in range(400)])
    root = (await db.read("SELECT rootpage FROM sqlite_master WHERE name = 'messages'"))[0][0]
    await db.close()  # the last connection to close checkpoints the WAL into the file
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as fh:
        fh.seek((root - 1) * page)
        original = fh.read(page)
        fh.seek((root - 1) * page)
        fh.write(b"\xff" * page)  # scribble over the messages table's root page

    db = Database(path)
    await db.open()
    try:
        queue = SqliteQueue(db)
        with pytest.raises(StorageError, match="malformed"):
            await queue.publish([Message("r", "new", "y")])
        assert not db.healthy
        # The page is repaired (restored from a backup): commits succeed again by themselves.
        with path.open("r+b") as fh:
            fh.seek((root - 1) * page)
            fh.write(original)
        await queue.publish([Message("r", "after", "z")])
        assert db.healthy
        rows = await db.read("SELECT operation_id FROM messages WHERE operation_id IN "
                             "('after', 'op_1')")
        assert len(rows) == 2
    finally:
        await db.close()


async def test_a_worker_held_past_its_lease_by_a_pause_keeps_its_message(
        db: Database, ledger: SqliteLedger, queue: SqliteQueue) -> None:
    """A Retry-After pause five leases long, and an idle second worker ready to claim the
    message the moment its lease runs out. The lease is extended while the first worker
    waits, so the second never gets it: the one attempt's ack removes the message. (Had it
    been claimed twice, the second holder's hand-back would have replaced the first's lease
    and the message would outlive the ack.)"""
    async with run_sandbox(SandboxConfig(recipients=3, absent_share=0.0, rate_per_second=0)
                           ) as sandbox:
        config = Config(queue=QueueConfig(lease_seconds=0.3, poll_interval_seconds=0.05),
                        partner=PartnerConfig(base_url=sandbox.url),
                        limits=LimitsConfig(rate_per_second=100, concurrency=2))
        run_id = await _queued_run(ledger, queue, ["r-000001"])
        limiter = LocalBudget(config.limits, key="test")
        limiter.pause(time.time() + 1.5, "test")
        partner = PartnerClient(config.partner, 2)
        await partner.start()
        settled = asyncio.Event()
        pool = ConsumerPool(config, ledger, queue, limiter, partner, on_settled=settled.set)
        task = asyncio.create_task(pool.run())
        try:
            async with asyncio.timeout(10):
                await settled.wait()
        finally:
            await pool.stop(1.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await partner.close()
        assert await ledger.run_counts(run_id) == {OpState.DELETED: 1}
        assert (await queue.stats()) == QueueStats(0, 0, 0, 0.0)
        attempts = await ledger.attempts(
            (await ledger.list_operations(run_id, None, None, 1))[0].id)
        assert len(attempts) == 1
        assert sandbox.state.stats()["executions"] == 1
