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

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from aiohttp import web

from supervisor.errors import StorageError
from supervisor.ledger.base import Ledger
from supervisor.model import Operation, Run
from supervisor.states import OpState

log = logging.getLogger(__name__)

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
# Small pages: each is one turn at the gate, short beside a consumer worker's step.
STREAM_PAGE = 250
COOL_DOWN = 8.0


def record(op: Operation) -> dict[str, Any]:
    return {"recipient_id": op.recipient_id, "operation_id": op.id, "run_id": op.run_id,
            "state": op.state.value,
            "reason": REASONS[op.state], "detail": op.reason, "updated_at": op.updated_at}


def count_by_reason(counts: Mapping[OpState, int]) -> dict[str, int]:
    """A run's operation counts by state, as exclusion counts by reason (every reason
    present, zeros included, so a gauge series never goes missing)."""
    out = dict.fromkeys(REASONS.values(), 0)
    for state, n in counts.items():
        out[REASONS[state]] += n
    return out


async def current_runs(ledger: Ledger, schedule: str) -> list[Run]:
    """The schedule's newest run and every older one still unfinished (with
    ``schedule.overlap = "allow"`` several drain at once), oldest first: one indexed read,
    not a walk through every run ever."""
    return await ledger.schedule_runs(schedule)


def run_header(run: Run, cutoff_s: float | None) -> dict[str, Any]:
    start = run.scheduled_for or run.created_at
    return {"id": run.id, "state": run.state.value, "scheduled_for": run.scheduled_for,
            # Until the scan has finished, recipients may still join the list.
            "complete": run.scan_finished_at is not None,
            "digest_cutoff": None if cutoff_s is None else start + cutoff_s}


@contextlib.asynccontextmanager
async def turn(gate: asyncio.Lock | None) -> AsyncIterator[None]:
    """One page read (or turned into lines) at a time through ``gate``, however many
    readers hold a stream, and the gate kept shut a while after each: pages back to back
    take at most 1 / (1 + COOL_DOWN) of the process's time, the drain keeps the rest.
    (Twenty streams taking turns with the consumer's workers, each page milliseconds of
    the event loop, cost every worker step twenty of them: a drain at 100/s fell to 5/s.)
    Readers wait at the gate; the drain does not."""
    if gate is None:
        yield
        return
    async with gate:
        began = time.monotonic()
        yield
        # Measured, not fixed: on a busy machine a page takes longer, and so does the rest.
        await asyncio.sleep((time.monotonic() - began) * COOL_DOWN)


async def batches(ledger: Ledger, runs: list[Run], after: Operation | None, size: int,
                  gate: asyncio.Lock | None = None) -> AsyncIterator[list[Operation]]:
    """The exclusions after the operation ``after`` (whose run is in ``runs``; None: from
    the start), run by run in ID order, read ``size`` at a time.

    ``gate``: see :func:`turn`."""
    start = 0 if after is None else [r.id for r in runs].index(after.run_id)
    cursor = None if after is None else after.id
    for run in runs[start:]:
        while True:
            async with turn(gate):
                ops = await ledger.list_operations(run.id, None, cursor, size)
            if ops:
                yield ops
            if len(ops) < size:
                break
            cursor = ops[-1].id
        cursor = None


async def page(ledger: Ledger, runs: list[Run], after: Operation | None,
               limit: int, gate: asyncio.Lock | None = None,
               ) -> tuple[list[Operation], str | None]:
    """Up to ``limit`` exclusions after ``after``, and the next page's cursor (None: this
    is the last)."""
    rows: list[Operation] = []
    async for ops in batches(ledger, runs, after, limit, gate):
        rows += ops
        if len(rows) >= limit:
            return rows[:limit], rows[limit - 1].id
    return rows, None


async def stream(request: web.Request, ledger: Ledger, runs: list[Run],
                 cutoff_s: float | None, after: Operation | None = None,
                 gate: asyncio.Lock | None = None) -> web.StreamResponse:
    """Every exclusion as one JSON line, read from the ledger a page at a time (a run of a
    million recipients is never held in memory), then an end line with the count: a
    client that does not see it has an incomplete list (the connection is cut on a fault,
    never ended as if complete), and may resume after the last line it has (``after``)."""
    headers = [run_header(run, cutoff_s) for run in runs]
    response = web.StreamResponse(headers={
        "Content-Type": JSONL, "Cleanup-Run-Id": ", ".join(r.id for r in runs),
        "Cleanup-Run-Complete": "true" if all(h["complete"] for h in headers) else "false"})
    await response.prepare(request)
    count = 0
    try:
        async for ops in batches(ledger, runs, after, STREAM_PAGE, gate):
            async with turn(gate):
                lines = b"".join(orjson.dumps(record(op)) + b"\n" for op in ops)
            await response.write(lines)  # outside the gate: a slow reader holds only itself
            count += len(ops)
        await response.write(orjson.dumps({"end": True, "count": count, "runs": headers}) + b"\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; nothing to tell it
    except StorageError as exc:
        # The status line is sent: cut the connection, so the list cannot pass for whole.
        log.error("exclusions stream cut after %d lines: %s", count, exc,
                  extra={"action": "exclusions_cut"})
        if request.transport is not None:
            request.transport.close()
    return response
