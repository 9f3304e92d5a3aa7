"""The rate budget protocol: what the consumer, the reconciler and the monitor may ask of it.

An implementation paces every request of every worker (and, later, of every replica)
through one adaptive rate, one pause and one set of quotas. The in-process one is
:class:`supervisor.budget.local.LocalBudget`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Protocol

from supervisor.budget.policy_state import BudgetState


class Outcome(enum.Enum):
    OK = "ok"  # the partner accepted the request (2xx, 404)
    THROTTLED = "throttled"  # 429
    OTHER = "other"  # an error, a timeout, a probe: no rate signal


@dataclass(frozen=True, slots=True)
class Policy:
    """One rate-limit policy the partner announced (or the configuration declares)."""

    name: str
    limit: int
    window_s: float
    remaining: int | None = None
    reset_s: float | None = None


@dataclass(frozen=True, slots=True)
class Feedback:
    """What one answer tells the budget."""

    outcome: Outcome
    latency_s: float = 0.0
    retry_after_s: float | None = None
    policies: tuple[Policy, ...] = ()
    # The limit a 429 names, where a partner counts both requests and ids
    # (supervisor/budget/pair.py): "items" for an item throttled on its own; "" unsaid.
    scope: Literal["", "requests", "items"] = ""


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission for one request; hand it back with :meth:`RateBudget.release`."""

    at: float  # wall clock of the grant: which cut the answer belongs to
    # The cut its slot was paced under (BudgetState.cut_at), where the budget paces by
    # cuts (the shared one); None: the grant's time decides.
    cut: float | None = None
    # When the rate that spaced it was read, where that is earlier than the grant (the
    # shared budget reserves slots ahead); None: at the grant.
    paced_at: float | None = None


@dataclass(slots=True)
class Admission:
    """A concurrency slot taken by :meth:`RateBudget.admit`, with no hold in force then:
    spent by :meth:`RateBudget.grant` (a grant, or nothing), or given back unused by
    :meth:`RateBudget.withdraw`. Whichever comes first frees it; the rest do nothing."""

    at: float  # wall clock of the admission
    spent: bool = False


@dataclass(frozen=True, slots=True)
class QuotaView:
    name: str
    limit: int
    window_s: float
    remaining: int
    resets_at: float  # wall clock; 0 when nothing is used


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The budget at one instant, for metrics, the API and projections."""

    state: BudgetState
    ceiling: float
    concurrency_limit: int
    concurrency_max: int
    in_flight: int
    # The configured maximum in flight, not the rate, bounds the pace (Little's law).
    concurrency_bound: bool = False
    quotas: tuple[QuotaView, ...] = field(default_factory=tuple)

    @property
    def rate(self) -> float:
        return self.state.rate

    @property
    def paused_until(self) -> float:
        return self.state.paused_until

    def held_for(self, now: float) -> float:
        """How long :meth:`RateBudget.ready` would hold a worker now: a pause in force, or
        a spent quota until its reset (0 when nothing holds)."""
        hold = self.state.paused_until - now
        for q in self.quotas:
            if q.remaining <= 0:
                hold = max(hold, q.resets_at - now)
        return max(0.0, hold)

    def projected_finish(self, remaining_ops: int, now: float) -> float:
        """When ``remaining_ops`` more requests will have been sent, given the rate, a
        pause in force and every quota's remaining allowance and reset."""
        if remaining_ops <= 0:
            return now
        start = max(now, self.state.paused_until)
        finish = start + remaining_ops / max(self.state.rate, 1e-9)
        for q in self.quotas:
            beyond = remaining_ops - q.remaining
            if beyond <= 0 or q.limit <= 0:
                continue
            # Each further window lets ``limit`` more through after its reset.
            windows = (beyond - 1) // q.limit
            last = max(start, q.resets_at) + windows * q.window_s
            finish = max(finish, last + (beyond - windows * q.limit) / max(self.state.rate, 1e-9))
        return finish


class RateBudget(Protocol):
    """One budget for every request to one partner."""

    async def start(self) -> None:
        """Load what an earlier life learnt (rate, pause, quota use)."""

    async def ready(self) -> None:
        """Wait while every worker is held (a Retry-After pause, an exhausted quota).

        Returns at once otherwise. Call it before committing to a request (before the
        attempt is written), so a long hold does not keep an attempt open.
        """

    async def acquire(self, cost: int = 1) -> Grant:
        """Wait for a concurrency slot, the pause and quotas, then ``cost`` tokens (a batch
        of k ids to a partner whose limit counts ids costs k); the request should leave
        right after. Cancellation takes nothing."""

    async def admit(self) -> Admission:
        """The first half of :meth:`acquire`: wait for a concurrency slot and out any hold,
        and keep the slot. Call it before the attempt is written, so that an attempt is
        never open while its worker waits for a slot or a pause. Cancellation takes
        nothing."""

    async def grant(self, admission: Admission, cost: int = 1) -> Grant | None:
        """The second half: wait for ``cost`` tokens under ``admission``'s slot (which it
        spends). None, with the slot freed, when a hold began meanwhile (a Retry-After, a
        spent quota): the caller closes its attempt unsent and waits out the hold before
        writing another. Cancellation frees the slot and takes nothing."""

    def withdraw(self, admission: Admission) -> None:
        """Free an admission's slot unused (the attempt could not be written); nothing
        once :meth:`grant` has spent it."""

    def departed(self) -> None:
        """A request to the partner has just left (its headers are being written): strict
        pacing counts the next one's spacing from here too (:mod:`supervisor.budget.pacer`)."""

    def release(self, grant: Grant, feedback: Feedback) -> None:
        """The answer to a granted request: frees its slot and feeds the policy."""

    def pause(self, until: float, reason: str) -> None:
        """Hold every worker until the wall-clock time ``until`` (at most the longest pause,
        ``partner.max_retry_after_seconds``, from now)."""

    def resume(self, forget_limit: bool = False) -> None:
        """An operator lifts the pause (and the partner's spent quotas) for every worker
        (of every replica); with ``forget_limit`` also the limit learnt from 429s and
        headers. :meth:`save` makes it durable."""

    def snapshot(self) -> Snapshot: ...

    async def save(self) -> None:
        """Persist what was learnt (at the end of a run and at shutdown)."""
