"""Rows to records, as every backend selects them (the column lists in
:mod:`supervisor.ledger.shape`): a run, an operation, an event, an operator's act, the
budget's memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from supervisor.model import Event, Operation, OperatorAction, Run
from supervisor.states import OpState, RunState


def run(r: Sequence[Any], listed: bool = False) -> Run:
    """A run from RUN_COLUMNS, or (``listed``) from LIST_RUN_COLUMNS: its source's kind."""
    return Run(
        id=r[0], tick_key=r[1], schedule=r[2], scheduled_for=r[3], state=RunState(r[4]),
        source={"kind": r[5]} if listed else orjson.loads(r[5]), scan_cursor=r[6],
        scan_pages=r[7], discovered=r[8], skipped_candidates=r[9], scan_failures=r[10],
        last_error=r[11], created_at=r[12], scan_finished_at=r[13], finished_at=r[14])


def counts(found: Sequence[Sequence[Any]] | str | None) -> dict[OpState, int]:
    """A run's operations by state: COUNT_RUN_STATES's rows, or the JSON object of them
    SELECT_RUN_WITH_COUNTS reads with the run (none when the run has no operation)."""
    if isinstance(found, str):
        return {OpState(state): int(n) for state, n in orjson.loads(found).items()}
    return {OpState(r[0]): int(r[1]) for r in found or ()}


def operation(r: Sequence[Any], unfinished: bool = False, offset: float = 0.0) -> Operation:
    """An operation from OP_COLUMNS. ``offset``: how far the database's clock is ahead of
    this process's; the due time comes back on the caller's clock (a retry not yet due is
    deferred against it)."""
    due_at = r[8] - offset if r[8] is not None and offset else r[8]
    return Operation(id=r[0], run_id=r[1], recipient_id=r[2], state=OpState(r[3]),
                     attempts=r[4], reason=r[5], created_at=r[6], updated_at=r[7],
                     due_at=due_at, unfinished_attempt=unfinished)


def event(r: Sequence[Any]) -> Event:
    """An outbox row from EVENT_COLUMNS."""
    counts = orjson.loads(r[8]) if r[8] is not None else None
    return Event(seq=r[0], id=r[1], kind=r[2], at=r[3], run_id=r[4], operation_id=r[5],
                 recipient_id=r[6], outcome=r[7], counts=counts)


def operator_action(r: Sequence[Any]) -> OperatorAction:
    """An audit row (id, at, action, actor, reason, detail JSON)."""
    try:
        detail = orjson.loads(r[5]) if r[5] else {}
    except orjson.JSONDecodeError:
        detail = {}
    return OperatorAction(id=int(r[0]), at=float(r[1]), action=r[2], by=r[3],
                          reason=r[4], detail=detail if isinstance(detail, dict) else {})


def budget_memory(blob: str | bytes | None) -> dict[str, Any] | None:
    """What the rate budget saved (a JSON object); None for nothing saved or anything
    unreadable (the budget then starts fresh)."""
    if blob is None:
        return None
    try:
        data = orjson.loads(blob)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
