"""K runs of one cell (``run.py --repeat K``): their mean, their worst, their spread.

Every run is a row of its own in results.json (``extra.repeat`` = 1..K); the tables show
one line per cell and tool: the mean ratio (against N / R and against the oracle), the
worst run's ratio and figures, and the spread (max - min of the ratio). The worst and best
cell are ranked on each cell's worst run, so a cell is as good as its worst run.
Rows saved before ``--repeat`` existed are one run each.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from matrix import best, worst
from scenario import Result


@dataclass(frozen=True, slots=True)
class Runs:
    """The runs of one scenario by one tool on one cell."""

    rows: tuple[Result, ...]

    @property
    def worst(self) -> Result:
        w = worst(self.rows)
        assert w is not None  # never empty
        return w

    @property
    def count(self) -> int:
        return len(self.rows)

    def _ratios(self) -> list[float]:
        return [r.ratio for r in self.rows if r.ratio is not None]

    def _oracle_ratios(self) -> list[float]:
        return [r.oracle_ratio for r in self.rows if r.oracle_ratio is not None]

    @property
    def mean_ratio(self) -> float | None:
        ratios = self._ratios()
        return statistics.fmean(ratios) if ratios else None

    @property
    def mean_oracle_ratio(self) -> float | None:
        ratios = self._oracle_ratios()
        return statistics.fmean(ratios) if ratios else None

    @property
    def spread(self) -> float | None:
        """max - min of the ratio over the runs with one; None with fewer than two."""
        ratios = self._ratios()
        return max(ratios) - min(ratios) if len(ratios) > 1 else None


def by_cell(rows: Iterable[Result]) -> list[Runs]:
    """Rows grouped by (tool, cell), in order of first appearance."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in rows:
        groups.setdefault((r.tool, r.cell), []).append(r)
    return [Runs(tuple(g)) for g in groups.values()]


def worst_runs(rows: Iterable[Result]) -> list[Result]:
    """Each cell's worst run (per tool): what the worst/best ranking compares."""
    return [g.worst for g in by_cell(rows)]


def worst_cell(rows: Sequence[Result]) -> Result | None:
    return worst(worst_runs(rows))


def best_cell(rows: Sequence[Result]) -> Result | None:
    """The cell whose worst run is the best of the worst runs."""
    return best(worst_runs(rows))


def runs_of(rows: Sequence[Result], of: Result) -> Runs:
    """The runs of ``of``'s cell and tool among ``rows``."""
    return Runs(tuple(r for r in rows if r.tool == of.tool and r.cell == of.cell))
