"""How far the consumers have got, for redrive (:mod:`supervisor.redrive`).

Each arrival is sampled: when it came and the latest due time among what came. Redrive
calls a message lost once the consumers have moved past its due time and nothing has
touched it since.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

from supervisor.model import Received

SAMPLES = 4096


class Frontier:
    def __init__(self, samples: int = SAMPLES) -> None:
        # (when, latest due time) of each arrival, and when a receive last found nothing.
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=samples)
        self._empty_at = 0.0

    def sample(self, received: Sequence[Received]) -> None:
        """The latest due time among what just arrived."""
        dues = [r.operation.due_at for r in received if r.operation and r.operation.due_at]
        if dues:
            self._samples.append((time.time(), max(dues)))

    def found_nothing(self) -> None:
        self._empty_at = time.time()

    def horizon(self, grace_s: float, now: float) -> float | None:
        """The due time of what was being received ``grace_s`` ago; or now less the grace
        when nothing has been there to receive for that long. None when no sample is old
        enough."""
        cutoff = now - grace_s
        last = self._samples[-1][0] if self._samples else 0.0
        if self._empty_at > last and last < cutoff and self._empty_at >= cutoff:
            return cutoff  # starved: everything still waiting was lost
        older = [due for at, due in self._samples if at <= cutoff]
        return max(older) if older else None
