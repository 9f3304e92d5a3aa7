"""The limiter's rate over time against the partner's true limit, with 429s marked.

One panel per scenario whose service runs recorded samples (hidden-limit, i.e. tick 1 of
the hidden-limit-memory runs, and changing-limit), drawn for the scenario's WORST cell
(highest ratio, then 429 share; matrix.worst): the ``cleanup_limiter_rate_per_second``
gauge scraped every 250 ms, the partner's true limit, the configured ceiling, the
deletions per second the partner actually executed, and a mark wherever 429s were
answered between two scrapes.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

from matrix import worst
from scenario import Result

PICTURED = ("hidden-limit", "changing-limit")


def plot_limiter(results: Sequence[Result], path: Path,
                 names: Sequence[str] = PICTURED) -> Path | None:
    """One panel per scenario of ``names``: its worst service cell that recorded samples."""
    from scenarios import BY_NAME

    runs = []
    for name in dict.fromkeys(names):
        rows = [r for r in results if r.tool == "service" and r.scenario == name
                and any(rate is not None for _, rate, _ in r.extra.get("samples", []))]
        bad = worst(rows)
        if bad is not None:
            runs.append(bad)
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 4.4 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs, strict=True):
        sc = r.scenario_spec() or BY_NAME[r.scenario]
        samples = [(t, rate, c) for t, rate, c in r.extra["samples"] if rate is not None]
        end = max(t for t, _, _ in samples)
        ts = [t for t, _, _ in samples]
        ax.step(ts, [rate for _, rate, _ in samples], where="post", color="tab:blue",
                lw=2, label="limiter rate (gauge, scraped every 250 ms)")
        grid = [i * 0.05 for i in range(int(end / 0.05) + 1)]
        ax.step(grid, [sc.limit_at(t) for t in grid], where="post", color="black", lw=1.2,
                label="partner's true limit")
        ax.axhline(sc.ceiling, color="grey", ls="--", lw=1, label="configured ceiling")
        for a, b in sc.pauses:
            ax.axvspan(a, b, color="orange", alpha=0.2)
        per_second = Counter(math.floor(t) for t in r.extra.get("executions_s", []) if t >= 0)
        if per_second:
            secs = range(int(end) + 1)
            ax.plot([s + 0.5 for s in secs], [per_second.get(s, 0) for s in secs],
                    color="tab:green", lw=1, alpha=0.8, marker=".",
                    label="deletions executed per second (partner log)")
        throttled = [(t1, c1 - c0, rate) for (_, _, c0), (t1, rate, c1)
                     in itertools.pairwise(samples) if c1 > c0]
        if throttled:
            ax.scatter([t for t, _, _ in throttled], [rate for _, _, rate in throttled],
                       marker="x", color="red", s=[20 + 4 * n for _, n, _ in throttled],
                       zorder=5, label="429s answered (size ∝ count per 250 ms)")
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "—"
        share = f"{r.share_429:.1%}" if r.share_429 is not None else "—"
        tick = (f", tick {r.extra.get('tick')} of {r.extra['run']}"
                if r.extra.get("run") not in (None, r.scenario) else "")
        ax.set_title(f"{sc.title}{tick}, worst cell {r.cell} ({sc.cell.describe()}): N={r.n:,}, "
                     f"wall {r.elapsed_s:.1f} s, ratio {ratio}, 429 share {share}", fontsize=9)
        ax.set_xlabel("seconds since the tick")
        ax.set_ylabel("requests per second")
        ax.set_xlim(0, end)
        ax.set_ylim(0, sc.ceiling * 1.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3,
                  frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
