"""What a database supplies to the ledger's core (:mod:`supervisor.ledger.core`): its
statements by name and a unit of work. Nothing here decides anything: the decisions
(which transition, what a refusal means, when an outcome is discarded) are the core's.

River's ``riverdriver.Executor`` and procrastinate's ``BaseConnector`` are the model:
each statement is one call, and both dialects number their parameters alike, so the core
passes the same arguments to either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from supervisor.states import OpState

# A row as either driver returns it (sqlite3.Row, asyncpg.Record): read by position.
Row = Any


class Tx(Protocol):
    """One write transaction of the backend's unit of work (a SQLite group commit's
    savepoint, a PostgreSQL transaction). A list argument is a list of values (a
    PostgreSQL array, a JSON array in SQLite)."""

    async def execute(self, query: str, *args: Any) -> int:
        """Run ``query``; the number of rows it changed."""

    async def executemany(self, query: str, rows: Sequence[Sequence[Any]]) -> None: ...

    async def fetch(self, query: str, *args: Any) -> list[Row]: ...

    async def fetchrow(self, query: str, *args: Any) -> Row | None: ...

    async def lock(self, name: str) -> None:
        """Serialise this transaction, until it commits, with every other that takes
        ``name`` (a database with one writer has nothing to do)."""

    async def notify(self, channel: str, payload: str = "") -> None:
        """Wake whoever waits on ``channel`` (other replicas) once this commits."""


class Statements(Protocol):
    """The statements the core runs, by name: each backend's sql module. Parameters are
    numbered the same in both (documented at each statement)."""

    # runs
    INSERT_RUN: str
    SELECT_RUN: str
    SELECT_RUN_BY_TICK: str
    SELECT_RECENT_RUN_OF_SCHEDULE: str
    SELECT_UNFINISHED_RUN: str
    SELECT_RUNS: str
    SELECT_RUNS_BEFORE: str
    SELECT_RUNS_BY_ID: str
    SELECT_SCHEDULE_RUNS: str
    SELECT_RUNS_TO_SCAN: str
    SELECT_CURRENT_RUN: str
    UPDATE_RUN_PAGE: str
    SELECT_RUN_SCAN: str
    UPDATE_RUN_SCANNED: str
    UPDATE_RUN_SCAN_FAILURE: str
    UPDATE_RUN_SCAN_ABANDONED: str
    UPDATE_RUNS_DONE: str
    REOPEN_RUN: str
    COUNT_RUN_STATES: str
    SELECT_RUN_WITH_COUNTS: str
    COUNT_AMBIGUOUS: str
    # operations
    SELECT_OPERATION: str
    SELECT_OPERATIONS_WITH_OPEN_ATTEMPT: str
    SELECT_OPERATIONS: str
    SELECT_OPERATIONS_IN_STATE: str
    SELECT_OPERATIONS_BY_STATE: str
    SELECT_UNPUBLISHED: str
    SELECT_OP_STATE: str
    RECORD_PUBLISHED: str
    RECORD_OUTBOX: str
    NOTE_RECEIVED: str
    NOTE_RECEIVED_ONCE: str
    SETTLE_BOOKKEEPING: str
    LEDGER_QUEUE_STATS: str
    SELECT_OVERDUE: str
    SELECT_AMBIGUOUS_DUE: str
    PUT_OFF_PROBE: str
    # attempts
    INSERT_ATTEMPT: str
    INSERT_EVIDENCE: str
    FINISH_ATTEMPT: str
    HAS_OPEN_ATTEMPT: str
    CLOSE_OPEN_ATTEMPTS: str
    CLOSE_OPEN_ATTEMPTS_OF: str
    SELECT_ATTEMPTS: str
    # batches (supervisor/ledger/batches.py)
    INSERT_BATCH: str
    LINK_ATTEMPT: str
    UPDATE_BATCH: str
    COUNT_JOBS: str
    SELECT_BATCH: str
    SELECT_BATCH_MEMBERS: str
    SELECT_OPEN_BATCH_OF: str
    SELECT_OPEN_JOBS: str
    CLOSE_FINISHED_BATCHES: str
    SELECT_OPEN_BATCHES_OF: str
    # the queue table, when the ledger owns the queue
    INSERT_MESSAGE: str
    DELETE_MESSAGE: str
    RETRY_MESSAGE: str
    # the operators' audit log
    INSERT_OPERATOR_ACTION: str
    SELECT_OPERATOR_ACTIONS: str
    # the events outbox
    INSERT_OPERATION_EVENT: str
    INSERT_RUN_EVENT: str
    SELECT_EVENTS_AFTER: str
    EVENT_BACKLOG: str
    SELECT_EVENT_CURSOR: str
    UPSERT_EVENT_CURSOR: str
    PRUNE_EVENTS: str

    def transition(self, target: OpState, guard_busy: bool) -> str:
        """The guarded transition (:func:`supervisor.ledger.shape.transition`)."""
