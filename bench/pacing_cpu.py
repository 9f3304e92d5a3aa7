"""What precise dispatch costs and what it buys: the service's pacer against aiolimiter.

For each rate, one task takes departures for ``SECONDS`` on uvloop (the service's loop)
from the service's own :class:`supervisor.budget.pacer.Pacer` (strict: each departure a
whole interval after the previous one actually left) and, for comparison, from an
aiolimiter bucket of one token (what the service paced with before). Printed per rate:
the process's CPU as a share of one core, how late each departure was against its
interval (p50 / p99 / max), the share of gaps shorter than the interval (an early arrival
a bucket of one refuses), and the achieved rate against the asked one.

Usage: python bench/pacing_cpu.py [--rates 20,50,100,200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from aiolimiter import AsyncLimiter

from paths import REPO

sys.path.insert(0, str(REPO))
from supervisor.budget.pacer import Pacer


async def _run(take: Callable[[], Awaitable[Any]], rate: float, seconds: float,
               ) -> dict[str, float]:
    times: list[float] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < seconds:
        await take()
        times.append(time.monotonic())  # both alike: when the caller has its grant
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    interval = 1.0 / rate
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    late = [g - interval for g in gaps]
    return {"cpu_share": cpu / wall, "late_p50_ms": late[len(late) // 2] * 1e3,
            "late_p99_ms": late[int(len(late) * 0.99)] * 1e3, "late_max_ms": late[-1] * 1e3,
            "early_share": sum(g < interval for g in gaps) / len(gaps),
            "achieved": (len(times) - 1) / (times[-1] - times[0]) / rate}


async def measure(rate: float, seconds: float) -> dict[str, dict[str, float]]:
    pacer = Pacer(rate, 0.0)
    # The spin's cost: the same pacer with no spin before the learnt lateness (it still
    # spins out what is left of that lateness when it wakes early).
    no_spin = Pacer(rate, 0.0, spin_s=0.0)
    bucket = AsyncLimiter(1, 1.0 / rate)
    return {"pacer": await _run(pacer.take, rate, seconds),
            "pacer, no spin": await _run(no_spin.take, rate, seconds),
            "aiolimiter": await _run(bucket.acquire, rate, seconds)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="20,50,100,200")
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    print("| rate /s | pacer | CPU of a core | late p50 ms | p99 ms | max ms | gaps early "
          "| achieved / asked |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        for name, m in uvloop.run(measure(rate, args.seconds)).items():
            print(f"| {rate:g} | {name} | {m['cpu_share']:.1%} | {m['late_p50_ms']:.3f} "
                  f"| {m['late_p99_ms']:.3f} | {m['late_max_ms']:.2f} | {m['early_share']:.1%} "
                  f"| {m['achieved']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
