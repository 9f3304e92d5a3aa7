"""The precise pacer: strict spacing measured from actual departures, an absolute schedule
when tolerant, a new rate reaching the waiters already queued, a batch's tokens in a row.
Real event loop. Lower bounds (never early) on the real monotonic clock, which a busy
host cannot break; what must happen *soon* on a clock that moves only when it is read or
told to (:class:`Ticking`), so a preempted test process cannot make it late."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from supervisor.budget.pacer import Pacer


class Ticking:
    """A clock that advances a microsecond per read (a spin on it ends) and jumps on
    ``advance``: departures on it are the pacer's arithmetic, not the host's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def departures(pacer: Pacer, n: int, cost: int = 1) -> list[float]:
    return [await pacer.take(cost) for _ in range(n)]


async def test_strict_never_lets_two_leave_closer_than_the_interval() -> None:
    pacer = Pacer(200.0, 0.0)
    times = await departures(pacer, 30)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 1 / 200


async def test_strict_spacing_counts_from_the_late_departure_not_the_schedule() -> None:
    pacer = Pacer(100.0, 0.0)
    first = await pacer.take()
    # The caller comes back late (a busy loop): the next still waits a whole interval
    # after it, since a bucket of one earned nothing more for the lateness.
    time.sleep(0.025)  # noqa: ASYNC251 - a blocked event loop, on purpose
    late = await pacer.take()
    after = await pacer.take()
    assert late - first >= 0.025
    assert after - late >= 0.01


async def test_tolerant_pacing_makes_up_a_late_departure() -> None:
    # Half an interval of tolerance: after a stall, the request after the late one leaves
    # half an interval early (strict pacing would wait the whole 10 ms).
    clock = Ticking()
    pacer = Pacer(100.0, 0.005, clock=clock)
    await pacer.take()
    clock.advance(0.015)  # the caller comes back late
    late = await pacer.take()
    caught_up = await pacer.take()
    assert caught_up - late == pytest.approx(0.005, abs=1e-4)
    strict = Pacer(100.0, 0.0, clock=clock)
    await strict.take()
    clock.advance(0.015)
    late = await strict.take()
    assert await strict.take() - late == pytest.approx(0.01, abs=1e-4)


async def test_an_idle_spell_earns_a_batch_nothing() -> None:
    pacer = Pacer(100.0, 0.0)
    await pacer.take()
    await asyncio.sleep(0.1)  # idle: ten intervals unused
    idle_end = time.monotonic()
    batch = await pacer.take(cost=5)
    assert batch - idle_end >= 0.04  # its last token four intervals on, as five in a row


async def test_a_new_rate_reaches_waiters_already_queued() -> None:
    clock = Ticking()
    pacer = Pacer(1.0, 0.0, clock=clock)  # one a second
    await pacer.take()
    waiters = [asyncio.create_task(pacer.take()) for _ in range(5)]
    await asyncio.sleep(0)
    tuned = clock.now
    pacer.tune(200.0, 0.0)
    left = await asyncio.wait_for(asyncio.gather(*waiters), 30.0)  # a hang guard only
    # At 1/s they would leave over 5 s; at the new rate, 5 ms apart from the tune on.
    assert max(left) - tuned == pytest.approx(5 * 0.005, abs=1e-3)


async def test_a_cut_slows_the_waiter_at_the_head() -> None:
    pacer = Pacer(20.0, 0.0)
    first = await pacer.take()
    waiter = asyncio.create_task(pacer.take())
    await asyncio.sleep(0)
    pacer.tune(2.0, 0.0)  # the owed part of the interval now lasts ten times as long
    second = await waiter
    assert second - first >= 0.2


async def test_empty_leaves_no_catch_up() -> None:
    pacer = Pacer(50.0, 0.02)
    # Read before the tune: read after it, a descheduled test (a busy machine) saw its
    # own lateness as the pacer's catch-up.
    emptied = time.monotonic()
    pacer.tune(50.0, 0.02, empty=True)
    first = await pacer.take()
    assert first - emptied >= 0.02


async def test_a_batch_leaves_when_its_last_token_would_have() -> None:
    pacer = Pacer(100.0, 0.0)
    start = await pacer.take()
    batch = await pacer.take(cost=5)  # five requests in a row: the last one 5 intervals on
    single = await pacer.take()
    assert batch - start >= 0.05
    assert single - batch >= 0.01


def test_tolerance_is_the_burst_beyond_one_token() -> None:
    assert Pacer.tolerance(50.0, 1.25, strict=False) == 0.25 / 50
    assert Pacer.tolerance(50.0, 1.25, strict=True) == 0.0
    assert Pacer.tolerance(50.0, 1.0, strict=False) == 0.0


async def test_strict_spacing_counts_from_a_late_departure_less_the_usual_delay() -> None:
    # Grants leave 0.2 ms after they are made, one 5 ms late (a slow ownership check): the
    # next may leave an interval after that late departure, less the usual 0.2 ms it will
    # take itself, so it reaches the partner no sooner than an interval after the late one.
    clock = Ticking()
    pacer = Pacer(100.0, 0.0, clock=clock)
    for _ in range(5):
        await pacer.take()
        clock.advance(0.0002)
        pacer.departed()
    await pacer.take()
    clock.advance(0.005)
    late = clock()
    pacer.departed()
    granted = await pacer.take()
    assert granted + 0.0002 - late == pytest.approx(0.01, abs=1e-4)


async def test_a_steady_delay_between_grant_and_departure_costs_no_pace() -> None:
    clock = Ticking()
    pacer = Pacer(100.0, 0.0, clock=clock)
    grants = []
    for _ in range(20):
        grants.append(await pacer.take())
        clock.advance(0.0003)
        pacer.departed()
    gaps = [b - a for a, b in itertools.pairwise(grants)]
    assert max(gaps) == pytest.approx(0.01, abs=1e-4)


async def test_tolerant_pacing_ignores_departures() -> None:
    # A partner with a burst absorbs a late request: the schedule stays absolute.
    clock = Ticking()
    pacer = Pacer(100.0, 0.005, clock=clock)
    first = await pacer.take()
    clock.advance(0.004)
    pacer.departed()
    assert await pacer.take() - first == pytest.approx(0.005, abs=1e-4)
