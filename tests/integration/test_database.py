"""The single-writer SQLite database: group commit, per-write savepoints, storage faults."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiosqlite
import pytest

from supervisor.errors import StorageError
from supervisor.ledger.database import Database
from supervisor.ledger.sqlite import SqliteLedger
from supervisor.queue.base import Message
from supervisor.queue.sqlite import SqliteQueue

from .conftest import HoldWriter


async def count(db: Database, table: str) -> int:
    row = await db.read_one(f"SELECT COUNT(*) FROM {table}")
    assert row is not None
    return int(row[0])


async def test_wal_mode_on_a_real_file(db: Database) -> None:
    assert db.path.exists()
    row = await db.read_one("PRAGMA journal_mode")
    assert row is not None
    assert row[0] == "wal"


async def test_group_commit_batches_concurrent_writes(db: Database) -> None:
    queue = SqliteQueue(db)
    before = db.commits
    await asyncio.gather(*(queue.publish([Message("run_1", f"op_{i}", f"r-{i}")])
                           for i in range(200)))
    assert await count(db, "messages") == 200
    commits = db.commits - before
    assert 1 <= commits <= 20, commits  # far fewer commits (fsyncs) than writes


async def test_a_failing_write_is_undone_alone(db: Database, hold_writer: HoldWriter) -> None:
    async def good(conn: aiosqlite.Connection) -> str:
        await conn.execute("INSERT INTO messages (operation_id, run_id, recipient_id, "
                           "available_at, enqueued_at) VALUES ('good', 'r', 'x', 0, 0)")
        return "ok"

    async def bad(conn: aiosqlite.Connection) -> None:
        await conn.execute("INSERT INTO messages (operation_id, run_id, recipient_id, "
                           "available_at, enqueued_at) VALUES ('bad', 'r', 'x', 0, 0)")
        raise ValueError("the caller's own mistake")

    async with hold_writer() as release:
        t_bad = asyncio.create_task(db.write(bad))
        t_good = asyncio.create_task(db.write(good))
        await asyncio.sleep(0)
        commits = await release()
    with pytest.raises(ValueError, match="own mistake"):
        await t_bad
    assert await t_good == "ok"
    assert db.commits == commits + 1
    rows = await db.read("SELECT operation_id FROM messages")
    assert [r[0] for r in rows] == ["good"]
    assert db.healthy


async def test_a_constraint_violation_is_the_callers_error_not_a_storage_fault(
        db: Database, hold_writer: HoldWriter) -> None:
    """A write that breaks a constraint (here: an operation for a run that does not exist)
    fails alone; it must not fail its batch or mark the ledger unhealthy."""
    ledger = SqliteLedger(db, owns_queue=True)
    queue = SqliteQueue(db)
    async with hold_writer() as release:
        orphan = asyncio.create_task(ledger.record_page("run_missing", ["a"], None, 0))
        other = asyncio.create_task(queue.publish([Message("run_1", "op_1", "r-1")]))
        await asyncio.sleep(0)
        await release()
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        await orphan
    await other
    assert db.healthy
    assert await count(db, "messages") == 1
    assert await count(db, "operations") == 0


async def test_writes_after_close_raise_storage_error(tmp_path: Path) -> None:
    db = Database(tmp_path / "x.sqlite3")
    await db.open()
    await db.close()

    async def noop(conn: aiosqlite.Connection) -> None:
        return None

    with pytest.raises(StorageError):
        await db.write(noop)
    with pytest.raises(StorageError):
        await db.read("SELECT 1")


async def test_close_finishes_queued_writes(tmp_path: Path) -> None:
    path = tmp_path / "x.sqlite3"
    db = Database(path)
    await db.open()
    queue = SqliteQueue(db)
    pending = [asyncio.create_task(queue.publish([Message("r", f"op_{i}", "x")]))
               for i in range(50)]
    await asyncio.sleep(0)  # every publish is queued
    await db.close()
    await asyncio.gather(*pending)
    reopened = Database(path)
    await reopened.open()
    try:
        assert await count(reopened, "messages") == 50
    finally:
        await reopened.close()


async def test_cancelling_a_writer_does_not_tear_its_write(db: Database) -> None:
    queue = SqliteQueue(db)
    task = asyncio.create_task(queue.publish([Message("r", "op_1", "x")]))
    await asyncio.sleep(0)  # queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The write was queued before the caller was cancelled: it commits all the same.
    async def noop(conn: aiosqlite.Connection) -> None:
        return None

    await db.write(noop)  # the next batch: everything before it has committed
    assert await count(db, "messages") == 1


async def test_an_unwritable_data_dir_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory", encoding="utf-8")
    db = Database(blocker / "sub" / "x.sqlite3")
    with pytest.raises(StorageError, match="cannot open ledger"):
        await db.open()


async def test_a_storage_fault_fails_the_batch_and_marks_unhealthy_until_a_commit(
        db: Database, hold_writer: HoldWriter) -> None:
    async def broken(conn: aiosqlite.Connection) -> None:
        await conn.execute("INSERT INTO no_such_table VALUES (1)")  # OperationalError

    queue = SqliteQueue(db)
    async with hold_writer() as release:
        fault = asyncio.create_task(db.write(broken))
        neighbour = asyncio.create_task(queue.publish([Message("r", "op_1", "x")]))
        await asyncio.sleep(0)
        await release()
    # Storage trouble is everyone's: the whole batch fails, nothing of it is committed.
    for task in (fault, neighbour):
        with pytest.raises(StorageError, match="ledger commit failed"):
            await task
    assert not db.healthy
    assert db.last_error is not None
    assert await count(db, "messages") == 0
    await queue.publish([Message("r", "op_2", "x")])
    assert db.healthy
    assert db.last_error is None
