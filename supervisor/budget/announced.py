"""The partner's longer rate-limit policies, as its headers announce them, for both budgets.

A policy with a window of ``PACE_WINDOW_S`` or less is a pace (the budget's rate follows
it); a longer one is a quota to spend, kept here by name with when it was announced (its
reset counts from then), and a spent one pauses every worker until its reset. The names
are the partner's: at most ``MAX_ANNOUNCED`` are kept, the one announced longest ago
evicted first, so a partner naming a new policy in every answer grows neither memory, nor
the cost of a snapshot, nor the metric labels they become (review L4).
"""

from __future__ import annotations

import dataclasses

from supervisor.budget.base import Policy, QuotaView
from supervisor.budget.policy_state import Announce, Pause

# A rate policy with a window this long or shorter is a pace; longer, a quota to spend.
PACE_WINDOW_S = 60.0
MAX_ANNOUNCED = 16


class Announced:
    """``max_pause_s``: no reset is taken as further away than the longest pause."""

    def __init__(self, max_pause_s: float, limit: int = MAX_ANNOUNCED) -> None:
        self._max_pause_s = max_pause_s
        self._limit = limit
        self._by_name: dict[str, tuple[Policy, float]] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def learn(self, policies: tuple[Policy, ...],
              now: float) -> tuple[Announce, list[Pause]]:
        """What one answer's policies tell the policy: the per-second limit to pace by,
        and the pauses for quotas it says are spent."""
        paces = [p.limit / p.window_s for p in policies if p.window_s <= PACE_WINDOW_S]
        pauses = []
        for p in policies:
            if p.window_s > PACE_WINDOW_S or not paces:
                p = self._note(p, now)
                # Spent: everyone waits for the reset. Pacing by a short policy keeps its
                # remaining near 0 all the time, so only longer ones (or a lone one) hold.
                if p.remaining is not None and p.remaining < 1 and p.reset_s:
                    pauses.append(Pause(now + p.reset_s, f"quota {p.name} exhausted"))
        return Announce(min(paces) if paces else None), pauses

    def _note(self, p: Policy, now: float) -> Policy:
        if p.reset_s is not None and p.reset_s > self._max_pause_s:
            p = dataclasses.replace(p, reset_s=self._max_pause_s)
        self._by_name.pop(p.name, None)  # re-announced: the newest again
        self._by_name[p.name] = (p, now)
        while len(self._by_name) > self._limit:
            del self._by_name[next(iter(self._by_name))]
        return p

    def views(self, now: float, since: float) -> list[QuotaView]:
        """The quotas whose reset is still ahead, announced after ``since`` (when an
        operator last lifted the pause: what was spent before no longer holds)."""
        out = []
        for p, at in self._by_name.values():
            if at < since or p.remaining is None or p.reset_s is None or now > at + p.reset_s:
                continue
            out.append(QuotaView(p.name, p.limit, p.window_s, p.remaining, at + p.reset_s))
        return out
