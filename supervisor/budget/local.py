"""The in-process rate budget: the policy's state, a precise pacer, the concurrency limit
and the quotas, for every worker of one process.

Pacing modes (:mod:`supervisor.budget.pacer`): *tolerant* (``limits.burst``, a little over
one token) keeps an absolute schedule and catches up after a late wake-up, so the average
is the rate; *strict* (once the partner refused a request at the top) never lets two
requests leave closer than 1/rate. A new rate reaches the waiters already queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from supervisor.budget import policy
from supervisor.budget.announced import PACE_WINDOW_S, Announced
from supervisor.budget.base import Admission, Grant, QuotaView, Snapshot
from supervisor.budget.feedback import PolicyChange, PolicyFeedback, shown
from supervisor.budget.pacer import Pacer
from supervisor.budget.policy_state import BudgetState, PolicyConfig, Success
from supervisor.budget.quota import RollingQuota
from supervisor.budget.settings import LimitsConfig
from supervisor.budget.slots import Slots

log = logging.getLogger(__name__)

__all__ = ["PACE_WINDOW_S", "LocalBudget"]


class MemoryStore(Protocol):
    async def load_budget(self, key: str) -> dict[str, Any] | None: ...

    async def save_budget(self, key: str, data: dict[str, Any]) -> None: ...


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
        self._pacer: Pacer | None = None
        self._changed: asyncio.Event | None = None
        self._emptied_for = 0.0  # the pause whose end has emptied the pacer
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

    def _ensure(self) -> tuple[Pacer, asyncio.Event]:
        if self._pacer is None or self._changed is None:
            self._pacer = Pacer(self._state.rate, self._tolerance())
            self._changed = asyncio.Event()
        return self._pacer, self._changed

    def _tolerance(self) -> float:
        return Pacer.tolerance(self._state.rate, self._burst, self._state.strict)

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
        pacer, _ = self._ensure()
        try:
            if not self._held_until(self._clock())[0]:
                # A batch's cost is paced as that many requests in a row would be, not
                # taken in one burst.
                await pacer.take(cost)
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

    def departed(self) -> None:
        if self._pacer is not None:
            self._pacer.departed()

    def _apply(self, event: PolicyChange, now: float, cut: float | None = None) -> None:
        self._set(policy.step(self.cfg, self._state, event, now))

    def _succeeded(self, now: float, sent_at: float) -> None:
        self._set(policy.step(self.cfg, self._state, Success(sent_at), now))

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
        if self._pacer is not None:
            self._pacer.tune(self._state.rate, self._tolerance(), empty)

    def snapshot(self) -> Snapshot:
        now = self._clock()
        views = [QuotaView(q.name, q.limit, q.window_s, q.remaining(now), q.resets_at(now))
                 for q in self._quotas]
        views += self._announced.views(now, self._state.resumed_at)
        return self._snapshot(self._state, views)
