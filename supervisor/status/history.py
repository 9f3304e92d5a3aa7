"""What the status page's chart draws: the limiter sampled in this process, kept in memory.

A ring buffer of readings, one every ``interval_s``: the limiter's rate, its ceiling,
whether a ``Retry-After`` pause holds every worker, and two running totals (429 answers,
operations settled) from which :meth:`History.series` derives rates per bucket. Nothing is
written anywhere: a restart starts an empty chart, and with replicas each process charts
its own 429s and settlements (the rate and ceiling are the shared budget's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from supervisor import metrics

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
# Three hours at one a second: the article's run drains in 16 minutes.
CAPACITY = 3 * 3600
# What one answer to the page carries at most; longer spans are averaged into buckets.
MAX_POINTS = 240
COMPLETED = ("deleted", "already_absent", "failed")


@dataclass(frozen=True, slots=True)
class Reading:
    rate: float
    ceiling: float
    paused: bool
    throttled: float  # 429 answers so far (a running total)
    completed: float  # operations settled so far (a running total)


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    reading: Reading


def counter_total(counter: Counter, **labels: str) -> float:
    """The sum of a counter's ``_total`` samples whose labels include ``labels``."""
    total = 0.0
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def metrics_reader(rate: Callable[[], float], ceiling: float,
                   clock: Callable[[], float] = time.time) -> Callable[[], Reading]:
    """A reading from the budget's rate and this process's metrics (the monitor refreshes
    the pause gauge every second)."""

    def read() -> Reading:
        paused_until = max((s.value for family in metrics.LIMITER_PAUSED_UNTIL.collect()
                            for s in family.samples), default=0.0)
        return Reading(
            rate=rate(), ceiling=ceiling, paused=paused_until > clock(),
            throttled=counter_total(metrics.PARTNER_RESPONSES, status="429"),
            completed=sum(counter_total(metrics.OPERATIONS, outcome=o) for o in COMPLETED))

    return read


class History:
    def __init__(self, read: Callable[[], Reading], interval_s: float = INTERVAL_S,
                 capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self.read = read
        self.interval_s = interval_s
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=capacity)

    def sample(self) -> Sample:
        s = Sample(self.clock(), self.read())
        self.samples.append(s)
        return s

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled. A failed reading is logged and
        skipped: a gap in the chart, never a stopped sampler."""
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("status history: a reading failed", extra={"action": "status_sample"})
            await asyncio.sleep(self.interval_s)

    def series(self, since: float, until: float | None = None,
               max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
        """The samples from ``since`` to ``until`` as at most ``max_points`` points, each
        ``{t, rate, ceiling, paused, throughput, throttled_per_min}``: rate and ceiling
        are the bucket's mean and highest, throughput (settled/s) and 429s per minute are
        measured across the bucket from the sample just before it."""
        window: list[Sample] = []
        before: Sample | None = None
        for s in self.samples:
            if s.t < since:
                before = s
            elif until is None or s.t <= until:
                window.append(s)
        if not window:
            return []
        size = max(1, math.ceil(len(window) / max_points))
        points = []
        start = before or window[0]
        for i in range(0, len(window), size):
            bucket = window[i:i + size]
            end = bucket[-1]
            span = end.t - start.t
            if span > 0:
                throughput = max(0.0, end.reading.completed - start.reading.completed) / span
                throttled = max(0.0, end.reading.throttled - start.reading.throttled) / span * 60
            else:
                throughput = throttled = 0.0
            points.append({
                "t": end.t,
                "rate": sum(s.reading.rate for s in bucket) / len(bucket),
                "ceiling": max(s.reading.ceiling for s in bucket),
                "paused": any(s.reading.paused for s in bucket),
                "throughput": throughput, "throttled_per_min": throttled})
            start = end
        return points
