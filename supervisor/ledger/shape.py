"""The SQL both dialects share the shape of: the column lists the row mappers
(:mod:`supervisor.ledger.rows`) read, the events' kinds, and the guarded transition,
generated from the state table in supervisor/states.py. Each backend's sql module builds
its statements from these with its own placeholders (``?1`` in SQLite, ``$1`` in
PostgreSQL, numbered alike so the core passes the same arguments to both)."""

from __future__ import annotations

import functools

from supervisor import states
from supervisor.states import OpState

RUN_COLUMNS = (
    "id, tick_key, schedule, scheduled_for, state, source, scan_cursor, scan_pages, "
    "discovered, skipped_candidates, scan_failures, last_error, created_at, "
    "scan_finished_at, finished_at"
)
OP_COLUMNS = "id, run_id, recipient_id, state, attempts, reason, created_at, updated_at, due_at"
ATTEMPT_COLUMNS = "id, operation_id, n, kind, started_at, finished_at, status, outcome, detail"
EVENT_COLUMNS = "seq, id, kind, at, run_id, operation_id, recipient_id, outcome, counts"


def list_run_columns(source_kind: str = "source_kind") -> str:
    """What list reads select: the source's kind (the expression ``source_kind``) instead
    of its JSON, which holds up to 10,000 IDs for an inline run (the scan alone needs
    them; it reads them with RUN_COLUMNS)."""
    return RUN_COLUMNS.replace("state, source,", f"state, {source_kind},")


# The events' kinds, as the outbox rows and the sinks' payloads carry them.
OPERATION_SETTLED = "operation.settled"
RUN_FINISHED = "run.finished"


def finish_attempt(mark: str, text: str = "", returning: bool = False) -> str:
    """An attempt's outcome, written only while the attempt is open and no other owner
    than the one that sent it holds its operation: a batch taken again carries on the
    same attempt under its taker (ledger/batches.py, take_batch), so only the owner tells
    the two senders apart. No row changed (or none back) means refused.

    Parameters: 1 now, 2 status, 3 outcome, 4 detail, 5 the attempt, 6 the owner that
    sent it (NULL: not checked; an owner of '' is none). ``text`` casts 6 where the
    dialect cannot type a bare NULL.
    """
    def p(n: int) -> str:
        return f"{mark}{n}"

    return (
        f"UPDATE attempts SET finished_at = {p(1)}, status = {p(2)}, outcome = {p(3)}, "
        f"detail = {p(4)} WHERE id = {p(5)} AND outcome IS NULL AND ({p(6)}{text} IS NULL "
        "OR NOT EXISTS (SELECT 1 FROM operations o WHERE o.id = attempts.operation_id "
        f"AND o.owner NOT IN ('', {p(6)})))" + (" RETURNING id" if returning else "")
    )


@functools.cache
def transition(target: OpState, guard_busy: bool, mark: str, clock: str = "",
               holder: bool = False, returning: bool = True) -> str:
    """The guarded state change: it only matches a row whose current state may legally
    move to ``target``, so the check and the write are one statement. No row back (or
    none changed) means refused; the caller finds out why.

    Parameters, in every dialect: 1 target, 2 reason, 3 count (added to the attempts),
    4 now, 5 owner, 6 busy_s (how long the attempt is held; NULL for no hold), 7 the
    operation's ID, and with ``holder`` 8 the replica holding it. ``mark`` is the
    dialect's placeholder prefix; ``clock`` the expression the hold is measured on (the
    database's now, so every replica compares it with one clock), by default the now
    passed in. With ``guard_busy`` it also refuses an operation another owner holds in
    flight. Without ``returning`` it suits ``executemany``: the caller counts the rows
    changed instead.
    """
    def p(n: int) -> str:
        return f"{mark}{n}"

    now = clock or p(4)
    # No predecessor (nothing moves back to discovered): PostgreSQL has no ``IN ()``.
    allowed = ", ".join(f"'{s.value}'" for s in sorted(states.predecessors(target))) or "NULL"
    busy = (f" AND (state != 'in_flight' OR busy_until IS NULL OR busy_until <= {now}"
            f" OR owner = {p(5)})") if guard_busy else ""
    return (
        f"UPDATE operations SET state = {p(1)}, reason = COALESCE({p(2)}, reason), "
        f"attempts = attempts + {p(3)}, updated_at = {p(4)}, owner = {p(5)}, "
        f"busy_until = {now} + {p(6)}" + (f", holder = {p(8)}" if holder else "")
        + f" WHERE id = {p(7)} AND state IN ({allowed}){busy}"
        + (" RETURNING attempts" if returning else "")
    )
