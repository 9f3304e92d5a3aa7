"""The ledger file of a stopped service, read directly: the one SQLite ledger reader of
the end-to-end and fault suites.

Read-only, and only once no process of the service runs, so what it shows is what the
service left on disk (its API would show what it believes).
"""

from __future__ import annotations

import re
import sqlite3
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATES = ("discovered", "queued", "in_flight", "retry_wait", "ambiguous", "deleted",
          "already_absent", "failed")
# An attempt's outcome that leaves open whether the partner executed the DELETE.
UNRESOLVED = (None, "unknown", "ambiguous")
# A batch in these states is a job the partner may hold: the job poller, driven by the
# ledger alone, settles its items (their messages were acked when it was submitted).
JOB_STATES = ("submitting", "submitted")
# The detail a probe leaves (supervisor/partner.py, PartnerClient.probe).
_PROBED = re.compile(r"\bprobe (HTTP \d+|failed)")


@dataclass(frozen=True)
class BatchRow:
    """One row of the ``batches`` table, and the operations its attempts belong to."""

    id: str
    shape: str
    size: int
    state: str  # formed | sent | submitting | submitted | closed
    job_ref: str | None
    detail: str | None
    members: tuple[str, ...]  # operation IDs, by position in the request
    open_attempts: int  # attempts it carried with no outcome yet: it is in the air


@dataclass
class LedgerRows:
    """The ledger file as the service left it, read with a read-only connection."""

    states: dict[str, int]
    op_attempts: int  # SUM(operations.attempts): delete attempts that counted
    attempts: Counter[str]  # attempts rows by kind (delete, probe, operator)
    outcomes: Counter[tuple[str, str | None]]  # (kind, outcome) -> rows
    open_attempts: int  # rows with no outcome yet
    messages: int  # the embedded queue's rows (always 0 with Infrai)
    leased: int
    # Embedded queue: queued/in_flight/retry_wait operations without any message. Infrai
    # keeps its messages elsewhere: see FaultService.stranded.
    stranded: list[str]
    live: dict[str, str | None]  # queued/in_flight/retry_wait op -> its live message_id
    terminal_at: dict[str, float]  # settled op -> when it settled (updated_at)
    state_of: dict[str, str]  # every op -> its state
    message_of: dict[str, str | None]  # every op -> the last message recorded as its live one
    runs: dict[str, str]  # run id -> state
    scan_pages: int
    blind_resends: list[str]  # a delete sent after an unresolved attempt, not re-queued
    not_sent: int  # delete attempts closed before their request left ("not sent: ...")
    log_of: dict[str, list[tuple[Any, ...]]]  # op -> [(n, kind, status, outcome, detail)]
    # Batch partners (docs/batch.md): every batch row, and each operation's delete
    # attempts' batch IDs in order (None: an attempt no batch was recorded for).
    batches: dict[str, BatchRow]
    batch_of: dict[str, list[str | None]]
    # Active operations whose open attempt went out in a job the partner may hold: the
    # job poller's, with no message by design.
    in_open_job: list[str]
    # Delete attempts settled by a probe of their own recipient (an accepted batch's
    # items; a job whose results were gone or whose submission was in doubt).
    item_probes: int

    @property
    def open_batches(self) -> dict[str, str]:
        """Batch ID -> state, for every batch not closed."""
        return {b.id: b.state for b in self.batches.values() if b.state != "closed"}


def read_ledger(path: Path, embedded: bool = True) -> LedgerRows:
    conn = _connect(path)
    try:
        states = dict.fromkeys(STATES, 0)
        states.update(conn.execute("SELECT state, COUNT(*) FROM operations GROUP BY state"))
        op_attempts = conn.execute("SELECT COALESCE(SUM(attempts), 0) FROM operations"
                                   ).fetchone()[0]
        rows = conn.execute("SELECT operation_id, n, kind, status, outcome, detail "
                            "FROM attempts ORDER BY operation_id, id").fetchall()
        batches, batch_of, in_open_job = _batches(conn)
        messages = conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        leased = conn.execute("SELECT COUNT(*) FROM messages WHERE lease_token IS NOT NULL"
                              ).fetchone()[0]
        stranded_ops = stranded(conn) if embedded else []
        live = dict(conn.execute(
            "SELECT id, message_id FROM operations "
            "WHERE state IN ('queued', 'in_flight', 'retry_wait')").fetchall())
        terminal_at = dict(conn.execute(
            "SELECT id, updated_at FROM operations "
            "WHERE state IN ('deleted', 'already_absent', 'failed')").fetchall())
        state_of = dict(conn.execute("SELECT id, state FROM operations").fetchall())
        message_of = dict(conn.execute("SELECT id, message_id FROM operations").fetchall())
        runs = dict(conn.execute("SELECT id, state FROM runs").fetchall())
        scan_pages = conn.execute("SELECT COALESCE(SUM(scan_pages), 0) FROM runs").fetchone()[0]
    finally:
        conn.close()
    log_of: dict[str, list[tuple[Any, ...]]] = {}
    for op_id, *rest in rows:
        log_of.setdefault(op_id, []).append(tuple(rest))
    blind: list[str] = []
    for op_id, log in log_of.items():
        blocked = False
        for _n, kind, _status, outcome, _detail in log:
            if kind == "delete":
                if blocked:
                    blind.append(op_id)
                    break
                blocked = outcome in UNRESOLVED
            elif outcome == "queued":  # a probe found it present, or an operator said retry
                blocked = False
    return LedgerRows(
        states=states, op_attempts=op_attempts,
        attempts=Counter(r[2] for r in rows), outcomes=Counter((r[2], r[4]) for r in rows),
        open_attempts=sum(1 for r in rows if r[4] is None), messages=messages,
        leased=leased, stranded=stranded_ops, live=live, terminal_at=terminal_at,
        state_of=state_of, message_of=message_of, runs=runs,
        scan_pages=scan_pages, blind_resends=blind, log_of=log_of,
        not_sent=sum(1 for r in rows if r[2] == "delete" and (r[5] or "").startswith("not sent")),
        batches=batches, batch_of=batch_of, in_open_job=in_open_job,
        item_probes=sum(1 for r in rows if r[2] == "delete" and _PROBED.search(r[5] or "")))


def _batches(conn: sqlite3.Connection,
             ) -> tuple[dict[str, BatchRow], dict[str, list[str | None]], list[str]]:
    """The ``batches`` table and ``attempts.batch_id`` (empty on a ledger from before
    batches, whose columns the service adds when it opens the file)."""
    columns = {r[1] for r in conn.execute("PRAGMA table_info(attempts)")}
    if "batch_id" not in columns:
        return {}, {}, []
    members: dict[str, list[str]] = {}
    unanswered: Counter[str] = Counter()
    batch_of: dict[str, list[str | None]] = {}
    for op_id, batch_id in conn.execute(
            "SELECT operation_id, batch_id FROM attempts WHERE kind = 'delete' "
            "ORDER BY operation_id, id"):
        batch_of.setdefault(op_id, []).append(batch_id)
    for batch_id, op_id, outcome in conn.execute(
            "SELECT batch_id, operation_id, outcome FROM attempts WHERE batch_id IS NOT NULL "
            "ORDER BY batch_id, batch_position"):
        members.setdefault(batch_id, []).append(op_id)
        unanswered[batch_id] += outcome is None
    batches = {r[0]: BatchRow(r[0], r[1], r[2], r[3], r[4], r[5], tuple(members.get(r[0], ())),
                              unanswered[r[0]])
               for r in conn.execute("SELECT id, shape, size, state, job_ref, detail "
                                     "FROM batches ORDER BY created_at, id")}
    in_open_job = [r[0] for r in conn.execute(
        "SELECT DISTINCT o.id FROM operations o JOIN attempts a ON a.operation_id = o.id "
        "JOIN batches b ON b.id = a.batch_id WHERE a.outcome IS NULL "
        "AND o.state IN ('queued', 'in_flight', 'retry_wait') "
        f"AND b.state IN {JOB_STATES!r}")]
    return batches, batch_of, in_open_job


def stranded(conn: sqlite3.Connection) -> list[str]:
    """Operations that still need work but have no message (embedded queue): acked
    without an outcome."""
    return [r[0] for r in conn.execute(
        "SELECT id FROM operations o WHERE state IN ('queued', 'in_flight', 'retry_wait') "
        "AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.operation_id = o.id)")]


def attempts_started_after(path: Path, after: dict[str, float]) -> dict[str, int]:
    """op -> how many attempts of it began after its time in ``after``."""
    conn = _connect(path)
    try:
        return {op: conn.execute(
            "SELECT COUNT(*) FROM attempts WHERE operation_id = ? AND started_at > ?",
            (op, at)).fetchone()[0] for op, at in after.items()}
    finally:
        conn.close()


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)
