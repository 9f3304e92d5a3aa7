"""The queue as a table in the PostgreSQL ledger's database.

Like the embedded SQLite queue, one row per operation whose ``available_at`` is both the
delay and the lease; what replicas add: claims take rows with ``FOR UPDATE SKIP LOCKED``
(two replicas claiming at once take different rows, neither waits), each lease names the
replica holding it (``holder``) so only a dead replica's are released, and a publish or a
hand-back NOTIFYs every replica's consumers, which otherwise poll only as a fallback.
Outcome and ack commit in one transaction (:class:`~supervisor.postgres.ledger.PostgresLedger`
deletes the message in the settlement's own transaction).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence

from supervisor.model import Delivery, Message, QueueStats
from supervisor.postgres import sql
from supervisor.postgres.database import Conn, PgDatabase
from supervisor.queue.base import Capabilities, wait_until_due

CAPABILITIES = Capabilities(transactional_ack=True, extend=True, nack=True, stats=True,
                            max_delay_s=float("inf"), billed=False, default_prefetch=0)
# Without a notification (a dropped LISTEN connection), consumers look this often.
FALLBACK_POLL_S = 2.0


class PostgresQueue:
    """:class:`~supervisor.queue.base.Queue` sharing the ledger's :class:`PgDatabase`."""

    def __init__(self, db: PgDatabase) -> None:
        self.db = db

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def healthy(self) -> bool:
        return self.db.healthy

    @property
    def _wakeup(self) -> asyncio.Event:
        return self.db.wakeups["queue"]

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        now = self.db.now()
        rows = [(m.operation_id, m.run_id, m.recipient_id, delay_s, now) for m in messages]

        async def write(conn: Conn) -> None:
            await conn.executemany(sql.INSERT_MESSAGE, rows)
            await self.db.notify(conn, "queue")

        await self.db.write(write)
        return [m.operation_id for m in messages]

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        token = secrets.token_hex(8)

        async def write(conn: Conn) -> list[Delivery]:
            # Leases on the database's clock: a replica whose own runs ahead cannot take
            # a message whose lease a peer still holds.
            rows = await conn.fetch(sql.CLAIM_MESSAGES, lease_s, token, self.db.replica,
                                    max_messages)
            return [Delivery(Message(r[0], r[1], r[2]), r[1], token) for r in rows]

        return await self.db.write(write)

    async def wait(self, timeout_s: float) -> None:
        # Clear before reading: a notification that lands during the read still wakes us.
        self._wakeup.clear()
        row = await self.db.read_one(sql.NEXT_AVAILABLE)
        due_in = row[0] if row is not None else None
        await wait_until_due(self._wakeup, None if due_in is None else time.time() + due_in,
                             min(timeout_s, FALLBACK_POLL_S))

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        rows = [(d.message.operation_id, d.receipt) for d in deliveries]

        async def write(conn: Conn) -> None:
            await conn.executemany(sql.DELETE_MESSAGE, rows)

        await self.db.write(write)

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        async def write(conn: Conn) -> None:
            await conn.execute(sql.RETRY_MESSAGE, delay_s,
                               delivery.message.operation_id, delivery.receipt)
            if delay_s <= 0:
                await self.db.notify(conn, "queue")

        await self.db.write(write)

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        async def write(conn: Conn) -> bool:
            status = await conn.execute(sql.EXTEND_MESSAGE, lease_s,
                                        delivery.message.operation_id, delivery.receipt)
            return bool(status == "UPDATE 1")

        return await self.db.write(write)

    async def stats(self) -> QueueStats:
        row = await self.db.read_one(sql.QUEUE_STATS)
        if row is None:  # no message at all
            return QueueStats(depth=0, parked=0, leased=0, oldest_claimable_age_s=0.0)
        # The oldest's age comes measured on the database's clock.
        return QueueStats(depth=row[0], parked=row[1], leased=row[2],
                          oldest_claimable_age_s=max(0.0, row[3] or 0.0))

    async def close(self) -> None:
        """Nothing of its own: the ledger closes the shared database."""
