"""The benchmark scenarios of issue 4, and the command line every scenario script shares.

Sizes are chosen so that each quick scenario takes well under a minute per tool while
still crossing what it tests (a limit change, several pauses, a window boundary).
The partner's token bucket holds ``partner_burst`` = 10 tokens unless noted: a realistic
small burst allowance (50 ms at 200/s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from harness import (
    OUT,
    TOOLS,
    Event,
    Result,
    Scenario,
    claim_redis_db,
    environment,
    have_tool,
    parse_overrides,
    preamble,
    run_tool,
    save,
    table,
)

KNOWN = Scenario(
    "known-limit", "known limit", "ratio ≤ 1.02, zero 429",
    n=6000, partner_rate=200, ceiling=200)

HIDDEN = Scenario(
    "hidden-limit", "hidden limit", "ratio ≤ 1.15 against the true limit, 429 share ≤ 3%",
    n=2000, partner_rate=100, ceiling=200, scrape=True)

# Three pauses of 3 s each, at 2, 6 and 10 s after the tick: ideal = 2000/200 + 9 = 19 s.
_STORMS = (Event(2.0, pause_s=3.0), Event(6.0, pause_s=3.0), Event(10.0, pause_s=3.0))
STORMS_SECONDS = Scenario(
    "storms-seconds", "Retry-After storms (delay-seconds)",
    "within 5% of ideal + pauses; no request during a pause",
    n=2000, partner_rate=200, ceiling=200, events=_STORMS, retry_after_format="seconds",
    scrape=True, service_set=(("limits", "long_pause_seconds", 2.0),))
STORMS_DATE = Scenario(
    "storms-http-date", "Retry-After storms (HTTP-date)",
    "within 5% of ideal + pauses; no request during a pause",
    n=2000, partner_rate=200, ceiling=200, events=_STORMS, retry_after_format="http-date",
    scrape=True, service_set=(("limits", "long_pause_seconds", 2.0),))

# 200/s, a quarter (50/s) from 6 s to 14 s after the tick, then 200/s again.
CHANGING = Scenario(
    "changing-limit", "changing limit", "follows the drop and the recovery within a few seconds",
    n=4000, partner_rate=200, ceiling=200, scrape=True,
    events=(Event(6.0, rate_per_second=50), Event(14.0, rate_per_second=200)))

# 6,000 per fixed minute (aligned to the partner's start); N > 6,000 so every tool crosses
# a window boundary. The ceiling is the documented quota per second. The loop that does
# not pace finishes at the boundary, so it gets the whole budget.
MINUTE = Scenario(
    "minute-window", "per-minute window", "429 share ≤ 1%",
    n=6600, partner_rate=100, ceiling=100, window="minute", celery_rate_limit="6000/m",
    cron_budget=(1.0, 8.0))
# --full: two whole aligned windows at the ceiling, where pacing 1% fast would trip it.
MINUTE_LONG = Scenario(
    "minute-window-long", "per-minute window, 2.5 windows", "429 share ≤ 1%",
    n=15_000, partner_rate=100, ceiling=100, window="minute", celery_rate_limit="6000/m",
    cron_budget=(1.0, 8.0), max_budget_s=400.0)

# The partner announces its quota (RateLimit-Policy: "default";q=100;w=1); the ceiling is
# configured at twice the true limit, so only the headers can keep the service from 429s.
HEADERS = Scenario(
    "ratelimit-headers", "RateLimit headers", "paced by them from the first second: zero 429",
    n=2000, partner_rate=100, ceiling=200, ratelimit_headers=True)

CAPACITY = Scenario(
    "capacity", "capacity (partner unlimited)", "≥ 2,000 operations per second end to end",
    n=10000, partner_rate=0, partner_burst=0, ceiling=100_000, concurrency=32,
    celery_concurrency=64, service_budget=(0.0, 60.0), peer_budget=(0.0, 45.0),
    # At its best against a partner that does not limit: a bucket that never makes anyone
    # wait (its timer would otherwise re-arm on every grant) and 2,000-candidate pages.
    service_set=(("limits", "burst", 1000.0), ("source", "page_size", 2000)))

ARTICLE = Scenario(
    "article", "the article's case", "ratio ≤ 1.02",
    n=18_400, partner_rate=20, ceiling=20,
    service_budget=(1.2, 60.0), peer_budget=(1.25, 30.0), max_budget_s=2400.0)

QUICK: tuple[Scenario, ...] = (KNOWN, HIDDEN, STORMS_SECONDS, STORMS_DATE, CHANGING, MINUTE,
                               HEADERS, CAPACITY)
FULL_ONLY: tuple[Scenario, ...] = (MINUTE_LONG, ARTICLE)
BY_NAME = {sc.name: sc for sc in (*QUICK, *FULL_ONLY)}


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", default=",".join(TOOLS),
                   help="comma-separated subset of: " + ", ".join(TOOLS))
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="override a service config key, e.g. limits.increase_per_second=20")


def selected_tools(spec: str) -> list[str]:
    tools = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise SystemExit(f"unknown tool(s) {sorted(unknown)}; known: {', '.join(TOOLS)}")
    usable = []
    for tool in tools:
        why = have_tool(tool)
        if why:
            print(f"skipping {tool}: {why}", file=sys.stderr)
        else:
            usable.append(tool)
    if "celery" in usable:
        claim_redis_db()
    return usable


async def run_scenarios(scenarios: Sequence[Scenario], tools: Sequence[str],
                        overrides: dict[str, dict[str, object]]) -> list[Result]:
    results = []
    for sc in scenarios:
        print(f"{sc.name}: {sc.title}; N={sc.n:,}, partner {sc.r_label()}/s, "
              f"ideal {sc.ideal_s() or 0:.1f} s; target: {sc.target}", file=sys.stderr,
              flush=True)
        for tool in tools:
            results.append(await run_tool(sc, tool, overrides))
    return results


def report(results: Sequence[Result], stem: str, start: dict[str, object] | None = None) -> str:
    limits = next((r.extra["limits"] for r in results if "limits" in r.extra), None)
    text = preamble(environment(), limits, start) + "\n\n" + table(results)
    save(results, stem, text)
    return text


def main(names: Sequence[str], argv: Sequence[str] | None = None) -> int:
    """One scenario script: run ``names`` with every selected tool, print the table."""
    p = argparse.ArgumentParser(description=BY_NAME[names[0]].title)
    add_common_args(p)
    args = p.parse_args(argv)
    tools = selected_tools(args.tools)
    start = environment()
    results = asyncio.run(run_scenarios([BY_NAME[n] for n in names], tools,
                                        parse_overrides(args.overrides)))
    print(report(results, names[0] if len(names) == 1 else "scenarios", start))
    if any(BY_NAME[n].scrape for n in names):
        from plot import plot_limiter

        path = plot_limiter(results, OUT / f"limiter-{names[0]}.png", names)
        if path is not None:
            print(f"\nlimiter curve: {path}")
    return 0
