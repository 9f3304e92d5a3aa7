"""The records every layer shares: a queue's message and delivery, a run, an operation and
its attempts, a settlement, an event. Protocols (``ledger.base``, ``queue.base``) and every
backend import these; this module imports nothing of the service but ``states``."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.states import OpState, RunState


@dataclass(frozen=True, slots=True)
class Message:
    """Identifiers only: never a profile, always far below any transport's size limit."""

    run_id: str
    operation_id: str
    recipient_id: str



@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message, held under a visibility timeout.

    ``message_id`` is the transport's name for the message (the same on every delivery of
    it); ``receipt`` names this one delivery: it owns the operation's attempt in the
    ledger, so two deliveries of one message never have two attempts in flight.
    """

    message: Message
    message_id: str
    receipt: str



@dataclass(frozen=True, slots=True)
class QueueStats:
    depth: int  # claimable now
    parked: int  # waiting for a delayed retry
    leased: int  # held by a consumer
    oldest_claimable_age_s: float  # 0 when nothing is claimable

    @classmethod
    def from_row(cls, row: Sequence[Any], now: float) -> QueueStats:
        """(claimable, parked, leased, when the oldest claimable one became so)."""
        oldest = now - row[3] if row[3] is not None else 0.0
        return cls(depth=row[0], parked=row[1], leased=row[2],
                   oldest_claimable_age_s=max(0.0, oldest))


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
    # The batch that carried the attempt: closed in the same commit as its last outcome.
    batch_id: str | None = None
    # Who held the attempt when it was sent: the outcome is not written once another
    # owner holds the operation (a sender stalled past its hold, its batch taken again).
    owner: str | None = None



@dataclass(frozen=True, slots=True)
class Settled:
    """What a settlement's commit left: the settlements whose message the transport must
    still ack or publish again (none when the queue is in the ledger's database), and the
    operations whose outcome was refused, not written (another attempt or owner decides
    them; their messages are left to their leases and decided again on what is written)."""

    leftovers: list[Settlement]
    refused: frozenset[str] = frozenset()


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


@dataclass(frozen=True, slots=True)
class Batch:
    """One request (or job) that carried many operations' attempts (docs/batch.md).

    ``state``: ``formed`` (its attempts written, the request not yet known to have
    left), ``sent`` (in the air or answered; its items settle on their own verdicts),
    ``submitted`` (a job the partner holds: ``job_ref``), ``closed`` (every item
    settled, or the job's results copied). Our ``id`` is the partner's idempotency key
    and a job's tag."""

    id: str
    shape: str
    size: int
    state: str
    created_at: float
    job_ref: str | None = None
    submitted_at: float | None = None
    polled_at: float | None = None
    closed_at: float | None = None
    results_expire_at: float | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class BatchMember:
    """An attempt a batch carried: its operation, position in the request, recipient,
    and its outcome (None while unknown)."""

    operation_id: str
    position: int
    attempt_id: int
    recipient_id: str
    outcome: str | None
