"""One adaptive rate limit shared by every worker, around ``aiolimiter.AsyncLimiter``.

Policy (CUBIC, as AWS's SDK adaptive mode and TCP use it, measured against the partner):

* never above the configured ceiling (the partner's documented limit), nor above what the
  partner announces in IETF ``RateLimit-Policy`` headers;
* on a 429: the rate drops to ``decrease_factor`` (0.8) x the *measured* success rate of
  the last two seconds (the partner's real limit shows there), once per throttle episode:
  429s for requests granted before the cut do not cut again;
* afterwards the rate follows ``W_max + C (t - K)^3``: it climbs back fast, flattens out
  just below the rate that was throttled (reached after ``recovery_seconds`` = K), then
  probes above it, slowly at first, faster the longer the partner agrees; at least
  ``increase_per_second`` per second, so a limit that recovers is found again quickly;
* never below ``floor_per_second``;
* a ``Retry-After`` pauses *every* worker until then, and the bucket is emptied when the
  pause ends so the waiters do not burst the moment it reopens. The server's wait is not
  jittered: it told us exactly when. Optionally (``long_pause_seconds`` > 0) a longer
  ``Retry-After`` is taken as a pause the partner imposes (maintenance, a quota window),
  not a sign the rate was too high: everyone waits, the rate is kept.

aiolimiter cannot change its rate at runtime (aiolimiter#98), so :func:`_retune` sets the
bucket's rate in place and re-arms its timer; waiters already queued then drain at the new
rate. tests/unit/test_limiter.py guards this against aiolimiter's internals changing.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import time

from aiolimiter import AsyncLimiter

from supervisor.config import LimitsConfig

# The partner's real limit is read off our successes over this window.
MEASURE_S = 2.0
MIN_MEASURE_S = 0.2
MIN_MEASURE_SAMPLES = 10
RAISE_EVERY_S = 0.05
PLATEAU = 0.95


def _retune(bucket: AsyncLimiter, rate: float, burst: float) -> None:
    bucket.max_rate = burst
    bucket.time_period = burst / rate
    bucket._rate_per_sec = rate
    bucket._wake_next()  # re-arm the timer of the waiter at the head with the new rate


def _fill(bucket: AsyncLimiter) -> None:
    """Leave no token in the bucket: the next acquisition waits one full token period."""
    bucket._leak()
    bucket._level = bucket.max_rate


class AdaptiveLimiter:
    """A token bucket whose rate follows the partner's 429s and Retry-After."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.ceiling = limits.rate_per_second
        self.floor = min(limits.floor_per_second, limits.rate_per_second)
        self.burst = limits.burst
        self.decrease_factor = limits.decrease_factor
        self.increase_per_second = limits.increase_per_second
        self.recovery_s = limits.recovery_seconds
        self.long_pause_s = limits.long_pause_seconds
        self.rate = self.ceiling
        # CUBIC state: the rate that was throttled, the rate cut to, and the curve's scale.
        self._w_max = self.ceiling
        self._cut_to = self.ceiling
        self._cubic_c = 0.0
        self._successes: collections.deque[float] = collections.deque()
        self._pauses: collections.deque[tuple[float, float]] = collections.deque(maxlen=16)
        self._bucket: AsyncLimiter | None = None
        self._paused_until = 0.0  # wall clock, for the metric and the ledger
        self._pause_changed: asyncio.Event | None = None
        self._last_cut = 0.0  # monotonic time of the last decrease
        self._last_raise = time.monotonic()
        self._pause_gen = 0  # bumped by every pause; the bucket is emptied once per pause
        self._filled_gen = 0
        self.throttles = 0
        self.announced: float | None = None  # rate from the partner's RateLimit headers

    def _ensure(self) -> AsyncLimiter:
        # Built lazily: aiolimiter binds itself to the running loop on first use.
        if self._bucket is None:
            self._bucket = AsyncLimiter(self.burst, self.burst / self.rate)
            self._pause_changed = asyncio.Event()
        return self._bucket

    @property
    def paused_until(self) -> float:
        """Wall-clock time until which every worker is held (0 when not paused)."""
        return self._paused_until if self._paused_until > time.time() else 0.0

    async def acquire(self) -> float:
        """Wait for a pause to end and for a token; return the monotonic time of the grant.

        The grant time lets :meth:`on_throttle` tell a 429 for a request sent before the
        last cut (already accounted for) from a new one.
        """
        bucket = self._ensure()
        while True:
            await self._wait_pause()
            await bucket.acquire()
            if self._paused_until <= time.time():
                return time.monotonic()
            # A pause began while we waited for the token: the token is forfeit.

    async def _wait_pause(self) -> None:
        assert self._pause_changed is not None
        paused = False
        while (remaining := self._paused_until - time.time()) > 0:
            paused = True
            self._pause_changed.clear()
            # Wake at the deadline, or earlier if the pause is extended or lifted.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._pause_changed.wait()
        if paused and self._bucket is not None and self._filled_gen != self._pause_gen:
            self._filled_gen = self._pause_gen
            _fill(self._bucket)

    @property
    def effective_ceiling(self) -> float:
        """The configured ceiling, lowered to what the partner announces, if it does."""
        if self.announced is None:
            return self.ceiling
        return max(self.floor, min(self.ceiling, self.announced))

    def on_quota(self, rate_per_second: float | None, exhausted_for_s: float | None) -> None:
        """The partner's RateLimit headers: pace by them before any 429 arrives."""
        if rate_per_second is not None and rate_per_second > 0 \
                and rate_per_second != self.announced:
            self.announced = rate_per_second
            if self.rate > self.effective_ceiling:
                # A cut like a 429's: a 429 for a request granted before it (the same
                # answer may carry both) was sent at the old rate and must not cut again.
                self._last_cut = self._last_raise = time.monotonic()
                self._set_rate(self.effective_ceiling)
            elif self.throttles == 0:
                # No 429 has taught us a lower rate: trust the announcement outright.
                self._set_rate(self.effective_ceiling)
        # "Nothing left until t" matters only when we cannot pace by the policy: pacing at
        # q/w keeps a token bucket's remaining near 0 all the time, and pausing on that
        # would halve the throughput for nothing.
        if self.announced is None and exhausted_for_s is not None and exhausted_for_s > 0:
            self.pause(exhausted_for_s)

    def measured_rate(self, now: float | None = None) -> float | None:
        """Successes per second over the last ``MEASURE_S`` and since the last cut (what
        the partner accepted before it is stale once it has throttled us), not counting
        time paused by a Retry-After; None while too little is left to tell."""
        now = time.monotonic() if now is None else now
        window = self._successes
        while window and window[0] < now - MEASURE_S:
            window.popleft()
        since = max(now - MEASURE_S, self._last_cut)
        recent = len(window) - bisect.bisect_left(window, since)
        if not recent:
            return None
        start = window[-recent]
        paused = sum(max(0.0, min(end, now) - max(begin, start))
                     for begin, end in self._pauses if end > start)
        active = now - start - paused
        if active < MIN_MEASURE_S or recent < MIN_MEASURE_SAMPLES:
            return None
        return recent / active

    def on_success(self) -> None:
        """A healthy answer: follow the recovery curve back up (at most every 50 ms)."""
        now = time.monotonic()
        self._successes.append(now)
        if self.rate >= self.effective_ceiling or now - self._last_raise < RAISE_EVERY_S:
            return
        self._last_raise = now
        t = now - self._last_cut
        cubic = self._w_max + self._cubic_c * (t - self.recovery_s) ** 3
        additive = self._cut_to + self.increase_per_second * t
        self._set_rate(min(self.effective_ceiling, max(self.rate, cubic, additive)))

    def on_throttle(self, sent_at: float, retry_after_s: float | None) -> None:
        """A 429: cut the rate once per episode and pause every worker for Retry-After."""
        self.throttles += 1
        now = time.monotonic()
        imposed = (self.long_pause_s > 0 and retry_after_s is not None
                   and retry_after_s >= self.long_pause_s)
        if sent_at >= self._last_cut and not imposed:
            measured = self.measured_rate(now)
            base = self.rate if measured is None else min(self.rate, measured)
            if measured is None:
                # Throttled again before anything could be measured: far too fast.
                base *= self.decrease_factor
            # The throttled rate overstates the limit by whatever the partner's own bucket
            # let through: plateau a little below it.
            self._w_max = base * PLATEAU
            self._cut_to = max(self.floor, base * self.decrease_factor)
            # The curve passes through the cut now and flattens at W_max after K seconds.
            self._cubic_c = max(0.0, self._w_max - self._cut_to) / self.recovery_s ** 3
            self._last_cut = self._last_raise = now
            self._set_rate(self._cut_to)
        if retry_after_s is not None and retry_after_s > 0:
            self.pause(retry_after_s)

    def pause(self, seconds: float) -> None:
        until = time.time() + seconds
        if until <= self._paused_until:
            return
        self._paused_until = until
        self._pause_gen += 1
        now = time.monotonic()
        self._pauses.append((now, now + seconds))
        self._ensure()
        assert self._pause_changed is not None
        self._pause_changed.set()
        if self._bucket is not None:
            _fill(self._bucket)

    def _set_rate(self, rate: float) -> None:
        if rate == self.rate:
            return
        self.rate = rate
        if self._bucket is not None:
            _retune(self._bucket, rate, self.burst)
