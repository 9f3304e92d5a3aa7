"""The single-writer SQLite database: group commit, per-write savepoints, storage faults."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiosqlite
import pytest

from supervisor.errors import StorageError
from supervisor.model import Message
from supervisor.sqlite import sql
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from tests.helpers import HoldWriter


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


async def test_a_ledger_of_the_previous_release_gains_the_bookkeeping(tmp_path: Path) -> None:
    """A file written before the queue's bookkeeping existed opens with its columns
    added, its queued work due at once, and its embedded messages recorded as live."""
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE runs (id TEXT PRIMARY KEY, tick_key TEXT NOT NULL UNIQUE,
            schedule TEXT NOT NULL, scheduled_for REAL, state TEXT NOT NULL,
            source TEXT NOT NULL, scan_cursor TEXT, scan_pages INTEGER NOT NULL DEFAULT 0,
            discovered INTEGER NOT NULL DEFAULT 0,
            skipped_candidates INTEGER NOT NULL DEFAULT 0,
            scan_failures INTEGER NOT NULL DEFAULT 0, last_error TEXT,
            created_at REAL NOT NULL, scan_finished_at REAL, finished_at REAL);
        CREATE TABLE operations (id TEXT PRIMARY KEY, run_id TEXT NOT NULL REFERENCES runs(id),
            recipient_id TEXT NOT NULL, state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0, reason TEXT, created_at REAL NOT NULL,
            updated_at REAL NOT NULL, owner TEXT, busy_until REAL,
            UNIQUE (run_id, recipient_id));
        CREATE TABLE messages (operation_id TEXT PRIMARY KEY, run_id TEXT NOT NULL,
            recipient_id TEXT NOT NULL, available_at REAL NOT NULL, lease_token TEXT,
            receives INTEGER NOT NULL DEFAULT 0, enqueued_at REAL NOT NULL);
        INSERT INTO runs (id, tick_key, schedule, state, source, created_at)
            VALUES ('run_1', 'weekly@1', 'weekly', 'draining', '{"kind": "http"}', 1);
        INSERT INTO operations (id, run_id, recipient_id, state, created_at, updated_at)
            VALUES ('op_1', 'run_1', 'r-1', 'queued', 1, 5), ('op_2', 'run_1', 'r-2', 'deleted', 1, 6);
        INSERT INTO messages VALUES ('op_1', 'run_1', 'r-1', 5, NULL, 0, 5);
    """)
    conn.commit()
    conn.close()
    db = Database(path)
    await db.open()
    try:
        rows = await db.read("SELECT id, due_at, message_id, receives FROM operations ORDER BY id")
        assert [tuple(r) for r in rows] == [("op_1", 5.0, "op_1", 0), ("op_2", 6.0, None, 0)]
        ledger = SqliteLedger(db, owns_queue=True)
        assert await ledger.overdue(None, 1e12, 10) == []  # its message is live
        stats = await ledger.queue_stats()
        assert stats.depth == 1
        # Its runs gain their source's kind: list reads show it without the JSON.
        [run] = await ledger.list_runs(10)
        assert run.source == {"kind": "http"}
        assert [r.id for r in await ledger.schedule_runs("weekly")] == ["run_1"]
    finally:
        await db.close()


async def test_exclusions_read_a_schedules_runs_through_an_index(db: Database) -> None:
    """However many runs a schedule has had, its newest and unfinished ones are two index
    ranges, never a scan of the runs table (issue 17, M7)."""
    plan = await db.read(f"EXPLAIN QUERY PLAN {sql.SELECT_SCHEDULE_RUNS}", ("w",))
    details = [str(r[3]) for r in plan]
    assert not [d for d in details if d.startswith("SCAN runs")], details
    searches = {d.partition(" (")[0] for d in details if d.startswith("SEARCH runs")}
    assert searches == {"SEARCH runs USING INDEX runs_schedule_unfinished",
                        "SEARCH runs USING INDEX runs_schedule"}, details


class WriterBug(BaseException):
    """Escapes the commit's own handling (which catches Exception): a bug in the writer."""


async def test_a_dead_writer_fails_its_callers_and_its_watch_restarts_it(
        db: Database) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    async def crash(conn: aiosqlite.Connection) -> None:
        entered.set()
        await gate.wait()
        raise WriterBug("writer bug")

    async def insert(conn: aiosqlite.Connection) -> None:
        await conn.execute("INSERT INTO messages (operation_id, run_id, recipient_id, "
                           "available_at, enqueued_at) VALUES ('after', 'r', 'x', 0, 0)")

    async def noop(conn: aiosqlite.Connection) -> None:
        return None

    crashing = asyncio.create_task(db.write(crash))
    await entered.wait()
    queued = [asyncio.create_task(db.write(noop)) for _ in range(3)]
    # Scheduled after the three tasks' first steps (FIFO): they are queued behind the
    # crashing batch when the writer dies.
    asyncio.get_running_loop().call_soon(gate.set)
    async with asyncio.timeout(5):  # nobody hangs
        results = await asyncio.gather(crashing, *queued, return_exceptions=True)
    assert all(isinstance(r, StorageError) for r in results), results
    assert not db.healthy
    with pytest.raises(StorageError, match="writer stopped"):
        await db.write(noop)  # at once, not into a queue nobody serves

    # The supervised component: it starts a new writer and raises, so the service's
    # supervisor counts the crash (and escalates when it repeats) like any other.
    async with asyncio.timeout(5):
        with pytest.raises(RuntimeError, match="restarted"):
            await db.watch()
        await db.write(insert)
    assert await count(db, "messages") == 1


async def test_close_after_the_writer_died_returns_and_later_writes_fail_at_once(
        tmp_path: Path) -> None:
    db = Database(tmp_path / "dead.sqlite3")
    await db.open()

    async def crash(conn: aiosqlite.Connection) -> None:
        raise WriterBug("writer bug")

    with pytest.raises(StorageError):
        await db.write(crash)
    async with asyncio.timeout(5):
        await db.close()  # neither hangs on the dead writer nor re-raises its death
    with pytest.raises(StorageError, match="not open"):
        await db.write(crash)
    # The file is intact and closed: a new open works on it.
    again = Database(tmp_path / "dead.sqlite3")
    await again.open()
    await again.close()
