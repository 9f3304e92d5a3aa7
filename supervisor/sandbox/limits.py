"""Rate limiters of the simulated partner: a token bucket and a fixed one-minute window.

Both take the current time as an argument instead of reading a clock, so they are
deterministic under test and the caller decides which clock is authoritative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

# Float drift in refill arithmetic must not turn "exactly one token" into a refusal.
_EPSILON = 1e-9

MINUTE = 60.0


@dataclass(frozen=True, slots=True)
class Quota:
    """What the IETF RateLimit / RateLimit-Policy headers advertise."""

    limit: int
    window_seconds: int
    remaining: int
    reset_seconds: int


class Limiter(Protocol):
    def acquire(self, now: float) -> float | None:
        """Take one unit; None when granted, else seconds until one would be available."""

    def quota(self, now: float) -> Quota | None:
        """The current quota, or None while limiting is disabled."""

    def retune(self, rate_per_second: float, burst: float, now: float) -> None: ...


def ceil_seconds(seconds: float) -> int:
    """Whole seconds a client should wait: rounded up, never 0 (0 invites a hot retry loop)."""
    return max(1, math.ceil(seconds - _EPSILON))


class TokenBucket:
    def __init__(self, rate_per_second: float, burst: float, now: float) -> None:
        self.rate = rate_per_second
        self.burst = burst
        # Starts full: a freshly started partner accepts an initial burst.
        self.tokens = burst
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            if self.rate > 0:
                self.tokens = min(self.burst, self.tokens + (now - self._updated) * self.rate)
            self._updated = now

    def acquire(self, now: float) -> float | None:
        if self.rate <= 0:
            return None
        self._refill(now)
        if self.tokens + _EPSILON >= 1.0:
            self.tokens = max(0.0, self.tokens - 1.0)
            return None
        return (1.0 - self.tokens) / self.rate

    def quota(self, now: float) -> Quota | None:
        if self.rate <= 0:
            return None
        self._refill(now)
        # The window of a bucket is the time it takes to refill completely (at least 1 s);
        # its quota is what the refill rate grants in that window, not the burst.
        window = max(1, math.ceil(self.burst / self.rate - _EPSILON))
        return Quota(
            limit=max(1, math.floor(self.rate * window + _EPSILON)),
            window_seconds=window,
            remaining=max(0, math.floor(self.tokens + _EPSILON)),
            reset_seconds=max(0, math.ceil((self.burst - self.tokens) / self.rate - _EPSILON)),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        # Settle what was earned under the old rate before switching.
        self._refill(now)
        was_unlimited = self.rate <= 0
        self.rate = rate_per_second
        self.burst = burst
        self.tokens = burst if was_unlimited else min(self.tokens, burst)
        self._updated = now


class FixedWindow:
    """Counts requests per fixed minute, aligned to the limiter's creation time."""

    def __init__(self, rate_per_second: float, now: float) -> None:
        self.rate = rate_per_second
        self._origin = now
        self._index = 0
        self.count = 0

    @property
    def limit(self) -> int:
        return max(1, math.floor(self.rate * MINUTE + _EPSILON))

    def _roll(self, now: float) -> float:
        index = max(0, math.floor((now - self._origin) / MINUTE))
        if index != self._index:
            self._index = index
            self.count = 0
        return self._origin + (index + 1) * MINUTE - now

    def acquire(self, now: float) -> float | None:
        if self.rate <= 0:
            return None
        until_reset = self._roll(now)
        if self.count < self.limit:
            self.count += 1
            return None
        return until_reset

    def quota(self, now: float) -> Quota | None:
        if self.rate <= 0:
            return None
        until_reset = self._roll(now)
        return Quota(
            limit=self.limit,
            window_seconds=int(MINUTE),
            remaining=max(0, self.limit - self.count),
            reset_seconds=ceil_seconds(until_reset),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        self._roll(now)
        self.rate = rate_per_second


def make_limiter(window: str, rate_per_second: float, burst: float, now: float) -> Limiter:
    if window == "minute":
        return FixedWindow(rate_per_second, now)
    return TokenBucket(rate_per_second, burst, now)
