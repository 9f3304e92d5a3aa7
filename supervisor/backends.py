"""The composition root for storage: which ledger, queue, rate budget and roles a
configuration means, opened in order and closed in reverse.

Embedded (``ledger.backend = "sqlite"``): one file under the data-dir lock, one process;
leases and in-flight guards left by a previous life are released at start, because their
owner is certainly gone. Scale-out (``"postgres"``): N replicas on one database; nothing is
released at start (its owner may be a live replica), a dead replica's work is released by
whichever replica notices (:class:`~supervisor.postgres.replicas.Membership`), singleton roles are
advisory locks, and one rate budget is shared through the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from supervisor.budget.base import RateBudget
from supervisor.budget.local import LocalBudget
from supervisor.config import Config
from supervisor.errors import StartupError, StorageError
from supervisor.ledger.base import LedgerStore
from supervisor.postgres import connect as pg
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from supervisor.postgres.queue import PostgresQueue
from supervisor.postgres.replicas import AdvisoryRoles, Membership, new_replica_id
from supervisor.queue.base import Queue
from supervisor.queue.infrai import InfraiQueue
from supervisor.roles import LocalRoles, Roles
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue

log = logging.getLogger(__name__)

# With replicas the last settlement of a run may happen anywhere: the monitor role's
# holder looks for runs to close this often (a statement that changes nothing until then).
FINISH_EVERY_S = 0.25
CLOSE_S = 5.0
# A storage fault counts as cleared once commits succeed this long after the last failure.
LEDGER_RECOVER_AFTER_S = 2.0


class DataDirLock:
    """An exclusive lock on the data dir: the SQLite ledger assumes a single process."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "cleanup.lock"
        self._fh: TextIO | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = self.path.open("a")
        except OSError as exc:
            raise StartupError(f"data dir {self.path.parent} is not writable: {exc}") from exc
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise StartupError(f"another cleanup-supervisor uses {self.path.parent}") from None
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def pg_migrations() -> tuple[pg.Migration, ...]:
    """Every component's migrations: the ledger's, the queue's (the same tables) and the
    shared budget's."""
    from supervisor.postgres.budget import MIGRATIONS as BUDGET

    return pg_sql.MIGRATIONS + BUDGET


@dataclass
class Backends:
    ledger: LedgerStore
    queue: Queue
    budget: RateBudget
    roles: Roles
    # Set by a write another replica (or this one) made: a run opened, a page discovered.
    wakeups: dict[str, asyncio.Event]
    replica: str = ""
    membership: Membership | None = None
    released: int = 0  # leases handed back at start (SQLite only)
    # How often the holder of the monitor role looks for runs to close.
    finish_every_s: float = 1.0
    storage_healthy: Callable[[], bool] = lambda: True
    describe: str = ""
    # Tasks the backends own that the service supervises with its components (a SQLite
    # ledger's writer): (name, coroutine function).
    components: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = field(
        default_factory=list)
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        """Outward first, the ledger last (it flushes pending writes)."""
        await _close_all(self._closers)
        self._closers.clear()


async def open_backends(c: Config) -> Backends:
    """Open what ``c`` configures; raises StartupError (exit 3) when any part cannot."""
    if c.ledger.backend == "postgres":
        return await _open_postgres(c)
    return await _open_sqlite(c)


async def _queue(c: Config, closers: list[Callable[[], Awaitable[None]]]) -> InfraiQueue:
    queue = InfraiQueue(c.infrai)
    closers.append(queue.close)
    await queue.start()
    return queue


async def _open_sqlite(c: Config) -> Backends:
    lock = DataDirLock(c.service.data_dir)
    lock.acquire()
    closers: list[Callable[[], Awaitable[None]]] = []

    async def unlock() -> None:
        lock.release()

    closers.append(unlock)
    db = Database(c.ledger_path, recover_after_s=LEDGER_RECOVER_AFTER_S)
    try:
        try:
            await db.open()
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
        closers.append(db.close)
        queue: Queue
        released = 0
        if c.queue.backend == "infrai":
            queue = await _queue(c, closers)
        else:
            sqlite_queue = queue = SqliteQueue(db)
            released = await sqlite_queue.recover_leases()
        ledger = SqliteLedger(db, owns_queue=queue.capabilities.transactional_ack)
        # Under the data-dir lock every in-flight guard's owner is a previous life.
        await ledger.release_dead_owners()
        budget = LocalBudget(c.limits, key=c.partner.base_url, store=ledger,
                             timeout_s=c.partner.request_timeout_seconds,
                             max_pause_s=c.partner.max_retry_after_seconds)
        await budget.start()
    except StorageError as exc:  # the ledger opened but its first reads or writes fail
        await _close_all(closers)
        raise StartupError(f"ledger {c.ledger_path} cannot be used: {exc}") from exc
    except BaseException:
        await _close_all(closers)
        raise
    return Backends(ledger=ledger, queue=queue, budget=budget, roles=LocalRoles(),
                    wakeups={"runs": asyncio.Event(), "outbox": asyncio.Event(),
                             "finished": asyncio.Event()},
                    released=released, storage_healthy=lambda: db.healthy,
                    describe=f"ledger {c.ledger_path}",
                    components=[("ledger-writer", db.watch)], _closers=closers)


async def _open_postgres(c: Config) -> Backends:
    from supervisor.postgres.budget import PostgresBudget

    assert c.ledger.dsn is not None  # config validation requires it
    dsn = c.ledger.dsn.reveal()
    replica = new_replica_id()
    closers: list[Callable[[], Awaitable[None]]] = []
    db = PgDatabase(dsn, c.ledger.schema, replica, pool_size=c.ledger.pool_size)
    try:
        try:
            await db.open(pg_migrations())
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
        closers.append(db.close)
        roles = AdvisoryRoles(dsn, c.ledger.schema, c.ledger.role_poll_seconds, replica)
        closers.append(roles.close)
        membership = Membership(db, c.ledger, roles)
        closers.append(membership.close)  # its own connection, should the join fail
        await membership.join()
        closers.append(membership.leave)
        queue: Queue = (await _queue(c, closers) if c.queue.backend == "infrai"
                        else PostgresQueue(db))
        ledger = PostgresLedger(db, owns_queue=queue.capabilities.transactional_ack,
                                fence_s=c.ledger.dead_after_seconds / 2,
                                dead_after_s=c.ledger.dead_after_seconds)
        budget = PostgresBudget(c.limits, key=c.partner.base_url, pool=db.pool, dsn=dsn,
                                schema=c.ledger.schema,
                                timeout_s=c.partner.request_timeout_seconds,
                                max_pause_s=c.partner.max_retry_after_seconds,
                                db_clock=db.clock)
        closers.append(budget.close)
        await budget.start()
    except (StorageError, OSError) as exc:
        await _close_all(closers)
        raise StartupError(f"cannot start on PostgreSQL: {exc}") from exc
    except BaseException:
        await _close_all(closers)
        raise
    return Backends(ledger=ledger, queue=queue, budget=budget, roles=roles,
                    wakeups={name: db.wakeups[name] for name in ("runs", "outbox", "finished")},
                    finish_every_s=FINISH_EVERY_S,
                    replica=replica, membership=membership,
                    storage_healthy=lambda: db.healthy and membership.fresh,
                    describe=f"ledger postgres schema {c.ledger.schema}, replica {replica}",
                    _closers=closers)


async def _close_all(closers: list[Callable[[], Awaitable[None]]]) -> None:
    # Each bounded: a database that does not answer must not hold the stop past the
    # runtime's stop timeout.
    for closer in reversed(closers):
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_S):
                await closer()
