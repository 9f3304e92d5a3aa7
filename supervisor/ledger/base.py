"""The ledger protocol and the records it hands out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from supervisor.model import (
    Attempt,
    Backlog,
    Batch,
    BatchMember,
    Delivery,
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
from supervisor.states import OpState


class BatchRecords(Protocol):
    """The batches that carried operations' attempts (docs/batch.md): one row each, and
    each attempt's batch and position. An operation never settles on its batch's state:
    these records tell which request or job an open attempt went out in, so that it is
    found again (a job polled, a batch sent again under its key) instead of resent."""

    async def record_batch(self, batch: Batch, members: Sequence[tuple[int, int]]) -> None:
        """Write ``batch`` and link its attempts, ``(attempt_id, position)``, before the
        request leaves."""

    async def update_batch(self, batch_id: str, state: str, *, job_ref: str | None = None,
                           submitted: bool = False, polled: bool = False,
                           results_expire_at: float | None = None,
                           detail: str | None = None) -> None:
        """Move ``batch_id`` to ``state`` (closing it when ``closed``), recording what is
        given; what is not given is kept."""

    async def reserve_job(self, batch_id: str, cap: int) -> bool:
        """Count ``batch_id`` among the jobs in flight if fewer than ``cap`` are (across
        replicas): True, and the batch is ``submitting``; False, nothing written."""

    async def get_batch(self, batch_id: str) -> Batch | None: ...

    async def batch_members(self, batch_id: str) -> list[BatchMember]:
        """The attempts ``batch_id`` carried, by position."""

    async def open_batch_of(self, operation_id: str) -> Batch | None:
        """The batch of the operation's open attempt (None: no open attempt, or not one
        a batch carried)."""

    async def open_jobs(self) -> list[Batch]:
        """Batches submitted as jobs (or being submitted) and not closed, oldest first."""

    async def take_batch(self, batch_id: str, owner: str,
                         busy_s: float) -> list[BatchMember] | None:
        """Hold, for ``owner`` and ``busy_s``, every operation whose attempt ``batch_id``
        carried and left open: all of them in one commit, or none. Its members by
        position; None when the batch is closed or another owner (a delivery, or a peer
        sending it again) holds one of them. One sender of a batch again, across
        replicas."""


class Ledger(BatchRecords, Protocol):
    """Truth about runs and operations. Every write is durable when the call returns."""

    @property
    def healthy(self) -> bool:
        """False while the last write failed (disk full, locked, read-only)."""

    @property
    def peers_may_take_over(self) -> bool:
        """True where other processes may release this one's holds before they run out
        (replicas declaring it dead): a hold with time left must still be read before
        a request leaves. False where a hold lapses only with time (one process)."""

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

    async def run_with_counts(self, run_id: str) -> tuple[Run, dict[OpState, int]] | None:
        """The run (``source`` as list_runs) and its operations' counts by state, as one
        read: a run seen done never shows an operation queued again after it closed."""

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

    async def begin_attempts(self, starts: Sequence[tuple[str, str]], kind: str,
                             busy_s: float) -> list[int | Exception]:
        """:meth:`begin_attempt` for many operations in one write, ``(operation_id,
        owner)`` each, superseding whatever attempt is open (a batch under idempotency
        keys): each one's attempt ID, or what refused it (OperationBusy,
        IllegalTransition, KeyError), in order. A refusal writes nothing for its
        operation and does not stop the others."""

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

    async def owns_attempts(self, claims: Sequence[tuple[str, int, str]],
                            for_s: float) -> set[str]:
        """:meth:`owns_attempt` for a batch's members at once (one read): of ``claims``
        (operation ID, attempt ID, owner), the operations whose attempt is still theirs
        for ``for_s`` more."""

    async def settle(self, settlements: Sequence[Settlement]) -> Settled:
        """Commit outcomes; return the settlements whose message the transport must still
        ack or publish again (none when the queue lives in the ledger's own database),
        and those refused. An outcome for an attempt that is closed already (another
        delivery's attempt superseded it), or whose operation another owner than the
        settlement's holds now (a batch taken again, :meth:`take_batch`), is refused,
        nothing of it written, its message not moved: that owner decides."""

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

    async def record_operator_action(self, action: str, by: str, reason: str,
                                     detail: Mapping[str, Any]) -> OperatorAction:
        """Append an operator's act to the audit table; durable when the call returns."""

    async def operator_actions(self, action: str, limit: int) -> list[OperatorAction]:
        """The latest ``limit`` acts of kind ``action``, newest first."""

    async def close(self) -> None: ...


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
