"""The digest rule: every recipient a cleanup run selected is excluded from the digest
explicitly, with its reason, even while the run drains.

The article's rule: "every active customer eligible at the cutoff must either enter the
digest audience or have an explicit exclusion reason, even while stale-recipient cleanup
drains". The digest builder asks ``GET /v1/exclusions?schedule=weekly`` and gets every
recipient of that schedule's current run, in any state: one still waiting for its
deletion must not be mailed a half-deleted profile, one already deleted may still be in
the builder's own list, one the partner never had or failed to delete is still stale.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from supervisor.ledger.base import Ledger, Operation, Run
from supervisor.states import OpState

# One reason per state: what the digest builder records against the recipient.
REASONS: dict[OpState, str] = {
    OpState.DISCOVERED: "deletion_pending",
    OpState.QUEUED: "deletion_pending",
    OpState.RETRY_WAIT: "deletion_pending",
    OpState.IN_FLIGHT: "deletion_in_flight",
    OpState.AMBIGUOUS: "deletion_unconfirmed",
    OpState.DELETED: "deleted",
    OpState.ALREADY_ABSENT: "absent_at_partner",
    OpState.FAILED: "deletion_failed",
}
JSONL = "application/x-ndjson"
SCHEDULE = re.compile(r"[!-~]{1,100}")
RUNS_PAGE = 50
STREAM_PAGE = 1000


def record(op: Operation) -> dict[str, Any]:
    return {"recipient_id": op.recipient_id, "operation_id": op.id, "state": op.state.value,
            "reason": REASONS[op.state], "detail": op.reason, "updated_at": op.updated_at}


def count_by_reason(counts: Mapping[OpState, int]) -> dict[str, int]:
    """A run's operation counts by state, as exclusion counts by reason (every reason
    present, zeros included, so a gauge series never goes missing)."""
    out = dict.fromkeys(REASONS.values(), 0)
    for state, n in counts.items():
        out[REASONS[state]] += n
    return out


async def current_run(ledger: Ledger, schedule: str) -> Run | None:
    """The newest run of ``schedule`` (runs of other schedules may be newer)."""
    before: str | None = None
    while True:
        runs = await ledger.list_runs(RUNS_PAGE, before)
        for run in runs:
            if run.schedule == schedule:
                return run
        if len(runs) < RUNS_PAGE:
            return None
        before = runs[-1].id


def run_header(run: Run, cutoff_s: float | None) -> dict[str, Any]:
    start = run.scheduled_for or run.created_at
    return {"id": run.id, "state": run.state.value, "scheduled_for": run.scheduled_for,
            # Until the scan has finished, recipients may still join the list.
            "complete": run.scan_finished_at is not None,
            "digest_cutoff": None if cutoff_s is None else start + cutoff_s}


async def stream(request: web.Request, ledger: Ledger, run: Run,
                 cutoff_s: float | None) -> web.StreamResponse:
    """Every exclusion as one JSON line, read from the ledger a page at a time (a run of a
    million recipients is never held in memory)."""
    header = run_header(run, cutoff_s)
    response = web.StreamResponse(headers={
        "Content-Type": JSONL, "Cleanup-Run-Id": run.id, "Cleanup-Run-State": header["state"],
        "Cleanup-Run-Complete": "true" if header["complete"] else "false"})
    await response.prepare(request)
    after: str | None = None
    while True:
        page = await ledger.list_operations(run.id, None, after, STREAM_PAGE)
        if page:
            await response.write(b"".join(orjson.dumps(record(op)) + b"\n" for op in page))
        if len(page) < STREAM_PAGE:
            break
        after = page[-1].id
    await response.write_eof()
    return response
