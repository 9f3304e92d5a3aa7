"""The rate policy alone against hidden limits the HTTP matrix never tries.

The matrix's hidden-limit cells all put the limit at half the ceiling, where one halving
lands just under it. This runs the pure policy (``supervisor.budget.policy``, no sockets,
no clock) against a modelled token bucket at limits from 10 % to 97 % of the ceiling and
bursts from 1.5 to 25 tokens, each 429 carrying the whole-second ``Retry-After`` such a
partner sends, and prints the ratio (time / (N / R)) and the 429s of every pair, for a
30 s and a 300 s run, then the mean and the worst. A model, not a measurement: no network,
no event loop, no jitter (the bucket of one is left out: its refusals are the host's
jitter, which only the HTTP matrix has). Seconds to run.

Usage: python bench/policy_grid.py [--ceiling 100] [--seconds 30,300]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.budget.policy import (
    BudgetState,
    PolicyConfig,
    Success,
    Throttle,
    initial,
    step,
)
from supervisor.budget.settings import LimitsConfig

T0 = 1_800_000_000.0
SHARES = (0.10, 0.20, 0.35, 0.50, 0.70, 0.84, 0.97)
BURSTS = (1.5, 2.0, 5.0, 10.0, 25.0)


@dataclass
class Run:
    refused: int
    done: int
    seconds: float
    state: BudgetState
    # (time, rate) after every answer: how the policy followed the limit.
    rates: list[tuple[float, float]]

    def ratio(self, limit: float) -> float:
        return self.seconds / (self.done / limit)


def steady(rate: float) -> Callable[[float], float]:
    return lambda _t: rate


def drain(ceiling: float, limit: Callable[[float], float], burst: float, n: int) -> Run:
    """Send ``n`` requests paced by the policy to a bucket refilling at ``limit(t)``/s."""
    c = PolicyConfig.from_limits(LimitsConfig(rate_per_second=ceiling, floor_per_second=0.5))
    s = initial(c)
    t = last = 0.0
    tokens = burst
    done = refused = 0
    rates: list[tuple[float, float]] = []
    while done < n and t < 100 * n / limit(0.0):
        t = max(t + 1.0 / s.rate, s.paused_until - T0)
        rate = limit(t)
        tokens = min(burst, tokens + (t - last) * rate)
        last = t
        if tokens >= 1.0:
            tokens -= 1.0
            done += 1
            s = step(c, s, Success(), T0 + t)
        else:
            refused += 1
            retry_after = float(math.ceil((1.0 - tokens) / rate))
            s = step(c, s, Throttle(T0 + t, retry_after), T0 + t)
        rates.append((t, s.rate))
    return Run(refused, done, t, s, rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ceiling", type=float, default=100.0)
    ap.add_argument("--seconds", default="30,300")
    args = ap.parse_args()
    for seconds in (float(x) for x in args.seconds.split(",")):
        print(f"\n{seconds:g} s runs, ceiling {args.ceiling:g}/s: ratio (429s)\n")
        print("| limit (of ceiling) | " + " | ".join(f"burst {b:g}" for b in BURSTS) + " |")
        print("|---" * (len(BURSTS) + 1) + "|")
        ratios: list[tuple[float, str]] = []
        for share in SHARES:
            limit = share * args.ceiling
            cells = []
            for burst in BURSTS:
                run = drain(args.ceiling, steady(limit), burst, int(seconds * limit))
                ratios.append((run.ratio(limit), f"limit {share:.0%}, burst {burst:g}"))
                cells.append(f"{run.ratio(limit):.3f} ({run.refused})")
            print(f"| {limit:g}/s ({share:.0%}) | " + " | ".join(cells) + " |")
        worst = max(ratios)
        print(f"\nmean {statistics.mean(r for r, _ in ratios):.3f}; "
              f"worst {worst[0]:.3f} ({worst[1]})")


if __name__ == "__main__":
    main()
