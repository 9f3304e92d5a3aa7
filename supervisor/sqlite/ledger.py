"""The embedded ledger: runs, operations and attempts in one SQLite file.

The rules are the core's (:class:`~supervisor.ledger.core.LedgerCore`); this module gives
it SQLite's statements and its unit of work, the group commit of :class:`Database`. What
only SQLite has: settlements of the embedded queue join one ``executemany`` per
statement in the next group commit, the budget's memory is kept here (the in-process
budget has nowhere else), and at start-up, under the data-dir lock, every in-flight guard
belongs to a dead process.

When the embedded queue shares the file (:class:`~supervisor.sqlite.queue.SqliteQueue`), an
outcome and its ack commit in one transaction, so no message is ever acked whose outcome
was not committed, and no committed outcome leaves its message behind.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiosqlite
import orjson

from supervisor.errors import StorageError
from supervisor.ledger import rows
from supervisor.ledger.core import LedgerCore
from supervisor.ledger.driver import Row
from supervisor.model import Disposition, Settled, Settlement
from supervisor.sqlite import sql
from supervisor.sqlite.database import Database
from supervisor.states import SETTLED, OpState

T = TypeVar("T")
# Each settlement, and what it learns: whether its outcome was refused.
_Batch = list[tuple[Settlement, asyncio.Future[bool]]]


def _params(args: Sequence[Any]) -> tuple[Any, ...]:
    # A list of values is a JSON array here (read with json_each).
    return tuple(orjson.dumps(a).decode() if isinstance(a, list) else a for a in args)


class SqliteTx:
    """The unit of work's :class:`~supervisor.ledger.driver.Tx`: one write of a group
    commit. One writer serialises every transaction, so there is nothing to lock, and
    nobody else to notify."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn

    async def execute(self, query: str, *args: Any) -> int:
        cur = await self.conn.execute(query, _params(args))
        return cur.rowcount

    async def executemany(self, query: str, params: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(query, [_params(p) for p in params])

    async def fetch(self, query: str, *args: Any) -> list[Row]:
        return list(await self.conn.execute_fetchall(query, _params(args)))

    async def fetchrow(self, query: str, *args: Any) -> Row | None:
        # One round trip to the writer's thread, not three (execute, fetch, close).
        found = await self.conn.execute_fetchall(query, _params(args))
        return next(iter(found), None)

    async def lock(self, name: str) -> None:
        pass

    async def notify(self, channel: str, payload: str = "") -> None:
        pass


class SqliteLedger(LedgerCore[SqliteTx]):
    """The :class:`~supervisor.ledger.base.Ledger` on one SQLite :class:`Database`, and
    its :class:`~supervisor.ledger.base.EventOutbox`: every settlement and finished run
    writes its event in its own transaction."""

    def __init__(self, db: Database, owns_queue: bool) -> None:
        super().__init__(db, sql, owns_queue)
        self.db = db
        # Settlements waiting for the next group commit (see _settle_batched).
        self._open_batch: _Batch | None = None

    # -- the core's primitives ---------------------------------------------------------

    async def _write(self, fn: Callable[[SqliteTx], Awaitable[T]], savepoint: bool = True) -> T:
        return await self.db.write(lambda conn: fn(SqliteTx(conn)), savepoint=savepoint)

    async def _read(self, query: str, *args: Any, listing: bool = False) -> list[Row]:
        return await self.db.read(query, _params(args), listing=listing)

    def _now(self) -> float:
        return time.time()

    def _queue_time(self, now: float, delay_s: float) -> float:
        return now + delay_s

    async def _insert_operations(self, tx: SqliteTx, ids: Sequence[str],
                                 recipient_ids: Sequence[str], run_id: str,
                                 now: float) -> int:
        before = tx.conn.total_changes
        await tx.conn.executemany(sql.INSERT_OPERATION, [
            (op_id, run_id, rid, now, now) for op_id, rid in zip(ids, recipient_ids,
                                                                 strict=True)])
        return tx.conn.total_changes - before

    # -- attempts: one process, its own clock --------------------------------------------

    async def keep_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           busy_s: float) -> bool:
        async def write(conn: aiosqlite.Connection) -> bool:
            now = time.time()
            cur = await conn.execute(sql.KEEP_ATTEMPT, {
                "id": operation_id, "attempt": attempt_id, "owner": owner, "until": now,
                "busy_until": now + busy_s})
            return cur.rowcount == 1

        return await self.db.write(write, savepoint=False)

    async def owns_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           for_s: float) -> bool:
        row = await self.db.read_one(sql.OWNS_ATTEMPT, {
            "id": operation_id, "attempt": attempt_id, "owner": owner,
            "until": time.time() + for_s})
        return row is not None

    async def owns_attempts(self, claims: Sequence[tuple[str, int, str]],
                            for_s: float) -> set[str]:
        if not claims:
            return set()
        rows = await self.db.read(sql.OWNS_ATTEMPTS, (
            orjson.dumps([list(c) for c in claims]).decode(), time.time() + for_s))
        return {row[0] for row in rows}

    async def release_dead_owners(self) -> int:
        """Free every operation an attempt of a previous process holds in flight.

        Call once at start-up, under the data-dir lock, with the queue's recover_leases:
        the holders are gone, so their redelivered messages may be resent at once rather
        than after ``busy_s``.
        """
        async def write(conn: aiosqlite.Connection) -> int:
            cur = await conn.execute(sql.RELEASE_DEAD_OWNERS)
            return cur.rowcount

        return await self.db.write(write)

    # -- settlement: the group commit ----------------------------------------------------

    async def settle(self, settlements: Sequence[Settlement]) -> Settled:
        if self._owns_queue and len(settlements) == 1 and _batchable(settlements[0]):
            [s] = settlements
            refused = await self._settle_batched(s)
            return Settled([], frozenset({s.operation_id}) if refused else frozenset())
        return await super().settle(settlements)

    async def begin_attempts(self, starts: Sequence[tuple[str, str]], kind: str,
                             busy_s: float) -> list[int | Exception]:
        """A batch's attempts in one ``executemany`` per statement when none is refused
        (the common case); else the core's rules one by one, which say what refused
        each. Either way one group commit."""
        if not starts:
            return []
        found = await self.db.write(functools.partial(self._begin_many, starts, kind, busy_s))
        if found is not None:
            return list(found)
        return await super().begin_attempts(starts, kind, busy_s)

    @staticmethod
    async def _begin_many(starts: Sequence[tuple[str, str]], kind: str, busy_s: float,
                          conn: aiosqlite.Connection) -> list[int] | None:
        now = time.time()
        ids = [op_id for op_id, _ in starts]
        await conn.execute("SAVEPOINT begin_many")
        before = conn.total_changes
        await conn.executemany(
            sql.transition(OpState.IN_FLIGHT, guard_busy=True, returning=False),
            [(OpState.IN_FLIGHT.value, None, 1, now, owner, busy_s if busy_s > 0 else None,
              op_id) for op_id, owner in starts])
        if conn.total_changes - before != len(starts) or len(set(ids)) != len(ids):
            await conn.execute("ROLLBACK TO begin_many")
            await conn.execute("RELEASE begin_many")
            return None
        listed = orjson.dumps(ids).decode()
        await conn.execute(sql.CLOSE_OPEN_ATTEMPTS_OF, (now, listed))
        await conn.execute(sql.CLOSE_FINISHED_BATCHES_OF, (now, listed))
        counts: dict[str, int] = {r[0]: int(r[1]) for r in
                                  await conn.execute_fetchall(sql.SELECT_ATTEMPT_COUNTS,
                                                              (listed,))}
        await conn.executemany(sql.INSERT_ATTEMPT_MANY,
                               [(op_id, counts[op_id], kind, now) for op_id in ids])
        # Just closed every other: the only open attempt of each is the one just written.
        opened: dict[str, int] = {r[0]: int(r[1]) for r in
                                  await conn.execute_fetchall(sql.SELECT_OPEN_ATTEMPTS_OF,
                                                              (listed,))}
        await conn.execute("RELEASE begin_many")
        return [opened[op_id] for op_id in ids]

    async def _settle_batched(self, settlement: Settlement) -> bool:
        """Join the settlements of every worker that settles before the next group commit,
        and write them with one ``executemany`` per statement instead of three statements
        each: at full speed this is where the ledger spends its time. Returns once the
        group commit holding it has committed: True when its outcome was refused."""
        if self._open_batch is None:
            batch: _Batch = []
            self._open_batch = batch
            write = asyncio.ensure_future(self.db.write(
                functools.partial(self._write_settlements, batch)))
            write.add_done_callback(functools.partial(self._settlements_done, batch))
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._open_batch.append((settlement, fut))
        return await asyncio.shield(fut)

    async def _write_settlements(self, batch: _Batch,
                                 conn: aiosqlite.Connection) -> list[BaseException | bool]:
        if self._open_batch is batch:
            self._open_batch = None  # later settlements start the next batch
        await conn.execute("SAVEPOINT fast")
        if await self._settle_many(conn, [s for s, _ in batch]):
            await conn.execute("RELEASE fast")
            return [False] * len(batch)
        # Some transition was refused, or an attempt was superseded: undo, and settle one
        # by one by the core's rules, so that only the offending settlement fails.
        await conn.execute("ROLLBACK TO fast")
        await conn.execute("RELEASE fast")
        outcomes: list[BaseException | bool] = []
        for s, _ in batch:
            await conn.execute("SAVEPOINT one")
            try:
                outcomes.append(bool(await self._settle_each(SqliteTx(conn), [s])))
            except (sqlite3.OperationalError, sqlite3.DatabaseError):
                raise  # storage trouble: the group commit fails as a whole
            except Exception as exc:
                await conn.execute("ROLLBACK TO one")
                outcomes.append(exc)
            await conn.execute("RELEASE one")
        return outcomes

    def _settlements_done(self, batch: _Batch,
                          write: asyncio.Future[list[BaseException | bool]]) -> None:
        """After the group commit: each settlement learns its own outcome."""
        if self._open_batch is batch:
            self._open_batch = None
        if write.cancelled():
            outcomes: list[BaseException | bool] = [StorageError("ledger closed")] * len(batch)
        elif (error := write.exception()) is not None:
            outcomes = [error] * len(batch)
        else:
            outcomes = write.result()
        for (_, fut), outcome in zip(batch, outcomes, strict=True):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    async def _settle_many(self, conn: aiosqlite.Connection,
                           settlements: Sequence[Settlement]) -> bool:
        """The core's settlement (``_settle_each``) for a batch that breaks no rule, one
        ``executemany`` per statement; False as soon as one would (the caller undoes
        it and lets the core settle each)."""
        now = time.time()
        # First, as the core does: an attempt another delivery has superseded (closed)
        # is found before anything moves.
        finishing = [(now, s.status, s.outcome, s.detail, s.attempt_id, s.owner)
                     for s in settlements if s.attempt_id is not None]
        before = conn.total_changes
        await conn.executemany(sql.FINISH_ATTEMPT, finishing)
        if conn.total_changes - before != len(finishing):
            return False
        by_target: dict[OpState, list[tuple[Any, ...]]] = {}
        for s in settlements:
            by_target.setdefault(s.target, []).append(
                (s.target.value, s.reason, -1 if s.refund_attempt else 0, now, None, None,
                 s.operation_id))
        for target, params in by_target.items():
            before = conn.total_changes
            await conn.executemany(sql.transition(target, guard_busy=False, returning=False),
                                   params)
            if conn.total_changes - before != len(params):
                return False
        await conn.executemany(sql.SETTLE_BOOKKEEPING,
                               [self._bookkeeping(s, now) for s in settlements])
        await conn.executemany(sql.DELETE_MESSAGE, [
            (s.operation_id, s.delivery.receipt) for s in settlements
            if s.delivery is not None and s.disposition is Disposition.ACK])
        await conn.executemany(sql.RETRY_MESSAGE, [
            (self._queue_time(now, s.delay_s), s.operation_id, s.delivery.receipt)
            for s in settlements
            if s.delivery is not None and s.disposition is Disposition.RETRY])
        await self._record_events(SqliteTx(conn), sql.INSERT_OPERATION_EVENT,
                                  [s.operation_id for s in settlements if s.target in SETTLED],
                                  now)
        batches = sorted({s.batch_id for s in settlements if s.batch_id is not None})
        if batches:
            await conn.execute(sql.CLOSE_FINISHED_BATCHES, (now, orjson.dumps(batches).decode()))
        return True

    # -- the in-process budget's memory ----------------------------------------------------

    async def load_budget(self, key: str) -> dict[str, Any] | None:
        """What the rate budget saved for ``key`` (a partner's base URL), if anything."""
        row = await self.db.read_one(sql.SELECT_BUDGET, (key,))
        return rows.budget_memory(row[0] if row is not None else None)

    async def save_budget(self, key: str, data: dict[str, Any]) -> None:
        """Replace what is saved for ``key``; durable when the call returns."""
        blob = orjson.dumps(data).decode()

        async def write(conn: aiosqlite.Connection) -> None:
            await conn.execute(sql.UPSERT_BUDGET, (key, blob, time.time()))

        await self.db.write(write)


def _batchable(s: Settlement) -> bool:
    # An ambiguous settlement without an attempt also closes earlier open attempts: the
    # one-by-one path does that.
    return not (s.target is OpState.AMBIGUOUS and s.attempt_id is None)
