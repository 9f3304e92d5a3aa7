"""One replica's reserved slots of the shared budget, and the workers sleeping on them.

A slot is a wall-clock time at which one request may leave. The replica reserves them on
the row in blocks (GCRA: :meth:`supervisor.postgres.budget_row.BudgetTable.reserve`, or a short
transaction when quotas are configured); how is the budget's business
(:mod:`supervisor.postgres.budget`). Here is what happens to them once reserved:

* **A block is sized to the demand**: one slot for every worker in acquire(), or what
  the replica was granted over the last second scaled to ``RESERVE_S``, whichever is
  more, and never more than ``RESERVE_S`` at the rate. Too many cost at most a block
  (unused slots go stale); too few, a statement per grant.
* **It starts no earlier than the answer is expected back, less the tolerance**
  ((burst - 1)/rate, 0 when strict): ``lag`` follows the reservations' round trips.
* **Workers sleep until their slot.** One overslept by more than the tolerance plus
  ``STALE_S`` is forfeit, so a stall of the event loop delays requests but never lets the
  overdue ones leave together. A cancelled sleeper hands its slot to the next worker.
* **A void** (a cut or a pause, here or on the row) drops every slot reserved so far and
  wakes their sleepers: the generation moves on, and a block answered for an older
  generation is dropped too, since it may predate the void.
* One reservation runs at a time: every worker short of a slot waits for the same one.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from supervisor.budget.pacer import PreciseSleep
from supervisor.budget.policy_state import BudgetState

# A reservation covers at most this much time at the rate: replicas interleave in blocks
# this long, and a cut voids at most this much of another replica's pacing.
RESERVE_S = 0.2
# This replica's demand is its grants over this long.
DEMAND_S = 1.0
# A slot still unused this long past its time (beyond the tolerance) is forfeit: after a
# stall of the event loop the overdue slots must not all leave at once.
STALE_S = 0.02
# How fast the estimate of a reservation's round trip follows the latest one.
LAG_ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class Block:
    """A reservation's answer: its slots (wall clock), the generation they were reserved
    in, and when the reservation was computed (for the round trip)."""

    slots: list[float]
    gen: int
    computed_at: float


class SlotBook:
    """The slots one replica holds. ``state`` gives the replica's current view of the
    policy's state (its tolerance decides when a slot is stale)."""

    def __init__(self, burst: float, clock: Callable[[], float],
                 state: Callable[[], BudgetState]) -> None:
        self._burst = burst
        self._clock = clock
        self._state = state
        # Reserved slots (wall clock), all of generation ``gen``; a void starts a new one.
        self._slots: deque[float] = deque()
        # When each slot's spacing was computed (its reservation): the policy measures a
        # probe's requests against the rate they were paced at (Throttle.paced_at).
        self._computed: dict[float, float] = {}
        self.gen = 0
        self._voided = asyncio.Event()
        self.reserving: asyncio.Task[None] | None = None
        # Workers past their concurrency slot, not yet granted: each needs a slot soon, those
        # sleeping on one already included (they come back for the next one right after).
        self.acquiring = 0
        self._granted: deque[float] = deque(maxlen=4096)  # this replica's recent grants
        self.lag = 0.0  # a reservation's round trip, as expected
        self.reservations = 0
        self._sleep = PreciseSleep(clock)  # a slot is left on time, to the tenth of a ms

    def __len__(self) -> int:
        return len(self._slots)

    def tolerance(self, state: BudgetState) -> float:
        return 0.0 if state.strict else (self._burst - 1.0) / max(state.rate, 1e-9)

    def stale(self, at: float, now: float) -> bool:
        return now > at + self.tolerance(self._state()) + STALE_S

    def earliest(self, state: BudgetState, now: float) -> float:
        """The earliest start of a reservation computed at ``now``: when its answer is
        expected back, less the tolerance."""
        return now + self.lag - self.tolerance(state)

    def size(self, rate: float, now: float) -> int:
        """How many slots to reserve now, at ``rate``."""
        return max(1, min(self._demand(now), math.ceil(rate * RESERVE_S)))

    def _demand(self, now: float) -> int:
        """The slots this replica will use soon: one for every worker in acquire() (those
        sleeping on a slot too: they come back for the next one), or what it was granted
        over the last 200 ms of the last second, whichever is more."""
        while self._granted and self._granted[0] < now - DEMAND_S:
            self._granted.popleft()
        return max(self.acquiring, math.ceil(len(self._granted) * RESERVE_S / DEMAND_S))

    def granted(self, now: float) -> None:
        self._granted.append(now)

    def add(self, block: Block) -> None:
        """Take a reservation's answer."""
        received = self._clock()
        self.lag += LAG_ALPHA * (received - block.computed_at - self.lag)
        self.reservations += bool(block.slots)
        if block.gen != self.gen:
            return  # it may predate a void: dropped, to be safe
        fresh = [at for at in block.slots if not self.stale(at, received)]
        if block.slots and not fresh:
            # An answer slower than expected: its slots are gone, but one is used now (a
            # slow database must not starve every worker).
            fresh = [received]
        self._slots.extend(fresh)
        self._computed.update((at, block.computed_at) for at in fresh)

    def paced_at(self, at: float) -> float | None:
        """When the spacing of the slot ``at``, just used, was computed."""
        return self._computed.pop(at, None)

    def void(self) -> None:
        """Drop every slot reserved so far and wake the workers sleeping on one."""
        self._slots.clear()
        self._computed.clear()
        self.gen += 1
        self._voided.set()
        self._voided = asyncio.Event()

    async def next(self, reserve: Callable[[], Coroutine[Any, Any, None]],
                   held: Callable[[float], bool]) -> float | None:
        """A reserved slot, running ``reserve`` when there is none; None when the
        reservation brought none (a hold began, a quota is spent, the database failed):
        the caller re-reads the hold."""
        while True:
            now = self._clock()
            while self._slots and self.stale(self._slots[0], now):
                self._computed.pop(self._slots.popleft(), None)
            if self._slots:
                return self._slots.popleft()
            if held(now):
                return None
            if self.reserving is None or self.reserving.done():
                self.reserving = asyncio.get_running_loop().create_task(
                    reserve(), name="budget-reserve")
            # A cancelled waiter leaves the reservation be: the others need it.
            await asyncio.wait([self.reserving])
            if not self._slots:
                return None

    async def wait(self, at: float, gen: int) -> bool:
        """Sleep until the slot; False when it is void by then, or was overslept (a late
        wake-up delays a request, it does not let it bunch with the next ones)."""
        try:
            while gen == self.gen and at - self._clock() > 0:
                await self._sleep.until(at, self._voided)
        except asyncio.CancelledError:
            if gen == self.gen and not self.stale(at, self._clock()):
                bisect.insort(self._slots, at)  # unused: another worker takes it
            else:
                self._computed.pop(at, None)
            raise
        return gen == self.gen and not self.stale(at, self._clock())
