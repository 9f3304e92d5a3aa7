"""The events outbox of the SQLite ledger.

The writes (:func:`record_settled`, :func:`record_finished`) run inside the transaction of
the state change they describe: :class:`~supervisor.sqlite.ledger.SqliteLedger` calls them
from its settlement, evidence and run-finishing writes, one ``executemany`` per batch, so an
event exists if and only if its change committed. The reads and the cursors are
:class:`OutboxMixin`'s, the :class:`~supervisor.ledger.base.EventOutbox` protocol.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

import aiosqlite
import orjson

from supervisor.model import Backlog, Event
from supervisor.sqlite import sql
from supervisor.sqlite.database import Database

OPERATION_SETTLED = "operation.settled"
RUN_FINISHED = "run.finished"


def new_event_id() -> str:
    """A stable event ID: assigned once, when the event is written, and sent unchanged on
    every delivery. Time-ordered and random like an operation ID, so it stays unique
    across ledger files (a restored backup, a second deployment)."""
    return f"ev_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(8)}"


async def record_settled(conn: aiosqlite.Connection, operation_ids: Sequence[str],
                         now: float) -> None:
    """One ``operation.settled`` event per operation, in the caller's transaction, after
    the operations moved: each row takes the state the operation now holds."""
    if operation_ids:
        await conn.executemany(sql.INSERT_OPERATION_EVENT, [
            {"event_id": new_event_id(), "now": now, "id": op_id} for op_id in operation_ids])


async def record_finished(conn: aiosqlite.Connection, run_ids: Sequence[str],
                          now: float) -> None:
    """One ``run.finished`` event per run, with its operations counted by state."""
    if run_ids:
        await conn.executemany(sql.INSERT_RUN_EVENT, [
            {"event_id": new_event_id(), "now": now, "run_id": run_id} for run_id in run_ids])


def _event(row: sqlite3.Row | tuple[Any, ...]) -> Event:
    counts = orjson.loads(row[8]) if row[8] is not None else None
    return Event(seq=row[0], id=row[1], kind=row[2], at=row[3], run_id=row[4],
                 operation_id=row[5], recipient_id=row[6], outcome=row[7], counts=counts)


class OutboxMixin:
    """The :class:`~supervisor.ledger.base.EventOutbox` methods on the ledger's database."""

    db: Database

    async def events_after(self, seq: int, limit: int) -> list[Event]:
        return [_event(r) for r in await self.db.read(sql.SELECT_EVENTS_AFTER, (seq, limit))]

    async def event_cursor(self, sink: str) -> int:
        row = await self.db.read_one(sql.SELECT_EVENT_CURSOR, (sink,))
        return int(row[0]) if row is not None else 0

    async def save_event_cursor(self, sink: str, seq: int) -> None:
        async def write(conn: aiosqlite.Connection) -> None:
            await conn.execute(sql.UPSERT_EVENT_CURSOR, (sink, seq, time.time()))

        await self.db.write(write, savepoint=False)

    async def event_backlog(self, after: int) -> Backlog:
        row = await self.db.read_one(sql.EVENT_BACKLOG, (after,))
        return Backlog(0, None) if row is None else Backlog(events=int(row[0]), oldest_at=row[1])

    async def prune_events(self, sinks: Sequence[str], before: float, limit: int) -> int:
        names = orjson.dumps(list(sinks)).decode()

        async def write(conn: aiosqlite.Connection) -> int:
            cur = await conn.execute(sql.PRUNE_EVENTS,
                                     {"sinks": names, "before": before, "limit": limit})
            return cur.rowcount

        return await self.db.write(write, savepoint=False)
