"""The adaptive limiter: the CUBIC policy, the global Retry-After pause, and the in-place retune of
aiolimiter's bucket (aiolimiter#98) for waiters already queued.

Time: real but short durations with generous bounds, or counts of what completed; never a
tight wall-clock assertion.
"""

from __future__ import annotations

import asyncio
import time

from aiolimiter import AsyncLimiter

from supervisor.config import LimitsConfig
from supervisor.limiter import AdaptiveLimiter, _fill, _retune


def limiter(**overrides: float) -> AdaptiveLimiter:
    values: dict[str, float] = {"rate_per_second": 20.0, "burst": 1.0, "decrease_factor": 0.5,
                                "increase_per_second": 1.0, "floor_per_second": 0.5,
                                "recovery_seconds": 8.0, "long_pause_seconds": 2.0}
    values.update(overrides)
    return AdaptiveLimiter(LimitsConfig(**values))  # type: ignore[arg-type]


def pretend_seconds_passed(lim: AdaptiveLimiter, seconds: float) -> None:
    """Backdate the last cut and raise instead of sleeping: the curve is a function of the
    time since the cut."""
    lim._last_cut -= seconds
    lim._last_raise -= seconds


def record_successes(lim: AdaptiveLimiter, per_second: float, seconds: float) -> None:
    """Successes the limiter measured over the last ``seconds`` (backdated, not slept)."""
    now = time.monotonic()
    n = int(per_second * seconds)
    lim._successes.extend(now - seconds + i / per_second for i in range(n))


# -- the cut ---------------------------------------------------------------------------


def test_starts_at_the_ceiling() -> None:
    lim = limiter(rate_per_second=20)
    assert lim.rate == lim.ceiling == 20.0
    assert lim.paused_until == 0.0


def test_a_429_cuts_to_the_decrease_factor_of_the_measured_rate() -> None:
    lim = limiter(rate_per_second=20, decrease_factor=0.5)
    record_successes(lim, per_second=12, seconds=1.5)
    measured = lim.measured_rate()
    assert measured is not None
    assert 11.0 <= measured <= 13.0
    lim.on_throttle(time.monotonic(), None)
    assert abs(lim.rate - 0.5 * measured) < 0.1
    assert lim.throttles == 1


def test_a_429_before_anything_was_measured_cuts_twice_as_hard() -> None:
    # Throttled before any measurement: the rate was far too high.
    lim = limiter(rate_per_second=20, decrease_factor=0.5)
    lim.on_throttle(time.monotonic(), None)
    assert lim.rate == 5.0


def test_a_second_429_for_a_request_sent_before_the_cut_does_not_cut_again() -> None:
    lim = limiter(rate_per_second=20, decrease_factor=0.5)
    sent_a = time.monotonic()
    sent_b = time.monotonic()
    lim.on_throttle(sent_a, None)
    lim.on_throttle(sent_b, None)  # in the air when the first 429 arrived: same episode
    assert lim.rate == 5.0
    assert lim.throttles == 2
    lim.on_throttle(time.monotonic(), None)  # sent after the cut: a new episode
    assert lim.rate == 1.25


async def test_episode_uses_the_grant_time_from_acquire() -> None:
    lim = limiter(rate_per_second=1000, decrease_factor=0.5)
    before_cut = await lim.acquire()
    lim.on_throttle(before_cut, None)
    assert lim.rate == 250.0
    lim.on_throttle(before_cut, None)
    assert lim.rate == 250.0
    after_cut = await lim.acquire()
    lim.on_throttle(after_cut, None)
    assert lim.rate == 62.5


def test_never_below_the_floor() -> None:
    lim = limiter(rate_per_second=20, decrease_factor=0.5, floor_per_second=3)
    for _ in range(20):
        lim.on_throttle(time.monotonic(), None)
        assert lim.rate >= 3.0
    assert lim.rate == 3.0


def test_floor_above_ceiling_is_clamped_to_the_ceiling() -> None:
    lim = AdaptiveLimiter(LimitsConfig(rate_per_second=2.0, floor_per_second=5.0))
    lim.on_throttle(time.monotonic(), None)
    assert lim.rate == 2.0


async def test_a_long_retry_after_pauses_without_cutting() -> None:
    # A partner-imposed pause (maintenance, a quota window) says nothing about our rate.
    lim = limiter(rate_per_second=20, long_pause_seconds=2.0)
    lim.on_throttle(time.monotonic(), 3.0)
    assert lim.rate == 20.0
    assert lim.paused_until > time.time() + 2.0
    lim.on_throttle(time.monotonic(), 1.0)  # a short one is a rate signal
    assert lim.rate < 20.0


async def test_paused_time_does_not_dilute_the_measured_rate() -> None:
    lim = limiter(rate_per_second=100)
    now = time.monotonic()
    # 25 successes in half a second, then a one-second pause in which nothing can succeed.
    lim._successes.extend(now - 1.5 + i * 0.02 for i in range(25))
    lim.pause(1.0)
    lim._pauses[-1] = (now - 1.0, now)
    measured = lim.measured_rate(now)
    assert measured is not None
    assert 45.0 <= measured <= 55.0  # over the 0.5 s not paused, not over 1.5 s


# -- recovery ----------------------------------------------------------------------------


def test_success_at_the_ceiling_changes_nothing() -> None:
    lim = limiter(rate_per_second=20)
    pretend_seconds_passed(lim, 10)
    lim.on_success()
    assert lim.rate == 20.0


def test_recovery_follows_the_cubic_curve_back_and_probes_above() -> None:
    lim = limiter(rate_per_second=100, decrease_factor=0.5, recovery_seconds=8,
                  increase_per_second=0.1)
    lim.on_throttle(time.monotonic(), None)  # unmeasured: 100 x 0.5 x 0.5 = 25
    assert lim.rate == 25.0
    plateau = lim._w_max  # just below the throttled rate (50)
    assert 45.0 <= plateau < 50.0
    lim.on_success()  # at the cut itself: no change
    assert lim.rate == 25.0
    pretend_seconds_passed(lim, 4.0)  # half way: most of the way back already (concave)
    lim.on_success()
    assert plateau - (plateau - 25) / 8 - 0.5 <= lim.rate <= plateau
    pretend_seconds_passed(lim, 4.0)  # t = K: at the plateau
    lim.on_success()
    assert abs(lim.rate - plateau) < 0.5
    pretend_seconds_passed(lim, 4.0)  # past K: probing above, slowly at first
    lim.on_success()
    assert plateau < lim.rate < plateau + 5
    pretend_seconds_passed(lim, 100.0)
    lim.on_success()
    assert lim.rate == 100.0  # capped at the ceiling, never above


def test_the_least_increase_applies_when_the_curve_is_flat() -> None:
    lim = limiter(rate_per_second=100, decrease_factor=0.5, recovery_seconds=100,
                  increase_per_second=10)
    lim.on_throttle(time.monotonic(), None)
    assert lim.rate == 25.0
    pretend_seconds_passed(lim, 2.0)
    lim.on_success()
    assert 45.0 <= lim.rate <= 47.0  # 25 + 10/s x 2 s (plus the test's own time)


def test_a_cut_restarts_the_recovery_clock() -> None:
    lim = limiter(rate_per_second=20, increase_per_second=5)
    pretend_seconds_passed(lim, 30)
    lim.on_throttle(time.monotonic(), None)
    cut = lim.rate
    lim.on_success()  # the 30 s of "health" before the 429 do not count
    assert lim.rate == cut


# -- Retry-After: a global pause ------------------------------------------------------------


async def granted_at(lim: AdaptiveLimiter) -> float:
    """Acquire, and return the wall-clock time of the grant (the pause is wall-clock)."""
    await lim.acquire()
    return time.time()


async def test_retry_after_pauses_every_waiter_until_it_ends() -> None:
    lim = limiter(rate_per_second=1000)
    await lim.acquire()
    lim.on_throttle(time.monotonic(), 0.6)
    assert lim.paused_until > time.time()
    pause_end = lim.paused_until
    tasks = [asyncio.create_task(granted_at(lim)) for _ in range(5)]
    done, _ = await asyncio.wait(tasks, timeout=0.2)
    assert not done, "a waiter got a token during the pause"
    grants = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert min(grants) >= pause_end - 0.01  # every grant came after the pause ended
    assert lim.paused_until == 0.0


async def test_pause_applies_to_waiters_already_queued_in_the_bucket() -> None:
    lim = limiter(rate_per_second=10)  # one token per 0.1 s
    await lim.acquire()
    tasks = [asyncio.create_task(granted_at(lim)) for _ in range(3)]
    await asyncio.sleep(0)  # all three are now queued inside aiolimiter's bucket
    lim.pause(0.3)
    pause_end = lim.paused_until
    grants = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert min(grants) >= pause_end - 0.01  # a token won during the pause is forfeit


async def test_bucket_is_emptied_when_the_pause_ends_so_waiters_do_not_burst() -> None:
    lim = limiter(rate_per_second=10)  # one token per 0.1 s
    lim.pause(0.2)
    pause_end = lim.paused_until
    tasks = [asyncio.create_task(granted_at(lim)) for _ in range(3)]
    grants = sorted(await asyncio.wait_for(asyncio.gather(*tasks), timeout=5))
    # From an emptied bucket the first grant waits one token period after the pause, and
    # the three are spread at 10/s; a burst would grant them all at the pause's end.
    assert grants[0] >= pause_end + 0.05
    assert grants[-1] - grants[0] >= 0.15


async def test_a_longer_pause_extends_a_shorter_one_and_a_shorter_one_does_not_shorten() -> None:
    lim = limiter(rate_per_second=1000)
    lim.pause(0.1)
    first = lim.paused_until
    lim.pause(0.6)
    second = lim.paused_until
    assert second > first
    lim.pause(0.05)  # never shortens the pause in force
    assert lim.paused_until == second
    task = asyncio.create_task(lim.acquire())
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done  # still held: the extension woke the waiter, who went back to sleep
    await asyncio.wait_for(task, timeout=5)
    assert time.time() >= second


async def test_no_pause_without_retry_after() -> None:
    lim = limiter(rate_per_second=1000)
    lim.on_throttle(time.monotonic(), None)
    lim.on_throttle(time.monotonic(), 0.0)
    assert lim.paused_until == 0.0
    await asyncio.wait_for(lim.acquire(), timeout=1)


# -- the in-place retune of aiolimiter (aiolimiter#98) -----------------------------------------


async def _queue_waiters(acquire: object, n: int) -> list[asyncio.Task[object]]:
    assert callable(acquire)
    tasks = [asyncio.create_task(acquire()) for _ in range(n)]
    await asyncio.sleep(0)  # each task runs until it blocks on the bucket
    return tasks


def test_aiolimiter_still_has_the_internals_the_retune_relies_on() -> None:
    bucket = AsyncLimiter(1, 1)
    for name in ("max_rate", "time_period", "_rate_per_sec", "_level", "_wake_next", "_leak",
                 "_waiters"):
        assert hasattr(bucket, name) or name in type(bucket).__slots__, name


async def test_raising_the_rate_speeds_up_waiters_already_queued() -> None:
    bucket = AsyncLimiter(1, 0.5)  # 2/s, burst 1
    await bucket.acquire()
    tasks = await _queue_waiters(bucket.acquire, 5)
    assert len(bucket._waiters) == 5
    started = time.monotonic()
    _retune(bucket, 1000.0, 1.0)
    # At 2/s they would need ~2.5 s; at 1000/s a few milliseconds.
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=1.0)
    assert time.monotonic() - started < 1.0


async def test_lowering_the_rate_slows_down_waiters_already_queued() -> None:
    bucket = AsyncLimiter(1, 0.001)  # 1000/s, burst 1
    await bucket.acquire()
    tasks = await _queue_waiters(bucket.acquire, 5)
    _retune(bucket, 2.0, 1.0)
    # At 1000/s all five would be done in ~5 ms; at 2/s at most one within 0.3 s.
    done, pending = await asyncio.wait(tasks, timeout=0.3)
    assert len(done) <= 1
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def test_adaptive_limiter_raise_reaches_queued_waiters() -> None:
    lim = limiter(rate_per_second=1000, decrease_factor=0.002, floor_per_second=2,
                  increase_per_second=1000)
    lim.on_throttle(time.monotonic(), None)
    assert lim.rate == 2.0
    await lim.acquire()
    tasks = await _queue_waiters(lim.acquire, 5)
    started = time.monotonic()
    pretend_seconds_passed(lim, 1.0)
    lim.on_success()  # climbs straight back to 1000/s
    assert lim.rate == 1000.0
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=1.0)
    assert time.monotonic() - started < 1.0


async def test_adaptive_limiter_cut_reaches_queued_waiters() -> None:
    lim = limiter(rate_per_second=1000, decrease_factor=0.002, floor_per_second=2)
    await lim.acquire()
    tasks = await _queue_waiters(lim.acquire, 5)
    lim.on_throttle(time.monotonic(), None)
    assert lim.rate == 2.0
    done, pending = await asyncio.wait(tasks, timeout=0.3)
    assert len(done) <= 1
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def test_rate_is_honoured_over_a_window() -> None:
    """Count grants over a short window: never more than rate x time + burst."""
    lim = limiter(rate_per_second=50, burst=1)
    started = time.monotonic()
    grants = 0
    while time.monotonic() - started < 0.3:
        await lim.acquire()
        grants += 1
    elapsed = time.monotonic() - started
    assert grants <= 50 * elapsed + 2


async def test_fill_leaves_no_token() -> None:
    bucket = AsyncLimiter(1, 0.01)
    _fill(bucket)
    assert not bucket.has_capacity()


