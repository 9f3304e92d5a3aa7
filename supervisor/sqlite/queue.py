"""The embedded queue: a table in the ledger's own SQLite file."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence

import aiosqlite

from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import Capabilities, wait_until_due
from supervisor.sqlite import sql
from supervisor.sqlite.database import Database

CAPABILITIES = Capabilities(transactional_ack=True, extend=True, nack=True, stats=True,
                            max_delay_s=float("inf"), billed=False, default_prefetch=0)


class SqliteQueue:
    """:class:`~supervisor.queue.base.Queue` sharing the ledger's :class:`Database`.

    ``available_at`` is both the delay and the lease: a claim pushes it ``lease_s`` ahead,
    so a consumer that dies simply lets the message become claimable again. One row per
    operation, keyed by its ID: that is the message ID, and a second publish is a no-op.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._wakeup = asyncio.Event()

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def healthy(self) -> bool:
        return self.db.healthy

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        now = time.time()
        rows = [(m.operation_id, m.run_id, m.recipient_id, now + delay_s, now)
                for m in messages]

        async def write(conn: aiosqlite.Connection) -> None:
            await conn.executemany(sql.INSERT_MESSAGE, rows)

        await self.db.write(write)
        self._wakeup.set()
        return [m.operation_id for m in messages]

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        token = secrets.token_hex(8)

        async def write(conn: aiosqlite.Connection) -> list[Delivery]:
            now = time.time()
            rows = await conn.execute_fetchall(sql.CLAIM_MESSAGES,
                                               (now + lease_s, token, now, max_messages))
            return [Delivery(Message(r[0], r[1], r[2]), r[1], token) for r in rows]

        return await self.db.write(write, savepoint=False)  # a single statement

    async def wait(self, timeout_s: float) -> None:
        # Clear before reading: a publish that lands during the read must still wake us.
        self._wakeup.clear()
        row = await self.db.read_one(sql.NEXT_AVAILABLE)
        await wait_until_due(self._wakeup, row[0] if row is not None else None, timeout_s)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        rows = [(d.message.operation_id, d.receipt) for d in deliveries]

        async def write(conn: aiosqlite.Connection) -> None:
            await conn.executemany(sql.DELETE_MESSAGE, rows)

        await self.db.write(write)

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        async def write(conn: aiosqlite.Connection) -> None:
            await conn.execute(sql.RETRY_MESSAGE, (time.time() + delay_s,
                                                   delivery.message.operation_id,
                                                   delivery.receipt))

        await self.db.write(write)
        if delay_s <= 0:
            self._wakeup.set()

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        async def write(conn: aiosqlite.Connection) -> bool:
            cur = await conn.execute(sql.EXTEND_MESSAGE, (time.time() + lease_s,
                                                          delivery.message.operation_id,
                                                          delivery.receipt))
            return cur.rowcount == 1

        return await self.db.write(write)

    async def recover_leases(self) -> int:
        """Hand back leases a previous process held; call once, under the data-dir lock."""

        async def write(conn: aiosqlite.Connection) -> int:
            now = time.time()
            cur = await conn.execute(sql.RELEASE_DEAD_LEASES, (now, now))
            return cur.rowcount

        released = await self.db.write(write)
        if released:
            self._wakeup.set()
        return released

    async def stats(self) -> QueueStats:
        now = time.time()
        row = await self.db.read_one(sql.QUEUE_STATS, {"now": now})
        assert row is not None
        return QueueStats.from_row(row, now)

    async def close(self) -> None:
        """Nothing of its own: the ledger closes the shared database."""
