"""What the status page shows, as plain data: the server renders it into the page and the
page's script fetches it again every two seconds (``/status/data``).

Display strings are made here, once, so the first render and every refresh agree. One
snapshot serves every open page for up to :data:`FRESH_S`: the counts cost the ledger a
query each, and ten people watching must not cost ten times a monitor pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.ledger.base import Ledger
from supervisor.model import LedgerStats, Run
from supervisor.states import SETTLED, OpState, RunState
from supervisor.status.history import History

FRESH_S = 1.0
RECENT_RUNS = 8
# A finished run's counts change only when an ambiguous operation is resolved: counted
# again at most this often (a resolution through the page counts it at once).
DONE_COUNTS_S = 30.0
OUTCOMES = ("deleted", "already_absent", "failed", "ambiguous")
DASH = "\u2014"


def clock_text(t: float | None) -> str:
    return DASH if t is None else time.strftime("%H:%M:%S UTC", time.gmtime(t))


def date_text(t: float | None) -> str:
    return DASH if t is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def duration_text(seconds: float) -> str:
    s = round(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def count_text(n: int) -> str:
    return f"{n:,}"


def summarize(run: Run, counts: dict[OpState, int], rate: float, now: float,
              cutoff_s: float | None,
              projected_finish: Callable[[int, float], float] | None = None) -> dict[str, Any]:
    """A run as the page shows it: raw figures, and ``fields`` (display strings by the
    name of the element that shows them) with ``verdict`` (ok, late or none)."""
    by_outcome = {o: counts.get(OpState(o), 0) for o in OUTCOMES}
    discovered = sum(counts.values())
    unfinished = sum(n for s, n in counts.items() if s not in SETTLED)
    done = run.state is RunState.DONE
    projected = None
    # The budget's projection (a pause in force, a spent quota) where there is one: the
    # same figure as the API, the gauge and CleanupDrainMissesDigestCutoff.
    if not done and unfinished and projected_finish is not None:
        projected = projected_finish(unfinished, now)
    elif not done and unfinished and rate > 0:
        projected = now + unfinished / rate
    slot = run.scheduled_for if run.scheduled_for is not None else run.created_at
    cutoff = None if cutoff_s is None else slot + cutoff_s
    finish = run.finished_at if done else projected
    verdict, verdict_text = "none", "no digest cutoff configured"
    if cutoff is not None:
        if finish is None:
            verdict_text = "no projection yet (no rate)"
        else:
            margin = cutoff - finish
            late = margin < 0
            verdict = "late" if late else "ok"
            when = "after" if late else "before"
            verb = "finished" if done else "projected to finish"
            verdict_text = f"{verb} {duration_text(margin)} {when} the cutoff"
    if done:
        finish_text = f"done at {clock_text(run.finished_at)}"
        if run.finished_at is not None:
            finish_text += f" after {duration_text(run.finished_at - run.created_at)}"
    elif projected is not None:
        finish_text = f"{clock_text(projected)} (in {duration_text(projected - now)})"
    else:
        finish_text = DASH
    fields = {
        "run_id": run.id, "state": run.state.value, "schedule": run.schedule,
        "created": date_text(run.created_at),
        "discovered": count_text(max(discovered, run.discovered)),
        **{o: count_text(n) for o, n in by_outcome.items()},
        "unfinished": count_text(unfinished),
        "rate": DASH if done else f"{rate:.1f}/s",
        "finish": finish_text, "cutoff": clock_text(cutoff) if cutoff else DASH,
        "verdict": verdict_text,
    }
    return {"id": run.id, "state": run.state.value, "created_at": run.created_at,
            "scheduled_for": run.scheduled_for, "finished_at": run.finished_at,
            "discovered": max(discovered, run.discovered), "counts": by_outcome,
            "settled": discovered - unfinished, "unfinished": unfinished,
            "projected_finish": projected, "cutoff": cutoff, "verdict": verdict,
            "fields": fields}


def run_row(summary: dict[str, Any]) -> list[str]:
    """One line of the recent runs table (the page's header names the columns)."""
    f = summary["fields"]
    return [f["run_id"], f["state"], f["created"], f["discovered"], f["deleted"],
            f["already_absent"], f["failed"], f["ambiguous"], f["unfinished"], f["verdict"]]


@dataclass
class _Counted:
    counts: dict[OpState, int]
    at: float
    state: RunState


class StatusData:
    """The snapshot the page shows, recomputed at most every :data:`FRESH_S`."""

    def __init__(self, ledger: Ledger, rate: Callable[[], float], cutoff_s: float | None,
                 history: History | None, clock: Callable[[], float] = time.time,
                 projected_finish: Callable[[int, float], float] | None = None,
                 ledger_stats: Callable[[], LedgerStats | None] = lambda: None) -> None:
        self.ledger = ledger
        self.ledger_stats = ledger_stats
        self.rate = rate
        self.projected_finish = projected_finish
        self.cutoff_s = cutoff_s
        self.history = history
        self.clock = clock
        self._lock = asyncio.Lock()
        self._snapshot: dict[str, Any] | None = None
        self._taken_at = 0.0
        self._done_counts: dict[str, _Counted] = {}

    def invalidate(self, run_id: str | None = None) -> None:
        """Forget the snapshot (and ``run_id``'s counts): something just changed."""
        self._snapshot = None
        if run_id is not None:
            self._done_counts.pop(run_id, None)

    async def get(self) -> dict[str, Any]:
        async with self._lock:  # one computation for every page asking at once
            if self._snapshot is None or time.monotonic() - self._taken_at >= FRESH_S:
                self._snapshot = await self._compute()
                self._taken_at = time.monotonic()
            return self._snapshot

    async def _counted(self, run: Run) -> tuple[Run, dict[OpState, int]]:
        """The run with its counts as one read (a count read after the run could hold an
        operation queued again once the run was listed done)."""
        cached = self._done_counts.get(run.id)
        if run.state is RunState.DONE and cached is not None and \
                cached.state is RunState.DONE and time.monotonic() - cached.at < DONE_COUNTS_S:
            return run, cached.counts
        run, counts = await self.ledger.run_with_counts(run.id) or (run, {})
        if run.state is RunState.DONE:
            self._done_counts[run.id] = _Counted(counts, time.monotonic(), run.state)
        return run, counts

    async def _compute(self) -> dict[str, Any]:
        now = self.clock()
        rate = self.rate()
        # The monitor's own pass (every second; every 15 s on a replica not holding the
        # monitor role): the ambiguous count and the newest run's counts. Counting again
        # here would double the ledger's busiest query while a page is open.
        stats = self.ledger_stats() or await self.ledger.stats()
        runs = await self.ledger.list_runs(RECENT_RUNS)
        summaries = []
        for r in runs:
            # The monitor's counts hold while the run is as it saw it; a run closed since
            # is counted afresh, so "done" never shows next to the counts of before.
            seen = stats.current_run
            if seen is not None and seen.id == r.id and seen.state is r.state:
                counts = dict(stats.current_run_by_state)
            else:
                r, counts = await self._counted(r)
            summaries.append(summarize(r, counts, rate, now, self.cutoff_s,
                                       self.projected_finish))
        keep = {r.id for r in runs}
        self._done_counts = {k: v for k, v in self._done_counts.items() if k in keep}
        current = summaries[0] if summaries else None
        chart: dict[str, Any] | None = None
        if current is not None:
            start = current["created_at"]
            end = current["finished_at"] or now
            points = self.history.series(start, current["finished_at"]) if self.history else []
            chart = {"start": start, "end": end, "points": points}
        return {"now": now, "rate": rate, "current": current,
                "runs": [{"id": s["id"], "cells": run_row(s)} for s in summaries],
                "ambiguous": stats.ambiguous, "chart": chart}
