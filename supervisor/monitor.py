"""Closes finished runs and refreshes the gauges that come from the ledger and the queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from supervisor import metrics
from supervisor.budget import gauges
from supervisor.budget.base import RateBudget
from supervisor.budget.pair import TwoLimits
from supervisor.errors import StorageError
from supervisor.exclusions import count_by_reason
from supervisor.ledger.base import Ledger
from supervisor.model import LedgerStats
from supervisor.queue.base import Queue
from supervisor.runs import RunSeen, RunWatch
from supervisor.states import SETTLED, TERMINAL, RunState

log = logging.getLogger(__name__)

REFRESH_S = 1.0
# A replica not holding the monitor role counts the queue and the current run this often:
# at a million operations each count costs the database a third to a whole second
# (docs/scale.md), and the holder already counts every second (the dashboard reads the
# replica holding the monitor role: a follower's figures may be 15 s old).
FOLLOWER_COUNT_S = 15.0


class Monitor:
    """Wakes on every settlement (at most every 100 ms) and at least once a second."""

    def __init__(self, ledger: Ledger, queue: Queue, budget: RateBudget,
                 runs_changed: RunWatch, digest_cutoff_s: float | None = None,
                 finishes: Callable[[], bool] = lambda: True,
                 settled: asyncio.Event | None = None, finish_every_s: float = REFRESH_S,
                 readiness: Callable[[], object] = lambda: None) -> None:
        self.digest_cutoff_s = digest_cutoff_s
        # With replicas only the holder of the "monitor" role closes runs; every replica
        # refreshes its own gauges and wakes its own long-polls.
        self.finishes = finishes
        self.ledger = ledger
        self.queue = queue
        self.budget = budget
        self.runs_changed = runs_changed
        # Set by a settlement here and, with replicas, by any replica closing a run (a
        # NOTIFY): a long-poll on this replica answers when the holder closes the run.
        self.settled = settled or asyncio.Event()
        # With replicas the last settlement may happen on another replica, which does not
        # wake this one: the holder of the role looks this often instead.
        self.finish_every_s = finish_every_s
        self._counted_at = -FOLLOWER_COUNT_S
        # Evaluated every second so cleanup_ready is true on a service nothing polls
        # (a container's HEALTHCHECK asks /healthz, not /readyz).
        self.readiness = readiness
        self._last_pause: tuple[float, float] | None = None  # (refreshed at, paused until)
        # The last count of the ledger, for the status page: one count serves both.
        self.last_stats: LedgerStats | None = None

    async def run(self) -> None:
        # At once, not a second in: cleanup_ready (and the gauges) are right from the start.
        await self.refresh()
        last_refresh = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.finish_every_s if self.finishes() else REFRESH_S):
                    await self.settled.wait()
            self.settled.clear()
            if self.ledger.healthy:
                done = await self.ledger.finish_runs() if self.finishes() else []
                for run_id in done:
                    log.info("run %s done", run_id, extra={"run_id": run_id, "action": "run_done"})
                if done:
                    # What this run learnt about the partner is where the next one starts.
                    with contextlib.suppress(StorageError):
                        await self.budget.save()
                with contextlib.suppress(StorageError):  # waiters keep the last view
                    await self.read_watched()
                self.runs_changed.notify()
            if time.monotonic() - last_refresh >= REFRESH_S:
                last_refresh = time.monotonic()
                await self.refresh()
            await asyncio.sleep(0.1)  # coalesce bursts of settlements into one pass

    async def read_watched(self) -> None:
        """Read the runs long-polls wait on, for all their waiters: each run's row (one
        indexed read for all of them) every pass, its counts when its state changed or
        a second after the last count (the current run's come from the count below)."""
        ids = self.runs_changed.watched()
        if not ids:
            return
        runs = await self.ledger.get_runs(ids)
        stats, now = self.last_stats, time.monotonic()
        seen: dict[str, RunSeen] = {}
        for run_id, run in runs.items():
            before = self.runs_changed.seen(run_id)
            if before is not None and before.run.state is run.state and \
                    now - before.counted_at < REFRESH_S:
                seen[run_id] = RunSeen(run, before.counts, before.counted_at)
            elif stats is not None and stats.current_run is not None and \
                    stats.current_run.id == run_id and stats.current_run.state is run.state \
                    and run.state is not RunState.DONE and now - self._counted_at < REFRESH_S:
                # Not for a run just done: its waiters are answered now, and with counts
                # read after it closed (the monitor's count may predate its last settle).
                seen[run_id] = RunSeen(run, stats.current_run_by_state, self._counted_at)
            elif (found := await self.ledger.run_with_counts(run_id)) is not None:
                # The run read again with its counts, as one: a count read after the run
                # could hold an operation queued again after the run was seen done.
                seen[run_id] = RunSeen(*found, now)
        self.runs_changed.publish(seen)

    def _count_paused(self, paused_until: float) -> None:
        """Add the time since the last refresh that the pause seen then covered. A pause
        begun since counts from the next refresh: it is under-counted by at most a second,
        never over-counted (a 0.1 s backoff after a 429 must not read as a paused second).
        Wall clock, as the pause's end is; a step back counts nothing."""
        now = time.time()
        if self._last_pause is not None:
            seen_at, until = self._last_pause
            if until > seen_at:
                metrics.LIMITER_PAUSED_SECONDS.inc(max(0.0, min(now, until) - seen_at))
        self._last_pause = (now, paused_until)

    async def refresh(self) -> None:
        budget = self.budget.snapshot()
        gauges.publish_budget(budget)
        if isinstance(self.budget, TwoLimits):
            gauges.publish_items(self.budget.items.snapshot())
        self._count_paused(budget.state.paused_until)
        metrics.LEDGER_HEALTHY.set(1 if self.ledger.healthy else 0)
        metrics.QUEUE_HEALTHY.set(1 if self.queue.healthy else 0)
        self.readiness()
        if not self.finishes() and time.monotonic() - self._counted_at < FOLLOWER_COUNT_S:
            return
        self._counted_at = time.monotonic()
        # A transport that cannot report its own queue is measured by the ledger, which
        # keeps the same meaning: the oldest message that is claimable, not parked.
        q = await (self.queue.stats() if self.queue.capabilities.stats
                   else self.ledger.queue_stats())
        metrics.QUEUE_DEPTH.set(q.depth)
        metrics.QUEUE_PARKED.set(q.parked)
        metrics.QUEUE_LEASED.set(q.leased)
        metrics.QUEUE_OLDEST_AGE.set(q.oldest_claimable_age_s)
        s = self.last_stats = await self.ledger.stats()
        metrics.AMBIGUOUS.set(s.ambiguous)
        metrics.INCONCLUSIVE.set(s.inconclusive)
        run = s.current_run
        if run is None:
            return
        metrics.LAST_TICK.set(run.created_at)
        if self.digest_cutoff_s is not None:
            metrics.DIGEST_CUTOFF.set((run.scheduled_for or run.created_at) + self.digest_cutoff_s)
        counts = s.current_run_by_state
        for reason, n in count_by_reason(counts).items():
            metrics.DIGEST_EXCLUSIONS.labels(reason).set(n)
        discovered = sum(counts.values())
        unfinished = sum(n for st, n in counts.items() if st not in TERMINAL)
        metrics.RUN_DISCOVERED.set(discovered)
        metrics.RUN_UNFINISHED.set(unfinished)
        active = sum(n for st, n in counts.items() if st not in SETTLED)
        if run.state is RunState.DONE or active == 0:
            metrics.RUN_PROJECTED_FINISH.set(0)
        else:
            metrics.RUN_PROJECTED_FINISH.set(budget.projected_finish(active, time.time()))
