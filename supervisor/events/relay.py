"""The relay: one worker per sink, each with its own cursor in the ledger, plus housekeeping.

A worker reads the outbox past its cursor (a range read on the primary key), delivers the
batch, and only then moves its cursor: at least once, in order. A failed batch is tried
again, unchanged, after a capped and jittered backoff; meanwhile the worker holds nothing
anyone else waits for. Settlements only ever write rows, so deletions never wait on a sink,
and every sink runs as its own supervised component, so one that is down delays only
itself. After a restart a worker resumes at its stored cursor: what it had acknowledged is
not sent again, at most the batch that was in the air.

Housekeeping refreshes each sink's lag (events, and the age of the oldest it has not
taken) and prunes what every configured sink has taken, in bounded batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence

from supervisor import metrics
from supervisor.events.settings import EventsConfig
from supervisor.events.sinks import Sink, SinkError
from supervisor.ledger.base import EventOutbox
from supervisor.lifecycle import Component, Drain
from supervisor.model import Event

log = logging.getLogger(__name__)

REFRESH_S = 1.0
# A pass prunes at most this many batches; the rest waits for the next pass, so pruning a
# long backlog never monopolises the ledger's writer.
PRUNE_BATCHES_PER_PASS = 10
# While a sink stays down, say so again this often (the first failure is said at once).
STILL_FAILING_LOG_S = 300.0


class SinkWorker:
    def __init__(self, sink: Sink, outbox: EventOutbox, config: EventsConfig,
                 batch_size: int, rng: Callable[[], float] = random.random) -> None:
        self.sink = sink
        self.outbox = outbox
        self.config = config
        self.batch_size = batch_size
        self.rng = rng
        self.cursor: int | None = None  # the last acknowledged event, once loaded
        self.failures = 0  # consecutive failed deliveries
        self.wakeup = asyncio.Event()
        self._failing_since: float | None = None
        self._said_at = 0.0

    @property
    def name(self) -> str:
        return self.sink.name

    async def run(self) -> None:
        # The stored cursor, read afresh at every (re)start: the ledger is truth.
        cursor = self.cursor = await self.outbox.event_cursor(self.name)
        pending: list[Event] = []
        while True:
            if not pending:
                self.wakeup.clear()  # before the read: a settlement meanwhile wakes us
                pending = await self.outbox.events_after(cursor, self.batch_size)
                if not pending:
                    await self._idle()
                    continue
            try:
                taken = await self.sink.deliver(pending)
            except SinkError as exc:
                await asyncio.sleep(self._failed(exc, pending))  # a backoff
                continue  # the same batch again: the same body, the same key
            cursor = pending[taken - 1].seq
            await self.outbox.save_event_cursor(self.name, cursor)
            self.cursor = cursor
            metrics.EVENTS_DELIVERED.labels(self.name).inc(taken)
            pending = pending[taken:]
            self._delivered()

    async def _idle(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.poll_interval_seconds):
                await self.wakeup.wait()

    def backoff(self, retry_after_s: float | None) -> float:
        """Seconds before the next try: the receiver's Retry-After as given (not jittered;
        at least the initial backoff, at most the cap), else our own doubling backoff,
        capped, with jitter over its upper half."""
        cap = self.config.backoff_max_seconds
        if retry_after_s is not None:
            return min(max(retry_after_s, self.config.backoff_initial_seconds), cap)
        ceiling = min(cap, self.config.backoff_initial_seconds * 2.0 ** min(self.failures - 1, 30))
        return ceiling / 2 + self.rng() * ceiling / 2

    def _failed(self, exc: SinkError, batch: Sequence[Event]) -> float:
        self.failures += 1
        metrics.EVENTS_FAILURES.labels(self.name).inc()
        delay = self.backoff(exc.retry_after_s)
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = self._said_at = now
            log.warning("events sink %s failed: %s; trying again in %.1fs (only this sink "
                        "waits; %d events from %s)", self.name, exc, delay, len(batch),
                        batch[0].id, extra={"action": "events_sink_failing", "sink": self.name})
        elif now - self._said_at >= STILL_FAILING_LOG_S:
            self._said_at = now
            log.warning("events sink %s still failing after %d tries over %.0fs: %s",
                        self.name, self.failures, now - self._failing_since, exc,
                        extra={"action": "events_sink_failing", "sink": self.name})
        else:
            log.debug("events sink %s failed (%d): %s", self.name, self.failures, exc)
        return delay

    def _delivered(self) -> None:
        if self._failing_since is not None:
            log.info("events sink %s delivering again after %d failed tries over %.1fs",
                     self.name, self.failures, time.monotonic() - self._failing_since,
                     extra={"action": "events_sink_recovered", "sink": self.name})
            self._failing_since = None
        self.failures = 0


class EventRelay:
    """Every configured sink's worker, and the housekeeping component."""

    def __init__(self, config: EventsConfig, outbox: EventOutbox, sinks: Sequence[Sink],
                 refresh_s: float = REFRESH_S) -> None:
        self.config = config
        self.outbox = outbox
        self.refresh_s = refresh_s
        sizes = {s.name: s.batch_size for s in config.sink}
        self.workers = [SinkWorker(s, outbox, config, sizes.get(s.name, 100)) for s in sinks]
        self._started: list[Sink] = []

    def components(self) -> list[Component]:
        """The housekeeping and one worker per sink, stopped last: undelivered events wait
        in the outbox for the next life, but what settles during the drain goes out."""
        return [Component("events", self.run, Drain.LAST, role="events")] + \
            [Component(f"events:{w.name}", w.run, Drain.LAST, role=f"events:{w.name}")
             for w in self.workers]

    async def start(self) -> None:
        for w in self.workers:
            await w.sink.start()
            self._started.append(w.sink)
            # The series exist from the start: a rate() or an alert sees a sink at zero.
            metrics.EVENTS_DELIVERED.labels(w.name)
            metrics.EVENTS_FAILURES.labels(w.name)
            metrics.EVENTS_LAG.labels(w.name).set(0)
            metrics.EVENTS_LAG_SECONDS.labels(w.name).set(0)

    async def close(self) -> None:
        for sink in self._started:
            with contextlib.suppress(Exception):
                await sink.close()
        self._started.clear()

    def notify(self) -> None:
        """Something settled: every idle worker looks at the outbox now."""
        for w in self.workers:
            w.wakeup.set()

    async def run(self) -> None:
        """Housekeeping: lag gauges every ``refresh_s``, pruning every prune interval."""
        last_prune = time.monotonic()
        while True:
            await self.refresh()
            if time.monotonic() - last_prune >= self.config.prune_interval_seconds:
                last_prune = time.monotonic()
                await self.prune()
            await asyncio.sleep(self.refresh_s)  # a refresh period

    async def refresh(self) -> None:
        now = time.time()
        for w in self.workers:
            cursor = w.cursor if w.cursor is not None else await self.outbox.event_cursor(w.name)
            backlog = await self.outbox.event_backlog(cursor)
            metrics.EVENTS_LAG.labels(w.name).set(backlog.events)
            age = now - backlog.oldest_at if backlog.oldest_at is not None else 0.0
            metrics.EVENTS_LAG_SECONDS.labels(w.name).set(max(0.0, age))

    async def prune(self) -> int:
        """Delete what every configured sink has taken and is past retention, in batches."""
        names = [s.name for s in self.config.sink]
        before = time.time() - self.config.retain_seconds
        pruned = 0
        for _ in range(PRUNE_BATCHES_PER_PASS):
            n = await self.outbox.prune_events(names, before, self.config.prune_batch)
            pruned += n
            if n < self.config.prune_batch:
                break
        if pruned:
            metrics.EVENTS_PRUNED.inc(pruned)
            log.debug("pruned %d delivered events", pruned)
        return pruned
