"""Running scenarios: one tool on one cell, a scenario over the matrix, the peers after it.

A matrix scenario runs the service over every selected cell first; the peers then run on
the default cell and on the service's worst cell of that scenario (the highest ratio,
then the highest 429 share), which keeps ``make bench`` to two peer runs per scenario.
hidden-limit and hidden-limit-memory are one run: its two ticks are their two rows.
Each run also records how busy the host was with processes that are not the bench's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from drivers import claim_redis_db, have_tool, run_celery, run_cron, run_service
from matrix import Cell, peer_cells
from paths import LOGS, PEERS, TOOLS
from processes import host_busy_cpu_s, self_cpu_s
from repeats import best_cell, worst_cell
from report import describe
from scenario import Result, Scenario, new_result

FOREIGN_LOAD_NOTE = 0.3  # cores used by processes outside the bench that earn a note
START_OVERHEAD_S = 3.0  # partner + service started and stopped: measured 1-2 s, with room


async def run_tool(sc: Scenario, tool: str, overrides: dict[str, dict[str, Any]],
                   repeat: tuple[int, int] | None = None) -> list[Result]:
    """One run of ``tool``: its rows (the service: one per reported tick; a peer: one);
    ``repeat``: (i, K) for run i of the K of this cell (``--repeat``)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    busy0 = host_busy_cpu_s()
    self0 = self_cpu_s()
    try:
        if tool == "service":
            results = await run_service(sc, overrides)
        elif tool == "cron":
            results = [await run_cron(sc)]
        elif tool == "celery":
            results = [await run_celery(sc)]
        else:
            raise ValueError(f"unknown tool {tool!r}")
    except Exception as exc:
        specs = [s for s in sc.tick_specs() if s is not None] if tool == "service" else [sc]
        results = [new_result(spec, tool) for spec in specs]
        for result in results:
            result.notes.append(f"error: {type(exc).__name__}: {exc}")
    # The host's load over the whole run (every tick of it), the same on each of its rows.
    harness_s = time.monotonic() - started
    busy1 = host_busy_cpu_s()
    own = sum(r.extra.get("own_cpu_s", 0.0) for r in results) + self_cpu_s() - self0
    foreign = max(0.0, (busy1 - busy0) - own) / harness_s
    for result in results:
        if repeat is not None:
            result.extra.update(repeat=repeat[0], repeats=repeat[1])
        result.extra.update(harness_s=harness_s, host_busy_cores=(busy1 - busy0) / harness_s,
                            foreign_cores=foreign)
        if foreign > FOREIGN_LOAD_NOTE and harness_s >= 3.0:  # shorter: start-up noise
            result.notes.append(f"host busy: other processes used {foreign:.1f} of "
                                f"{os.cpu_count()} cores")
        if not result.finished and not result.errored:
            result.notes.insert(0, f"not finished: {result.completed:,}/{result.n:,} in "
                                   f"{result.elapsed_s:.0f} s; ratio projected")
        if sc.unlimited and result.projected_s:
            result.notes.insert(0, f"{result.n / result.projected_s:,.0f} ops/s end to end")
        tick = f"#{result.extra['tick']}" if "run" in result.extra else ""
        tick += f" {repeat[0]}/{repeat[1]}" if repeat is not None and repeat[1] > 1 else ""
        print(f"  {result.scenario:<20} {sc.cell.name:<12} {tool + tick:<10} "
              f"{describe(result)}", file=sys.stderr, flush=True)
    return results


async def run_matrix(sc: Scenario, cells: Sequence[Cell], tools: Sequence[str],
                     overrides: dict[str, dict[str, Any]], explicit_cells: bool,
                     repeat: int = 1) -> list[Result]:
    """The service over ``cells`` ``repeat`` times, then the peers (once) on the default
    and the worst cell (that of the worst run).

    The repeats go round the cells (every cell once, then again), so a spell of load on
    the host lands on one run of several cells rather than on every run of one.

    A multi-tick scenario with a row per tick (hidden-limit-memory, whose tick 1 is the
    hidden-limit row) is one service run per cell; the peers run its first tick's
    scenario alone, on the default cell and the worst cell of that tick's rows.
    """
    results = []
    if "service" in tools:
        for i in range(1, repeat + 1):
            for cell in cells:
                results += await run_tool(sc.on(cell), "service", overrides, (i, repeat))
    service_rows = list(results)
    for name in sc.row_names:
        rows = [r for r in service_rows if r.scenario == name]
        if rows:
            bad, good = worst_cell(rows), best_cell(rows)
            print(f"  {name}: worst cell {bad.cell if bad else '—'}, "
                  f"best cell {good.cell if good else '—'}", file=sys.stderr, flush=True)
    peers = [t for t in tools if t in PEERS]
    peer_sc = sc.peer_scenario
    if peers and peer_sc is None:
        print(f"  {sc.name}: peers skipped (they keep nothing from one run to the next)",
              file=sys.stderr, flush=True)
    elif peers and peer_sc is not None:
        if peer_sc.name != sc.name:
            print(f"  {sc.name}: peers on {peer_sc.name} only, a single tick (they keep "
                  "nothing from one run to the next)", file=sys.stderr, flush=True)
        mine = [r for r in service_rows if r.scenario == peer_sc.name]
        for cell in peer_cells(cells, mine, explicit_cells):
            for tool in peers:
                results += await run_tool(peer_sc.on(cell), tool, overrides)
    return results


async def run_scenarios(scenarios: Sequence[Scenario], tools: Sequence[str],
                        overrides: dict[str, dict[str, Any]], cells: Sequence[Cell],
                        explicit_cells: bool = False, repeat: int = 1) -> list[Result]:
    """Every scenario in turn; a matrix one's service runs ``repeat`` times per cell."""
    results = []
    for sc in scenarios:
        where = (f"{len(cells)} cell(s)" if sc.matrix else f"its own partner ({sc.cell.describe()})")
        earlier = "".join(f"; tick {i} is the {t.name} row (target: {t.target.describe()})"
                          for i, t in enumerate(sc.tick_rows[:sc.ticks - 1], 1))
        print(f"{sc.name}: {sc.title}; N={sc.n:,}{f' x {sc.ticks} ticks' if sc.ticks > 1 else ''}, "
              f"partner {sc.r_label()}/s, ideal {sc.ideal_s() or 0:.1f} s, over {where}; "
              f"target: {sc.target.describe()}{earlier}"
              + (" [quick: not for reporting]" if sc.quick else ""),
              file=sys.stderr, flush=True)
        if sc.matrix:
            results += await run_matrix(sc, cells, tools, overrides, explicit_cells, repeat)
        else:
            # A scenario about the service's own queue transport, or about how it reads the
            # partner's headers, has no peer row.
            alone = sc.queue != "sqlite" or sc.service_only
            for tool in [t for t in tools if t == "service"] if alone else tools:
                results += await run_tool(sc, tool, overrides)
    return results


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


def estimate_s(scenarios: Sequence[Scenario], tools: Sequence[str],
               cells: Sequence[Cell], repeat: int = 1) -> tuple[float, int]:
    """Seconds a run should take if every tool is near its ideal (peers: their budget),
    and how many runs it makes (a multi-tick service run counts once)."""
    total, runs = 0.0, 0
    for sc in scenarios:
        ideal = sc.ideal_s() or 10.0
        n_cells = len(cells) if sc.matrix else 1
        k = repeat if sc.matrix else 1
        if "service" in tools:
            total += k * n_cells * sc.ticks * (1.05 * ideal + START_OVERHEAD_S)
            runs += k * n_cells
        peer_sc = sc.peer_scenario
        if peer_sc is None or sc.queue != "sqlite" or sc.service_only:
            continue
        peer_n = min(2, n_cells) if sc.matrix else 1
        for tool in tools:
            if tool in PEERS:
                total += peer_n * (peer_sc.budget_s(tool) + START_OVERHEAD_S)
                runs += peer_n
    return total, runs
