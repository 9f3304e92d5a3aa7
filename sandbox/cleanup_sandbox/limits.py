"""Rate limiters of the simulated partner, one per limiter shape real APIs use.

* ``bucket``: a token bucket (the classic "burst then a steady rate").
* ``gcra``: the strict leaky bucket / GCRA of API gateways, at integer milliseconds.
* ``sliding``: a sliding log, at most N requests in any trailing window.
* ``second`` / ``minute``: fixed windows aligned to the limiter's creation.

Every limiter takes the current time as an argument instead of reading a clock, so it is
deterministic under test and the caller decides which clock is authoritative. ``peek``
never consumes, so several limiters (the rate limiter and the quotas) can all be asked
before any of them is charged: a request refused by one must cost nothing in the others.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

# Float drift in refill arithmetic must not turn "exactly one token" into a refusal.
_EPSILON = 1e-9
# Far enough ahead that every limiter and quota has refilled or rolled over.
_FAR_FUTURE_S = 1e9

SECOND = 1.0
MINUTE = 60.0


@dataclass(frozen=True, slots=True)
class Quota:
    """One policy as the RateLimit / X-RateLimit headers advertise it."""

    limit: int
    window_seconds: int
    remaining: int
    reset_seconds: int


class Limiter(Protocol):
    def peek(self, now: float) -> float | None:
        """None when one unit could be taken now, else seconds until one could; takes nothing."""

    def commit(self, now: float) -> None:
        """Take the unit a preceding ``peek(now)`` found available."""

    def acquire(self, now: float) -> float | None:
        """Take one unit; None when granted, else seconds until one would be available."""

    def quota(self, now: float) -> Quota | None:
        """The current quota, or None while limiting is disabled."""

    def retune(self, rate_per_second: float, burst: float, now: float) -> None: ...


def ceil_seconds(seconds: float) -> int:
    """Whole seconds a client should wait: rounded up, never 0 (0 invites a hot retry loop)."""
    return max(1, math.ceil(seconds - _EPSILON))


def _reset_seconds(seconds: float) -> int:
    # Unlike a Retry-After, a reset of 0 is meaningful ("nothing to wait for").
    return max(0, math.ceil(seconds - _EPSILON))


class _PeekThenCommit:
    """acquire() in terms of peek() and commit(), so the two can never disagree."""

    def peek(self, now: float) -> float | None:
        raise NotImplementedError

    def commit(self, now: float) -> None:
        raise NotImplementedError

    def acquire(self, now: float) -> float | None:
        wait = self.peek(now)
        if wait is None:
            self.commit(now)
        return wait


class TokenBucket(_PeekThenCommit):
    def __init__(self, rate_per_second: float, burst: float, now: float) -> None:
        self.rate = rate_per_second
        self.burst = burst
        # Starts full: a freshly started partner accepts an initial burst.
        self.tokens = burst
        self._updated = now

    def _refill(self, now: float) -> None:
        # Settling the refill early changes nothing observable, so peek() may call it.
        if now > self._updated:
            if self.rate > 0:
                self.tokens = min(self.burst, self.tokens + (now - self._updated) * self.rate)
            self._updated = now

    def peek(self, now: float) -> float | None:
        if self.rate <= 0:
            return None
        self._refill(now)
        if self.tokens + _EPSILON >= 1.0:
            return None
        return (1.0 - self.tokens) / self.rate

    def commit(self, now: float) -> None:
        if self.rate <= 0:
            return
        self._refill(now)
        self.tokens = max(0.0, self.tokens - 1.0)

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
            reset_seconds=_reset_seconds((self.burst - self.tokens) / self.rate),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        # Settle what was earned under the old rate before switching.
        self._refill(now)
        was_unlimited = self.rate <= 0
        self.rate = rate_per_second
        self.burst = burst
        self.tokens = burst if was_unlimited else min(self.tokens, burst)
        self._updated = now


def to_millis(now: float) -> int:
    # Gateways see an integer-millisecond clock. The nanosecond added before flooring only
    # undoes binary rounding of decimal seconds (1.001 * 1000 == 1000.9999...), it forgives
    # nothing a real millisecond clock would not.
    return math.floor(now * 1000.0 + 1e-6)


_NS_PER_MS = 1_000_000
_NS_PER_S = 1_000_000_000


class Gcra(_PeekThenCommit):
    """Generic cell rate algorithm: a strict leaky bucket with no float forgiveness.

    TAT is the theoretical arrival time of the next conforming request; a request at t
    (whole milliseconds) conforms iff t >= TAT - tau. Unlike the token bucket there is no
    epsilon: a client pacing at exactly the rate but 1 ms early is refused, as gateways do.
    TAT and tau are kept in integer nanoseconds so that long runs accumulate no float drift
    that would turn an exactly-on-time request into a refusal.
    """

    def __init__(self, rate_per_second: float, burst: float, now: float) -> None:
        self.rate = rate_per_second
        self.burst = burst
        # None = no request yet, i.e. the whole burst is available.
        self._tat_ns: int | None = None

    @property
    def interval_ns(self) -> int:
        return max(1, round(_NS_PER_S / self.rate))

    @property
    def tolerance_ns(self) -> int:
        return round((self.burst - 1.0) * _NS_PER_S / self.rate)

    def _tat(self, t_ns: int) -> int:
        return t_ns if self._tat_ns is None else self._tat_ns

    def peek(self, now: float) -> float | None:
        if self.rate <= 0:
            return None
        t_ns = to_millis(now) * _NS_PER_MS
        earliest = self._tat(t_ns) - self.tolerance_ns
        if t_ns >= earliest:
            return None
        return (earliest - t_ns) / _NS_PER_S

    def commit(self, now: float) -> None:
        if self.rate <= 0:
            return
        t_ns = to_millis(now) * _NS_PER_MS
        self._tat_ns = max(self._tat(t_ns), t_ns) + self.interval_ns

    def _used(self, t_ns: int) -> float:
        """Units of the burst currently in use (0 = the whole burst is available)."""
        return max(0, self._tat(t_ns) - t_ns) / self.interval_ns

    def quota(self, now: float) -> Quota | None:
        if self.rate <= 0:
            return None
        t_ns = to_millis(now) * _NS_PER_MS
        # The same figures a token bucket of this rate and burst would advertise.
        window = max(1, math.ceil(self.burst / self.rate - _EPSILON))
        return Quota(
            limit=max(1, math.floor(self.rate * window + _EPSILON)),
            window_seconds=window,
            remaining=max(0, math.floor(self.burst - self._used(t_ns) + _EPSILON)),
            reset_seconds=_reset_seconds(max(0, self._tat(t_ns) - t_ns) / _NS_PER_S),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        t_ns = to_millis(now) * _NS_PER_MS
        # Keep the burst units in use rather than the TAT itself: the backlog a client built
        # up then drains at the new rate, as the token bucket's retained tokens do.
        used = 0.0 if self.rate <= 0 or self._tat_ns is None else min(self._used(t_ns), burst)
        self.rate = rate_per_second
        self.burst = burst
        if rate_per_second <= 0 or used <= 0:
            self._tat_ns = None
        else:
            self._tat_ns = t_ns + round(used * self.interval_ns)


class SlidingLog(_PeekThenCommit):
    """At most floor(rate * window) admitted requests in any trailing window."""

    def __init__(self, rate_per_second: float, now: float, window_seconds: float = SECOND) -> None:
        self.rate = rate_per_second
        self.window = window_seconds
        self._admitted: deque[float] = deque()

    @property
    def limit(self) -> int:
        return max(1, math.floor(self.rate * self.window + _EPSILON))

    def _expire(self, now: float) -> None:
        # An entry exactly one window old has left it (the window is (now - w, now]);
        # the epsilon keeps float subtraction from keeping it a hair longer.
        horizon = now - self.window + _EPSILON
        admitted = self._admitted
        while admitted and admitted[0] <= horizon:
            admitted.popleft()

    def peek(self, now: float) -> float | None:
        if self.rate <= 0:
            return None
        self._expire(now)
        excess = len(self._admitted) - self.limit
        if excess < 0:
            return None
        # After a retune downwards the window may hold more than `limit`: then the
        # `excess + 1` oldest must all leave before one more fits.
        return max(0.0, self._admitted[excess] + self.window - now)

    def commit(self, now: float) -> None:
        if self.rate <= 0:
            return
        self._admitted.append(now)

    def quota(self, now: float) -> Quota | None:
        if self.rate <= 0:
            return None
        self._expire(now)
        in_window = len(self._admitted)
        # A sliding log never resets as a whole; "reset" is when the next unit frees up,
        # which is what a client that ran out should wait for.
        reset = self._admitted[0] + self.window - now if in_window else 0.0
        return Quota(
            limit=self.limit,
            # The headers carry whole seconds; rounding a fractional window up understates
            # the rate, which errs on the side of a client pacing too slowly.
            window_seconds=max(1, math.ceil(self.window - _EPSILON)),
            remaining=max(0, self.limit - in_window),
            reset_seconds=_reset_seconds(reset),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        # The log is what was admitted, whatever the limit was; only the limit changes.
        self._expire(now)
        self.rate = rate_per_second


class CountingWindow(_PeekThenCommit):
    """A fixed limit per fixed window, windows aligned to ``origin``."""

    def __init__(self, limit: int, window_seconds: float, origin: float) -> None:
        self._limit = limit
        self.window = window_seconds
        self._origin = origin
        self._index = 0
        self.count = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def enabled(self) -> bool:
        return True

    def _roll(self, now: float) -> float:
        """Seconds until the current window ends; starts a fresh count in a new window."""
        # The epsilon makes a request at origin + k * window (computed in floats) land in
        # window k, not a hair before it in window k - 1.
        index = max(0, math.floor((now - self._origin) / self.window + _EPSILON))
        if index != self._index:
            self._index = index
            self.count = 0
        return self._origin + (index + 1) * self.window - now

    def peek(self, now: float) -> float | None:
        if not self.enabled:
            return None
        until_reset = self._roll(now)
        if self.count < self.limit:
            return None
        return until_reset

    def commit(self, now: float) -> None:
        if not self.enabled:
            return
        self._roll(now)
        self.count += 1

    def quota(self, now: float) -> Quota | None:
        if not self.enabled:
            return None
        until_reset = self._roll(now)
        return Quota(
            limit=self.limit,
            window_seconds=max(1, math.ceil(self.window - _EPSILON)),
            remaining=max(0, self.limit - self.count),
            reset_seconds=ceil_seconds(until_reset),
        )

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        # A quota is contractual: the control endpoint's rate does not move it.
        self._roll(now)


class FixedWindow(CountingWindow):
    """Counts requests per fixed window (a minute by default) with a limit of rate * window."""

    def __init__(self, rate_per_second: float, now: float, window_seconds: float = MINUTE) -> None:
        super().__init__(0, window_seconds, now)
        self.rate = rate_per_second

    @property
    def limit(self) -> int:
        return max(1, math.floor(self.rate * self.window + _EPSILON))

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def retune(self, rate_per_second: float, burst: float, now: float) -> None:
        # The count so far stands: lowering the rate mid-window may leave it already over.
        self._roll(now)
        self.rate = rate_per_second


def make_limiter(
    window: str,
    rate_per_second: float,
    burst: float,
    now: float,
    window_seconds: float = SECOND,
) -> Limiter:
    if window == "minute":
        return FixedWindow(rate_per_second, now, MINUTE)
    if window == "second":
        return FixedWindow(rate_per_second, now, SECOND)
    if window == "gcra":
        return Gcra(rate_per_second, burst, now)
    if window == "sliding":
        return SlidingLog(rate_per_second, now, window_seconds)
    return TokenBucket(rate_per_second, burst, now)


class _Units(Protocol):
    def peek(self, now: float) -> float | None: ...

    def commit(self, now: float) -> None: ...


def wait_for_units(limiter: _Units, now: float, units: int) -> float | None:
    """Seconds until ``units`` could be taken together, None when now; takes nothing.

    Limiters answer for one unit, so a copy takes them one by one, each as soon as it is
    free: the last one's time is when all were free together, provided the limiter can
    hold that many at all (:func:`can_hold`).
    """
    if units <= 1:
        return limiter.peek(now)
    trial = copy.deepcopy(limiter)
    at = now
    for _ in range(units):
        wait = trial.peek(at)
        if wait is not None:
            at += wait
        trial.commit(at)
    return None if at == now else at - now


def can_hold(limiter: _Units, now: float, units: int) -> bool:
    """Whether ``units`` fit at once into the limiter refilled (its burst, limit or quota)."""
    if units <= 1:
        # A burst and every limit are at least 1 (config validates them): skip the copy.
        return True
    trial = copy.deepcopy(limiter)
    later = now + _FAR_FUTURE_S
    for _ in range(units):
        if trial.peek(later) is not None:
            return False
        trial.commit(later)
    return True
