"""How many requests may be in flight: a gradient limit in the manner of Netflix's
concurrency-limits Gradient2, bounded by the request timeout and by configuration.

Pure (no clock, no asyncio): fed one latency sample per answer.

* ``long`` is the partner's usual latency (a slow average), ``short`` its latency now (a
  fast one). When ``short`` climbs above ``long`` x tolerance, requests are queueing at the
  partner: the limit shrinks by the ratio. While they agree, and the limit is in use, it
  grows by ``sqrt(limit)`` per sample, so a slow but healthy partner (500 ms every time)
  soon gets as many requests in flight as its full rate needs (Little's law).
* Latency is never let near the request timeout: once ``short`` passes half of it the
  limit shrinks in proportion, so a partner whose latency climbs from 20 ms to 2 s under
  load is not pushed into timeouts (each of which would be an ambiguous attempt).
* It starts small (``INITIAL``) and never exceeds ``limits.concurrency``; it changes at
  most once per ``limit`` answers, so it sees the effect of one change before the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOLERANCE = 1.5
SMOOTHING = 0.2
SHORT_ALPHA = 0.1  # about the last 10 answers
LONG_ALPHA = 0.01  # about the last 100 answers
MIN_SAMPLES = 10
INITIAL = 4.0
# Keep the latency now under this share of the request timeout.
TIMEOUT_SHARE = 0.5


@dataclass(slots=True)
class GradientLimit:
    maximum: int
    timeout_s: float = math.inf
    limit: float = 0.0
    short: float | None = None
    long: float | None = None
    samples: int = 0
    _since_update: int = 0

    def __post_init__(self) -> None:
        if not self.limit:
            self.limit = min(float(self.maximum), INITIAL)

    @property
    def value(self) -> int:
        return max(1, min(self.maximum, math.floor(self.limit)))

    def bounds(self, rate: float) -> bool:
        """Whether the configured maximum, reached, is what holds ``rate`` back: at the
        usual latency the rate needs more in flight (Little's law). A gradient limit below
        the maximum is the partner's latency speaking, not the configuration."""
        return (self.long is not None and self.value >= self.maximum
                and rate * self.long > self.maximum)

    def sample(self, latency_s: float, in_flight: int) -> None:
        if not latency_s >= 0 or not math.isfinite(latency_s):
            return
        self.samples += 1
        self.short = latency_s if self.short is None else (
            self.short + SHORT_ALPHA * (latency_s - self.short))
        self.long = latency_s if self.long is None else (
            self.long + LONG_ALPHA * (latency_s - self.long))
        self._since_update += 1
        # One change per window of ``limit`` answers (about one round trip of the pool):
        # the answers that show a change's effect come back a latency later.
        if self.samples < MIN_SAMPLES or self._since_update < self.limit:
            return
        self._since_update = 0
        if self.long > 2 * self.short:
            # The partner got faster again: let the baseline follow it down quickly.
            self.long *= 0.95
        short = max(self.short, 1e-6)
        near_timeout = TIMEOUT_SHARE * self.timeout_s / short
        gradient = max(0.5, min(1.0, TOLERANCE * self.long / short))
        # Grow only while the limit is used: an idle pool proves nothing about more.
        queue = math.sqrt(self.limit) if in_flight * 2 >= self.limit and gradient >= 1 else 0.0
        target = self.limit * gradient + queue
        if near_timeout < 1:
            # Past half the timeout: shrink at once, in proportion; the next answers
            # would be timeouts, and every timeout is an ambiguous attempt.
            self.limit *= max(0.5, near_timeout)
        elif target > self.limit:
            self.limit = target  # a whole step: the window already waited a round trip
        else:
            # Shrink smoothly, so one slow answer does not halve the pool.
            self.limit += SMOOTHING * (target - self.limit)
        self.limit = max(1.0, min(float(self.maximum), self.limit))
