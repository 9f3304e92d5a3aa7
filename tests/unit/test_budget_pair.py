"""Two limits on one partner (supervisor/budget/pair.py): one request token and k id
tokens a batch; a 429 adapts the limit it implicates and no other."""

from __future__ import annotations

import asyncio
import time

import pytest

from supervisor.budget.base import Feedback, Outcome
from supervisor.budget.local import LocalBudget
from supervisor.budget.pair import TwoLimits, implicated, item_limits
from supervisor.budget.settings import LimitsConfig, QuotaConfig


def _pair(requests_rate: float, items_rate: float) -> TwoLimits:
    limits = LimitsConfig(rate_per_second=requests_rate, concurrency=4)
    return TwoLimits(LocalBudget(limits, key="p"),
                     LocalBudget(item_limits(limits, items_rate), key="p#items"))


@pytest.mark.parametrize(("requests", "items", "k", "blamed"), [
    (20.0, 500.0, 100, "items"),  # 5 batches a second allowed by the ids: they bind
    (20.0, 5000.0, 10, "requests"),  # 500 a second by the ids: the requests bind
    (20.0, 2000.0, 100, "both"),  # 20 and 20: no evidence says which
    (20.0, 2150.0, 100, "both"),  # within the margin
    (20.0, 500.0, 0, "requests"),  # a probe or a poll (no id) reads as one id
])
def test_a_429_implicates_the_limit_binding_at_the_batchs_size(
        requests: float, items: float, k: int, blamed: str) -> None:
    assert implicated(requests, items, k) == blamed


def test_the_ids_budget_keeps_the_adaptation_scaled_and_no_quota() -> None:
    limits = LimitsConfig(rate_per_second=20.0, floor_per_second=0.5,
                          quota=(QuotaConfig(limit=1000, period_seconds=86400.0),))
    ids = item_limits(limits, 1000.0)
    assert (ids.rate_per_second, ids.floor_per_second, ids.quota) == (1000.0, 25.0, ())
    assert ids.decrease_factor == limits.decrease_factor


async def test_a_429_adapts_only_the_limit_it_implicates() -> None:
    pair = _pair(20.0, 500.0)
    grant = await pair.acquire(100)
    pair.release(grant, Feedback(Outcome.THROTTLED, 0.01))
    assert pair.items.snapshot().rate < 500.0
    # A limit learnt (the plateau) on the one implicated, none on the other.
    assert pair.items.snapshot().state.w_max is not None
    assert pair.requests.snapshot().state.w_max is None

    pair = _pair(20.0, 5000.0)
    grant = await pair.acquire(10)
    pair.release(grant, Feedback(Outcome.THROTTLED, 0.01))
    assert pair.requests.snapshot().state.w_max is not None
    assert pair.items.snapshot().state.w_max is None


async def test_an_item_throttled_on_its_own_implicates_the_ids_whatever_binds() -> None:
    pair = _pair(20.0, 5000.0)  # the requests bind at 10 ids
    grant = await pair.acquire(10)
    pair.release(grant, Feedback(Outcome.THROTTLED, 0.01, scope="items"))
    assert pair.items.snapshot().state.w_max is not None
    assert pair.requests.snapshot().state.w_max is None


async def test_a_retry_after_on_the_ids_holds_every_request() -> None:
    pair = _pair(100.0, 500.0)
    grant = await pair.acquire(100)
    pair.release(grant, Feedback(Outcome.THROTTLED, 0.01, retry_after_s=60.0, scope="items"))
    assert pair.snapshot().held_for(time.time()) > 50  # the status page sees the hold
    admission = await pair.requests.admit()
    # Admitted before the hold was seen: the grant gives nothing, and frees the slot.
    assert await asyncio.wait_for(pair.grant(admission, 1), 1.0) is None
    assert pair.requests.snapshot().in_flight == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pair.ready(), 0.2)
    pair.resume()
    await asyncio.wait_for(pair.ready(), 1.0)


async def test_k_ids_take_k_tokens_of_the_ids_budget_and_one_request() -> None:
    pair = _pair(1000.0, 40.0)
    started = time.monotonic()
    for _ in range(3):
        pair.release(await pair.acquire(7), Feedback(Outcome.OK, 0.001))
    # 21 ids at 40 a second: at least 20 / 40 s (a floor: pacing promises no more).
    assert time.monotonic() - started >= 20 / 40.0 * 0.95
    assert pair.requests.snapshot().in_flight == pair.items.snapshot().in_flight == 0
