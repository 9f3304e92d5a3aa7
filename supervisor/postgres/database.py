"""One PostgreSQL database as the ledger, the queue and the replica registry see it: a pool,
a transaction helper that turns connection trouble into StorageError (and readiness),
and one LISTEN connection that wakes local waiters when another replica writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from supervisor.errors import StorageError
from supervisor.postgres import connect as pg

log = logging.getLogger(__name__)

T = TypeVar("T")
if TYPE_CHECKING:
    Conn = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]
else:
    Conn = Any

# Two transactions that touch the same rows in opposite order (or a serialization
# failure) are retried: each attempt rolls back completely first.
RETRYABLE = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)
# What says the database, not the caller, is at fault. InternalClientError: a session
# the server ended (terminated, restarted) whose socket has not closed yet refuses the
# next query with it, not with a connection error.
STORAGE = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
           asyncpg.InternalClientError, asyncpg.InsufficientResourcesError,
           asyncpg.ReadOnlySQLTransactionError, asyncpg.CannotConnectNowError,
           asyncpg.AdminShutdownError, asyncpg.OperatorInterventionError)
# Channels replicas wake one another on.
CHANNELS = ("queue", "runs", "outbox", "finished")


class PgDatabase:
    """Owns the pool of one replica; ``replica`` names it in leases and guards."""

    def __init__(self, dsn: str, schema: str, replica: str, pool_size: int = 10) -> None:
        self.dsn = dsn
        self.schema = schema
        self.replica = replica
        self.pool_size = pool_size
        self.clock = pg.DbClock()  # measured at open: the time this replica keeps
        self._pool: asyncpg.Pool | None = None
        self.healthy = False
        self.last_error: str | None = None
        self.statements = 0  # transactions and reads: the ledger's cost, for the bench
        self.wakeups = {name: asyncio.Event() for name in CHANNELS}
        # What each open transaction notified: set locally once it has committed.
        self._notified_by: dict[int, set[str]] = {}
        self._listener: asyncpg.Connection | None = None
        self._listen_task: asyncio.Task[None] | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StorageError("ledger is not open")
        return self._pool

    @property
    def offset(self) -> float:
        return self.clock.offset

    def now(self) -> float:
        return self.clock.now()

    async def open(self, migrations: tuple[pg.Migration, ...] = ()) -> list[str]:
        self._pool = await pg.create_pool(self.dsn, self.schema, max_size=self.pool_size)
        try:
            applied = await pg.migrate(self._pool, self.schema, migrations) if migrations else []
            await self.clock.measure(self._pool)
        except (asyncpg.PostgresError, *STORAGE) as exc:
            await self.close()
            raise StorageError(f"cannot migrate schema {self.schema}: {exc}") from exc
        self.healthy = True
        await self._listen()
        self._listen_task = asyncio.create_task(self._keep_listening(), name="pg-listen")
        return applied

    async def _listen(self) -> None:
        try:
            conn = await pg.connect(self.dsn, self.schema)
            for name in CHANNELS:
                await conn.add_listener(pg.channel(self.schema, name), self._notified)
        except (StorageError, asyncpg.PostgresError, *STORAGE) as exc:
            log.warning("LISTEN connection failed (%s); polling until it is back", exc)
            return
        self._listener = conn
        for event in self.wakeups.values():
            event.set()  # whatever was notified while we were deaf: look once

    def _notified(self, _conn: Any, _pid: int, channel: str, _payload: object) -> None:
        name = channel.rpartition("_")[2]
        if name in self.wakeups:
            self.wakeups[name].set()

    async def _keep_listening(self) -> None:
        """Reconnect a dropped LISTEN connection; until then waiters fall back to polling."""
        while True:
            await asyncio.sleep(2.0)  # a period, not a synchronisation
            conn = self._listener
            if conn is not None and not conn.is_closed():
                try:
                    # A connection a NAT or a firewall dropped in silence looks open:
                    # only an answer says it still delivers notifications.
                    await conn.fetchval("SELECT 1", timeout=2.0)
                    continue
                except (asyncpg.PostgresError, *STORAGE):
                    conn.terminate()
            self._listener = None
            await self._listen()

    async def notify(self, conn: Conn, name: str, payload: str = "") -> None:
        """Wake every replica waiting on ``name`` when the caller's transaction commits."""
        await conn.execute("SELECT pg_notify($1, $2)", pg.channel(self.schema, name), payload)
        # Our own waiters too, but not before the commit (they would look too early and
        # then wait for the poll should the LISTEN connection be down): see write().
        self._notified_by.setdefault(id(conn), set()).add(name)

    async def write(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``fn`` in one transaction; its result once committed. A caller's error
        rolls back its own transaction and reaches the caller; a storage fault becomes
        StorageError and marks the ledger unhealthy until a commit succeeds."""
        for attempt in range(3):
            key = 0
            try:
                async with self.pool.acquire() as conn:
                    key = id(conn)
                    async with conn.transaction():
                        self.statements += 1
                        result = await fn(conn)
            except RETRYABLE:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.01 * (attempt + 1))  # a backoff, not a sync
                continue
            except (asyncpg.IntegrityConstraintViolationError, asyncpg.DataError):
                raise
            except STORAGE as exc:
                self._mark_unhealthy(exc)
                raise StorageError(f"ledger commit failed: {exc}") from exc
            except asyncpg.PostgresError as exc:
                self._mark_unhealthy(exc)
                raise StorageError(f"ledger commit failed: {exc}") from exc
            finally:
                notified = self._notified_by.pop(key, set())
            for name in notified:  # committed: now our own waiters may look
                self.wakeups[name].set()
            self._mark_healthy()
            return result
        raise AssertionError("unreachable")

    async def read(self, query: str, *args: Any) -> list[asyncpg.Record]:
        try:
            async with self.pool.acquire() as conn:
                self.statements += 1
                return list(await conn.fetch(query, *args))
        except (asyncpg.PostgresError, *STORAGE) as exc:
            raise StorageError(f"ledger read failed: {exc}") from exc

    async def read_one(self, query: str, *args: Any) -> asyncpg.Record | None:
        rows = await self.read(query, *args)
        return rows[0] if rows else None

    def _mark_unhealthy(self, exc: BaseException) -> None:
        if self.healthy:
            log.error("ledger cannot commit: %s; operations stay unacked until it can", exc,
                      extra={"action": "ledger_unhealthy"})
        self.healthy = False
        self.last_error = str(exc)

    def _mark_healthy(self) -> None:
        if not self.healthy:
            log.warning("ledger writable again", extra={"action": "ledger_recovered"})
            self.healthy = True
            self.last_error = None

    async def close(self) -> None:
        if self._listen_task is not None:
            self._listen_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listen_task
            self._listen_task = None
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
            self._listener = None
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pool.close(), 10)
            self._pool = None

