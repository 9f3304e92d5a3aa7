"""The ledger's rules, written once for every database.

:class:`LedgerCore` implements the :class:`~supervisor.ledger.base.Ledger` and
:class:`~supervisor.ledger.base.EventOutbox` protocols: transitions and why one was
refused, evidence, settlement (with the superseded-attempt rule), run opening (a tick
deduped by its key, no overlap with an unfinished run), the IDs and the events outbox. A
backend supplies its statements (:class:`~supervisor.ledger.driver.Statements`), a unit
of work (:meth:`_write` over a :class:`~supervisor.ledger.driver.Tx`), reads, its clock,
and what only it has: SQLite its group commit, PostgreSQL its fencing (a replica whose
heartbeat is stale starts nothing) and the locks and notifications replicas need (saq's
``Queue`` over ``_enqueue``/``_finish``, procrastinate's ``JobManager`` over a connector).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import orjson

from supervisor import states
from supervisor.errors import AttemptOpen, IllegalTransition, OperationBusy, ScanConflict
from supervisor.ledger import rows
from supervisor.ledger.batches import BatchBook
from supervisor.ledger.driver import Row, Statements, Tx
from supervisor.ledger.ids import new_event_id, new_operation_id, new_run_id
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
    Settled,
    Settlement,
)
from supervisor.states import SETTLED, OpState, RunState

log = logging.getLogger(__name__)

T = TypeVar("T")
TxT = TypeVar("TxT", bound=Tx)


class Storage(Protocol):
    """The database a backend's ledger runs on, as the core sees it."""

    healthy: bool

    async def close(self) -> None: ...


class LedgerCore(BatchBook, ABC, Generic[TxT]):
    """The ledger and its events outbox over one backend's statements and unit of work."""

    def __init__(self, db: Storage, sql: Statements, owns_queue: bool,
                 holder: str | None = None) -> None:
        self._storage = db
        self._sql = sql
        # True when the queue's messages live in this same database: an outcome and its
        # ack (or a message queued again) commit in one transaction.
        self._owns_queue = owns_queue
        # The replica every in-flight guard names (PostgreSQL); None: one process.
        self._holder = holder

    # -- what a backend supplies -------------------------------------------------------

    @abstractmethod
    async def _write(self, fn: Callable[[TxT], Awaitable[T]], savepoint: bool = True) -> T:
        """Run ``fn`` in the backend's unit of work; its result once committed. An error
        ``fn`` raises undoes what it wrote and reaches the caller. ``savepoint=False``:
        ``fn`` can only raise before it has written anything (SQLite then skips the
        savepoint; a backend with a transaction per write ignores it)."""

    @abstractmethod
    async def _read(self, query: str, *args: Any, listing: bool = False) -> list[Row]:
        """Run a read. ``listing``: a long listing for the API (SQLite reads those on a
        connection of their own)."""

    @abstractmethod
    def _now(self) -> float:
        """The ledger's now (PostgreSQL: the database's clock, as one replica keeps it)."""

    @property
    def _offset(self) -> float:
        """How far the ledger's clock is ahead of this process's: horizons the callers
        give on their own clock are moved onto the ledger's by it."""
        return 0.0

    @abstractmethod
    def _queue_time(self, now: float, delay_s: float) -> float:
        """The queue table's parameter for a message due ``delay_s`` after ``now``
        (SQLite stores the time; PostgreSQL's statements add the delay to its clock)."""

    @abstractmethod
    async def _insert_operations(self, tx: TxT, ids: Sequence[str],
                                 recipient_ids: Sequence[str], run_id: str,
                                 now: float) -> int:
        """Insert a page's operations (an existing (run, recipient) keeps its row);
        how many were added."""

    async def _admit(self, tx: TxT) -> None:
        """Refuse to start an attempt (raise) while this process may not: PostgreSQL's
        fence, a replica whose registration is stale. Nothing by default."""

    @abstractmethod
    async def keep_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           busy_s: float) -> bool:
        """See :meth:`~supervisor.ledger.base.Ledger.keep_attempt`: each backend's own,
        as whose hold counts is (one process's clock; a fresh replica's, on the
        database's)."""

    @abstractmethod
    async def owns_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           for_s: float) -> bool:
        """See :meth:`~supervisor.ledger.base.Ledger.owns_attempt` (as keep_attempt)."""

    @abstractmethod
    async def owns_attempts(self, claims: Sequence[tuple[str, int, str]],
                            for_s: float) -> set[str]:
        """See :meth:`~supervisor.ledger.base.Ledger.owns_attempts` (as keep_attempt)."""

    @property
    def healthy(self) -> bool:
        return self._storage.healthy

    # Each backend says; one process's ledger (SQLite) has no peers.
    peers_may_take_over = False

    # -- runs --------------------------------------------------------------------------

    async def open_run(self, tick_key: str, schedule: str, scheduled_for: float | None,
                       source: Mapping[str, Any], skip_if_unfinished: bool,
                       reuse_within_s: float | None = None) -> OpenRunResult:
        sql = self._sql

        async def write(tx: TxT) -> OpenRunResult:
            # Every replica's schedule fires the same tick: one at a time decides.
            await tx.lock("open_run")
            existing = await tx.fetchrow(sql.SELECT_RUN_BY_TICK, tick_key)
            if existing is None and reuse_within_s is not None:
                existing = await tx.fetchrow(sql.SELECT_RECENT_RUN_OF_SCHEDULE, schedule,
                                             self._now() - reuse_within_s)
            if existing is not None:
                return OpenRunResult(rows.run(existing), created=False)
            if skip_if_unfinished:
                busy = await tx.fetchrow(sql.SELECT_UNFINISHED_RUN)
                if busy is not None:
                    return OpenRunResult(None, created=False,
                                         skipped_for=rows.run(busy, listed=True))
            now = self._now()
            run_id = new_run_id(now)
            await tx.execute(sql.INSERT_RUN, run_id, tick_key, schedule, scheduled_for,
                             RunState.SCANNING.value, orjson.dumps(source).decode(),
                             source.get("kind"), now)
            row = await tx.fetchrow(sql.SELECT_RUN, run_id)
            if row is None:
                raise AssertionError(f"run {run_id} not found in its own transaction")
            await tx.notify("runs", run_id)
            return OpenRunResult(rows.run(row), created=True)

        return await self._write(write)

    async def get_run(self, run_id: str) -> Run | None:
        row = await self._read_one(self._sql.SELECT_RUN, run_id)
        return rows.run(row) if row else None

    async def list_runs(self, limit: int, before: str | None = None) -> list[Run]:
        found = await (self._read(self._sql.SELECT_RUNS, limit) if before is None else
                       self._read(self._sql.SELECT_RUNS_BEFORE, before, limit))
        return [rows.run(r, listed=True) for r in found]

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, Run]:
        found = await self._read(self._sql.SELECT_RUNS_BY_ID, list(run_ids))
        return {r[0]: rows.run(r, listed=True) for r in found}

    async def schedule_runs(self, schedule: str) -> list[Run]:
        # An exclusions read: off the hot reader.
        found = await self._read(self._sql.SELECT_SCHEDULE_RUNS, schedule, listing=True)
        return [rows.run(r, listed=True) for r in found]

    async def run_counts(self, run_id: str) -> dict[OpState, int]:
        return rows.counts(await self._read(self._sql.COUNT_RUN_STATES, run_id))

    async def run_with_counts(self, run_id: str) -> tuple[Run, dict[OpState, int]] | None:
        row = await self._read_one(self._sql.SELECT_RUN_WITH_COUNTS, run_id)
        return (rows.run(row, listed=True), rows.counts(row[-1])) if row else None

    async def runs_to_scan(self) -> list[Run]:
        return [rows.run(r) for r in await self._read(self._sql.SELECT_RUNS_TO_SCAN)]

    async def record_page(self, run_id: str, recipient_ids: Sequence[str],
                          next_cursor: str | None, skipped: int,
                          resumed_from: str | None = None) -> PageResult:
        sql, now = self._sql, self._now()
        ids = [new_operation_id() for _ in recipient_ids]

        async def write(tx: TxT) -> PageResult:
            added = await self._insert_operations(tx, ids, recipient_ids, run_id, now)
            if not await tx.execute(sql.UPDATE_RUN_PAGE, next_cursor, added, skipped, run_id,
                                    resumed_from):
                row = await tx.fetchrow(sql.SELECT_RUN_SCAN, run_id)
                if row is None or row[0] != RunState.SCANNING.value:
                    raise ValueError(f"run {run_id} is not scanning")
                raise ScanConflict(run_id, resumed_from, row[1])
            state = RunState.SCANNING
            if next_cursor is None:
                await tx.execute(sql.UPDATE_RUN_SCANNED, now, run_id)
                state = RunState.DRAINING
            if added:
                await tx.notify("outbox")
            return PageResult(added, state)

        return await self._write(write)

    async def record_scan_failure(self, run_id: str, error: str, give_up: bool) -> None:
        sql = self._sql

        async def write(tx: TxT) -> None:
            await tx.execute(sql.UPDATE_RUN_SCAN_FAILURE, error[:1000], run_id)
            if give_up:
                await tx.execute(sql.UPDATE_RUN_SCAN_ABANDONED, self._now(),
                                 f"scan abandoned: {error}"[:1000], run_id)

        await self._write(write)

    async def finish_runs(self) -> list[str]:
        async def write(tx: TxT) -> list[str]:
            # Serialised with record_evidence queueing an operation again: each statement
            # here then sees that operation, or the reopen sees the run done.
            await tx.lock("finish_runs")
            now = self._now()
            done = [r[0] for r in await tx.fetch(self._sql.UPDATE_RUNS_DONE, now)]
            if done:
                await tx.notify("finished", done[0])  # long-polls on these runs answer
                await self._record_events(tx, self._sql.INSERT_RUN_EVENT, done, now)
            return done

        return await self._write(write)

    # -- operations --------------------------------------------------------------------

    async def unpublished(self, limit: int) -> list[Message]:
        found = await self._read(self._sql.SELECT_UNPUBLISHED, limit)
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in found]

    async def record_published(self, published: Sequence[Published],
                               outbox: bool = False) -> None:
        now = self._now()
        statement = self._sql.RECORD_OUTBOX if outbox else self._sql.RECORD_PUBLISHED
        params = [(p.message_id, now, p.due_at, p.operation_id) for p in published]

        async def write(tx: TxT) -> None:
            await tx.executemany(statement, params)

        await self._write(write)

    async def note_received(self, deliveries: Sequence[Delivery], lease_s: float,
                            per_message: bool = False) -> list[Received]:
        statement = self._sql.NOTE_RECEIVED_ONCE if per_message else self._sql.NOTE_RECEIVED

        async def write(tx: TxT) -> dict[int, tuple[int, float]]:
            now = self._now()
            counted: dict[int, tuple[int, float]] = {}
            for i, d in enumerate(deliveries):
                row = await tx.fetchrow(statement, now, now + lease_s, d.message_id,
                                        d.message.operation_id)
                if row is not None:
                    counted[i] = (int(row[0]), float(row[1]))
            return counted

        # Nothing is written before the first UPDATE can fail: no savepoint needed.
        counted = await self._write(write, savepoint=False)
        ops = await self.get_operations([d.message.operation_id for d in deliveries])
        return [Received(ops.get(d.message.operation_id), *counted.get(i, (0, 0.0)))
                for i, d in enumerate(deliveries)]

    async def get_operation(self, operation_id: str) -> Operation | None:
        return (await self.get_operations([operation_id])).get(operation_id)

    async def get_operations(self, operation_ids: Sequence[str]) -> dict[str, Operation]:
        found = await self._read(self._sql.SELECT_OPERATIONS_WITH_OPEN_ATTEMPT,
                                 list(operation_ids))
        return {r[0]: self._op(r, unfinished=bool(r[9])) for r in found}

    async def list_operations(self, run_id: str, state: OpState | None, after: str | None,
                              limit: int) -> list[Operation]:
        # The API's and the exclusions' pages: a listing read.
        if state is None:
            found = await self._read(self._sql.SELECT_OPERATIONS, run_id, after or "", limit,
                                     listing=True)
        else:
            found = await self._read(self._sql.SELECT_OPERATIONS_IN_STATE, run_id,
                                     state.value, after or "", limit, listing=True)
        return [self._op(r) for r in found]

    async def operations_in_state(self, state: OpState, after: str | None,
                                  limit: int) -> list[Operation]:
        found = await self._read(self._sql.SELECT_OPERATIONS_BY_STATE, state.value,
                                 after or "", limit)
        return [self._op(r) for r in found]

    async def attempts(self, operation_id: str, after: int = 0,
                       limit: int | None = None) -> list[Attempt]:
        return [Attempt(*r) for r in await self._read(self._sql.SELECT_ATTEMPTS, operation_id,
                                                      limit, after)]

    async def ambiguous_due(self, settled_before: float, limit: int) -> list[Operation]:
        # settled_before is on this host's clock, as the caller's.
        found = await self._read(self._sql.SELECT_AMBIGUOUS_DUE, settled_before + self._offset,
                                 self._now(), limit)
        return [self._op(r) for r in found]

    async def overdue(self, before: float | None, unposted_before: float,
                      limit: int) -> list[Message]:
        off = self._offset  # the horizons are on this host's clock, as the caller's
        found = await self._read(self._sql.SELECT_OVERDUE,
                                 None if before is None else before + off,
                                 unposted_before + off, limit)
        return [Message(run_id=r[0], operation_id=r[1], recipient_id=r[2]) for r in found]

    async def queue_stats(self) -> QueueStats:
        now = self._now()
        row = await self._read_one(self._sql.LEDGER_QUEUE_STATS, now)
        return QueueStats.from_row(tuple(row) if row is not None else (0, 0, 0, None), now)

    async def stats(self) -> LedgerStats:
        ambiguous = await self._read_one(self._sql.COUNT_AMBIGUOUS)
        row = await self._read_one(self._sql.SELECT_CURRENT_RUN)
        current = rows.run(row, listed=True) if row else None
        counts = await self.run_counts(current.id) if current else {}
        return LedgerStats(ambiguous=ambiguous[0] if ambiguous else 0,
                           inconclusive=ambiguous[1] if ambiguous else 0, current_run=current,
                           current_run_by_state=counts)

    # -- attempts ------------------------------------------------------------------------

    async def begin_attempt(self, operation_id: str, kind: str, owner: str = "",
                            busy_s: float = 0.0, supersedes_open: bool = True) -> int:
        sql = self._sql

        async def write(tx: TxT) -> int:
            await self._admit(tx)
            now = self._now()
            n = await self._transition(tx, operation_id, OpState.IN_FLIGHT, None, count=1,
                                       now=now, owner=owner,
                                       busy_s=busy_s if busy_s > 0 else None)
            if supersedes_open:
                await tx.execute(sql.CLOSE_OPEN_ATTEMPTS, now, operation_id)
            elif await tx.fetchrow(sql.HAS_OPEN_ATTEMPT, operation_id) is not None:
                raise AttemptOpen(operation_id)  # the savepoint undoes the transition
            [row] = await tx.fetch(sql.INSERT_ATTEMPT, operation_id, n, kind, now)
            return int(row[0])

        # The guarded transition is the first write and raises before anything is
        # written; only the open-attempt refusal comes after a write, and needs undoing.
        return await self._write(write, savepoint=not supersedes_open)

    async def begin_attempts(self, starts: Sequence[tuple[str, str]], kind: str,
                             busy_s: float) -> list[int | Exception]:
        sql = self._sql

        async def write(tx: TxT) -> list[int | Exception]:
            await self._admit(tx)
            now = self._now()
            out: list[int | Exception] = []
            begun: dict[str, int] = {}
            for operation_id, owner in starts:
                try:
                    # Refused before anything is written: nothing to undo for it.
                    begun[operation_id] = await self._transition(
                        tx, operation_id, OpState.IN_FLIGHT, None, count=1, now=now,
                        owner=owner, busy_s=busy_s if busy_s > 0 else None)
                except (OperationBusy, IllegalTransition, KeyError) as exc:
                    out.append(exc)
                    continue
                out.append(-1)
            if begun:
                await tx.execute(sql.CLOSE_OPEN_ATTEMPTS_OF, now, list(begun))
                await self._close_batches(tx, now, of_operations=list(begun))
            for i, (operation_id, _) in enumerate(starts):
                if out[i] == -1:
                    [row] = await tx.fetch(sql.INSERT_ATTEMPT, operation_id,
                                           begun[operation_id], kind, now)
                    out[i] = int(row[0])
            return out

        return await self._write(write, savepoint=False)

    async def settle(self, settlements: Sequence[Settlement]) -> Settled:
        async def write(tx: TxT) -> set[str]:
            return await self._settle_each(tx, settlements)

        # With a savepoint: each attempt is finished first (that is how a superseded one
        # is found), so a transition refused after it must undo that write.
        refused = await self._write(write)
        return Settled(self._leftovers(settlements, refused), frozenset(refused))

    def _leftovers(self, settlements: Sequence[Settlement],
                   refused: set[str]) -> list[Settlement]:
        """What the transport must still ack or publish again: nothing when the queue
        is in this database (the settlement did it), nor for an outcome refused (its
        message is left to its lease, as the queue in this database leaves it)."""
        if self._owns_queue:
            return []
        return [s for s in settlements
                if s.delivery is not None and s.disposition is not Disposition.KEEP
                and s.operation_id not in refused]

    async def _settle_each(self, tx: TxT, settlements: Sequence[Settlement]) -> set[str]:
        """Write each outcome; return the operations whose outcome was refused."""
        # SQLite settles a lone settlement of its own queue in a group commit, one
        # executemany per statement (sqlite/ledger.py, _settle_many): a vectorised copy
        # of these rules, falling back here for any batch it cannot take. The ledger
        # contract runs SQLite with its own queue (that copy) and beside a transport
        # (this loop): a rule added here and not there fails the contract.
        sql, now = self._sql, self._now()
        settled: list[str] = []
        held: list[str] = []  # operations whose earlier attempts were closed unknown
        refused: set[str] = set()
        for s in settlements:
            if s.attempt_id is not None and not await tx.execute(
                    sql.FINISH_ATTEMPT, now, s.status, s.outcome, s.detail, s.attempt_id,
                    s.owner):
                # The attempt is closed already: another delivery's attempt superseded it
                # (its guard ran out, or the operation was held as ambiguous), or another
                # replica took the operation over from ours (declared dead after a stall).
                # Or it is open but another owner holds it: a batch found again, carried on
                # under its taker. That owner decides the operation now; writing this
                # outcome over it could undo what it decides.
                superseded(s)
                refused.add(s.operation_id)
                continue
            await self._transition(tx, s.operation_id, s.target, s.reason,
                                   count=-1 if s.refund_attempt else 0, now=now)
            if s.target in SETTLED:
                settled.append(s.operation_id)
            if s.attempt_id is None and s.target is OpState.AMBIGUOUS:
                # Held because an earlier attempt has no outcome (its process died):
                # that outcome is unknown for good, not "still in the air".
                await tx.execute(sql.CLOSE_OPEN_ATTEMPTS, now, s.operation_id)
                held.append(s.operation_id)
            await tx.execute(sql.SETTLE_BOOKKEEPING, *self._bookkeeping(s, now))
            if self._owns_queue and s.delivery is not None:
                if s.disposition is Disposition.ACK:
                    await tx.execute(sql.DELETE_MESSAGE, s.operation_id, s.delivery.receipt)
                elif s.disposition is Disposition.RETRY:
                    await tx.execute(sql.RETRY_MESSAGE, self._queue_time(now, s.delay_s),
                                     s.operation_id, s.delivery.receipt)
        await self._record_events(tx, sql.INSERT_OPERATION_EVENT, settled, now)
        await self._close_batches(tx, now, {s.batch_id for s in settlements
                                            if s.batch_id is not None}, held)
        return refused

    def _bookkeeping(self, s: Settlement, now: float) -> tuple[bool, float | None, bool, str]:
        """SETTLE_BOOKKEEPING's parameters: keep the lease, the retry's due time, clear the
        live message, the operation."""
        retry = s.disposition is Disposition.RETRY
        # The transport acks the old message after this commit and publishes a new one
        # for a retry: until then no message of this operation is live.
        return (s.disposition is Disposition.KEEP, now + s.delay_s if retry else None,
                retry and not self._owns_queue, s.operation_id)

    async def record_evidence(self, operation_id: str, kind: str, target: OpState,
                              reason: str, detail: str, status: int | None = None,
                              probe_after_s: float | None = None) -> bool:
        """Record a probe's or an operator's finding and move the operation on it.

        Returns True when the operation was queued again and the transport (when it is
        not this database) must publish its message.
        """
        sql = self._sql

        async def write(tx: TxT) -> None:
            if target is OpState.QUEUED:
                await tx.lock("finish_runs")  # see finish_runs
            now = self._now()
            row = await tx.fetchrow(sql.SELECT_OPERATION, operation_id)
            if row is None:
                raise KeyError(f"operation {operation_id} does not exist")
            op = rows.operation(row)
            await self._transition(tx, operation_id, target, reason, count=0, now=now)
            await tx.execute(sql.INSERT_EVIDENCE, operation_id, op.attempts, kind, now, now,
                             status, target.value, detail[:1000])
            if target in SETTLED and target is not op.state:  # an inconclusive probe: none
                await self._record_events(tx, sql.INSERT_OPERATION_EVENT, [operation_id], now)
            if target is OpState.AMBIGUOUS and probe_after_s is not None:
                await tx.execute(sql.PUT_OFF_PROBE, now + probe_after_s, operation_id)
            if target is OpState.QUEUED:
                await tx.execute(sql.REOPEN_RUN, op.run_id)
                # Due now, with no live message until it is published (redrive's cue
                # should the publish after this commit never happen).
                await tx.execute(sql.SETTLE_BOOKKEEPING, False, now, not self._owns_queue,
                                 operation_id)
                if self._owns_queue:
                    await tx.execute(sql.INSERT_MESSAGE, operation_id, op.run_id,
                                     op.recipient_id, self._queue_time(now, 0.0), now)
                    await tx.notify("queue")

        await self._write(write)
        return target is OpState.QUEUED and not self._owns_queue

    async def _transition(self, tx: TxT, operation_id: str, target: OpState,
                          reason: str | None, count: int, now: float,
                          owner: str | None = None, busy_s: float | None = None) -> int:
        """Move one operation to ``target`` inside the caller's transaction; return its
        attempts. ``owner`` holds it in flight for ``busy_s`` (on PostgreSQL, named with
        this replica).

        Raises before writing anything: IllegalTransition when the state machine forbids
        the move, OperationBusy when another owner holds the attempt in flight (only
        checked when ``owner`` is given), KeyError when there is no such operation.
        """
        args: list[Any] = [target.value, reason, count, now, owner, busy_s, operation_id]
        if self._holder is not None:
            args.append(self._holder if owner is not None else None)
        row = await tx.fetchrow(self._sql.transition(target, owner is not None), *args)
        if row is not None:
            return int(row[0])
        found = await tx.fetchrow(self._sql.SELECT_OP_STATE, operation_id)
        if found is None:
            raise KeyError(f"operation {operation_id} does not exist")
        state, _, held_by, busy, clock = found
        if owner is not None and state == OpState.IN_FLIGHT.value and busy \
                and busy > (clock if clock is not None else now) and held_by != owner:
            # A hold on the database's clock (None: on ours) comes back on the caller's.
            raise OperationBusy(operation_id,
                                busy if clock is None else time.time() + (busy - clock))
        states.check(operation_id, OpState(state), target)
        raise AssertionError(f"transition of {operation_id} refused for no known reason")

    def _op(self, r: Row, unfinished: bool = False) -> Operation:
        return rows.operation(r, unfinished, self._offset)

    async def _read_one(self, query: str, *args: Any) -> Row | None:
        found = await self._read(query, *args)
        return found[0] if found else None

    # -- the operators' audit log ----------------------------------------------------------

    async def record_operator_action(self, action: str, by: str, reason: str,
                                     detail: Mapping[str, Any]) -> OperatorAction:
        now, blob = self._now(), orjson.dumps(dict(detail)).decode()

        async def write(tx: TxT) -> int:
            [row] = await tx.fetch(self._sql.INSERT_OPERATOR_ACTION, now, action, by, reason,
                                   blob)
            return int(row[0])

        row_id = await self._write(write, savepoint=False)
        return rows.operator_action((row_id, now, action, by, reason, blob))

    async def operator_actions(self, action: str, limit: int) -> list[OperatorAction]:
        found = await self._read(self._sql.SELECT_OPERATOR_ACTIONS, action, limit)
        return [rows.operator_action(tuple(r)) for r in found]

    async def close(self) -> None:
        await self._storage.close()

    # -- the events outbox -----------------------------------------------------------------

    async def _record_events(self, tx: TxT, statement: str, ids: Sequence[str],
                             now: float) -> None:
        """One event per operation settled or run finished (``statement``: the outbox
        insert for either), in the transaction of that change, after it: each row takes
        the state the operation now holds, or the run's operations counted by state. An
        event exists if and only if its change committed."""
        if ids:
            # Held to commit: events get their seq in commit order, so a sink reading past
            # seq N never misses an event with a smaller seq that commits after it read.
            await tx.lock("events")
            await tx.executemany(statement, [(new_event_id(), now, i) for i in ids])

    async def events_after(self, seq: int, limit: int) -> list[Event]:
        return [rows.event(r) for r in await self._read(self._sql.SELECT_EVENTS_AFTER, seq,
                                                        limit)]

    async def event_cursor(self, sink: str) -> int:
        row = await self._read_one(self._sql.SELECT_EVENT_CURSOR, sink)
        return int(row[0]) if row is not None else 0

    async def save_event_cursor(self, sink: str, seq: int) -> None:
        async def write(tx: TxT) -> None:
            await tx.execute(self._sql.UPSERT_EVENT_CURSOR, sink, seq, self._now())

        await self._write(write, savepoint=False)

    async def event_backlog(self, after: int) -> Backlog:
        row = await self._read_one(self._sql.EVENT_BACKLOG, after)
        if row is None or not row[0]:
            return Backlog(0, None)
        return Backlog(events=int(row[0]), oldest_at=row[1])

    async def prune_events(self, sinks: Sequence[str], before: float, limit: int) -> int:
        async def write(tx: TxT) -> int:
            return await tx.execute(self._sql.PRUNE_EVENTS, list(sinks), before + self._offset,
                                    limit)

        return await self._write(write, savepoint=False)


def superseded(s: Settlement) -> None:
    log.warning("operation %s: attempt %d was superseded (by another delivery's attempt, by "
                "the replica that took the operation over, or by the sender that took its "
                "batch again); this outcome (%s) is not recorded", s.operation_id,
                s.attempt_id, s.outcome,
                extra={"action": "settlement_superseded"})
