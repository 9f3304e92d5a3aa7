"""Run the quick benchmarks (``make bench``) and print ONE markdown table.

Every quick scenario runs through the service and both peers (cron alone, Celery + Redis)
against a fresh partner simulator each; then the growth benchmark (scan and publish of
10k, 100k and 1M candidates). ``--full`` adds the article's case (18,400 at 20/s, about
15 minutes per tool). Writes bench/out/results.{md,json}, bench/out/limiter.png and a copy
of the PNG at docs/limiter.png for the README.

Usage: python bench/run.py [--full] [--only NAME,...] [--tools service,cron,celery]
                           [--no-growth] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time

from growth import run_growth
from harness import OUT, REPO, environment, load_results, parse_overrides, table
from plot import plot_limiter
from scenarios import (
    BY_NAME,
    FULL_ONLY,
    QUICK,
    add_common_args,
    report,
    run_scenarios,
    selected_tools,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--full", action="store_true", help="add the article's case (~15 min/tool)")
    p.add_argument("--only", help="comma-separated scenario names: " + ", ".join(BY_NAME))
    p.add_argument("--no-growth", action="store_true", help="skip the growth benchmark")
    p.add_argument("--render", action="store_true",
                   help="only print the table (and redraw the PNGs) of bench/out/results.json")
    args = p.parse_args()
    if args.render:
        results = load_results(OUT / "results.json")
        print(table(results))
        plot_limiter(results, OUT / "limiter-all.png", [r.scenario for r in results])
        if plot_limiter(results, OUT / "limiter.png") is not None:
            shutil.copyfile(OUT / "limiter.png", REPO / "docs" / "limiter.png")
        return 0
    scenarios = [*QUICK, *(FULL_ONLY if args.full else ())]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME and n != "growth"]
        if unknown:
            raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}, growth")
        scenarios = [BY_NAME[n] for n in names if n != "growth"]
    growth = not args.no_growth and (not args.only or "growth" in args.only.split(","))
    tools = selected_tools(args.tools)
    started = time.monotonic()
    start = environment()
    results = asyncio.run(run_scenarios(scenarios, tools, parse_overrides(args.overrides)))
    if growth:
        print("growth: scan and publish only", file=sys.stderr, flush=True)
        results += run_growth()
    text = report(results, "results", start)
    print(text)
    plot_limiter(results, OUT / "limiter-all.png", [sc.name for sc in scenarios if sc.scrape])
    png = plot_limiter(results, OUT / "limiter.png")
    if png is not None:
        docs = REPO / "docs"
        docs.mkdir(exist_ok=True)
        shutil.copyfile(png, docs / "limiter.png")
        print(f"\nlimiter curve: {png} (copied to docs/limiter.png)")
    print(f"\n{len(results)} rows in {time.monotonic() - started:.0f} s; "
          f"bench/out/results.md, bench/out/results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
