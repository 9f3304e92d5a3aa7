"""How many requests may be in flight: a gradient limit in the manner of Netflix's
concurrency-limits Gradient2, bounded below by Little's law and above by configuration.

Pure (no clock, no asyncio): fed one latency sample per answer.

* ``long`` is the partner's usual latency (a slow average), ``short`` its latency now (a
  fast one). When ``short`` climbs above ``long`` x tolerance, requests are queueing at the
  partner: the limit shrinks by the ratio, so a partner whose latency climbs from 20 ms to
  2 s under load is not pushed into timeouts. While they agree, the limit grows by
  ``queue`` per sample towards the configured maximum.
* It never drops below what the rate needs at the partner's unloaded latency (rate x
  ``base`` + 1, Little's law): a slow but healthy partner still gets its full rate.
  ``base`` follows a faster partner at once and a slower one only 1 % per answer, so a
  latency that climbs *because* of the load does not raise the floor with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOLERANCE = 1.5
SMOOTHING = 0.2
SHORT_ALPHA = 0.1  # about the last 10 answers
LONG_ALPHA = 0.01  # about the last 100 answers
MIN_SAMPLES = 10
BASE_RISE = 1.01


@dataclass(slots=True)
class GradientLimit:
    maximum: int
    limit: float = 0.0
    short: float | None = None
    long: float | None = None
    base: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        if not self.limit:
            self.limit = float(self.maximum)

    @property
    def value(self) -> int:
        return max(1, min(self.maximum, math.floor(self.limit)))

    def sample(self, latency_s: float, rate: float, in_flight: int) -> None:
        if not latency_s >= 0 or not math.isfinite(latency_s):
            return
        self.samples += 1
        self.short = latency_s if self.short is None else (
            self.short + SHORT_ALPHA * (latency_s - self.short))
        self.long = latency_s if self.long is None else (
            self.long + LONG_ALPHA * (latency_s - self.long))
        self.base = latency_s if self.base is None else min(latency_s, self.base * BASE_RISE)
        if self.samples < MIN_SAMPLES:
            return
        if self.long > 2 * self.short:
            # The partner got faster again: let the baseline follow it down quickly.
            self.long *= 0.95
        gradient = max(0.5, min(1.0, TOLERANCE * self.long / max(self.short, 1e-6)))
        # Grow only while the limit is used: an idle pool proves nothing about more.
        queue = math.sqrt(self.limit) if in_flight * 2 >= self.limit else 0.0
        target = self.limit * gradient + queue
        self.limit += SMOOTHING * (target - self.limit)
        floor = rate * self.base + 1.0
        self.limit = max(1.0, min(float(self.maximum), max(self.limit, floor)))
