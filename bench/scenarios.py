"""The benchmark scenarios, and the command line every scenario script shares.

Matrix scenarios (run over the partner cells of matrix.py, at partner rate R = 50/s
unless ``--rate`` says otherwise; N = R x 30 s, changing-limit 27.5 s, storms 12 s):

* ``known-limit``: N = 30 R at R, ceiling R. Target: ratio <= 1.05, 429 share <= 0.5 %.
* ``hidden-limit``: N = 30 R, partner R, ceiling 2R. Ratio <= 1.15, 429 share <= 2 %.
  Tick 1 of the hidden-limit-memory run (a fresh data dir); the peers run it alone.
* ``hidden-limit-memory``: the same twice against ONE partner process and ONE data dir,
  the service restarted in between; the second tick is the row. Ratio <= 1.03. One run
  per cell gives both rows; ``--only`` either name runs it.
* ``changing-limit``: R -> R/4 at 8 s -> R at 18 s, N = 27.5 R (ideal 35 s). Under the
  new limit within 3 s of the drop, >= 90 % of R within 15 s of the recovery, both on the
  limiter's gauge and on the partner's executions per second.
* ``storms``: N = 12 R; three pauses of 3 s at 2, 6 and 10 s (ideal 21 s). Within 5 %
  of the ideal; no request during a pause beyond the ones in flight when it began.

The peers' runs in these scenarios stop after 15 s at most (ratio projected).

Scenarios with a partner of their own (not run over the matrix; ``--full`` or by name):
minute-window, ratelimit-headers, capacity, and the long ones minute-window-long, article,
and article-hidden-* (18,400 at 20/s, ceiling 40/s, against a bucket of one and behind
nginx limit_req without and with a static Retry-After: 1; gateway.py).
The dialects (``dialect-*``, run by ``make bench`` too): 1,500 at a fixed window of 50/s,
ceiling 100/s, once per way the partner words its wait (matrix.DIALECT_CELLS).

``--quick`` scales N and every time by 0.2: a smoke run whose figures are not to be reported.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from matrix import CELLS_BY_NAME, DIALECT_CELLS, LONG_CELLS, Cell, select_cells
from oracle import attach
from paths import OUT, TOOLS
from processes import parse_overrides
from report import environment, preamble, save, tables
from runner import estimate_s, run_scenarios, selected_tools
from scenario import Event, Result, Scenario, Target

DEFAULT_RATE = 50.0
QUICK_SCALE = 0.2
PEER_MAX_BUDGET_S = 15.0  # the peers' wall time per run in a matrix scenario, at most


def matrix_scenarios(rate: float = DEFAULT_RATE, scale: float = 1.0) -> tuple[Scenario, ...]:
    r, quick = rate, scale != 1.0

    def at(t: float) -> float:
        return round(t * scale, 3)

    def n(seconds_at_r: float) -> int:
        return max(1, round(r * seconds_at_r * scale))

    common: dict[str, Any] = dict(partner_rate=r, matrix=True, quick=quick,
                                  max_peer_budget_s=PEER_MAX_BUDGET_S)
    known = Scenario(
        "known-limit", "known limit", n=n(30), ceiling=r,
        target=Target(max_ratio=1.05, max_share_429=0.005), **common)
    # One run per cell, two ticks against one partner and one data dir: tick 1 (a fresh
    # data dir) is the hidden-limit row, tick 2 (after a restart) the memory row.
    hidden = Scenario(
        "hidden-limit", "hidden limit (ceiling 2R)", n=n(30), ceiling=2 * r,
        target=Target(max_ratio=1.15, max_share_429=0.02), scrape=True, **common)
    memory = replace(
        hidden, name="hidden-limit-memory",
        title="hidden limit, second tick after a restart (per-partner memory)", ticks=2,
        tick_rows=(hidden,), target=Target(max_ratio=1.03))
    # R for 8 s, R/4 for 10 s, then R: 8 R + 2.5 R + 17 R = 27.5 R in 35 s.
    changing = Scenario(
        "changing-limit", "changing limit (R → R/4 → R)", n=n(27.5), ceiling=r,
        target=Target(max_drop_s=3.0, max_recovery_s=15.0), scrape=True,
        events=(Event(at(8.0), rate_per_second=r / 4), Event(at(18.0), rate_per_second=r)),
        **common)
    # Three pauses of 3 s at 2, 6 and 10 s: ideal = 12 + 9 = 21 s.
    storms = Scenario(
        "storms", "Retry-After storms (three 3 s pauses)", n=n(12), ceiling=r,
        target=Target(max_ratio=1.05, pause_reveals_only=True), scrape=True,
        events=tuple(Event(at(t), pause_s=at(3.0)) for t in (2.0, 6.0, 10.0)),
        service_set=(("limits", "long_pause_seconds", round(2.0 * scale, 3)),), **common)
    return (known, memory, changing, storms)


def own_partner_scenarios() -> tuple[Scenario, ...]:
    minute = Cell("minute-6000", "minute")
    # 6,000 per fixed minute (aligned to the partner's start); N > 6,000 so every tool
    # crosses a window boundary. The loop that does not pace finishes at the boundary, so
    # it gets the whole budget.
    minute_window = Scenario(
        "minute-window", "per-minute window", target=Target(max_share_429=0.01),
        n=6600, partner_rate=100, ceiling=100, cell=minute, celery_rate_limit="6000/m",
        cron_budget=(1.0, 8.0))
    # The partner announces its quota (RateLimit-Policy: "default";q=100;w=1); the ceiling
    # is twice the true limit, so only the headers can keep the service from 429s.
    headers = Scenario(
        "ratelimit-headers", "RateLimit headers", target=Target(max_share_429=0.0),
        n=2000, partner_rate=100, ceiling=200, cell=Cell("bucket-10-ietf", ratelimit_headers="ietf"))
    capacity = Scenario(
        "capacity", "capacity (partner unlimited)", target=Target(min_ops_per_s=2000),
        n=10000, partner_rate=0, cell=Cell("unlimited", burst=0), ceiling=100_000,
        concurrency=32, celery_concurrency=64, service_budget=(0.0, 60.0),
        peer_budget=(0.0, 45.0),
        # At its best against a partner that does not limit: a bucket that never makes
        # anyone wait and 2,000-candidate pages.
        service_set=(("limits", "burst", 1000.0), ("source", "page_size", 2000)))
    # The known-limit case with Infrai as the queue, pulled, 20 ms added to every call.
    infrai_known = Scenario(
        "infrai-known-limit", "known limit, Infrai queue (+20 ms a call)", n=1500,
        partner_rate=50, ceiling=50, target=Target(max_ratio=1.03), queue="infrai")
    # The known-limit case and capacity with a team's broker as the queue (issue 21).
    brokers = tuple(sc for queue in ("redis", "rabbitmq") for sc in (
        replace(infrai_known, name=f"{queue}-known-limit",
                title=f"known limit, {queue} queue", queue=queue),
        replace(capacity, name=f"{queue}-capacity",
                title=f"capacity (partner unlimited), {queue} queue", queue=queue,
                service_only=True)))
    return (minute_window, headers, capacity, infrai_known, *brokers)


def dialect_scenarios() -> tuple[Scenario, ...]:
    """The issue's case, once per way of wording the wait: N = 1,500 against a fixed
    window of 50/s, the ceiling twice that, so only what the partner says (a header, a
    429's Retry-After) keeps the run on pace. Headers let it pace before any 429; a
    Retry-After alone is a hidden limit found by 429s."""
    out = []
    for cell in DIALECT_CELLS:
        told = cell.ratelimit_headers != "none"
        out.append(Scenario(
            f"dialect-{cell.name}", f"the wait worded as {cell.describe()}", n=1500,
            partner_rate=50, ceiling=100, cell=cell, service_only=True,
            target=Target(max_ratio=1.05 if told else 1.15)))
    return tuple(out)


def full_only_scenarios() -> tuple[Scenario, ...]:
    # Two whole aligned windows at the ceiling, where pacing 1 % fast would trip it.
    minute_long = Scenario(
        "minute-window-long", "per-minute window, 2.5 windows", target=Target(max_share_429=0.01),
        n=15_000, partner_rate=100, ceiling=100, cell=Cell("minute-6000", "minute"),
        celery_rate_limit="6000/m", cron_budget=(1.0, 8.0), max_budget_s=400.0)
    article = Scenario(
        "article", "the article's case", target=Target(max_ratio=1.02),
        n=18_400, partner_rate=20, ceiling=20,
        service_budget=(1.2, 60.0), peer_budget=(1.25, 30.0), max_budget_s=2400.0)
    infrai_article = replace(article, name="infrai-article",
                             title="the article's case, Infrai queue (+20 ms a call)",
                             target=Target(max_ratio=1.03), queue="infrai")
    broker_articles = tuple(replace(article, name=f"{queue}-article",
                                    title=f"the article's case, {queue} queue",
                                    target=Target(max_ratio=1.03), queue=queue)
                            for queue in ("redis", "rabbitmq"))
    # The article's run with the limit hidden (the ceiling twice it) against the strict
    # partners: a bucket of one, and nginx's limit_req in front of the partner, with and
    # without a Retry-After. 920 s at R: learning the limit must cost seconds of it.
    long_hidden = tuple(Scenario(
        f"article-hidden-{cell.name}", f"the article's case, hidden limit: {cell.describe()}",
        target=Target(max_ratio=1.03, max_share_429=0.01), n=18_400, partner_rate=20,
        ceiling=40, cell=cell, service_only=True, scrape=True,
        service_budget=(1.2, 60.0), max_budget_s=2400.0)
        for cell in (CELLS_BY_NAME["bucket-1"], *LONG_CELLS))
    return (minute_long, article, infrai_article, *broker_articles, *long_hidden)


def quick(sc: Scenario) -> Scenario:
    """A scenario with its own partner, scaled for a smoke run."""
    return replace(sc, n=max(1, round(sc.n * QUICK_SCALE)), quick=True, events=tuple(
        Event(e.at_s * QUICK_SCALE, e.rate_per_second,
              None if e.pause_s is None else e.pause_s * QUICK_SCALE) for e in sc.events))


def build(rate: float = DEFAULT_RATE, is_quick: bool = False) -> dict[str, Scenario]:
    """Every scenario by name (the rows' names, hidden-limit too), at partner rate
    ``rate`` (matrix ones), scaled if quick."""
    scale = QUICK_SCALE if is_quick else 1.0
    own = (*own_partner_scenarios(), *dialect_scenarios(), *full_only_scenarios())
    out: dict[str, Scenario] = {}
    for sc in (*matrix_scenarios(rate, scale), *(quick(s) if is_quick else s for s in own)):
        out.update({t.name: t for t in sc.tick_rows})
        out[sc.name] = sc
    return out


def to_run(names: Sequence[str], by_name: dict[str, Scenario]) -> list[Scenario]:
    """The scenarios to run for ``names``, each once: a name that is an earlier tick of
    another scenario (hidden-limit, tick 1 of hidden-limit-memory) runs that one."""
    owner = {t.name: sc for sc in by_name.values() for t in sc.tick_rows}
    runs: dict[str, Scenario] = {}
    for name in names:
        sc = owner.get(name, by_name[name])
        runs.setdefault(sc.name, sc)
    return list(runs.values())


def row_names(scenarios: Sequence[Scenario]) -> list[str]:
    """The scenarios whose rows running ``scenarios`` gives."""
    return [name for sc in scenarios for name in sc.row_names]


MATRIX = tuple(row_names(matrix_scenarios()))  # the rows; to_run makes them 4 runs
OWN_PARTNER = tuple(sc.name for sc in own_partner_scenarios())
DIALECTS = tuple(sc.name for sc in dialect_scenarios())
FULL_ONLY = tuple(sc.name for sc in full_only_scenarios())
BY_NAME = build()


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", default=",".join(TOOLS),
                   help="comma-separated subset of: " + ", ".join(TOOLS))
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="override a service config key, e.g. limits.decrease_factor=0.7")
    p.add_argument("--cells", help="comma-separated partner cells (default: all 8)")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE,
                   help="the matrix scenarios' partner rate R per second (default 50)")
    p.add_argument("--quick", action="store_true",
                   help="scale N and times by 0.2: a smoke run, not figures to report")


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {"rate": args.rate, "quick": args.quick, "tools": args.tools,
            "cells": [c.name for c in select_cells(args.cells)], "set": args.overrides}


def report(results: Sequence[Result], stem: str, start: dict[str, Any] | None = None,
           opts: dict[str, Any] | None = None) -> str:
    limits = next((r.extra["limits"] for r in results if "limits" in r.extra), None)
    text = preamble(environment(), limits, start, opts) + "\n\n" + tables(results)
    save(results, stem, text, {"options": opts or {}, "environment": start})
    return text


def plot(results: Sequence[Result], path_stem: str, names: Sequence[str]) -> None:
    """The limiter curves of ``names`` (worst cell each); skipped without matplotlib."""
    try:
        from plot import plot_limiter
    except ImportError as exc:
        print(f"\nno limiter plot: {exc} (pip install -e '.[bench]')", file=sys.stderr)
        return
    path = plot_limiter(results, OUT / f"{path_stem}.png", names)
    if path is not None:
        print(f"\nlimiter curve (worst cell): {path}")


def main(names: Sequence[str], argv: Sequence[str] | None = None,
         stem: str | None = None) -> int:
    """One scenario script: run ``names`` with every selected tool, print the tables."""
    p = argparse.ArgumentParser(description=BY_NAME[names[0]].title)
    add_common_args(p)
    args = p.parse_args(argv)
    scenarios = to_run(names, build(args.rate, args.quick))
    cells = select_cells(args.cells)
    tools = selected_tools(args.tools)
    total, runs = estimate_s(scenarios, tools, cells)
    print(f"{runs} runs, about {total / 60:.0f} min", file=sys.stderr, flush=True)
    start = environment()
    results = asyncio.run(run_scenarios(scenarios, tools, parse_overrides(args.overrides),
                                        cells, explicit_cells=bool(args.cells)))
    attach(results)  # the cached oracle of each cell (python bench/oracle.py measures it)
    stem = stem or (names[0] if len(names) == 1 else "scenarios")
    print(report(results, stem, start, options(args)))
    scraped = [n for sc in scenarios if sc.scrape for n in sc.row_names]
    if scraped:
        plot(results, f"limiter-{names[0]}", scraped)
    return 0
