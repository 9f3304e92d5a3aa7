"""The ledger on PostgreSQL, for N replicas on one database.

The same state machine and bookkeeping as :class:`~supervisor.sqlite.ledger.SqliteLedger`
(the SQL guard comes from supervisor/states.py through pg_sql.transition); what several
writers add: every in-flight guard names its replica (``holder``) and begin_attempt
refuses while this replica's registration is stale (the others may have released what it
held), runs open under a transaction lock so every replica's tick dedupes on one row, a
page commits only from the cursor its scan resumed from, and the events outbox is written
in commit order (a transaction lock around the insert) so a sink's cursor never skips an
event that commits late.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
import orjson

from supervisor import states
from supervisor.errors import AttemptOpen, OperationBusy, ReplicaFenced, ScanConflict
from supervisor.ledger.base import budget_memory, operator_action
from supervisor.model import (
    Attempt,
    Backlog,
    Delivery,
    Disposition,
    Event,
    LedgerStats,
    Message,
    OpenRunResult,
    Operation,
    OperatorAction,
    PageResult,
    Published,
    QueueStats,
    Received,
    Run,
    Settlement,
)
from supervisor.postgres import connect as pg
from supervisor.postgres import sql
from supervisor.postgres.database import Conn, PgDatabase
from supervisor.sqlite.ledger import new_operation_id, new_run_id
from supervisor.sqlite.outbox import new_event_id
from supervisor.states import SETTLED, OpState, RunState

log = logging.getLogger(__name__)


def _run(r: asyncpg.Record, listed: bool = False) -> Run:
    """A run from RUN_COLUMNS, or (``listed``) from LIST_RUN_COLUMNS: its source's kind."""
    return Run(
        id=r[0], tick_key=r[1], schedule=r[2], scheduled_for=r[3], state=RunState(r[4]),
        source={"kind": r[5]} if listed else orjson.loads(r[5]), scan_cursor=r[6],
        scan_pages=r[7], discovered=r[8], skipped_candidates=r[9], scan_failures=r[10],
        last_error=r[11], created_at=r[12], scan_finished_at=r[13], finished_at=r[14])


def _op(r: asyncpg.Record, unfinished: bool = False) -> Operation:
    return Operation(id=r[0], run_id=r[1], recipient_id=r[2], state=OpState(r[3]),
                     attempts=r[4], reason=r[5], created_at=r[6], updated_at=r[7],
                     due_at=r[8], unfinished_attempt=unfinished)


def _event(r: asyncpg.Record) -> Event:
    counts = orjson.loads(r[8]) if r[8] is not None else None
    return Event(seq=r[0], id=r[1], kind=r[2], at=r[3], run_id=r[4], operation_id=r[5],
                 recipient_id=r[6], outcome=r[7], counts=counts)


class PostgresLedger:
    """:class:`~supervisor.ledger.base.Ledger` and
    :class:`~supervisor.ledger.base.EventOutbox` on one :class:`PgDatabase`."""

    def __init__(self, db: PgDatabase, owns_queue: bool, fence_s: float = 2.5,
                 dead_after_s: float | None = None) -> None:
        self.db = db
        self._owns_queue = owns_queue
        # No attempt starts unless our heartbeat is this fresh (half of dead_after).
        self._fence_s = fence_s
        # When peers declare a silent replica dead: no request leaves unless it is over
        # (by its own timeouts) before our heartbeat could be that old.
        self._dead_after_s = dead_after_s if dead_after_s is not None else 2 * fence_s
        self._events_lock = pg.lock_key(db.schema, "xact:events")
        self._open_lock = pg.lock_key(db.schema, "xact:open_run")
        self._finish_lock = pg.lock_key(db.schema, "xact:finish_runs")

    def _op(self, r: asyncpg.Record, unfinished: bool = False) -> Operation:
        op = _op(r, unfinished)
        if op.due_at is None or not self.db.offset:
            return op
        # Callers hold a due time against their own clock (a retry not yet due is deferred).
        return dataclasses.replace(op, due_at=op.due_at - self.db.offset)

    @property
    def healthy(self) -> bool:
        return self.db.healthy

    # -- runs --------------------------------------------------------------------------

    async def open_run(self, tick_key: str, schedule: str, scheduled_for: float | None,
                       source: Mapping[str, Any], skip_if_unfinished: bool,
                       reuse_within_s: float | None = None) -> OpenRunResult:
        async def write(conn: Conn) -> OpenRunResult:
            # Every replica's schedule fires the same tick: one at a time decides.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", self._open_lock)
            existing = await conn.fetchrow(sql.SELECT_RUN_BY_TICK, tick_key)
            if existing is None and reuse_within_s is not None:
                existing = await conn.fetchrow(sql.SELECT_RECENT_RUN_OF_SCHEDULE, schedule,
                                               self.db.now() - reuse_within_s)
            if existing is not None:
                return OpenRunResult(_run(existing), created=False)
            if skip_if_unfinished:
                busy = await conn.fetchrow(sql.SELECT_UNFINISHED_RUN)
                if busy is not None:
                    return OpenRunResult(None, created=False,
                                         skipped_for=_run(busy, listed=True))
            now = self.db.now()
            run_id = new_run_id(now)
            await conn.execute(sql.INSERT_RUN, run_id, tick_key, schedule, scheduled_for,
                               RunState.SCANNING.value, orjson.dumps(source).decode(),
                               source.get("kind"), now)
            row = await conn.fetchrow(sql.SELECT_RUN, run_id)
            assert row is not None
            await self.db.notify(conn, "runs", run_id)
            return OpenRunResult(_run(row), created=True)

        return await self.db.write(write)

    async def get_run(self, run_id: str) -> Run | None:
        row = await self.db.read_one(sql.SELECT_RUN, run_id)
        return _run(row) if row else None

    async def list_runs(self, limit: int, before: str | None = None) -> list[Run]:
        if before is None:
            rows = await self.db.read(sql.SELECT_RUNS, limit)
        else:
            rows = await self.db.read(sql.SELECT_RUNS_BEFORE, before, limit)
        return [_run(r, listed=True) for r in rows]

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, Run]:
        rows = await self.db.read(sql.SELECT_RUNS_BY_ID, list(run_ids))
        return {r[0]: _run(r, listed=True) for r in rows}

    async def schedule_runs(self, schedule: str) -> list[Run]:
        return [_run(r, listed=True) for r in await self.db.read(sql.SELECT_SCHEDULE_RUNS,
                                                                 schedule)]

    async def run_counts(self, run_id: str) -> dict[OpState, int]:
        rows = await self.db.read(sql.COUNT_RUN_STATES, run_id)
        return {OpState(r[0]): r[1] for r in rows}

    async def runs_to_scan(self) -> list[Run]:
        return [_run(r) for r in await self.db.read(sql.SELECT_RUNS_TO_SCAN)]

    async def record_page(self, run_id: str, recipient_ids: Sequence[str],
                          next_cursor: str | None, skipped: int,
                          resumed_from: str | None = None) -> PageResult:
        now = self.db.now()
        ids = [new_operation_id() for _ in recipient_ids]

        async def write(conn: Conn) -> PageResult:
            added = await conn.fetchval(sql.INSERT_OPERATIONS, ids, list(recipient_ids),
                                        run_id, now)
            status = await conn.execute(sql.UPDATE_RUN_PAGE, next_cursor, added, skipped,
                                        run_id, resumed_from)
            if status.endswith(" 0"):
                row = await conn.fetchrow(sql.SELECT_RUN_SCAN, run_id)
                if row is None or row[0] != RunState.SCANNING.value:
                    raise ValueError(f"run {run_id} is not scanning")
                raise ScanConflict(run_id, resumed_from, row[1])
            state = RunState.SCANNING
            if next_cursor is None:
                await conn.execute(sql.UPDATE_RUN_SCANNED, now, run_id)
                state = RunState.DRAINING
            if added:
                await self.db.notify(conn, "outbox")
            return PageResult(int(added), state)

        return await self.db.write(write)

    async def record_scan_failure(self, run_id: str, error: str, give_up: bool) -> None:
        async def write(conn: Conn) -> None:
            await conn.execute(sql.UPDATE_RUN_SCAN_FAILURE, error[:1000], run_id)
            if give_up:
                await conn.execute(sql.UPDATE_RUN_SCAN_ABANDONED, self.db.now(),
                                   f"scan abandoned: {error}"[:1000], run_id)

        await self.db.write(write)

    async def finish_runs(self) -> list[str]:
        async def write(conn: Conn) -> list[str]:
            # Serialised with record_evidence queueing an operation again: each statement
            # here then sees that operation, or the reopen sees the run done.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", self._finish_lock)
            now = self.db.now()
            done = [r[0] for r in await conn.fetch(sql.UPDATE_RUNS_DONE, now)]
            if done:
                # Every replica's long-polls on these runs answer now.
                await self.db.notify(conn, "finished", done[0])
                await self._lock_events(conn)
                await conn.executemany(sql.INSERT_RUN_EVENT, [
                    (new_event_id(), now, run_id) for run_id in done])
            return done

        return await self.db.write(write)

    # -- operations --------------------------------------------------------------------

    async def unpublished(self, limit: int) -> list[Message]:
        rows = await self.db.read(sql.SELECT_UNPUBLISHED, limit)
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in rows]

    async def record_published(self, published: Sequence[Published],
                               outbox: bool = False) -> None:
        now = self.db.now()
        rows = [(p.message_id, now, p.due_at, p.operation_id) for p in published]
        statement = sql.RECORD_OUTBOX if outbox else sql.RECORD_PUBLISHED

        async def write(conn: Conn) -> None:
            await conn.executemany(statement, rows)

        await self.db.write(write)

    async def note_received(self, deliveries: Sequence[Delivery], lease_s: float,
                            per_message: bool = False) -> list[Received]:
        statement = sql.NOTE_RECEIVED_ONCE if per_message else sql.NOTE_RECEIVED

        async def write(conn: Conn) -> dict[int, tuple[int, float]]:
            now = self.db.now()
            counted: dict[int, tuple[int, float]] = {}
            for i, d in enumerate(deliveries):
                row = await conn.fetchrow(statement, now, now + lease_s, d.message_id,
                                          d.message.operation_id)
                if row is not None:
                    counted[i] = (int(row[0]), float(row[1]))
            return counted

        counted = await self.db.write(write)
        ops = await self.get_operations([d.message.operation_id for d in deliveries])
        return [Received(ops.get(d.message.operation_id), *counted.get(i, (0, 0.0)))
                for i, d in enumerate(deliveries)]

    async def get_operation(self, operation_id: str) -> Operation | None:
        return (await self.get_operations([operation_id])).get(operation_id)

    async def get_operations(self, operation_ids: Sequence[str]) -> dict[str, Operation]:
        rows = await self.db.read(sql.SELECT_OPERATIONS_WITH_OPEN_ATTEMPT, list(operation_ids))
        return {r[0]: self._op(r, unfinished=bool(r[9])) for r in rows}

    async def list_operations(self, run_id: str, state: OpState | None, after: str | None,
                              limit: int) -> list[Operation]:
        if state is None:
            rows = await self.db.read(sql.SELECT_OPERATIONS, run_id, after or "", limit)
        else:
            rows = await self.db.read(sql.SELECT_OPERATIONS_IN_STATE, run_id, state.value,
                                      after or "", limit)
        return [self._op(r) for r in rows]

    async def operations_in_state(self, state: OpState, after: str | None,
                                  limit: int) -> list[Operation]:
        rows = await self.db.read(sql.SELECT_OPERATIONS_BY_STATE, state.value, after or "", limit)
        return [self._op(r) for r in rows]

    async def attempts(self, operation_id: str, after: int = 0,
                       limit: int | None = None) -> list[Attempt]:
        rows = await self.db.read(sql.SELECT_ATTEMPTS, operation_id, limit, after)
        return [Attempt(*r) for r in rows]

    async def begin_attempt(self, operation_id: str, kind: str, owner: str = "",
                            busy_s: float = 0.0, supersedes_open: bool = True) -> int:
        async def write(conn: Conn) -> int:
            if await conn.fetchval(sql.ALIVE, self.db.replica, self._fence_s) is None:
                raise ReplicaFenced(f"replica {self.db.replica} is not registered as alive: "
                                    "no attempt starts until its heartbeat is fresh")
            now = self.db.now()
            n = await _transition(conn, operation_id, OpState.IN_FLIGHT, None, count=1,
                                  now=now, owner=owner, holder=self.db.replica,
                                  busy_s=busy_s if busy_s > 0 else None)
            if supersedes_open:
                insert = sql.SUPERSEDE_AND_INSERT_ATTEMPT
            elif await conn.fetchval(sql.HAS_OPEN_ATTEMPT, operation_id) is not None:
                raise AttemptOpen(operation_id)  # the transaction undoes the transition
            else:
                insert = sql.INSERT_ATTEMPT
            return int(await conn.fetchval(insert, operation_id, n, kind, now))

        return await self.db.write(write)

    async def keep_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           busy_s: float) -> bool:
        async def write(conn: Conn) -> bool:
            # Shared, like begin_attempt's: no peer reaps us while this commits.
            if await conn.fetchval(sql.ALIVE, self.db.replica, self._fence_s) is None:
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

    async def settle(self, settlements: Sequence[Settlement]) -> list[Settlement]:
        async def write(conn: Conn) -> None:
            now = self.db.now()
            settled: list[str] = []
            for s in settlements:
                if s.attempt_id is not None and await conn.fetchval(
                        sql.FINISH_ATTEMPT, now, s.status, s.outcome, s.detail,
                        s.attempt_id) is None:
                    # The attempt was closed by another replica: ours was declared dead
                    # (a stall longer than dead_after), and the one that took the
                    # operation over owns it now. Its own attempt, resent with the key or
                    # probed, decides; writing ours over it could undo that.
                    log.warning("operation %s: attempt %d was taken over by another "
                                "replica; this outcome (%s) is not recorded",
                                s.operation_id, s.attempt_id, s.outcome,
                                extra={"action": "settlement_superseded"})
                    continue
                await _transition(conn, s.operation_id, s.target, s.reason,
                                  count=-1 if s.refund_attempt else 0, now=now)
                if s.target in SETTLED:
                    settled.append(s.operation_id)
                if s.attempt_id is None and s.target is OpState.AMBIGUOUS:
                    # Held because an earlier attempt has no outcome: unknown for good.
                    await conn.execute(sql.CLOSE_OPEN_ATTEMPTS, now, s.operation_id)
                retry = s.disposition is Disposition.RETRY
                await conn.execute(sql.SETTLE_BOOKKEEPING, s.disposition is Disposition.KEEP,
                                   now + s.delay_s if retry else None,
                                   retry and not self._owns_queue, s.operation_id)
                if self._owns_queue and s.delivery is not None:
                    if s.disposition is Disposition.ACK:
                        await conn.execute(sql.DELETE_MESSAGE, s.operation_id,
                                           s.delivery.receipt)
                    elif retry:
                        await conn.execute(sql.RETRY_MESSAGE, s.delay_s,
                                           s.operation_id, s.delivery.receipt)
            await self._record_settled(conn, settled, now)

        await self.db.write(write)
        if self._owns_queue:
            return []
        return [s for s in settlements
                if s.delivery is not None and s.disposition is not Disposition.KEEP]

    async def record_evidence(self, operation_id: str, kind: str, target: OpState,
                              reason: str, detail: str, status: int | None = None,
                              probe_after_s: float | None = None) -> bool:
        async def write(conn: Conn) -> None:
            if target is OpState.QUEUED:
                await conn.execute("SELECT pg_advisory_xact_lock($1)", self._finish_lock)
            now = self.db.now()
            row = await conn.fetchrow(sql.SELECT_OPERATION, operation_id)
            if row is None:
                raise KeyError(f"operation {operation_id} does not exist")
            op = self._op(row)
            await _transition(conn, operation_id, target, reason, count=0, now=now)
            await conn.execute(sql.INSERT_EVIDENCE, operation_id, op.attempts, kind, now, now,
                               status, target.value, detail[:1000])
            if target in SETTLED and target is not op.state:
                await self._record_settled(conn, [operation_id], now)
            if target is OpState.AMBIGUOUS and probe_after_s is not None:
                await conn.execute(sql.PUT_OFF_PROBE, now + probe_after_s, operation_id)
            if target is OpState.QUEUED:
                await conn.execute(sql.REOPEN_RUN, op.run_id)
                await conn.execute(sql.SETTLE_BOOKKEEPING, False, now, not self._owns_queue,
                                   operation_id)
                if self._owns_queue:
                    await conn.execute(sql.INSERT_MESSAGE, operation_id, op.run_id,
                                       op.recipient_id, 0.0, now)
                    await self.db.notify(conn, "queue")

        await self.db.write(write)
        return target is OpState.QUEUED and not self._owns_queue

    async def ambiguous_due(self, settled_before: float, limit: int) -> list[Operation]:
        # settled_before is on this host's clock, as the caller's.
        rows = await self.db.read(sql.SELECT_AMBIGUOUS_DUE, settled_before + self.db.offset,
                                  self.db.now(), limit)
        return [self._op(r) for r in rows]

    async def overdue(self, before: float | None, unposted_before: float,
                      limit: int) -> list[Message]:
        off = self.db.offset  # the horizons are on this host's clock, as the caller's
        rows = await self.db.read(sql.SELECT_OVERDUE, None if before is None else before + off,
                                  unposted_before + off, limit)
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in rows]

    async def queue_stats(self) -> QueueStats:
        now = self.db.now()
        row = await self.db.read_one(sql.LEDGER_QUEUE_STATS, now)
        assert row is not None
        return QueueStats.from_row(tuple(row), now)

    async def stats(self) -> LedgerStats:
        ambiguous = await self.db.read_one(sql.COUNT_AMBIGUOUS)
        row = await self.db.read_one(sql.SELECT_CURRENT_RUN)
        current = _run(row, listed=True) if row else None
        counts = await self.run_counts(current.id) if current else {}
        return LedgerStats(ambiguous=ambiguous[0] if ambiguous else 0,
                           inconclusive=ambiguous[1] if ambiguous else 0, current_run=current,
                           current_run_by_state=counts)

    async def load_budget(self, key: str) -> dict[str, Any] | None:
        row = await self.db.read_one(sql.SELECT_BUDGET, key)
        return budget_memory(row[0] if row is not None else None)

    async def save_budget(self, key: str, data: dict[str, Any]) -> None:
        blob = orjson.dumps(data).decode()

        async def write(conn: Conn) -> None:
            await conn.execute(sql.UPSERT_BUDGET, key, blob, self.db.now())

        await self.db.write(write)

    async def record_operator_action(self, action: str, by: str, reason: str,
                                     detail: Mapping[str, Any]) -> OperatorAction:
        now, blob = self.db.now(), orjson.dumps(dict(detail)).decode()

        async def write(conn: Conn) -> int:
            return int(await conn.fetchval(sql.INSERT_OPERATOR_ACTION, now, action, by,
                                           reason, blob))

        row_id = await self.db.write(write)
        return operator_action((row_id, now, action, by, reason, blob))

    async def operator_actions(self, action: str, limit: int) -> list[OperatorAction]:
        rows = await self.db.read(sql.SELECT_OPERATOR_ACTIONS, action, limit)
        return [operator_action(tuple(r)) for r in rows]

    async def close(self) -> None:
        await self.db.close()

    # -- the events outbox -------------------------------------------------------------

    async def _lock_events(self, conn: Conn) -> None:
        # Held to commit: events get their seq in commit order, so a sink reading past
        # seq N never misses an event with a smaller seq that commits after it read.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", self._events_lock)

    async def _record_settled(self, conn: Conn, operation_ids: Sequence[str],
                              now: float) -> None:
        if operation_ids:
            await self._lock_events(conn)
            await conn.executemany(sql.INSERT_OPERATION_EVENT, [
                (new_event_id(), now, op_id) for op_id in operation_ids])

    async def events_after(self, seq: int, limit: int) -> list[Event]:
        return [_event(r) for r in await self.db.read(sql.SELECT_EVENTS_AFTER, seq, limit)]

    async def event_cursor(self, sink: str) -> int:
        row = await self.db.read_one(sql.SELECT_EVENT_CURSOR, sink)
        return int(row[0]) if row is not None else 0

    async def save_event_cursor(self, sink: str, seq: int) -> None:
        async def write(conn: Conn) -> None:
            await conn.execute(sql.UPSERT_EVENT_CURSOR, sink, seq, self.db.now())

        await self.db.write(write)

    async def event_backlog(self, after: int) -> Backlog:
        row = await self.db.read_one(sql.EVENT_BACKLOG, after)
        if row is None or not row[0]:
            return Backlog(0, None)
        return Backlog(events=int(row[0]), oldest_at=row[1])

    async def prune_events(self, sinks: Sequence[str], before: float, limit: int) -> int:
        async def write(conn: Conn) -> int:
            status = await conn.execute(sql.PRUNE_EVENTS, list(sinks), before + self.db.offset,
                                        limit)
            return int(status.rpartition(" ")[2])

        return await self.db.write(write)


async def _transition(conn: Conn, operation_id: str, target: OpState, reason: str | None,
                      count: int, now: float, owner: str | None = None,
                      holder: str | None = None, busy_s: float | None = None) -> int:
    """Move one operation to ``target`` in the caller's transaction; return its attempts.
    ``busy_s``: hold it in flight that long, from the database's now.
    Raises (before anything is written) IllegalTransition, OperationBusy or KeyError."""
    n = await conn.fetchval(sql.transition(target, owner is not None), target.value, reason,
                            count, now, owner, busy_s, operation_id, holder)
    if n is not None:
        return int(n)
    row = await conn.fetchrow(sql.SELECT_OP_STATE, operation_id)
    if row is None:
        raise KeyError(f"operation {operation_id} does not exist")
    state, _, held_by, busy, db_now = row
    if owner is not None and state == OpState.IN_FLIGHT.value and busy and busy > db_now \
            and held_by != owner:
        # The hold is on the database's clock; the caller waits on its own.
        raise OperationBusy(operation_id, time.time() + (busy - db_now))
    states.check(operation_id, OpState(state), target)
    raise AssertionError(f"transition of {operation_id} refused for no known reason")
