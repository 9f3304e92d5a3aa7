"""The ledger protocol and the records it hands out."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from supervisor.queue.base import Delivery, Message, QueueStats
from supervisor.states import OpState, RunState


@dataclass(frozen=True, slots=True)
class Run:
    """A run. ``source`` is the whole source (an inline run's IDs included) only as
    get_run and runs_to_scan read it; list reads give ``{"kind": ...}``."""

    id: str
    tick_key: str
    schedule: str
    scheduled_for: float | None
    state: RunState
    source: Mapping[str, Any]
    scan_cursor: str | None
    scan_pages: int
    discovered: int
    skipped_candidates: int
    scan_failures: int
    last_error: str | None
    created_at: float
    scan_finished_at: float | None
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class Operation:
    id: str
    run_id: str
    recipient_id: str
    state: OpState
    attempts: int
    reason: str | None
    created_at: float
    updated_at: float
    due_at: float | None = None  # when its message is (or was) due to be delivered
    # The newest attempt has no outcome: the request may have reached the partner.
    unfinished_attempt: bool = False


@dataclass(frozen=True, slots=True)
class Attempt:
    id: int
    operation_id: str
    n: int
    kind: str
    started_at: float
    finished_at: float | None
    status: int | None
    outcome: str | None
    detail: str | None


@dataclass(frozen=True, slots=True)
class OpenRunResult:
    run: Run | None
    created: bool
    # Set when no run was opened because another one is unfinished.
    skipped_for: Run | None = None


@dataclass(frozen=True, slots=True)
class PageResult:
    new_operations: int
    run_state: RunState


class Disposition(enum.Enum):
    ACK = "ack"  # the operation is settled: the message is done
    RETRY = "retry"  # claimable again after delay_s
    KEEP = "keep"  # neither: the transport keeps its lease (it expires or is handed back)


@dataclass(frozen=True, slots=True)
class Settlement:
    """One operation's outcome: the ledger change and what happens to its message."""

    operation_id: str
    target: OpState
    delivery: Delivery | None
    disposition: Disposition = Disposition.ACK
    delay_s: float = 0.0
    reason: str | None = None
    attempt_id: int | None = None
    status: int | None = None
    outcome: str | None = None
    detail: str | None = None
    # A throttled attempt is not a failed one: it does not count towards max_attempts.
    refund_attempt: bool = False


@dataclass(frozen=True, slots=True)
class Published:
    """A message now out there for an operation: its ID and when it becomes deliverable."""

    operation_id: str
    message_id: str | None  # None: the wait is longer than the transport's longest delay
    due_at: float


@dataclass(frozen=True, slots=True)
class Received:
    """What the ledger knows about one delivery when it arrives."""

    operation: Operation | None  # None: no such operation
    receives: int  # deliveries since the operation's last outcome, this one included
    # How much longer someone holds the operation, as it arrived: an attempt's in-flight
    # guard, or a retry wait not yet due. 0: nobody does.
    held_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LedgerStats:
    ambiguous: int = 0
    # Ambiguous operations whose last probe was inconclusive (their next one put off).
    inconclusive: int = 0
    current_run: Run | None = None
    current_run_by_state: Mapping[OpState, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OperatorAction:
    """One operator's act outside an operation's own record (lifting the budget's pause):
    what, by whom, why and when, and what it changed (``detail``, a small JSON object)."""

    id: int
    at: float
    action: str  # e.g. "budget.resume"
    by: str
    reason: str
    detail: Mapping[str, Any] = field(default_factory=dict)


class Ledger(Protocol):
    """Truth about runs and operations. Every write is durable when the call returns."""

    @property
    def healthy(self) -> bool:
        """False while the last write failed (disk full, locked, read-only)."""

    async def open_run(self, tick_key: str, schedule: str, scheduled_for: float | None,
                       source: Mapping[str, Any], skip_if_unfinished: bool,
                       reuse_within_s: float | None = None) -> OpenRunResult:
        """Open the run for ``tick_key``, or return the one that tick already opened.

        ``reuse_within_s``: a tick without a slot or key also matches any run of the same
        schedule opened that recently (a caller that retried its request).
        ``skip_if_unfinished``: open nothing while another run is unfinished.
        """

    async def get_run(self, run_id: str) -> Run | None: ...

    async def list_runs(self, limit: int, before: str | None = None) -> list[Run]:
        """Runs newest first, before the run ``before``. Like every list read here
        (get_runs, schedule_runs, stats) a run's ``source`` holds only its ``kind``: an
        inline run's IDs are for the scan (get_run, runs_to_scan), not for listings."""

    async def get_runs(self, run_ids: Sequence[str]) -> dict[str, Run]:
        """Several runs in one read (those that exist), by ID; ``source`` as list_runs."""

    async def schedule_runs(self, schedule: str) -> list[Run]:
        """The schedule's newest run and every older one still unfinished, oldest first,
        through an index: what exclusions read, however many runs the schedule has had."""

    async def run_counts(self, run_id: str) -> dict[OpState, int]: ...

    async def runs_to_scan(self) -> list[Run]: ...

    async def record_page(self, run_id: str, recipient_ids: Sequence[str],
                          next_cursor: str | None, skipped: int,
                          resumed_from: str | None = None) -> PageResult:
        """Write one page's operations and the cursor after it, in one transaction.

        ``next_cursor`` None means the source is exhausted and the run starts draining.
        A recipient already in the run keeps its operation: a resumed scan adds nothing.
        ``resumed_from`` is the cursor this page was read from: when the run no longer
        holds it (another scanner moved on) nothing is written and ScanConflict is raised.
        """

    async def record_scan_failure(self, run_id: str, error: str, give_up: bool) -> None:
        """Count a failed page; ``give_up`` ends the scan and lets the run drain what it has."""

    async def unpublished(self, limit: int) -> list[Message]:
        """Operations discovered but not yet handed to the queue (the outbox)."""

    async def record_published(self, published: Sequence[Published],
                               outbox: bool = False) -> None:
        """Record each operation's live message; a discovered operation becomes queued.
        ``outbox``: the first publish, recorded only while the operation is still
        discovered (a consumer that had the message first keeps its bookkeeping)."""

    async def note_received(self, deliveries: Sequence[Delivery], lease_s: float,
                            per_message: bool = False) -> list[Received]:
        """Count each delivery against its operation, as held for ``lease_s``; one
        :class:`Received` per delivery, in order. ``per_message``: a delivery of the
        message counted last is not counted again (a transport that redelivers one message
        over and over by itself, as Infrai's push does after its visibility timeout), and
        becomes the operation's live message."""

    async def get_operation(self, operation_id: str) -> Operation | None: ...

    async def get_operations(self, operation_ids: Sequence[str]) -> dict[str, Operation]:
        """Several operations in one read (those that exist), by ID."""

    async def list_operations(self, run_id: str, state: OpState | None, after: str | None,
                              limit: int) -> list[Operation]:
        """A run's operations ordered by ID, after the operation ID ``after`` (a cursor
        that means the same in every backend: no storage row ID)."""

    async def attempts(self, operation_id: str, after: int = 0,
                       limit: int | None = None) -> list[Attempt]:
        """The operation's attempts and evidence in the order written: ``limit`` of them
        (None: all) after the first ``after`` (a position: the log is only appended to)."""

    async def begin_attempt(self, operation_id: str, kind: str, owner: str = "",
                            busy_s: float = 0.0, supersedes_open: bool = True) -> int:
        """Move the operation in flight and write its attempt *before* the request leaves.

        ``owner`` holds the operation for ``busy_s``: meanwhile another owner's attempt
        raises OperationBusy, so two workers never have one operation in flight.
        ``supersedes_open``: an earlier attempt may be unfinished; record it as unknown.
        Without it, an unfinished one raises AttemptOpen and nothing is written (no
        idempotency keys: a resend after an unknown outcome would be blind).
        """

    async def keep_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           busy_s: float) -> bool:
        """Hold the operation for ``busy_s`` more (from the ledger's clock's now) while
        ``attempt_id`` waits to be sent: only while it is still the operation's open
        attempt, held by ``owner``, and its hold has not run out (on PostgreSQL, and this
        replica is registered as alive). False: the attempt is no longer ``owner``'s,
        and its request must not be sent."""

    async def owns_attempt(self, operation_id: str, attempt_id: int, owner: str,
                           for_s: float) -> bool:
        """The check right before a request leaves (a read): ``attempt_id`` is still the
        operation's open attempt, held by ``owner`` for at least ``for_s`` more (and on
        PostgreSQL this replica's heartbeat is fresh enough that no peer can declare it
        dead within ``for_s``)."""

    async def settle(self, settlements: Sequence[Settlement]) -> list[Settlement]:
        """Commit outcomes; return the settlements whose message the transport must still
        ack or publish again (none when the queue lives in the ledger's own database).
        An outcome for an attempt that is closed already (another delivery's attempt
        superseded it) is discarded: that attempt owns the operation."""

    async def record_evidence(self, operation_id: str, kind: str, target: OpState,
                              reason: str, detail: str, status: int | None = None,
                              probe_after_s: float | None = None) -> bool:
        """Record a probe's or operator's finding and move the operation; True when the
        operation was queued again and its message must still be published.
        ``probe_after_s``: an inconclusive finding (``target`` ambiguous) puts the next
        probe off this long (the operation's ``due_at``)."""

    async def ambiguous_due(self, settled_before: float, limit: int) -> list[Operation]:
        """Ambiguous operations that have settled for long enough to be probed, and whose
        next probe is not put off."""

    async def operations_in_state(self, state: OpState, after: str | None,
                                  limit: int) -> list[Operation]:
        """Operations of every run in ``state``, ordered by ID, after ``after``."""

    async def overdue(self, before: float | None, unposted_before: float,
                      limit: int) -> list[Message]:
        """Unsettled operations whose message must be published again (redrive): none is
        live and the retry is due by ``unposted_before``, or nothing has been due,
        delivered, held or changed since ``before`` (None: only the first rule)."""

    async def queue_stats(self) -> QueueStats:
        """The queue as the ledger sees it, for a transport that cannot report its own."""

    async def finish_runs(self) -> list[str]:
        """Mark draining runs with nothing left queued or in flight as done."""

    async def stats(self) -> LedgerStats: ...

    async def load_budget(self, key: str) -> dict[str, Any] | None:
        """What the rate budget saved for ``key`` (a partner's base URL), if anything."""

    async def save_budget(self, key: str, data: dict[str, Any]) -> None:
        """Replace what is saved for ``key``; durable when the call returns."""

    async def record_operator_action(self, action: str, by: str, reason: str,
                                     detail: Mapping[str, Any]) -> OperatorAction:
        """Append an operator's act to the audit table; durable when the call returns."""

    async def operator_actions(self, action: str, limit: int) -> list[OperatorAction]:
        """The latest ``limit`` acts of kind ``action``, newest first."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One row of the events outbox: identifiers and an outcome, never a profile.

    ``seq`` orders the outbox and is what a sink's cursor holds; ``id`` is the stable
    event ID a receiver deduplicates on (the same on every delivery of the event).
    """

    seq: int
    id: str
    kind: str  # "operation.settled" | "run.finished"
    at: float
    run_id: str
    operation_id: str | None = None
    recipient_id: str | None = None
    outcome: str | None = None  # the operation's settled state
    counts: Mapping[str, int] | None = None  # a finished run's operations by state


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a sink has not taken yet: how many events, and when the oldest was written."""

    events: int
    oldest_at: float | None


class EventOutbox(Protocol):
    """The events outbox: written by the ledger with every settlement and finished run, in
    the same transaction; read by the sinks, each past its own cursor."""

    async def events_after(self, seq: int, limit: int) -> list[Event]:
        """Up to ``limit`` events after ``seq``, oldest first (an indexed range read)."""

    async def event_cursor(self, sink: str) -> int:
        """The last event ``sink`` acknowledged; 0 for a sink never seen."""

    async def save_event_cursor(self, sink: str, seq: int) -> None:
        """Record that ``sink`` took every event up to ``seq``; a cursor never moves back."""

    async def event_backlog(self, after: int) -> Backlog:
        """The events after ``after`` (a sink's cursor): their number and the oldest's time."""

    async def prune_events(self, sinks: Sequence[str], before: float, limit: int) -> int:
        """Delete at most ``limit`` events that every one of ``sinks`` has taken and that
        were written before ``before``; returns how many went."""


class LedgerStore(Ledger, EventOutbox, Protocol):
    """A ledger backend as the service holds it: the ledger and its events outbox."""


def budget_memory(blob: str | bytes | None) -> dict[str, Any] | None:
    """What the rate budget saved, as every backend stores it (a JSON object); None for
    nothing saved or anything unreadable (the budget then starts fresh)."""
    if blob is None:
        return None
    try:
        data = orjson.loads(blob)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def operator_action(row: Sequence[Any]) -> OperatorAction:
    """An audit row (id, at, action, actor, reason, detail JSON) as every backend stores it."""
    try:
        detail = orjson.loads(row[5]) if row[5] else {}
    except orjson.JSONDecodeError:
        detail = {}
    return OperatorAction(id=int(row[0]), at=float(row[1]), action=row[2], by=row[3],
                          reason=row[4], detail=detail if isinstance(detail, dict) else {})
