"""The in-process budget: the global pause, quotas,
the concurrency gate (memory: tests/contract/test_rate_budget.py, on a real ledger).
Real event loop, short real waits, generous bounds."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from supervisor import metrics
from supervisor.budget import gauges
from supervisor.budget.announced import MAX_ANNOUNCED
from supervisor.budget.base import Feedback, Outcome, Policy
from supervisor.budget.concurrency import GradientLimit
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig, QuotaConfig


def budget(**overrides: Any) -> LocalBudget:
    values: dict[str, Any] = {"rate_per_second": 50.0, "concurrency": 4}
    values.update(overrides)
    return LocalBudget(LimitsConfig(**values), key="http://partner")


async def test_capacity_of_one_never_grants_two_closer_than_the_period() -> None:
    b = budget(rate_per_second=200.0, burst=1.0)
    times = []
    for _ in range(20):
        grant = await b.acquire()
        times.append(grant.at)  # read as it was granted
        b.release(grant, Feedback(Outcome.OK, 0.001))
    gaps = [y - x for x, y in itertools.pairwise(times)]
    # 0.9: the grant's time is read just after the departure, and a busy host may
    # preempt between the two (a tolerant bucket would allow 0.75 after a late one).
    assert min(gaps) >= 1 / 200 * 0.9


async def test_a_retry_after_pauses_every_waiter_and_empties_the_bucket() -> None:
    b = budget()
    grant = await b.acquire()
    b.release(grant, Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.4))
    paused_until = b.snapshot().paused_until
    assert paused_until == pytest.approx(time.time() + 0.4, abs=0.05)
    waiters = [asyncio.create_task(b.acquire()) for _ in range(3)]
    done, _ = await asyncio.wait(waiters, timeout=0.25)
    assert not done  # held by the pause
    grants = await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
    assert all(g.at >= paused_until for g in grants)


async def test_an_edge_throttle_switches_to_strict_pacing() -> None:
    b = budget()
    grant = await b.acquire()
    b.release(grant, Feedback(Outcome.THROTTLED, 0.001, retry_after_s=None))
    state = b.snapshot().state
    assert state.strict
    gaps = []
    for _ in range(3):
        # A stall longer than any catch-up, then two grants: tolerant pacing would let the
        # second leave a quarter interval early to make the stall up; strict never does.
        time.sleep(0.03)  # noqa: ASYNC251 - a blocked event loop, on purpose
        times = []
        for _ in range(2):
            g = await b.acquire()
            times.append(time.monotonic())
            b.release(g, Feedback(Outcome.OK, 0.001))
        gaps.append(times[1] - times[0])
    assert min(gaps) >= 1 / b.snapshot().state.rate * 0.98


async def test_a_configured_quota_holds_everyone_until_its_window_frees() -> None:
    b = budget(rate_per_second=100.0,
               quota=(QuotaConfig(limit=3, period_seconds=0.6, name="short"),))
    started = time.time()
    for _ in range(3):
        b.release(await b.acquire(), Feedback(Outcome.OK, 0.001))
    (view,) = b.snapshot().quotas
    assert (view.name, view.remaining) == ("short", 0)
    assert b.snapshot().projected_finish(3, time.time()) >= view.resets_at
    fourth = await asyncio.wait_for(b.acquire(), 3.0)
    assert fourth.at - started >= 0.6


async def test_an_announced_quota_that_is_spent_pauses_until_its_reset() -> None:
    b = budget()
    grant = await b.acquire()
    day = Policy("day", 50_000, 86_400.0, remaining=0, reset_s=0.3)
    second = Policy("default", 50, 1.0, remaining=10, reset_s=1)
    b.release(grant, Feedback(Outcome.OK, 0.001, policies=(second, day)))
    snap = b.snapshot()
    assert snap.state.pause_reason == "quota day exhausted"
    assert snap.paused_until == pytest.approx(time.time() + 0.3, abs=0.05)
    assert any(q.name == "day" and q.remaining == 0 for q in snap.quotas)
    assert snap.state.announced == 50.0


async def test_the_short_policy_at_zero_does_not_pause_when_it_paces() -> None:
    b = budget()
    grant = await b.acquire()
    b.release(grant, Feedback(Outcome.OK, 0.001,
                              policies=(Policy("default", 50, 1.0, remaining=0, reset_s=1),)))
    assert b.snapshot().paused_until == 0.0


async def test_concurrency_slots_are_given_back_on_cancellation() -> None:
    b = budget(concurrency=1)
    grant = await b.acquire()
    blocked = asyncio.create_task(b.acquire())
    await asyncio.sleep(0)  # one turn of the loop: the waiter reaches the slot's wait
    assert not blocked.done()
    blocked.cancel()
    b.release(grant, Feedback(Outcome.OK, 0.001))
    assert b.snapshot().in_flight == 0
    await asyncio.wait_for(b.acquire(), 1.0)


def test_gradient_limit_grows_while_latency_holds_and_shrinks_when_it_climbs() -> None:
    g = GradientLimit(maximum=32, timeout_s=3.0)
    assert g.value == 4  # starts small
    for _ in range(200):
        g.sample(0.02, in_flight=g.value)
    assert g.value == 32
    for _ in range(200):  # 2 s now, past half the 3 s timeout
        g.sample(2.0, in_flight=g.value)
    assert g.value < 16


def test_gradient_limit_keeps_latency_under_half_the_timeout() -> None:
    g = GradientLimit(maximum=64, timeout_s=1.0)
    for _ in range(400):
        # A partner queueing: 20 ms alone, 60 ms more per request already in hand.
        g.sample(0.02 + 0.06 * (g.value - 1), in_flight=g.value)
    assert 0.02 + 0.06 * (g.value - 1) <= 0.6


def test_gradient_limit_gives_a_slow_healthy_partner_what_its_rate_needs() -> None:
    slow = GradientLimit(maximum=64, timeout_s=10.0)
    for _ in range(300):
        # 40/s at 500 ms needs 20 in flight; the pool uses what the rate lets it.
        slow.sample(0.5, in_flight=min(slow.value, 20))
    assert slow.value >= 20


async def test_concurrency_bound_shows_when_the_maximum_limits_the_pace() -> None:
    b = budget(rate_per_second=100.0, concurrency=2)
    for _ in range(12):
        b.release(await b.acquire(), Feedback(Outcome.OK, 0.5))
    assert b.snapshot().concurrency_bound


async def test_partner_named_policies_are_bounded_in_memory_and_in_metric_labels() -> None:
    # Review L4: a new RateLimit-Policy name in every answer.
    b = budget()
    for i in range(40):
        grant = await b.acquire()
        named = Policy(f"p{i}", 10, 3600.0, remaining=5, reset_s=600.0)
        b.release(grant, Feedback(Outcome.OK, 0.001, policies=(named,)))
        gauges.publish_budget(b.snapshot())
    names = [q.name for q in b.snapshot().quotas]
    assert len(names) == MAX_ANNOUNCED
    assert names == [f"p{i}" for i in range(40 - MAX_ANNOUNCED, 40)]  # the oldest went
    series = {s.labels["policy"] for family in metrics.LIMITER_QUOTA_REMAINING.collect()
              for s in family.samples}
    assert series == set(names)


async def test_an_announced_quota_spent_before_a_resume_no_longer_holds() -> None:
    b = budget()
    grant = await b.acquire()
    day = Policy("day", 50_000, 86_400.0, remaining=0, reset_s=600.0)
    b.release(grant, Feedback(Outcome.OK, 0.001, policies=(day,)))
    assert b.snapshot().held_for(time.time()) > 500
    b.resume()
    assert b.snapshot().held_for(time.time()) == 0.0
    await asyncio.wait_for(b.acquire(), 1.0)
