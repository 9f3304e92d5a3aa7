"""Shared fixtures: a real SQLite ledger file in tmp_path and the embedded queue on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest

from supervisor.model import Settlement
from supervisor.queue.courier import Courier
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(tmp_path / "data" / "cleanup.sqlite3")
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def ledger(db: Database) -> SqliteLedger:
    return SqliteLedger(db, owns_queue=True)


@pytest.fixture
def queue(db: Database) -> SqliteQueue:
    return SqliteQueue(db)


@asynccontextmanager
async def writer_held(db: Database) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Hold the ledger's writer inside a batch, so writes queued meanwhile share the next
    group commit. ``release()`` lets the held batch commit and returns the commit count."""
    entered, gate = asyncio.Event(), asyncio.Event()

    async def hold(conn: object) -> None:
        entered.set()
        await gate.wait()

    blocker = asyncio.create_task(db.write(hold))
    await entered.wait()

    async def release() -> int:
        gate.set()
        await blocker
        return db.commits

    try:
        yield release
    finally:
        gate.set()
        await blocker


HoldWriter = Callable[[], AbstractAsyncContextManager[Callable[[], Awaitable[int]]]]


@pytest.fixture
def hold_writer(db: Database) -> HoldWriter:
    return lambda: writer_held(db)


async def ambiguous_operation(ledger: SqliteLedger, queue: SqliteQueue) -> str:
    """A one-recipient run whose only operation's DELETE had an unknown outcome."""
    opened = await ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await ledger.record_page(opened.run.id, ["r-000001"], None, 0)
    await Courier(ledger, queue).publish(await ledger.unpublished(10))
    [d] = await queue.receive(1, 60)
    attempt = await ledger.begin_attempt(d.message.operation_id, "delete")
    await ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                    attempt_id=attempt, outcome="ambiguous")])
    return d.message.operation_id
