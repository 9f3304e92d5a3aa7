"""Running scenarios: one tool on one cell, a scenario over the matrix, the peers after it.

A matrix scenario runs the service over every selected cell first; the peers then run on
the default cell and on the service's worst cell of that scenario (the highest ratio,
then the highest 429 share), which keeps ``make bench`` to two peer runs per scenario.
Each run also records how busy the host was with processes that are not the bench's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from drivers import claim_redis_db, have_tool, run_celery, run_cron, run_service
from matrix import Cell, best, peer_cells, worst
from paths import LOGS, PEERS, TOOLS
from processes import host_busy_cpu_s, self_cpu_s
from report import describe
from scenario import Result, Scenario, new_result

FOREIGN_LOAD_NOTE = 0.3  # cores used by processes outside the bench that earn a note
START_OVERHEAD_S = 3.0  # partner + service started and stopped: measured 1-2 s, with room


async def run_tool(sc: Scenario, tool: str, overrides: dict[str, dict[str, Any]]) -> Result:
    LOGS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    busy0 = host_busy_cpu_s()
    self0 = self_cpu_s()
    try:
        if tool == "service":
            result = await run_service(sc, overrides)
        elif tool == "cron":
            result = await run_cron(sc)
        elif tool == "celery":
            result = await run_celery(sc)
        else:
            raise ValueError(f"unknown tool {tool!r}")
    except Exception as exc:
        result = new_result(sc, tool)
        result.notes.append(f"error: {type(exc).__name__}: {exc}")
    harness_s = result.extra["harness_s"] = time.monotonic() - started
    busy1 = host_busy_cpu_s()
    own = result.extra.get("own_cpu_s", 0.0) + self_cpu_s() - self0
    foreign = max(0.0, (busy1 - busy0) - own) / harness_s
    result.extra.update(host_busy_cores=(busy1 - busy0) / harness_s, foreign_cores=foreign)
    if foreign > FOREIGN_LOAD_NOTE and harness_s >= 3.0:  # shorter: start-up noise
        result.notes.append(f"host busy: other processes used {foreign:.1f} of "
                            f"{os.cpu_count()} cores")
    if not result.finished and not result.errored:
        result.notes.insert(0, f"not finished: {result.completed:,}/{result.n:,} in "
                               f"{result.elapsed_s:.0f} s; ratio projected")
    if sc.unlimited and result.projected_s:
        result.notes.insert(0, f"{result.n / result.projected_s:,.0f} ops/s end to end")
    print(f"  {sc.name:<20} {sc.cell.name:<12} {tool:<8} {describe(result)}",
          file=sys.stderr, flush=True)
    return result


async def run_matrix(sc: Scenario, cells: Sequence[Cell], tools: Sequence[str],
                     overrides: dict[str, dict[str, Any]], explicit_cells: bool,
                     ) -> list[Result]:
    """The service over ``cells``, then the peers on the default and the worst cell."""
    results = []
    if "service" in tools:
        for cell in cells:
            results.append(await run_tool(sc.on(cell), "service", overrides))
    service_rows = list(results)
    if service_rows:
        bad, good = worst(service_rows), best(service_rows)
        print(f"  {sc.name}: worst cell {bad.cell if bad else '—'}, "
              f"best cell {good.cell if good else '—'}", file=sys.stderr, flush=True)
    peers = [t for t in tools if t in PEERS]
    if peers and sc.ticks > 1:
        print(f"  {sc.name}: peers skipped (they keep nothing from one run to the next)",
              file=sys.stderr, flush=True)
    elif peers:
        for cell in peer_cells(cells, service_rows, explicit_cells):
            for tool in peers:
                results.append(await run_tool(sc.on(cell), tool, overrides))
    return results


async def run_scenarios(scenarios: Sequence[Scenario], tools: Sequence[str],
                        overrides: dict[str, dict[str, Any]], cells: Sequence[Cell],
                        explicit_cells: bool = False) -> list[Result]:
    results = []
    for sc in scenarios:
        where = (f"{len(cells)} cell(s)" if sc.matrix else f"its own partner ({sc.cell.describe()})")
        print(f"{sc.name}: {sc.title}; N={sc.n:,}{f' x {sc.ticks} ticks' if sc.ticks > 1 else ''}, "
              f"partner {sc.r_label()}/s, ideal {sc.ideal_s() or 0:.1f} s, over {where}; "
              f"target: {sc.target.describe()}" + (" [quick: not for reporting]" if sc.quick else ""),
              file=sys.stderr, flush=True)
        if sc.matrix:
            results += await run_matrix(sc, cells, tools, overrides, explicit_cells)
        else:
            for tool in tools:
                results.append(await run_tool(sc, tool, overrides))
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
               cells: Sequence[Cell]) -> tuple[float, int]:
    """Seconds a run should take if every tool is near its ideal (peers: their budget)."""
    total, runs = 0.0, 0
    for sc in scenarios:
        ideal = sc.ideal_s() or 10.0
        n_cells = len(cells) if sc.matrix else 1
        if "service" in tools:
            total += n_cells * sc.ticks * (1.05 * ideal + START_OVERHEAD_S)
            runs += n_cells
        if sc.ticks > 1:
            continue
        peer_n = min(2, n_cells) if sc.matrix else 1
        for tool in tools:
            if tool in PEERS:
                total += peer_n * (sc.budget_s(tool) + START_OVERHEAD_S)
                runs += peer_n
    return total, runs
