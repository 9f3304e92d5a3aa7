"""The in-process rate budget: the policy's state, an aiolimiter bucket, the concurrency
limit and the quotas, for every worker of one process.

aiolimiter cannot change its rate at runtime (aiolimiter#98), so :func:`tune_bucket` sets
the bucket's rate and capacity in place and re-arms its timer, so waiters already queued
drain at the new rate; it is the one place that touches aiolimiter's internals, and
tests/unit/test_budget_local.py guards it against them changing.

Pacing modes: *tolerant* (capacity ``limits.burst``, a little over one token) catches up
after a late wake-up, so the average is the rate even with the event loop's millisecond
timers; *strict* (capacity 1, once the partner refused a request at the top) never lets
two requests closer than 1/rate, at the price of the wake-up lateness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from aiolimiter import AsyncLimiter

from supervisor.budget import policy
from supervisor.budget.announced import PACE_WINDOW_S, Announced
from supervisor.budget.base import Admission, Grant, QuotaView, Snapshot
from supervisor.budget.feedback import PolicyChange, PolicyFeedback, shown
from supervisor.budget.policy import BudgetState, PolicyConfig
from supervisor.budget.quota import RollingQuota
from supervisor.budget.settings import LimitsConfig
from supervisor.budget.slots import Slots

log = logging.getLogger(__name__)

__all__ = ["PACE_WINDOW_S", "LocalBudget", "charge", "tune_bucket"]


class MemoryStore(Protocol):
    async def load_budget(self, key: str) -> dict[str, Any] | None: ...

    async def save_budget(self, key: str, data: dict[str, Any]) -> None: ...


def tune_bucket(bucket: AsyncLimiter, rate: float, capacity: float, empty: bool = False) -> None:
    """Set ``bucket`` to ``rate`` per second and ``capacity`` tokens in place; ``empty``
    leaves no token, so the next grant waits a full period."""
    bucket._leak()
    # A batch's tokens charged beyond the capacity (charge()) are owed whatever the rate.
    owed = max(0.0, bucket._level - bucket.max_rate)
    bucket.max_rate = capacity
    bucket.time_period = capacity / rate
    bucket._rate_per_sec = rate
    if empty:
        bucket._level = capacity + owed
    else:
        bucket._level = min(bucket._level - owed, capacity) + owed
    bucket._wake_next()  # re-arm the timer of the waiter at the head with the new rate


async def charge(bucket: AsyncLimiter, tokens: int) -> None:
    """Take ``tokens`` in a row, as that many acquisitions one after the other would,
    in two waits: the first token, then the rest charged at once (nobody else gets a
    token before they have leaked) and waited out. One wait per token was the pace's
    own limit at hundreds of ids a second (each timer wakes late)."""
    await bucket.acquire()
    if tokens > 1:
        bucket._leak()
        bucket._level += tokens - 1
        await bucket.acquire(0)  # until the level is back within the capacity


class LocalBudget(PolicyFeedback):
    """The budget of one process. Construct it anywhere; it binds to the loop on first use."""

    def __init__(self, limits: LimitsConfig, key: str, store: MemoryStore | None = None,
                 clock: Callable[[], float] = time.time, timeout_s: float = math.inf,
                 max_pause_s: float = 900.0) -> None:
        self.cfg = PolicyConfig.from_limits(limits, max_pause_s)
        self.key = key
        self._burst = limits.burst
        self._store = store
        self._clock = clock
        self._state = policy.initial(self.cfg)
        self._bucket: AsyncLimiter | None = None
        self._costly = asyncio.Lock()  # one batch's tokens at a time (grant's cost)
        self._changed: asyncio.Event | None = None
        self._emptied_for = 0.0  # the pause whose end has emptied the bucket
        self._slots = Slots(limits.concurrency, timeout_s)
        self._quotas = [RollingQuota(q.name, q.limit, q.period_seconds) for q in limits.quotas]
        self._announced = Announced(max_pause_s)
        self._saving: asyncio.Task[None] | None = None

    # -- persistence -----------------------------------------------------------------

    async def start(self) -> None:
        if self._store is None:
            return
        data = await self._store.load_budget(self.key)
        if not data:
            return
        now = self._clock()
        try:
            memory = BudgetState.from_dict(data.get("state", {}))
        except (TypeError, ValueError):
            log.warning("budget memory for %s unreadable; starting fresh", self.key)
            return
        if policy.overlong(self.cfg, memory, now):
            log.warning("budget memory for %s holds a pause until %s, %.0f s away: longer than "
                        "any pause may last (partner.max_retry_after_seconds = %g); dropped",
                        self.key, shown(memory.paused_until), memory.paused_until - now,
                        self.cfg.max_pause_s, extra={"action": "budget_pause_dropped"})
        self._set(policy.remembered(self.cfg, memory, now), save=False)
        for quota in self._quotas:
            quota.restore(data.get("quotas", {}).get(quota.name), now)
        log.info("budget for %s starts at %.1f/s (learnt %s, paused until %s)", self.key,
                 self._state.rate, shown(memory.w_max), shown(self._state.paused_until or None),
                 extra={"action": "budget_remembered"})

    async def save(self) -> None:
        if self._store is None:
            return
        if self._saving is not None and self._saving is not asyncio.current_task():
            await asyncio.wait([self._saving])  # let a save in progress land first
        data = {"state": self._state.to_dict(),
                "quotas": {q.name: q.to_list() for q in self._quotas}}
        await self._store.save_budget(self.key, data)

    def _save_soon(self) -> None:
        if self._store is None or (self._saving is not None and not self._saving.done()):
            return

        async def save() -> None:
            try:
                await self.save()
            except Exception as exc:  # a fault the ledger reports itself; memory is best effort
                log.debug("could not save budget memory: %s", exc)

        self._saving = asyncio.get_running_loop().create_task(save(), name="budget-save")

    # -- pacing ----------------------------------------------------------------------

    def _ensure(self) -> tuple[AsyncLimiter, asyncio.Event]:
        if self._bucket is None or self._changed is None:
            self._bucket = AsyncLimiter(self._capacity(), self._capacity() / self._state.rate)
            self._changed = asyncio.Event()
        return self._bucket, self._changed

    def _capacity(self) -> float:
        return 1.0 if self._state.strict else self._burst

    def _held_until(self, now: float) -> tuple[float, str]:
        until, reason = self._state.paused_until, self._state.pause_reason
        for q in self._quotas:
            at = q.available_at(now)
            if at > until:
                until, reason = at, f"quota {q.name} exhausted"
        return (until, reason) if until > now else (0.0, "")

    async def ready(self) -> None:
        _, changed = self._ensure()
        held = False
        while (until := self._held_until(self._clock())[0]) > 0:
            held = True
            changed.clear()
            # Wake at the deadline, or earlier if the hold is extended or lifted.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, until - self._clock())):
                    await changed.wait()
        if held and self._emptied_for != self._state.paused_until:
            # The waiters must not burst the moment the hold ends.
            self._emptied_for = self._state.paused_until
            self._tune(empty=True)

    async def acquire(self, cost: int = 1) -> Grant:
        while True:
            if (grant := await self.grant(await self.admit(), cost)) is not None:
                return grant

    async def admit(self) -> Admission:
        return await self._slots.admit(self.ready, self._clock)

    async def grant(self, admission: Admission, cost: int = 1) -> Grant | None:
        if admission.spent:
            raise RuntimeError("LocalBudget.grant: this admission was spent already")
        admission.spent = True
        bucket, _ = self._ensure()
        try:
            if not self._held_until(self._clock())[0]:
                # One token at a time: a strict bucket holds one, and a batch's cost must
                # be paced as that many requests would be, not taken in one burst. One
                # batch's tokens in a row: two batches taking theirs in turn would both
                # leave at the end, their ids arriving at once.
                if cost > 1:
                    async with self._costly:
                        await charge(bucket, cost)
                else:
                    await bucket.acquire()
                now = self._clock()
                if not self._held_until(now)[0]:
                    for q in self._quotas:
                        for _ in range(max(1, cost)):
                            q.take(now)
                    return Grant(at=now)
            # A hold began after the admission (or while we waited for the token, which
            # is then forfeit): nothing is granted before it ends.
        except BaseException:
            self._slots.free()
            raise
        self._slots.free()
        return None

    def withdraw(self, admission: Admission) -> None:
        self._slots.withdraw(admission)

    def _apply(self, event: PolicyChange, now: float, cut: float | None = None) -> None:
        self._set(policy.step(self.cfg, self._state, event, now))

    def _succeeded(self, now: float) -> None:
        self._set(policy.step(self.cfg, self._state, policy.Success(), now))

    def _rate(self) -> float:
        return self._state.rate

    def _set(self, state: BudgetState, save: bool = True) -> None:
        """Take the policy's new state, and do what its change implies."""
        old, self._state = self._state, state
        if old.paused_until != state.paused_until and self._changed is not None:
            self._changed.set()  # waiters in ready() re-read the hold
        if (old.rate, old.strict) != (state.rate, state.strict):
            self._tune()
        # What a restart must not forget: a pause in force (or lifted), a limit learnt.
        if save and (old.paused_until, old.w_max, old.resumed_at) != (
                state.paused_until, state.w_max, state.resumed_at):
            self._save_soon()

    def _tune(self, empty: bool = False) -> None:
        if self._bucket is not None:
            tune_bucket(self._bucket, self._state.rate, self._capacity(), empty)

    def snapshot(self) -> Snapshot:
        now = self._clock()
        views = [QuotaView(q.name, q.limit, q.window_s, q.remaining(now), q.resets_at(now))
                 for q in self._quotas]
        views += self._announced.views(now, self._state.resumed_at)
        return self._snapshot(self._state, views)
