"""Precise dispatch: when each request of one process may leave, on time within 0.5 ms (p99).

A GCRA (virtual scheduling) on the monotonic clock: the *theoretical arrival time* of the
next request advances by one interval per request, and a request may leave once the clock
is past it less the tolerance. Tolerant pacing (tolerance ``(burst - 1) / rate``) keeps an
absolute schedule: a late wake-up is made up by the next requests, so the average is the
rate. Strict pacing (tolerance 0) schedules each request one interval after the previous
one was granted, so no two are ever closer than the interval: a partner's bucket of one
token refuses any request that arrives early by a millisecond.

A grant is not a departure: between the two a worker checks with the ledger that its
attempt is still its own and aiohttp takes a pooled connection: 0.4 ms at the least, 0.7
usually, up to 4.6 on a quiet host (behind nginx at 20/s). A request that leaves late lets
the next one, granted on time, reach the partner early (gaps of 48.1 ms at nginx's 50).
So strict pacing also counts the next interval from when the last request actually left
(its headers written: :meth:`Pacer.departed`),
less the shortest delay between a grant and its departure seen lately: the spacing at the
partner gains only the delay beyond the usual, not the usual delay.

Why not aiolimiter: its leak is counted on the event loop's clock, which uvloop caches at
each iteration to the millisecond, and its waiters wake by that loop's millisecond timers.
A grant computed on a stale clock can leave closer than the interval to the one before it
(a bucket of one refuses it), and every wake-up is late by up to a millisecond (5 % at
50/s). Here the waiter sleeps until just before its time and spins the last fraction of a
millisecond (``SPIN_S``); the cost is measured by ``bench/pacing_cpu.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable

# Sleep until this long before a departure (less how late the loop's timers have been
# waking: learnt), then spin. Measured at 100/s (bench/pacing_cpu.py): spinning 0.3 ms
# without learning the timers' lateness left departures 0.37 ms late (p50); 0.6 ms, on
# time for 9.5 % of a core; 0.15 ms after the learnt lateness, on time (p50 0.001 ms)
# for 6.1 %, of which the spin is 1 % (aiolimiter alone: 8.0 %, 1 ms late).
SPIN_S = 0.00015
# How fast the estimate of the timers' lateness follows the latest one, and its bound.
OVERSLEEP_ALPHA = 0.2
MAX_OVERSLEEP_S = 0.0005
# The shortest of this many recent grant-to-departure delays is the one a departure is
# taken to have had anyway (see the module's docstring).
DELAY_SAMPLES = 64


def _interval(rate: float) -> float:
    # An unbounded rate (no limit configured) paces nothing.
    return 1.0 / rate if math.isfinite(rate) and rate > 0 else 0.0


class Pacer:
    """Departures at ``rate`` per second, ``tolerance_s`` of catch-up after late ones.

    One departure is computed at a time, in arrival order (a fair lock), so a batch that
    takes several tokens leaves as that many requests in a row would.
    """

    def __init__(self, rate: float, tolerance_s: float,
                 clock: Callable[[], float] = time.monotonic, spin_s: float = SPIN_S) -> None:
        self._interval = _interval(rate)
        self._tolerance = tolerance_s
        self._clock = clock
        self._tat: float | None = None  # None: nothing sent yet, the burst is whole
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._sleeper = PreciseSleep(clock, spin_s)
        self._granted: float | None = None  # the last grant
        self._delays: deque[float] = deque(maxlen=DELAY_SAMPLES)

    @property
    def interval(self) -> float:
        return self._interval

    def tune(self, rate: float, tolerance_s: float, empty: bool = False) -> None:
        """A new rate for the waiters already queued too. What is owed stays owed (in
        requests, not in seconds); ``empty`` leaves no catch-up, so the next departure
        waits a whole interval."""
        now = self._clock()
        interval = _interval(rate)
        if empty:
            self._tat = now + interval + tolerance_s
        elif self._tat is not None:
            # The requests the schedule is ahead by, at the new interval.
            owed = (self._tat - now) / self._interval if self._interval else 0.0
            self._tat = now + owed * interval
        self._interval, self._tolerance = interval, tolerance_s
        self._changed.set()
        self._changed = asyncio.Event()

    async def take(self, cost: int = 1) -> float:
        """Wait until ``cost`` requests' worth may leave; return the departure (clock)."""
        async with self._lock:
            # After an idle spell the schedule starts now: what was not used is not owed
            # (a batch must not leave at once for the tokens an idle second earned).
            start = self._clock()
            if self._tat is None or self._tat < start:
                self._tat = start
            while True:
                now = self._clock()
                tat = self._tat
                # A batch leaves when the last of its tokens conforms.
                at = tat + (max(1, cost) - 1) * self._interval - self._tolerance
                if at <= now:
                    break
                await self._until(at)
            self._tat = max(tat + (max(1, cost) - 1) * self._interval, now) + self._interval
            self._granted = now
            return now

    def departed(self) -> None:
        """The request granted last has just left (its headers are being written). Under
        strict pacing the next may leave no sooner than an interval after this, less the
        shortest grant-to-departure delay seen lately (it will have one too)."""
        now = self._clock()
        if self._granted is None or now < self._granted:
            return
        # Paired with the last grant: a request that left after a later one was granted
        # looks quicker than it was, which only makes the usual delay shorter (safe).
        self._delays.append(now - self._granted)
        if self._tolerance == 0 and self._interval and self._tat is not None:
            self._tat = max(self._tat, now - min(self._delays) + self._interval)

    async def _until(self, at: float) -> None:
        """Until ``at``, or until the pace changes."""
        await self._sleeper.until(at, self._changed)

    @staticmethod
    def tolerance(rate: float, burst: float, strict: bool) -> float:
        """The catch-up a bucket of ``burst`` allows at ``rate`` (none when strict)."""
        if strict or not math.isfinite(rate) or rate <= 0:
            return 0.0
        return max(0.0, burst - 1.0) / rate


class PreciseSleep:
    """Sleeps that end on time: until ``SPIN_S`` before the deadline less how late the
    loop's timers have been waking (learnt), then a spin. Used by the pacer and by the
    replicas' slot waits (:mod:`supervisor.postgres.budget_slots`)."""

    def __init__(self, clock: Callable[[], float], spin_s: float = SPIN_S) -> None:
        self._clock = clock
        self._spin = spin_s
        self._oversleep = 0.0  # how late a sleep has been waking, as expected

    async def until(self, at: float, woken: asyncio.Event) -> bool:
        """Sleep, then spin, until ``at`` (``clock``); True when ``woken`` was set first."""
        wake = at - self._spin - self._oversleep
        if (delay := wake - self._clock()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await woken.wait()
                    return True
            late = min(MAX_OVERSLEEP_S, max(0.0, self._clock() - wake))
            self._oversleep += OVERSLEEP_ALPHA * (late - self._oversleep)
        spin_end = self._clock() + 2 * self._spin + MAX_OVERSLEEP_S
        # Spin only the last fraction: a wake-up far too early (a clock jump) sleeps again.
        while (now := self._clock()) < at and now < spin_end:
            if woken.is_set():
                return True
        return woken.is_set()
