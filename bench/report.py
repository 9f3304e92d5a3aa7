"""Tables, the preamble (where and on what it was measured), saving and loading results.

A matrix scenario gets a table of its own: one row per cell for the service, a line
naming the worst and the best cell, then the peers' rows (the default cell and the
service's worst) the same way; hidden-limit's service rows are tick 1 of the
hidden-limit-memory runs. Above them a summary: per scenario and tool, the worst
cell's figures, which is what the README quotes. Scenarios with a partner of their own
(minute-window, ratelimit-headers, capacity, article) and growth share one flat table.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paths import OUT, REPO
from repeats import Runs, best_cell, by_cell, runs_of, worst_cell
from scenario import (
    Result,
    Scenario,
    follow_delay,
    gauge_applies,
    learning_s,
    misses,
    pause_excess,
    steady_pace,
)


def _f(value: float | None, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def describe(r: Result) -> str:
    """One line for the progress log."""
    wall = f"{r.wall_s:.1f}s" if r.wall_s is not None else f"DNF({r.elapsed_s:.0f}s)"
    return (f"wall={wall} ratio={_f(r.ratio, '.3f')} 429={_f(r.share_429, '.2%')} "
            f"req={r.requests} dups={r.duplicates} pause_reqs={r.requests_during_pause} "
            f"announced_wait_reqs={r.requests_during_announced_wait} "
            f"rss={r.peak_rss_mb or 0:.0f}MB {'; '.join(r.notes)}")


def _wall(r: Result) -> str:
    if r.wall_s is not None:
        return f"{r.wall_s:.1f}"
    return f"DNF ({r.elapsed_s:.0f})" if r.projected_s is not None else "—"


def _ratio(r: Result) -> str:
    return "—" if r.ratio is None else f"{r.ratio:.3f}" + ("" if r.finished else " (proj.)")


def _oracle_ratio(r: Result) -> str:
    return ("—" if r.oracle_ratio is None
            else f"{r.oracle_ratio:.3f}" + ("" if r.finished else " (proj.)"))


def _oracle_rate(r: Result) -> str:
    return "—" if r.oracle_rate is None else f"{r.oracle_rate:g}"


def _verdict(r: Result, sc: Scenario | None) -> str:
    if sc is None:
        return "—"
    missed = misses(r, sc)
    return ("✓" if not missed else "✗ " + ", ".join(missed)) + (" (quick)" if sc.quick else "")


def _delays(r: Result, kind: str) -> str:
    f = follow_delay(r, kind)
    if f is None:
        return "—"

    def one(v: float | None, seen: bool = True) -> str:
        return "—" if not seen else "not seen" if v is None else f"{v:.1f}"

    return (one(f["gauge_s"], f["gauge_seen"] and gauge_applies(r)) + " / "
            + one(f["executions_s"]))


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- a matrix scenario --------------------------------------------------------------------


def _columns(sc: Scenario) -> list[str]:
    # Over a cell's K runs: the mean ratio and the worst run's, their spread (max - min);
    # every other figure is the worst run's.
    cols = ["cell", "tool", "runs", "wall s", "ideal s", "ratio mean", "ratio worst", "spread",
            "oracle /s", "vs oracle mean", "vs oracle worst", "429 share", "requests", "dups",
            "req. in announced wait"]
    if sc.pauses:
        cols += ["req. in pause", "beyond in-flight"]
    if sc.rate_changes:
        cols += ["drop s (gauge / exec.)", "recovery s (gauge / exec.)"]
    return [*cols, "peak RSS MB", "target", "notes"]


def _cells(g: Runs, sc: Scenario) -> list[str]:
    r = g.worst
    row = [r.cell, r.tool, str(g.count), _wall(r), _f(r.ideal_s, ".1f"),
           _f(g.mean_ratio, ".3f"), _ratio(r), _f(g.spread, ".3f"), _oracle_rate(r),
           _f(g.mean_oracle_ratio, ".3f"), _oracle_ratio(r), _f(r.share_429, ".2%"),
           f"{r.requests:,}", str(r.duplicates), str(r.requests_during_announced_wait)]
    if sc.pauses:
        row += [str(r.requests_during_pause), str(pause_excess(r, sc))]
    notes = list(r.notes)
    if g.count > 1:
        notes.insert(0, f"worst: run {r.extra['repeat']} of {g.count}" if "repeat" in r.extra
                     else f"worst of {g.count} runs")
    if sc.rate_changes:
        row += [_delays(r, "drop"), _delays(r, "recovery")]
        notes = [n for n in notes if not n.startswith("limit ")]
    return [*row, _f(r.peak_rss_mb, ".0f"), _verdict(r, sc), "; ".join(notes)]


def _worst_best(rows: Sequence[Result]) -> str:
    """The worst and the best cell, each ranked on its worst run."""
    def name(r: Result | None) -> str:
        if r is None:
            return "—"
        return (f"**{r.cell}** (ratio {_f(r.ratio, '.3f')}, vs oracle "
                f"{_f(r.oracle_ratio, '.3f')}, 429 share {_f(r.share_429, '.2%')})")

    return f"worst: {name(worst_cell(rows))}; best: {name(best_cell(rows))}"


def scenario_section(sc: Scenario, rows: Sequence[Result]) -> str:
    head = (f"### {sc.name}: {sc.title}\n\nN = {sc.n:,}"
            + (" per tick" if sc.ticks > 1 else "")
            + f", partner {sc.r_label()}/s, ceiling {sc.ceiling:g}/s, ideal "
            f"{_f(sc.ideal_s(), '.1f')} s. Target: {sc.target.describe()}.")
    if sc.ticks > 1:
        earlier = "".join(f"tick {i} is the {t.name} row, "
                          for i, t in enumerate(sc.tick_rows[:sc.ticks - 1], 1))
        head += (f" {sc.ticks} ticks against one partner process and one data dir, the "
                 f"service restarted in between: {earlier}tick {sc.ticks} this one.")
    service = [r for r in rows if r.tool == "service"]
    part_of = {(r.extra["run"], r.extra.get("tick")) for r in service
               if r.extra.get("run") not in (None, sc.name)}
    peers_too = any(r.tool != "service" for r in rows)
    for run, tick in sorted(part_of, key=str):
        head += (f" The service's rows are tick {tick} of the {run} run"
                 + (" (the peers': a run of this scenario alone)." if peers_too else "."))
    parts = [head]
    peers = [r for r in rows if r.tool != "service"]
    cols = _columns(sc)
    if service:
        parts += [_md(cols, [_cells(g, sc) for g in by_cell(service)]), _worst_best(service)]
    if peers:
        parts += ["peers (the default cell and the service's worst):",
                  _md(cols, [_cells(g, sc) for g in by_cell(peers)])]
        for tool in dict.fromkeys(r.tool for r in peers):
            parts.append(f"{tool}: " + _worst_best([r for r in peers if r.tool == tool]))
    return "\n\n".join(parts)


def summary(groups: Sequence[tuple[Scenario, list[Result]]]) -> str:
    """Per matrix scenario and tool: its worst cell (and best), against the target."""
    rows = []
    for sc, results in groups:
        for tool in dict.fromkeys(r.tool for r in results):
            mine = [r for r in results if r.tool == tool]
            bad, good = worst_cell(mine), best_cell(mine)
            if bad is None:
                continue
            runs = runs_of(mine, bad)
            rows.append([sc.name, tool, str(len(by_cell(mine))), str(runs.count), bad.cell,
                         _ratio(bad), _f(runs.mean_ratio, ".3f"), _f(runs.spread, ".3f"),
                         _oracle_ratio(bad), _f(bad.share_429, ".2%"),
                         str(bad.requests_during_announced_wait),
                         good.cell if good else "—", _ratio(good) if good else "—",
                         _verdict(bad, sc), sc.target.describe()])
    return _md(["scenario", "tool", "cells", "runs", "worst cell", "ratio (worst run)",
                "mean", "spread", "vs oracle (worst run)", "429 share",
                "req. in announced wait", "best cell", "ratio", "worst cell vs target",
                "target"], rows)


def oracle_table(results: Sequence[Result]) -> str | None:
    """The oracle's pace per cell (bench/oracle.py), from the rows that carry it."""
    seen: dict[tuple[str, float, int | None], dict[str, Any]] = {}
    for r in results:
        o = r.extra.get("oracle")
        if o and o.get("rate"):
            # A long cell's whole runs are an oracle of their own N, beside the short one.
            n = o.get("n") if o.get("whole") else None
            seen.setdefault((r.cell, float(o.get("partner_rate") or 0), n), o)
    if not seen:
        return None
    rows = [[cell, f"{rate:g}", f"{o['rate']:g}", _f(o["rate"] / rate if rate else None, ".1%"),
             _f(o.get("n"), ","), str(o.get("trials", "—")),
             (f"{o['s']:.1f} s, {o.get('partner_429') or 0} 429s, "
              f"{o.get('in_announced_wait') or 0} sent in an announced wait")
             if o.get("whole") else "—",
             _f(o.get("late_p99_ms"), ".2f"), _f(o.get("cpu_share"), ".1%"),
             str(o.get("measured", "—"))]
            for (cell, rate, _), o in seen.items()]
    return _md(["cell", "R /s", "oracle /s", "of R", "trial N", "trials",
                "whole run (429s honoured)", "departures late p99 ms",
                "oracle CPU (of a core)", "measured"], rows)


# -- the flat table (own-partner scenarios, growth) ----------------------------------------


HEADER = ["scenario", "tool", "N", "R /s", "wall s", "ideal s", "ratio", "vs oracle",
          "learning s (steady /s)", "429 share", "dups", "req. in pause",
          "req. in announced wait", "peak RSS MB", "notes"]


def _learning(r: Result) -> str:
    cost, steady = learning_s(r), steady_pace(r)
    return "—" if cost is None or steady is None else f"{cost:.1f} ({steady:.2f})"


def table_row(r: Result) -> list[str]:
    partner = r.requests > 0  # growth rows never talk to a partner
    return [r.scenario, r.tool, f"{r.n:,}", r.r_label, _wall(r), _f(r.ideal_s, ".1f"),
            _ratio(r), _oracle_ratio(r), _learning(r), _f(r.share_429, ".2%"),
            str(r.duplicates) if partner else "—",
            str(r.requests_during_pause) if partner else "—",
            str(r.requests_during_announced_wait) if partner else "—",
            _f(r.peak_rss_mb, ".0f"), "; ".join(r.notes)]


def table(results: Sequence[Result]) -> str:
    return _md(HEADER, [table_row(r) for r in results])


def grouped(results: Sequence[Result]) -> tuple[list[tuple[Scenario, list[Result]]],
                                                  list[Result]]:
    """Matrix scenarios with their rows (in order of appearance), and every other row."""
    groups: dict[str, tuple[Scenario, list[Result]]] = {}
    flat = []
    for r in results:
        sc = r.scenario_spec()
        if sc is not None and sc.matrix:
            groups.setdefault(r.scenario, (sc, []))[1].append(r)
        else:
            flat.append(r)
    return list(groups.values()), flat


def tables(results: Sequence[Result]) -> str:
    groups, flat = grouped(results)
    parts = []
    if groups:
        parts += ["Worst cell per scenario and tool (worst = highest ratio, then highest "
                  "429 share, of each cell's worst run; ratio = wall / (N / R, pauses "
                  "added); vs oracle = wall / the oracle's time, bench/oracle.py):",
                  summary(groups)]
    oracles = oracle_table(results)
    if oracles:
        parts += ["The oracle per cell: the fastest pace with no 429 in a whole run on "
                  "this machine, or where a long cell's whole N was run, the fastest of "
                  "those runs with their 429s honoured (bench/out/oracle.json):", oracles]
    if groups:
        parts += [scenario_section(sc, rows) for sc, rows in groups]
    if flat:
        parts += (["### scenarios with a partner of their own, and growth"] if groups else [])
        parts.append(table(flat))
    return "\n\n".join(parts)


# -- environment, save, load ----------------------------------------------------------------


def environment() -> dict[str, Any]:
    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return "?"

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    dirty = git("status", "--porcelain", "--", "supervisor")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "supervisor_dirty": bool(dirty and dirty != "?"),
            "cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def preamble(env: dict[str, Any], limits: dict[str, Any] | None,
             start: dict[str, Any] | None = None, options: dict[str, Any] | None = None) -> str:
    """Where and on what the table was measured; ``start``: the environment at the start."""
    start = start or env
    commit = start["commit"] + ("" if start["commit"] == env["commit"] else
                                f" at the start, {env['commit']} at the end")
    dirty = start["supervisor_dirty"] or env["supervisor_dirty"]
    lines = [f"commit {commit}" + (" (supervisor/ had uncommitted changes)" if dirty else "")
             + f", {env['cpus']} x {env['cpu']}, Python {env['python']}, {env['date']}"]
    if limits:
        # Every scalar setting but the ceiling, which each scenario sets (see its table).
        shown = {k: v for k, v in limits.items()
                 if k != "rate_per_second" and not isinstance(v, list | dict)}
        lines.append("service limits (config/default.toml + scenario + --set): "
                     + ", ".join(f"{k}={v}" for k, v in shown.items()))
    options = options or {}
    if options.get("quick"):
        lines.append("**QUICK RUN: N and times scaled by 0.2 (a smoke run; not figures to "
                     "report, the targets are not meant for it)**")
    if (options.get("repeat") or 1) > 1:
        lines.append(f"every matrix cell's service run {options['repeat']} times: mean, worst "
                     "run and spread (max - min of the ratio); the ranking is the worst run's")
    if options.get("rate") is not None:
        lines.append(f"matrix scenarios at R = {options['rate']:g}/s over cells "
                     + ", ".join(options.get("cells", [])))
    return "\n".join(lines)


def load_results(path: Path) -> tuple[list[Result], dict[str, Any]]:
    """Results saved by :func:`save` (and the options they were run with)."""
    doc = json.loads(path.read_text())
    rows, meta = (doc, {}) if isinstance(doc, list) else (doc["results"], doc.get("meta", {}))
    names = set(Result.__dataclass_fields__)
    return [Result(**{k: v for k, v in d.items() if k in names}) for d in rows], meta


def save(results: Sequence[Result], stem: str, text: str,
         meta: dict[str, Any] | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.md").write_text(text + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"meta": meta or {}, "results": [r.as_dict() for r in results]}, indent=1,
        default=str))
