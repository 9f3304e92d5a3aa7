"""Run the benchmarks (``make bench``) and print their tables.

Default: every matrix scenario (known-limit, hidden-limit, hidden-limit-memory,
changing-limit, storms) through the service over all 8 partner cells, hidden-limit and
hidden-limit-memory being the two ticks of one run; the peers (cron alone, Celery +
Redis; at most 15 s a run) on the default cell and on the service's worst cell of each
scenario but hidden-limit-memory; the header dialects (1,500 at a fixed window of 50/s,
once per way of wording the wait: X-RateLimit-Reset as seconds left, epoch seconds or
epoch milliseconds, IETF t=, Retry-After in seconds or as an HTTP-date; the service
alone); then the growth benchmark (scan and publish of 10k,
100k and 1M candidates). About 29 minutes with ``--repeat 1`` when every cell is near
its ideal, ~73 with the default three runs per cell, plus the oracle the first time.
``--full`` adds the scenarios with a partner of their own (minute-window,
ratelimit-headers, capacity, minute-window-long) and the article's case (18,400 at 20/s,
about 15 minutes per tool). Writes bench/out/results.{md,json}, bench/out/limiter.png (the
worst cells of hidden-limit and changing-limit) and a copy of it at docs/limiter.png.

Every matrix cell's service runs ``--repeat K`` times (default 3; 1 with ``--quick``): the
tables show the mean, the worst and the spread of the K ratios, the ranking the worst run.
Before the runs, the oracle (bench/oracle.py) of each selected cell at R: the fastest pace
that gets no 429 in a whole run on this machine, measured once and kept in
bench/out/oracle.json (``--remeasure-oracle`` measures again, ``--no-oracle`` skips it);
every matrix row is also given as a ratio against the oracle's time.

Usage: python bench/run.py [--full] [--only NAME,...] [--cells CELL,...] [--rate R]
                           [--quick] [--tools service,cron,celery] [--no-growth]
                           [--repeat K] [--remeasure-oracle] [--no-oracle]
                           [--set section.key=value ...] [--render]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from collections.abc import Sequence

import oracle
from growth import SIZES, run_growth
from matrix import select_cells
from paths import OUT, REPO
from processes import parse_overrides
from report import environment, load_results, preamble, tables
from runner import estimate_s, run_scenarios, selected_tools
from scenario import Result
from scenarios import (
    BY_NAME,
    DIALECTS,
    FULL_ONLY,
    MATRIX,
    OWN_PARTNER,
    QUICK_SCALE,
    add_common_args,
    build,
    options,
    report,
    row_names,
    to_run,
)

GROWTH_ESTIMATE_S = 90.0  # 10k + 100k + 1M candidates scanned and published
PICTURED = ("hidden-limit", "changing-limit")


def plots(results: Sequence[Result], scrape_names: Sequence[str], quick: bool = False) -> None:
    """limiter-all.png and limiter.png; the latter copied to docs/ unless a quick run."""
    if not any(r.extra.get("samples") and r.scenario in scrape_names for r in results):
        return
    try:
        from plot import plot_limiter
    except ImportError as exc:
        print(f"\nno limiter plots: {exc} (pip install -e '.[bench]')", file=sys.stderr)
        return
    plot_limiter(results, OUT / "limiter-all.png", scrape_names)
    png = plot_limiter(results, OUT / "limiter.png", PICTURED)
    if png is not None and quick:
        print(f"\nlimiter curve (worst cells): {png} (quick run: not copied to docs/)")
    elif png is not None:
        docs = REPO / "docs"
        docs.mkdir(exist_ok=True)
        shutil.copyfile(png, docs / "limiter.png")
        print(f"\nlimiter curve (worst cells): {png} (copied to docs/limiter.png)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--full", action="store_true",
                   help="add the own-partner scenarios and the article's case (~15 min/tool)")
    p.add_argument("--only", help="comma-separated scenario names: "
                                  + ", ".join([*BY_NAME, "growth"]))
    p.add_argument("--no-growth", action="store_true", help="skip the growth benchmark")
    p.add_argument("--render", action="store_true",
                   help="only print the tables (and redraw the PNGs) of bench/out/results.json")
    p.add_argument("--repeat", type=int, default=None, metavar="K",
                   help="runs of the service per matrix cell (default 3; 1 with --quick)")
    p.add_argument("--remeasure-oracle", action="store_true",
                   help="measure every selected cell's oracle again (bench/out/oracle.json)")
    p.add_argument("--no-oracle", action="store_true",
                   help="no oracle measurement (rows still get a cached one)")
    args = p.parse_args()
    if args.render:
        results, meta = load_results(OUT / "results.json")
        oracle.attach(results)  # rows saved before the oracle get the cached one, if any
        opts = meta.get("options", {})
        env = meta.get("environment")
        if env:
            print(preamble(env, None, None, opts) + "\n")
        print(tables(results))
        plots(results, list(dict.fromkeys(r.scenario for r in results if r.extra.get("samples"))),
              quick=bool(opts.get("quick")))
        return 0
    scenarios_by_name = build(args.rate, args.quick)
    names = [*MATRIX, *DIALECTS, *((*OWN_PARTNER, *FULL_ONLY) if args.full else ())]
    growth = not args.no_growth
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in scenarios_by_name and n != "growth"]
        if unknown:
            raise SystemExit(f"unknown scenario(s) {unknown}; known: "
                             f"{', '.join(scenarios_by_name)}, growth")
        names = [n for n in wanted if n != "growth"]
        growth = growth and "growth" in wanted
    scenarios = to_run(names, scenarios_by_name)
    cells = select_cells(args.cells)
    tools = selected_tools(args.tools)
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 3
    if repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    total, runs = estimate_s(scenarios, tools, cells, repeat)
    oracle_n = oracle.trial_n(args.rate, args.quick)
    to_measure = ([] if args.no_oracle or not any(sc.matrix for sc in scenarios) else
                  oracle.missing(cells, args.rate, oracle_n, args.remeasure_oracle))
    total += oracle.estimate_s(to_measure, args.rate, oracle_n)
    total += GROWTH_ESTIMATE_S * (QUICK_SCALE if args.quick else 1.0) if growth else 0.0
    rows = row_names(scenarios)
    print(f"{len(rows)} scenario(s) in {len(scenarios)} run(s) x {len(cells)} cell(s) "
          f"({', '.join(c.name for c in cells)}); {runs} runs"
          + (f" ({repeat} per matrix cell)" if repeat > 1 else "")
          + (f"; the oracle of {len(to_measure)} cell(s)" if to_measure else "")
          + (" + growth" if growth else "") + f"; about {total / 60:.0f} min",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    start = environment()
    if to_measure:
        asyncio.run(oracle.ensure(to_measure, args.rate, oracle_n, args.remeasure_oracle))
    results = asyncio.run(run_scenarios(scenarios, tools, parse_overrides(args.overrides),
                                        cells, explicit_cells=bool(args.cells), repeat=repeat))
    oracle.attach(results)
    if growth:
        print("growth: scan and publish only", file=sys.stderr, flush=True)
        sizes = SIZES if not args.quick else tuple(int(n * QUICK_SCALE) for n in SIZES)
        results += run_growth(sizes)
    text = report(results, "results", start, {**options(args), "repeat": repeat})
    print(text)
    plots(results, [n for sc in scenarios if sc.scrape for n in sc.row_names], quick=args.quick)
    print(f"\n{len(results)} rows in {time.monotonic() - started:.0f} s; "
          f"bench/out/results.md, bench/out/results.json", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
