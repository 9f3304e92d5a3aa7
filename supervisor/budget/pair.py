"""Two limits on one partner: one on requests and one on ids (``batch.cost = "both"``).

Some partners count both: Klaviyo's bulk jobs (75 a second and 700 a minute of requests,
and the profiles they carry), Google's batch (every inner call counts, and so does the
batch), Salesforce (records and batches per day). A batch of k ids then needs one token
of the requests budget and k of the ids budget; each budget is the project's ordinary
adaptive one (local or shared by replicas), each with its own limit learnt from 429s.

Which limit a 429 implicates: the one the answer names (an item throttled on its own,
:attr:`Feedback.scope`), else the one that was binding for that request, judged from the
two rates: at k ids a request, the ids budget lets ``items_rate / k`` requests a second
through; whichever of that and the requests rate is lower is the limit the partner
refused, and both when they are within :data:`MARGIN` of each other (no evidence says
which). The other budget learns nothing from that answer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.budget.base import Admission, Feedback, Grant, Outcome, RateBudget, Snapshot
from supervisor.budget.settings import LimitsConfig

Scope = Literal["requests", "items", "both"]

# Two rates this close (relative) both bind: a 429 then implicates both limits.
MARGIN = 0.1


@dataclass(frozen=True, slots=True)
class PairGrant(Grant):
    """A request's token and its ids' tokens."""

    items: Grant | None = None
    cost: int = 1


def item_limits(limits: LimitsConfig, items_per_second: float) -> LimitsConfig:
    """The ids budget's ``[limits]``: the requests budget's adaptation (decrease, probes,
    recovery) at ``items_per_second``, its floor scaled alike; quotas stay with requests
    (a partner's daily quota counts its calls)."""
    scale = items_per_second / limits.rate_per_second
    return dataclasses.replace(limits, rate_per_second=items_per_second,
                               floor_per_second=limits.floor_per_second * scale, quota=())


def implicated(requests_rate: float, items_rate: float, cost: int,
               margin: float = MARGIN) -> Scope:
    """The limit a whole request's 429 implicates when the answer does not say: the one
    binding at ``cost`` ids a request (see the module's docstring)."""
    allowed = items_rate / max(1, cost)
    if allowed < requests_rate * (1 - margin):
        return "items"
    if requests_rate < allowed * (1 - margin):
        return "requests"
    return "both"


class TwoLimits:
    """A :class:`~supervisor.budget.base.RateBudget` over a requests budget and an ids
    budget. ``grant(admission, k)`` takes one request token and k id tokens: the ids'
    first, so that the request leaves right after its own token (request spacing stays
    what the requests budget paces)."""

    def __init__(self, requests: RateBudget, items: RateBudget) -> None:
        self.requests = requests
        self.items = items

    async def start(self) -> None:
        await self.requests.start()
        await self.items.start()

    async def close(self) -> None:
        for budget in (self.items, self.requests):
            close: Any = getattr(budget, "close", None)
            if close is not None:
                await close()

    async def ready(self) -> None:
        await self.items.ready()
        await self.requests.ready()

    async def acquire(self, cost: int = 1) -> Grant:
        while True:
            if (grant := await self.grant(await self.admit(), cost)) is not None:
                return grant

    async def admit(self) -> Admission:
        return await self.requests.admit()

    async def grant(self, admission: Admission, cost: int = 1) -> Grant | None:
        now = time.time()
        if self.items.snapshot().held_for(now) > 0:
            # A hold on the ids (their Retry-After) holds the request: nothing granted.
            self.requests.withdraw(admission)
            return None
        try:
            items = await self.items.grant(await self.items.admit(), cost)
        except BaseException:
            self.requests.withdraw(admission)
            raise
        if items is None:
            self.requests.withdraw(admission)
            return None
        try:
            grant = await self.requests.grant(admission, 1)
        except BaseException:
            self.items.release(items, Feedback(Outcome.OTHER))
            raise
        if grant is None:
            self.items.release(items, Feedback(Outcome.OTHER))
            return None
        return PairGrant(at=grant.at, cut=grant.cut, paced_at=grant.paced_at, items=items,
                         cost=cost)

    def withdraw(self, admission: Admission) -> None:
        self.requests.withdraw(admission)

    def departed(self) -> None:
        self.requests.departed()
        self.items.departed()

    def implicated(self, cost: int) -> Scope:
        return implicated(self.requests.snapshot().rate, self.items.snapshot().rate, cost)

    def release(self, grant: Grant, feedback: Feedback) -> None:
        mine = grant if isinstance(grant, PairGrant) else PairGrant(grant.at, grant.cut,
                                                                        grant.paced_at)
        scope: Scope = "both"
        if feedback.outcome is Outcome.THROTTLED:
            scope = feedback.scope or self.implicated(mine.cost)
        unblamed = Feedback(Outcome.OTHER, feedback.latency_s)
        self.requests.release(Grant(mine.at, mine.cut, mine.paced_at),
                              feedback if scope in ("requests", "both") else unblamed)
        if mine.items is not None:
            # Announced policies describe the partner's request limits: they stay there.
            self.items.release(mine.items, dataclasses.replace(feedback, policies=())
                               if scope in ("items", "both") else unblamed)

    def pause(self, until: float, reason: str) -> None:
        self.requests.pause(until, reason)
        self.items.pause(until, reason)

    def resume(self, forget_limit: bool = False) -> None:
        self.requests.resume(forget_limit)
        self.items.resume(forget_limit)

    def snapshot(self) -> Snapshot:
        """The requests budget's, held as long as either is (an ids budget paused by a
        Retry-After holds every request)."""
        snap, items = self.requests.snapshot(), self.items.snapshot()
        if items.paused_until > snap.paused_until:
            snap = dataclasses.replace(snap, state=dataclasses.replace(
                snap.state, paused_until=items.paused_until,
                pause_reason=items.state.pause_reason))
        return snap

    async def save(self) -> None:
        await self.requests.save()
        await self.items.save()
