"""The ledger on PostgreSQL, for N replicas on one database.

The rules are the core's (:class:`~supervisor.ledger.core.LedgerCore`), the same as
SQLite's; this module gives it PostgreSQL's statements (the guard from
supervisor/states.py through sql.transition) and a transaction per write. What several
writers add: every in-flight guard names its replica (``holder``) and an attempt starts
or is kept only while this replica's registration is fresh (the others may have released
what it held), the core's named locks are transaction-scoped advisory locks (runs open
one at a time so every replica's tick dedupes on one row; events are written in commit
order so a sink's cursor never skips an event that commits late), its notifications are
NOTIFYs other replicas wake on, and times the replicas compare are on the database's
clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from supervisor.errors import ReplicaFenced
from supervisor.ledger.core import LedgerCore
from supervisor.ledger.driver import Row
from supervisor.postgres import connect as pg
from supervisor.postgres import sql
from supervisor.postgres.database import Conn, PgDatabase

T = TypeVar("T")


class PgTx:
    """The unit of work's :class:`~supervisor.ledger.driver.Tx`: one transaction."""

    def __init__(self, db: PgDatabase, conn: Conn) -> None:
        self.db = db
        self.conn = conn

    async def execute(self, query: str, *args: Any) -> int:
        status = await self.conn.execute(query, *args)  # "UPDATE 3", "INSERT 0 1"
        count = status.rpartition(" ")[2]
        return int(count) if count.isdigit() else 0

    async def executemany(self, query: str, params: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(query, params)

    async def fetch(self, query: str, *args: Any) -> list[Row]:
        return list(await self.conn.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> Row | None:
        return await self.conn.fetchrow(query, *args)

    async def lock(self, name: str) -> None:
        await self.conn.execute("SELECT pg_advisory_xact_lock($1)",
                                pg.lock_key(self.db.schema, f"xact:{name}"))

    async def notify(self, channel: str, payload: str = "") -> None:
        await self.db.notify(self.conn, channel, payload)


class PostgresLedger(LedgerCore[PgTx]):
    """:class:`~supervisor.ledger.base.Ledger` and
    :class:`~supervisor.ledger.base.EventOutbox` on one :class:`PgDatabase`."""

    # A replica declared dead has its holds released by whichever survivor notices.
    peers_may_take_over = True

    def __init__(self, db: PgDatabase, owns_queue: bool, fence_s: float = 2.5,
                 dead_after_s: float | None = None) -> None:
        super().__init__(db, sql, owns_queue, holder=db.replica)
        self.db = db
        # No attempt starts unless our heartbeat is this fresh (half of dead_after).
        self._fence_s = fence_s
        # When peers declare a silent replica dead: no request leaves unless it is over
        # (by its own timeouts) before our heartbeat could be that old.
        self._dead_after_s = dead_after_s if dead_after_s is not None else 2 * fence_s

    # -- the core's primitives ---------------------------------------------------------

    async def _write(self, fn: Callable[[PgTx], Awaitable[T]], savepoint: bool = True) -> T:
        return await self.db.write(lambda conn: fn(PgTx(self.db, conn)))

    async def _read(self, query: str, *args: Any, listing: bool = False) -> list[Row]:
        return await self.db.read(query, *args)

    def _now(self) -> float:
        return self.db.now()

    @property
    def _offset(self) -> float:
        return self.db.offset

    def _queue_time(self, now: float, delay_s: float) -> float:
        return delay_s  # the queue table's times are on the database's clock

    async def _insert_operations(self, tx: PgTx, ids: Sequence[str],
                                 recipient_ids: Sequence[str], run_id: str,
                                 now: float) -> int:
        return int(await tx.conn.fetchval(sql.INSERT_OPERATIONS, list(ids),
                                          list(recipient_ids), run_id, now))

    # -- fencing -----------------------------------------------------------------------

    async def _alive(self, conn: Conn) -> bool:
        # FOR SHARE: no peer reaps this replica while the caller's transaction commits.
        return await conn.fetchval(sql.ALIVE, self.db.replica, self._fence_s) is not None

    async def _admit(self, tx: PgTx) -> None:
        if not await self._alive(tx.conn):
            raise ReplicaFenced(f"replica {self.db.replica} is not registered as alive: "
                                "no attempt starts until its heartbeat is fresh")

    async def keep_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           busy_s: float) -> bool:
        async def write(conn: Conn) -> bool:
            if not await self._alive(conn):
                return False
            status = await conn.execute(sql.KEEP_ATTEMPT, operation_id, attempt_id, owner,
                                        self.db.replica, busy_s)
            return bool(status == "UPDATE 1")

        return await self.db.write(write)

    async def owns_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           for_s: float) -> bool:
        fresh_s = self._dead_after_s - for_s
        if fresh_s <= 0:
            return False  # no heartbeat is fresh enough (config refuses this)
        row = await self.db.read_one(sql.OWNS_ATTEMPT, operation_id, attempt_id, owner,
                                     self.db.replica, for_s, fresh_s)
        return row is not None

    async def owns_attempts(self, claims: Sequence[tuple[str, int, str]],
                            for_s: float) -> set[str]:
        fresh_s = self._dead_after_s - for_s
        if fresh_s <= 0 or not claims:
            return set()
        ids, attempts, owners = (list(x) for x in zip(*claims, strict=True))
        rows = await self.db.read(sql.OWNS_ATTEMPTS, ids, attempts, owners,
                                  self.db.replica, for_s, fresh_s)
        return {row[0] for row in rows}
