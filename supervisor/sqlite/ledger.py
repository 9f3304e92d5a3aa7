"""The embedded ledger: runs, operations and attempts in one SQLite file.

When the embedded queue shares the file (:class:`~supervisor.sqlite.queue.SqliteQueue`), an
outcome and its ack commit in one transaction, so no message is ever acked whose outcome
was not committed, and no committed outcome leaves its message behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiosqlite
import orjson

from supervisor import states
from supervisor.errors import AttemptOpen, OperationBusy, ScanConflict, StorageError
from supervisor.ledger.base import budget_memory, operator_action
from supervisor.model import (
    Attempt,
    Delivery,
    Disposition,
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
from supervisor.sqlite import outbox, sql
from supervisor.sqlite.database import Database
from supervisor.states import SETTLED, OpState, RunState

log = logging.getLogger(__name__)

_last_ms = 0
_seq = 0


def new_operation_id() -> str:
    """A new operation ID, and so the partner's Idempotency-Key: unique and time-ordered.

    Time-ordered (a millisecond timestamp, a counter within the millisecond, then 48
    random bits, like UUIDv7 with a monotonic counter) so a run's operations append to the
    ledger's indexes instead of landing at random places in them (discovery stays linear
    at a million candidates), and so paging by ID returns them in discovery order.
    Assigned once: the unique (run, recipient) row keeps the first ID even when a resumed
    scan reads a page again.
    """
    global _last_ms, _seq
    ms = time.time_ns() // 1_000_000
    if ms <= _last_ms:
        ms, _seq = _last_ms, _seq + 1
        if _seq > 0xFFFF:  # 65,536 in one millisecond: borrow the next one
            ms, _seq = ms + 1, 0
    else:
        _seq = 0
    _last_ms = ms
    return f"op_{ms:012x}{_seq:04x}{secrets.token_hex(6)}"


def new_run_id(now: float) -> str:
    return "run_" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + "_" + secrets.token_hex(3)


def _run(row: sqlite3.Row | tuple[Any, ...], listed: bool = False) -> Run:
    """A run from RUN_COLUMNS, or (``listed``) from LIST_RUN_COLUMNS: its source's kind."""
    return Run(
        id=row[0], tick_key=row[1], schedule=row[2], scheduled_for=row[3],
        state=RunState(row[4]), source={"kind": row[5]} if listed else orjson.loads(row[5]),
        scan_cursor=row[6],
        scan_pages=row[7], discovered=row[8], skipped_candidates=row[9],
        scan_failures=row[10], last_error=row[11], created_at=row[12],
        scan_finished_at=row[13], finished_at=row[14],
    )


def _op(row: sqlite3.Row | tuple[Any, ...], unfinished: bool = False) -> Operation:
    return Operation(
        id=row[0], run_id=row[1], recipient_id=row[2], state=OpState(row[3]),
        attempts=row[4], reason=row[5], created_at=row[6], updated_at=row[7],
        due_at=row[8], unfinished_attempt=unfinished,
    )


class SqliteLedger(outbox.OutboxMixin):
    """The :class:`~supervisor.ledger.base.Ledger` on one SQLite :class:`Database`, and
    its :class:`~supervisor.ledger.base.EventOutbox`: every settlement and finished run
    writes its event in its own transaction."""

    def __init__(self, db: Database, owns_queue: bool) -> None:
        self.db = db
        # Settlements waiting for the next group commit (see _settle_batched).
        self._open_batch: list[tuple[Settlement, asyncio.Future[None]]] | None = None
        # True when the queue's messages live in this same file: acks join our transactions.
        self._owns_queue = owns_queue

    @property
    def healthy(self) -> bool:
        return self.db.healthy

    async def open_run(self, tick_key: str, schedule: str, scheduled_for: float | None,
                       source: Mapping[str, Any], skip_if_unfinished: bool,
                       reuse_within_s: float | None = None) -> OpenRunResult:
        async def write(conn: aiosqlite.Connection) -> OpenRunResult:
            existing = await _fetchone(conn, sql.SELECT_RUN_BY_TICK, (tick_key,))
            if existing is None and reuse_within_s is not None:
                existing = await _fetchone(conn, sql.SELECT_RECENT_RUN_OF_SCHEDULE,
                                           (schedule, time.time() - reuse_within_s))
            if existing is not None:
                return OpenRunResult(_run(existing), created=False)
            if skip_if_unfinished:
                busy = await _fetchone(conn, sql.SELECT_UNFINISHED_RUN, ())
                if busy is not None:
                    return OpenRunResult(None, created=False,
                                         skipped_for=_run(busy, listed=True))
            now = time.time()
            run_id = new_run_id(now)
            await conn.execute(sql.INSERT_RUN, (run_id, tick_key, schedule, scheduled_for,
                                                RunState.SCANNING.value, orjson.dumps(source),
                                                source.get("kind"), now))
            row = await _fetchone(conn, sql.SELECT_RUN, (run_id,))
            assert row is not None
            return OpenRunResult(_run(row), created=True)

        return await self.db.write(write)

    async def get_run(self, run_id: str) -> Run | None:
        row = await self.db.read_one(sql.SELECT_RUN, (run_id,))
        return _run(row) if row else None

    async def list_runs(self, limit: int, before: str | None = None) -> list[Run]:
        if before is None:
            rows = await self.db.read(sql.SELECT_RUNS, (limit,))
        else:
            rows = await self.db.read(sql.SELECT_RUNS_BEFORE, (before, limit))
        return [_run(r, listed=True) for r in rows]

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, Run]:
        rows = await self.db.read(sql.SELECT_RUNS_BY_ID, (orjson.dumps(list(run_ids)).decode(),))
        return {r[0]: _run(r, listed=True) for r in rows}

    async def schedule_runs(self, schedule: str) -> list[Run]:
        rows = await self.db.read(sql.SELECT_SCHEDULE_RUNS, {"schedule": schedule},
                                  listing=True)  # an exclusions read: off the hot reader
        return [_run(r, listed=True) for r in rows]

    async def run_counts(self, run_id: str) -> dict[OpState, int]:
        rows = await self.db.read(sql.COUNT_RUN_STATES, (run_id,))
        return {OpState(state): n for state, n in rows}

    async def runs_to_scan(self) -> list[Run]:
        return [_run(r) for r in await self.db.read(sql.SELECT_RUNS_TO_SCAN)]

    async def record_page(self, run_id: str, recipient_ids: Sequence[str],
                          next_cursor: str | None, skipped: int,
                          resumed_from: str | None = None) -> PageResult:
        now = time.time()
        rows = [(new_operation_id(), run_id, rid, now, now) for rid in recipient_ids]

        async def write(conn: aiosqlite.Connection) -> PageResult:
            before = conn.total_changes
            await conn.executemany(sql.INSERT_OPERATION, rows)
            added = conn.total_changes - before
            cur = await conn.execute(sql.UPDATE_RUN_PAGE,
                                     (next_cursor, added, skipped, run_id, resumed_from))
            if cur.rowcount == 0:
                row = await _fetchone(conn, sql.SELECT_RUN_SCAN, (run_id,))
                if row is None or row[0] != RunState.SCANNING.value:
                    raise ValueError(f"run {run_id} is not scanning")
                raise ScanConflict(run_id, resumed_from, row[1])
            state = RunState.SCANNING
            if next_cursor is None:
                await conn.execute(sql.UPDATE_RUN_SCANNED, (now, run_id))
                state = RunState.DRAINING
            return PageResult(added, state)

        return await self.db.write(write)

    async def record_scan_failure(self, run_id: str, error: str, give_up: bool) -> None:
        async def write(conn: aiosqlite.Connection) -> None:
            await conn.execute(sql.UPDATE_RUN_SCAN_FAILURE, (error[:1000], run_id))
            if give_up:
                await conn.execute(sql.UPDATE_RUN_SCAN_ABANDONED,
                                   (time.time(), f"scan abandoned: {error}"[:1000], run_id))

        await self.db.write(write)

    async def unpublished(self, limit: int) -> list[Message]:
        rows = await self.db.read(sql.SELECT_UNPUBLISHED, (limit,))
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in rows]

    async def record_published(self, published: Sequence[Published],
                               outbox: bool = False) -> None:
        now = time.time()
        rows = [{"message_id": p.message_id, "now": now, "due_at": p.due_at,
                 "id": p.operation_id} for p in published]
        statement = sql.RECORD_OUTBOX if outbox else sql.RECORD_PUBLISHED

        async def write(conn: aiosqlite.Connection) -> None:
            await conn.executemany(statement, rows)

        await self.db.write(write)

    async def note_received(self, deliveries: Sequence[Delivery], lease_s: float,
                            per_message: bool = False) -> list[Received]:
        statement = sql.NOTE_RECEIVED_ONCE if per_message else sql.NOTE_RECEIVED

        async def write(conn: aiosqlite.Connection) -> dict[int, tuple[int, float]]:
            now = time.time()
            counted: dict[int, tuple[int, float]] = {}
            for i, d in enumerate(deliveries):
                rows = list(await conn.execute_fetchall(statement, {
                    "now": now, "until": now + lease_s, "message_id": d.message_id,
                    "id": d.message.operation_id}))
                if rows:
                    counted[i] = (int(rows[0][0]), float(rows[0][1]))
            return counted

        # Nothing is written before the first UPDATE can fail: no savepoint needed.
        counted = await self.db.write(write, savepoint=False)
        ops = await self.get_operations([d.message.operation_id for d in deliveries])
        return [Received(ops.get(d.message.operation_id), *counted.get(i, (0, 0.0)))
                for i, d in enumerate(deliveries)]

    async def get_operation(self, operation_id: str) -> Operation | None:
        return (await self.get_operations([operation_id])).get(operation_id)

    async def get_operations(self, operation_ids: Sequence[str]) -> dict[str, Operation]:
        rows = await self.db.read(sql.SELECT_OPERATIONS_WITH_OPEN_ATTEMPT,
                                  (orjson.dumps(list(operation_ids)).decode(),))
        return {r[0]: _op(r, unfinished=bool(r[9])) for r in rows}

    async def list_operations(self, run_id: str, state: OpState | None, after: str | None,
                              limit: int) -> list[Operation]:
        # The API's and the exclusions' pages: on the listing connection (see Database).
        if state is None:
            rows = await self.db.read(sql.SELECT_OPERATIONS, (run_id, after or "", limit),
                                      listing=True)
        else:
            rows = await self.db.read(sql.SELECT_OPERATIONS_IN_STATE,
                                      (run_id, state.value, after or "", limit), listing=True)
        return [_op(r) for r in rows]

    async def attempts(self, operation_id: str, after: int = 0,
                       limit: int | None = None) -> list[Attempt]:
        rows = await self.db.read(sql.SELECT_ATTEMPTS,
                                  (operation_id, -1 if limit is None else limit, after))
        return [Attempt(*r) for r in rows]

    async def begin_attempt(self, operation_id: str, kind: str, owner: str = "",
                            busy_s: float = 0.0, supersedes_open: bool = True) -> int:
        async def write(conn: aiosqlite.Connection) -> int:
            now = time.time()
            n = await _transition(conn, operation_id, OpState.IN_FLIGHT, None, count=1, now=now,
                                  owner=owner, busy_until=now + busy_s if busy_s > 0 else None)
            if supersedes_open:
                await conn.execute(sql.CLOSE_OPEN_ATTEMPTS, (now, operation_id))
            elif await conn.execute_fetchall(sql.HAS_OPEN_ATTEMPT, (operation_id,)):
                raise AttemptOpen(operation_id)  # the savepoint undoes the transition
            rows = await conn.execute_fetchall(sql.INSERT_ATTEMPT, (operation_id, n, kind, now))
            return int(next(iter(rows))[0])

        # The guarded transition is the first statement and raises before anything is
        # written; only the open-attempt refusal comes after a write, and needs undoing.
        return await self.db.write(write, savepoint=not supersedes_open)

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

    async def settle(self, settlements: Sequence[Settlement]) -> list[Settlement]:
        if self._owns_queue and len(settlements) == 1 and \
                _batchable(settlements[0]):
            await self._settle_batched(settlements[0])
            return []

        async def write(conn: aiosqlite.Connection) -> None:
            await self._settle_each(conn, settlements)

        # One settlement can only fail at its first (guarded) statement: no savepoint.
        await self.db.write(write, savepoint=len(settlements) > 1)
        if self._owns_queue:
            return []
        return [s for s in settlements
                if s.delivery is not None and s.disposition is not Disposition.KEEP]

    async def _settle_batched(self, settlement: Settlement) -> None:
        """Join the settlements of every worker that settles before the next group commit,
        and write them with one ``executemany`` per statement instead of three statements
        each: at full speed this is where the ledger spends its time. Returns once the
        group commit holding it has committed."""
        if self._open_batch is None:
            batch: list[tuple[Settlement, asyncio.Future[None]]] = []
            self._open_batch = batch
            write = asyncio.ensure_future(self.db.write(
                functools.partial(self._write_settlements, batch)))
            write.add_done_callback(functools.partial(self._settlements_done, batch))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._open_batch.append((settlement, fut))
        await asyncio.shield(fut)

    async def _write_settlements(self, batch: list[tuple[Settlement, asyncio.Future[None]]],
                                 conn: aiosqlite.Connection) -> list[BaseException | None]:
        if self._open_batch is batch:
            self._open_batch = None  # later settlements start the next batch
        await conn.execute("SAVEPOINT fast")
        if await self._settle_many(conn, [s for s, _ in batch]):
            await conn.execute("RELEASE fast")
            return [None] * len(batch)
        # Some transition was refused: undo, and settle one by one so that only the
        # offending settlement fails.
        await conn.execute("ROLLBACK TO fast")
        await conn.execute("RELEASE fast")
        outcomes: list[BaseException | None] = []
        for s, _ in batch:
            await conn.execute("SAVEPOINT one")
            try:
                await self._settle_each(conn, [s])
                outcomes.append(None)
            except (sqlite3.OperationalError, sqlite3.DatabaseError):
                raise  # storage trouble: the group commit fails as a whole
            except Exception as exc:
                await conn.execute("ROLLBACK TO one")
                outcomes.append(exc)
            await conn.execute("RELEASE one")
        return outcomes

    def _settlements_done(self, batch: list[tuple[Settlement, asyncio.Future[None]]],
                          write: asyncio.Future[list[BaseException | None]]) -> None:
        """After the group commit: each settlement learns its own outcome."""
        if self._open_batch is batch:
            self._open_batch = None
        if write.cancelled():
            outcomes: list[BaseException | None] = [StorageError("ledger closed")] * len(batch)
        elif (error := write.exception()) is not None:
            outcomes = [error] * len(batch)
        else:
            outcomes = write.result()
        for (_, fut), outcome in zip(batch, outcomes, strict=True):
            if fut.done():
                continue
            if outcome is None:
                fut.set_result(None)
            else:
                fut.set_exception(outcome)

    async def _settle_many(self, conn: aiosqlite.Connection,
                           settlements: Sequence[Settlement]) -> bool:
        now = time.time()
        # First, so that an attempt another delivery has superseded (closed) is found
        # before anything moves: the one-by-one path then discards just that outcome.
        finishing = [(now, s.status, s.outcome, s.detail, s.attempt_id)
                     for s in settlements if s.attempt_id is not None]
        before = conn.total_changes
        await conn.executemany(sql.FINISH_ATTEMPT, finishing)
        if conn.total_changes - before != len(finishing):
            return False
        by_target: dict[OpState, list[dict[str, Any]]] = {}
        for s in settlements:
            by_target.setdefault(s.target, []).append(
                {"target": s.target.value, "reason": s.reason, "now": now, "id": s.operation_id,
                 "count": -1 if s.refund_attempt else 0, "owner": None, "busy_until": None})
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
            (now + s.delay_s, s.operation_id, s.delivery.receipt) for s in settlements
            if s.delivery is not None and s.disposition is Disposition.RETRY])
        await outbox.record_settled(
            conn, [s.operation_id for s in settlements if s.target in SETTLED], now)
        return True

    async def _settle_each(self, conn: aiosqlite.Connection,
                           settlements: Sequence[Settlement]) -> None:
        now = time.time()
        settled: list[str] = []
        for s in settlements:
            if s.attempt_id is not None and await _fetchone(
                    conn, sql.SELECT_OPEN_ATTEMPT, (s.attempt_id,)) is None:
                # Another delivery's attempt closed this one (its guard ran out, or the
                # operation was held as ambiguous): that attempt owns the operation now,
                # and writing this outcome over it could undo what it decides.
                _superseded(s)
                continue
            # Read first, so the guarded transition is still the first write and raises
            # before anything is written (no savepoint needed for one settlement).
            await _transition(conn, s.operation_id, s.target, s.reason,
                              count=-1 if s.refund_attempt else 0, now=now)
            if s.target in SETTLED:
                settled.append(s.operation_id)
            if s.attempt_id is not None:
                await conn.execute(sql.FINISH_ATTEMPT, (now, s.status, s.outcome,
                                                        s.detail, s.attempt_id))
            elif s.target is OpState.AMBIGUOUS:
                # Held because an earlier attempt has no outcome (its process died):
                # that outcome is unknown for good, not "still in the air".
                await conn.execute(sql.CLOSE_OPEN_ATTEMPTS, (now, s.operation_id))
            await conn.execute(sql.SETTLE_BOOKKEEPING, self._bookkeeping(s, now))
            if self._owns_queue and s.delivery is not None:
                token = s.delivery.receipt
                if s.disposition is Disposition.ACK:
                    await conn.execute(sql.DELETE_MESSAGE, (s.operation_id, token))
                elif s.disposition is Disposition.RETRY:
                    await conn.execute(sql.RETRY_MESSAGE,
                                       (now + s.delay_s, s.operation_id, token))
        await outbox.record_settled(conn, settled, now)

    def _bookkeeping(self, s: Settlement, now: float) -> dict[str, Any]:
        retry = s.disposition is Disposition.RETRY
        return {"keep": s.disposition is Disposition.KEEP,
                "due_at": now + s.delay_s if retry else None,
                # The transport acks the old message after this commit and publishes a
                # new one for a retry: until then no message of this operation is live.
                "clear": retry and not self._owns_queue, "id": s.operation_id}

    async def record_evidence(self, operation_id: str, kind: str, target: OpState,
                              reason: str, detail: str, status: int | None = None,
                              probe_after_s: float | None = None) -> bool:
        """Record a probe's or an operator's finding and move the operation on it.

        Returns True when the operation was queued again and the transport (when it is
        not this database) must publish its message.
        """
        async def write(conn: aiosqlite.Connection) -> Operation:
            now = time.time()
            row = await _fetchone(conn, sql.SELECT_OPERATION, (operation_id,))
            if row is None:
                raise KeyError(f"operation {operation_id} does not exist")
            op = _op(row)
            await _transition(conn, operation_id, target, reason, count=0, now=now)
            await conn.execute(sql.INSERT_EVIDENCE, (operation_id, op.attempts, kind, now, now,
                                                     status, target.value, detail[:1000]))
            if target in SETTLED and target is not op.state:  # an inconclusive probe: none
                await outbox.record_settled(conn, [operation_id], now)
            if target is OpState.AMBIGUOUS and probe_after_s is not None:
                await conn.execute(sql.PUT_OFF_PROBE, (now + probe_after_s, operation_id))
            if target is OpState.QUEUED:
                await conn.execute(sql.REOPEN_RUN, (op.run_id,))
                # Due now, with no live message until it is published (redrive's cue
                # should the publish after this commit never happen).
                await conn.execute(sql.SETTLE_BOOKKEEPING, {
                    "keep": False, "due_at": now, "clear": not self._owns_queue,
                    "id": operation_id})
                if self._owns_queue:
                    await conn.execute(sql.INSERT_MESSAGE,
                                       (operation_id, op.run_id, op.recipient_id, now, now))
            return op

        await self.db.write(write)
        return target is OpState.QUEUED and not self._owns_queue

    async def ambiguous_due(self, settled_before: float, limit: int) -> list[Operation]:
        rows = await self.db.read(sql.SELECT_AMBIGUOUS_DUE, (settled_before, time.time(), limit))
        return [_op(r) for r in rows]

    async def operations_in_state(self, state: OpState, after: str | None,
                                  limit: int) -> list[Operation]:
        rows = await self.db.read(sql.SELECT_OPERATIONS_BY_STATE,
                                  (state.value, after or "", limit))
        return [_op(r) for r in rows]

    async def overdue(self, before: float | None, unposted_before: float,
                      limit: int) -> list[Message]:
        rows = await self.db.read(sql.SELECT_OVERDUE, {
            "before": before, "unposted_before": unposted_before, "limit": limit})
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in rows]

    async def queue_stats(self) -> QueueStats:
        now = time.time()
        row = await self.db.read_one(sql.LEDGER_QUEUE_STATS, {"now": now})
        assert row is not None
        return QueueStats.from_row(row, now)

    async def finish_runs(self) -> list[str]:
        async def write(conn: aiosqlite.Connection) -> list[str]:
            now = time.time()
            cur = await conn.execute(sql.UPDATE_RUNS_DONE, (now,))
            done = [r[0] for r in await cur.fetchall()]
            await outbox.record_finished(conn, done, now)
            return done

        return await self.db.write(write)

    async def stats(self) -> LedgerStats:
        ambiguous = await self.db.read_one(sql.COUNT_AMBIGUOUS)
        row = await self.db.read_one(sql.SELECT_CURRENT_RUN)
        current = _run(row, listed=True) if row else None
        current_counts = await self.run_counts(current.id) if current else {}
        return LedgerStats(ambiguous=ambiguous[0] if ambiguous else 0,
                           inconclusive=ambiguous[1] if ambiguous else 0, current_run=current,
                           current_run_by_state=current_counts)

    async def load_budget(self, key: str) -> dict[str, Any] | None:
        row = await self.db.read_one(sql.SELECT_BUDGET, (key,))
        return budget_memory(row[0] if row is not None else None)

    async def save_budget(self, key: str, data: dict[str, Any]) -> None:
        blob = orjson.dumps(data).decode()

        async def write(conn: aiosqlite.Connection) -> None:
            await conn.execute(sql.UPSERT_BUDGET, (key, blob, time.time()))

        await self.db.write(write)

    async def record_operator_action(self, action: str, by: str, reason: str,
                                     detail: Mapping[str, Any]) -> OperatorAction:
        now, blob = time.time(), orjson.dumps(dict(detail)).decode()

        async def write(conn: aiosqlite.Connection) -> int:
            row = await _fetchone(conn, sql.INSERT_OPERATOR_ACTION,
                                  (now, action, by, reason, blob))
            assert row is not None
            return int(row[0])

        row_id = await self.db.write(write, savepoint=False)
        return operator_action((row_id, now, action, by, reason, blob))

    async def operator_actions(self, action: str, limit: int) -> list[OperatorAction]:
        rows = await self.db.read(sql.SELECT_OPERATOR_ACTIONS, (action, limit))
        return [operator_action(tuple(r)) for r in rows]

    async def close(self) -> None:
        await self.db.close()


def _superseded(s: Settlement) -> None:
    log.warning("operation %s: attempt %d was superseded by another delivery's; this "
                "outcome (%s) is not recorded", s.operation_id, s.attempt_id, s.outcome,
                extra={"action": "settlement_superseded"})


def _batchable(s: Settlement) -> bool:
    # An ambiguous settlement without an attempt also closes earlier open attempts: the
    # one-by-one path does that.
    return not (s.target is OpState.AMBIGUOUS and s.attempt_id is None)


async def _fetchone(conn: aiosqlite.Connection, query: str,
                    params: Any) -> sqlite3.Row | None:
    async with conn.execute(query, params) as cur:
        return await cur.fetchone()


async def _transition(conn: aiosqlite.Connection, operation_id: str, target: OpState,
                      reason: str | None, count: int, now: float, owner: str | None = None,
                      busy_until: float | None = None) -> int:
    """Move one operation to ``target`` inside the caller's transaction; return its attempts.

    Raises before writing anything: IllegalTransition when the state machine forbids the
    move, OperationBusy when another owner holds the attempt in flight (only checked when
    ``owner`` is given), KeyError when there is no such operation.
    """
    params = {"target": target.value, "reason": reason, "count": count, "now": now,
              "owner": owner, "busy_until": busy_until, "id": operation_id}
    rows = list(await conn.execute_fetchall(sql.transition(target, owner is not None), params))
    if rows:
        return int(rows[0][0])
    row = await _fetchone(conn, sql.SELECT_OP_STATE, (operation_id,))
    if row is None:
        raise KeyError(f"operation {operation_id} does not exist")
    state, _, holder, busy = row
    if owner is not None and state == OpState.IN_FLIGHT.value and busy and busy > now \
            and holder != owner:
        raise OperationBusy(operation_id, busy)
    states.check(operation_id, OpState(state), target)
    raise AssertionError(f"transition of {operation_id} refused for no known reason")
