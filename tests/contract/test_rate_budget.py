"""The RateBudget contract: what the consumer, the reconciler and the monitor rely on,
run against every implementation: the in-process one, whose memory goes through the real
ledger (a SQLite file), as it does in the service, and the one shared through PostgreSQL,
whose memory is its row (a schema of its own per test; the ledger argument is unused)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import pytest

from supervisor.budget import policy
from supervisor.budget.base import Feedback, Grant, Outcome, Policy, RateBudget
from supervisor.budget.local import LocalBudget, MemoryStore
from supervisor.budget.pair import TwoLimits, item_limits
from supervisor.budget.policy_state import BudgetState
from supervisor.budget.settings import LimitsConfig, QuotaConfig
from supervisor.postgres.budget import MIGRATIONS, PostgresBudget
from supervisor.postgres.connect import create_pool, migrate
from supervisor.sqlite.ledger import SqliteLedger

Factory = Callable[..., RateBudget]


def _limits(**limits: Any) -> LimitsConfig:
    return LimitsConfig(**{"rate_per_second": 40.0, "concurrency": 4, **limits})


def _local(store: MemoryStore, max_pause_s: float = 900.0, **limits: Any) -> RateBudget:
    return LocalBudget(_limits(**limits), key="http://partner", store=store,
                       max_pause_s=max_pause_s)


class PgSchema(Protocol):
    dsn: str
    schema: str


@pytest.fixture
async def postgres(pg: PgSchema) -> AsyncIterator[Factory]:
    """Budgets on one schema. Each one made is a new life of the one process: starting it
    closes the earlier ones first (a restart), as a second LocalBudget is a new life."""
    pool = await create_pool(pg.dsn, pg.schema, min_size=1, max_size=4)
    await migrate(pool, pg.schema, MIGRATIONS)
    lives: list[PostgresBudget] = []

    class Restarted(PostgresBudget):
        async def start(self) -> None:
            for earlier in lives:
                if earlier is not self:
                    await earlier.close()
            await super().start()

    def make(_store: object, max_pause_s: float = 900.0, **limits: Any) -> RateBudget:
        budget = Restarted(_limits(**limits), key="http://partner", pool=pool, dsn=pg.dsn,
                           schema=pg.schema, max_pause_s=max_pause_s)
        lives.append(budget)
        return budget

    try:
        yield make
    finally:
        for budget in lives:
            await budget.close()
        await pool.close()


def _two_limits(store: MemoryStore, max_pause_s: float = 900.0, **limits: Any) -> RateBudget:
    """Two limits whose ids' one never binds here (1,000 ids a request a second): the
    requests' budget is held to the whole contract through the pair."""
    requests = _local(store, max_pause_s, **limits)
    items = LocalBudget(item_limits(_limits(**limits), 1000 * _limits(**limits).rate_per_second),
                        key="http://partner#items", store=store, max_pause_s=max_pause_s)
    return TwoLimits(requests, items)


@pytest.fixture(params=["local", "postgres", "two_limits"])
def make(request: pytest.FixtureRequest) -> Factory:
    if request.param == "local":
        return _local
    if request.param == "two_limits":
        return _two_limits
    return request.getfixturevalue("postgres")  # type: ignore[no-any-return]


class TestRateBudgetContract:
    async def test_grants_are_paced_at_no_more_than_the_rate(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        started = time.monotonic()
        for _ in range(21):
            budget.release(await budget.acquire(), Feedback(Outcome.OK, 0.001))
        # 20 intervals at 40/s (less 1 % headroom) cannot take less than half a second.
        assert time.monotonic() - started >= 20 / 40.0 * 0.95

    async def test_a_grant_of_cost_k_is_paced_as_k_grants(
            self, make: Factory, ledger: SqliteLedger) -> None:
        # A batch of k ids to a partner whose limit counts ids (docs/batch.md): three
        # grants of 7 take as long as 21 grants of one. A lower bound only: a floor is
        # what pacing promises.
        budget = make(ledger)
        if isinstance(budget, TwoLimits):
            pytest.skip("two limits: k ids take k of the ids' budget and one request "
                        "(tests/unit/test_budget_pair.py)")
        await budget.start()
        started = time.monotonic()
        for _ in range(3):
            budget.release(await budget.acquire(7), Feedback(Outcome.OK, 0.001))
        assert time.monotonic() - started >= 20 / 40.0 * 0.95

    async def test_departures_never_let_grants_come_faster(
            self, make: Factory, ledger: SqliteLedger) -> None:
        # The partner client reports each request's departure, granted or not (before
        # the first grant, twice for one): pacing stays at no more than the rate.
        budget = make(ledger)
        await budget.start()
        budget.departed()
        started = time.monotonic()
        for _ in range(21):
            grant = await budget.acquire()
            budget.departed()
            budget.departed()
            budget.release(grant, Feedback(Outcome.OK, 0.001))
        assert time.monotonic() - started >= 20 / 40.0 * 0.95

    async def test_a_pause_holds_ready_and_acquire_until_it_ends(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        until = time.time() + 0.3
        budget.pause(until, "test")
        assert budget.snapshot().paused_until == until
        grant = await asyncio.wait_for(budget.acquire(), 2.0)
        assert grant.at >= until
        await asyncio.wait_for(budget.ready(), 0.1)  # over: returns at once

    async def test_a_throttle_lowers_the_rate_and_a_retry_after_pauses(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        before = budget.snapshot().rate
        budget.release(await budget.acquire(), Feedback(Outcome.THROTTLED, 0.001, 1.0))
        snap = budget.snapshot()
        assert snap.rate < before
        assert snap.paused_until == pytest.approx(time.time() + 1.0, abs=0.1)

    async def test_cancelling_acquire_takes_nothing(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, concurrency=1)
        await budget.start()
        grant = await budget.acquire()
        waiter = asyncio.ensure_future(budget.acquire())
        await asyncio.sleep(0)  # one turn of the loop: the waiter starts (or not: either way)
        waiter.cancel()
        budget.release(grant, Feedback(Outcome.OK, 0.001))
        # Let the cancellation land: a slot the release handed to the waiter would only be
        # counted once the waiter has run.
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.snapshot().in_flight == 0

    async def test_admit_takes_the_slot_and_waits_out_a_hold_grant_paces(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, concurrency=1)
        await budget.start()
        until = time.time() + 0.3
        budget.pause(until, "test")
        admission = await asyncio.wait_for(budget.admit(), 2.0)
        assert admission.at >= until
        assert budget.snapshot().in_flight == 1  # the slot is held from the admission on
        # The only slot is taken: a second admission waits for it.
        second = asyncio.ensure_future(budget.admit())
        done, _ = await asyncio.wait({second}, timeout=0.1)
        assert not done
        grant = await asyncio.wait_for(budget.grant(admission), 2.0)
        assert grant is not None
        assert grant.at >= admission.at
        budget.release(grant, Feedback(Outcome.OK, 0.001))
        other = await asyncio.wait_for(second, 2.0)
        budget.withdraw(other)  # unused: the slot is free again
        budget.withdraw(other)  # and only once
        assert budget.snapshot().in_flight == 0

    async def test_a_hold_after_the_admission_grants_nothing_and_frees_the_slot(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, concurrency=2)
        await budget.start()
        admission = await budget.admit()
        budget.pause(time.time() + 60, "a Retry-After after the attempt was written")
        assert await asyncio.wait_for(budget.grant(admission), 1.0) is None
        assert budget.snapshot().in_flight == 0
        budget.withdraw(admission)  # spent by grant(): changes nothing
        assert budget.snapshot().in_flight == 0

    async def test_a_hold_beginning_while_grant_waits_ends_the_wait(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, rate_per_second=2.0, concurrency=4)
        await budget.start()
        first = await budget.acquire()  # the next token is about half a second away
        admission = await budget.admit()
        waiting = asyncio.ensure_future(budget.grant(admission))
        done, _ = await asyncio.wait({waiting}, timeout=0.05)
        assert not done
        budget.release(first, Feedback(Outcome.THROTTLED, 0.001, 60.0))
        assert await asyncio.wait_for(waiting, 2.0) is None
        assert budget.snapshot().in_flight == 0

    async def test_cancelling_grant_frees_the_slot(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, rate_per_second=1.0, concurrency=4)
        await budget.start()
        budget.release(await budget.acquire(), Feedback(Outcome.OK, 0.001))
        admission = await budget.admit()
        waiting = asyncio.ensure_future(budget.grant(admission))
        done, _ = await asyncio.wait({waiting}, timeout=0.05)
        assert not done
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert budget.snapshot().in_flight == 0
        budget.withdraw(admission)
        assert budget.snapshot().in_flight == 0

    async def test_what_was_learnt_survives_a_new_life(self, make: Factory,
                                                       ledger: SqliteLedger) -> None:
        quota = (QuotaConfig(limit=10, period_seconds=600.0, name="ten"),)
        first = make(ledger, quota=quota)
        await first.start()
        for _ in range(3):
            first.release(await first.acquire(), Feedback(Outcome.OK, 0.001))
        # A 429 that teaches a lower rate, then a pause in force.
        first.release(await first.acquire(), Feedback(Outcome.THROTTLED, 0.001, None))
        first.pause(time.time() + 600, "retry-after")
        await first.save()
        learnt = first.snapshot().state.w_max
        assert learnt is not None

        second = make(ledger, quota=quota)
        await second.start()
        snap = second.snapshot()
        assert snap.paused_until == pytest.approx(time.time() + 600, abs=2)
        # Never held long enough to be trusted: remembered a step under.
        assert snap.state.w_max == pytest.approx(learnt * policy.PROBE_BACK)
        assert [(q.name, q.remaining) for q in snap.quotas] == [("ten", 6)]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(second.acquire(), 0.2)  # nothing is sent before it ends

    async def test_the_state_is_small_and_serialisable(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        state = budget.snapshot().state
        blob = json.dumps(state.to_dict())
        assert len(blob) < 1024
        assert BudgetState.from_dict(json.loads(blob)) == state

    async def test_no_pause_lasts_longer_than_the_longest_pause(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, max_pause_s=60.0)
        await budget.start()
        budget.pause(time.time() + 1.8e12, "quota x-ratelimit exhausted")
        assert budget.snapshot().paused_until <= time.time() + 60.0
        budget.release(await _unpaused(budget), Feedback(Outcome.THROTTLED, 0.001, 1e9))
        assert budget.snapshot().paused_until <= time.time() + 60.0

    async def test_an_announced_quota_holds_no_longer_than_the_longest_pause(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger, max_pause_s=60.0)
        await budget.start()
        spent = Policy("x-ratelimit", 5000, 86400.0, remaining=0, reset_s=1.8e12)
        budget.release(await budget.acquire(), Feedback(Outcome.OK, 0.001, policies=(spent,)))
        snap = budget.snapshot()
        assert 0 < snap.held_for(time.time()) <= 60.0

    async def test_resume_lifts_a_pause_for_the_workers_waiting_on_it(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        budget.pause(time.time() + 600, "retry-after")
        spent = Policy("day", 5000, 86400.0, remaining=0, reset_s=600.0)
        budget.release(await _unpaused(budget, 0.0),
                       Feedback(Outcome.OK, 0.001, policies=(spent,)))
        waiter = asyncio.ensure_future(budget.acquire())
        await asyncio.sleep(0.05)
        assert not waiter.done()  # held by the pause
        budget.resume()
        grant = await asyncio.wait_for(waiter, 3.0)
        budget.release(grant, Feedback(Outcome.OK, 0.001))
        snap = budget.snapshot()
        assert (snap.paused_until, snap.held_for(time.time())) == (0.0, 0.0)
        await budget.save()
        # Lifted for the next life too.
        again = make(ledger)
        await again.start()
        assert again.snapshot().held_for(time.time()) == 0.0

    async def test_resume_can_forget_the_learnt_limit(
            self, make: Factory, ledger: SqliteLedger) -> None:
        budget = make(ledger)
        await budget.start()
        fresh = budget.snapshot().rate
        # A short Retry-After: a rate signal (a long one would be an imposed pause).
        budget.release(await budget.acquire(), Feedback(Outcome.THROTTLED, 0.001, 1.0))
        assert budget.snapshot().state.w_max is not None
        budget.resume()  # the pause only: the limit stays learnt
        state = budget.snapshot().state
        assert (state.paused_until, state.w_max is not None) == (0.0, True)
        budget.resume(forget_limit=True)
        state = budget.snapshot().state
        assert (state.w_max, state.announced, state.rate) == (None, None, fresh)

    async def test_a_saved_pause_longer_than_the_longest_pause_is_dropped_at_a_new_life(
            self, make: Factory, ledger: SqliteLedger, caplog: pytest.LogCaptureFixture,
    ) -> None:
        # Saved by a life that allowed far longer pauses (as one that read a reset in
        # milliseconds as seconds did).
        first = make(ledger, max_pause_s=1e13)
        await first.start()
        first.pause(time.time() + 1.8e12, "quota x-ratelimit exhausted")
        await first.save()
        assert first.snapshot().paused_until > time.time() + 1e12
        second = make(ledger)
        with caplog.at_level(logging.WARNING):
            await second.start()
        assert second.snapshot().paused_until == 0.0
        assert any(getattr(r, "action", "") == "budget_pause_dropped" for r in caplog.records)
        await asyncio.wait_for(second.acquire(), 2.0)

    async def test_a_saved_pause_within_the_longest_pause_is_kept(
            self, make: Factory, ledger: SqliteLedger) -> None:
        first = make(ledger, max_pause_s=1e13)
        await first.start()
        until = time.time() + 300
        first.pause(until, "retry-after")
        await first.save()
        second = make(ledger)
        await second.start()
        assert second.snapshot().paused_until == pytest.approx(until)


async def _unpaused(budget: RateBudget, hold_s: float = 0.0) -> Grant:
    """A grant while a pause is in force (what a request sent just before it got)."""
    return Grant(at=time.time() - hold_s)


async def test_two_limits_on_postgresql_are_two_shared_rows(pg: PgSchema) -> None:
    # As composition builds them for replicas: a requests' budget and an ids' budget,
    # each a shared row of its own. A 429 blamed on the ids cuts the ids' row only, and
    # the next replica to start finds the ids' limit learnt and the requests' untouched.
    pool = await create_pool(pg.dsn, pg.schema, min_size=1, max_size=4)
    await migrate(pool, pg.schema, MIGRATIONS)
    limits = _limits(rate_per_second=20.0)
    made: list[PostgresBudget] = []

    def pair() -> TwoLimits:
        budgets = [PostgresBudget(lim, key=key, pool=pool, dsn=pg.dsn, schema=pg.schema)
                   for lim, key in ((limits, "http://partner"),
                                    (item_limits(limits, 500.0), "http://partner#items"))]
        made.extend(budgets)
        return TwoLimits(*budgets)

    try:
        first = pair()
        await first.start()
        # 100 ids a batch: the ids allow 5 batches a second, under 20: they bind.
        first.release(await first.acquire(100), Feedback(Outcome.THROTTLED, 0.01))
        assert first.items.snapshot().state.w_max is not None
        assert first.requests.snapshot().state.w_max is None
        await first.save()
        second = pair()
        await second.start()
        assert second.items.snapshot().rate < 500.0
        assert second.items.snapshot().state.w_max is not None
        assert second.requests.snapshot().state.w_max is None
    finally:
        for budget in made:
            await budget.close()
        await pool.close()
