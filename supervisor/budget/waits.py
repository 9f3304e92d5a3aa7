"""How long the rate policy waits where the partner does not say.

Two waits, each weighed against what it costs: the backoff after a 429 without
``Retry-After`` (a partner closed for we do not know how long), and the length of the next
probe once one was refused close over a level that held (a probe worth its 429). Pure
arithmetic, used by :mod:`supervisor.budget.policy`.
"""

from __future__ import annotations

import math

# A 429 without Retry-After: pause everyone this long, doubling per 429 in a row...
BLIND_BASE_S = 0.1
# ...up to this, or this share of the time the partner has been closed if longer: a
# partner closed without saying how long is probed by one request at a time, so a run
# resumes at most that long after it reopens. A backoff that kept doubling overshot a 3 s
# storm by 3 s; a fixed 0.5 s, by 0.22 s a storm (1.064 x N/R over three; 0.25 s: 1.04 in
# the model), and probed an hour-long closure twice a second throughout.
BLIND_MAX_S = 0.25
BLIND_SHARE = 0.1
# 2.0 ** 1024 overflows: a fixed cap met that 8.5 minutes into a closure.
_MAX_DOUBLINGS = 64


def blind_backoff(blind: int, closed_s: float) -> float:
    """The pause after a 429 without ``Retry-After``, ``blind`` such 429s in a row before
    it, the first ``closed_s`` seconds ago."""
    grown = BLIND_BASE_S * 2.0 ** min(blind, _MAX_DOUBLINGS)
    return min(grown, max(BLIND_MAX_S, BLIND_SHARE * closed_s))


def repaid_s(level: float, failed: float, high: float, pause_s: float) -> float:
    """The length of a probe from ``level`` towards ``high`` that reaches ``failed`` (the
    rate a probe was refused at) no sooner than the rate it could gain below there,
    ``failed - level``, repays a 429's ``pause_s`` of every worker.

    A limit bracketed closely is hardly worth probing: between 48 and 51.2/s (a sliding
    log of 50/s), the doubled probe crossed the limit again twice in a 30 s run, each time
    for a 1 - 2 s HTTP-date pause (5 429s, 1.14 x N/R in the model; 1.22 - 1.26 over HTTP).
    Probing this slowly: 3 429s, 1.07 (1.13 - 1.22 over HTTP). A wide bracket, or a bare
    429's 0.1 s pause, keeps probing as often as before.
    """
    gap = failed - level
    if gap <= 0 or high <= level:
        return 0.0
    # The cubic probe (policy.curve) is at level + (high - level) * x**3 a fraction x of
    # the way.
    return pause_s * level / gap / math.cbrt(gap / (high - level))
