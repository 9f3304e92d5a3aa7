"""The partner's hidden rate, measured from two overloads (a delivery-rate estimate).

A client that honours ``Retry-After`` sees no accepted rate while it waits: what succeeded
before a 429 is its own pace. Two overloads do carry the partner's rate. A bucket with
``b`` tokens refilling at ``r``/s that the run's first overload drained at ``first_rate``
for ``first_s`` seconds says ``b = (first_rate - r) * first_s``; a probe that started with
the bucket full (its plateau held) was refused when its excess over ``r``, the integral of
its curve less ``r``, reached ``b``. The one ``r`` satisfying both, between the plateau and
the rate refused, is the limit: within 1 % against a token bucket or a GCRA in the model
(``bench/policy_grid.py``). A partner of another shape (a sliding log) can yield no root,
or a low one; the policy caps the harm (it only settles and slows probes on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

# The probe's curve is integrated over this many slices, and the root bracketed on a grid
# of as many steps, then bisected.
SAMPLES = 64


def limit(curve: Callable[[float], float], start: float, refused_at: float, plateau: float,
          high: float, first_rate: float, first_s: float) -> float | None:
    """The partner's rate between ``plateau`` and ``high`` (None: no such rate).

    ``curve``: the probe's rate at a time, from ``start`` to ``refused_at``;
    ``first_rate`` for ``first_s`` seconds: the run's first overload.
    """
    if not first_s or refused_at <= start or high <= plateau:
        return None
    dt = (refused_at - start) / SAMPLES
    rates = [curve(start + (i + 0.5) * dt) for i in range(SAMPLES)]

    def surplus(r: float) -> float:  # the probe's excess over r, less the burst at r
        return sum(x - r for x in rates if x > r) * dt - (first_rate - r) * first_s

    # Convex in r: positive at the plateau, the smaller root is the limit (the larger, if
    # any, is an artefact of a probe that went past first_rate).
    if surplus(plateau) <= 0:
        return None
    grid = [plateau + (high - plateau) * i / SAMPLES for i in range(SAMPLES + 1)]
    for lo, hi in itertools.pairwise(grid):
        if surplus(hi) <= 0:
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if surplus(mid) > 0 else (lo, mid)
            return (lo + hi) / 2
    return None
