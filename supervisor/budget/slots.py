"""The concurrency gate both budgets share: how many requests are in flight under the
gradient limit (``concurrency.py``), the wait for a slot and everything holding the workers
(``admit``), and the warning when the limit, not the rate, sets the pace."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from supervisor.budget.base import Admission
from supervisor.budget.concurrency import GradientLimit

log = logging.getLogger("supervisor.budget")


class Slots:
    def __init__(self, maximum: int, timeout_s: float) -> None:
        self.limit = GradientLimit(maximum, timeout_s)
        self.in_flight = 0
        # Made by the first wait, in the loop that runs it (a budget may be built outside).
        self._free: asyncio.Event | None = None
        self._bound_logged = False

    async def admit(self, ready: Callable[[], Awaitable[None]],
                    clock: Callable[[], float]) -> Admission:
        """A slot first, then every hold waited out (``ready``): the token, whose timing
        is what the partner sees, comes last (the budget's ``grant``)."""
        if self._free is None:
            self._free = asyncio.Event()
        while self.in_flight >= self.limit.value:
            self._free.clear()
            await self._free.wait()
        self.in_flight += 1
        try:
            await ready()
        except BaseException:
            self.free()
            raise
        return Admission(at=clock())

    def free(self) -> None:
        self.in_flight -= 1
        if self._free is not None:
            self._free.set()

    def withdraw(self, admission: Admission) -> None:
        """Give back an admission's slot unless its grant already did."""
        if not admission.spent:
            admission.spent = True
            self.free()

    def sample(self, latency_s: float, rate: float) -> None:
        """One healthy answer's latency; says once when the limit bounds ``rate``."""
        self.limit.sample(latency_s, self.in_flight + 1)
        bound = self.limit.bounds(rate)
        if bound and not self._bound_logged:
            long = self.limit.long or 0.0
            log.warning("limits.concurrency = %d bounds the pace: %.1f/s at %.0f ms needs %d "
                        "in flight", self.limit.maximum, rate, 1000 * long,
                        math.ceil(rate * long), extra={"action": "concurrency_bound"})
        self._bound_logged = bound
