"""Quotas longer than a second (3,000 an hour, 50,000 a day), configured or learnt.

A configured quota is counted here as a *rolling* window of ``window_s``, in
``SLOTS`` slots: never more than ``limit`` in any window, so never more than a partner's
fixed window of the same size allows either, wherever its boundaries fall. Pure: times
are arguments. The counts serialise, so a restart does not forget what was spent.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

SLOTS = 60


@dataclass(slots=True)
class RollingQuota:
    name: str
    limit: int
    window_s: float
    _slots: deque[list[float]] = field(default_factory=deque)  # [slot start, count]
    _used: int = 0

    @property
    def slot_s(self) -> float:
        return self.window_s / SLOTS

    def _expire(self, now: float) -> None:
        # A slot leaves the window only once all of it is older than the window: counting
        # it a little longer is the conservative side.
        while self._slots and self._slots[0][0] + self.slot_s + self.window_s <= now:
            self._used -= int(self._slots.popleft()[1])

    def remaining(self, now: float) -> int:
        self._expire(now)
        return max(0, self.limit - self._used)

    def available_at(self, now: float) -> float:
        """When the next request may go: ``now`` unless the quota is spent."""
        self._expire(now)
        if self._used < self.limit:
            return now
        freed = 0
        for start, count in self._slots:
            freed += int(count)
            if self._used - freed < self.limit:
                return start + self.slot_s + self.window_s
        return now  # unreachable: the counts add up to _used

    def resets_at(self, now: float) -> float:
        """When the oldest use still counted leaves the window; 0 when nothing is used."""
        self._expire(now)
        return self._slots[0][0] + self.slot_s + self.window_s if self._slots else 0.0

    def take(self, now: float) -> None:
        start = math.floor(now / self.slot_s) * self.slot_s
        if self._slots and self._slots[-1][0] == start:
            self._slots[-1][1] += 1
        else:
            self._slots.append([start, 1.0])
        self._used += 1

    def to_list(self) -> list[list[float]]:
        return [list(s) for s in self._slots]

    def restore(self, slots: Any, now: float) -> None:
        """Counts an earlier life saved; anything malformed is ignored (counted as unused
        would overspend, so it is better read as nothing only when it cannot be read)."""
        if not isinstance(slots, list):
            return
        for item in slots:
            if (isinstance(item, list) and len(item) == 2
                    and all(isinstance(v, int | float) and math.isfinite(v) for v in item)
                    and item[1] > 0):
                self._slots.append([float(item[0]), float(int(item[1]))])
                self._used += int(item[1])
        self._expire(now)
