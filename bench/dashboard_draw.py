"""Grafana's panels drawn with matplotlib, for bench/dashboard_png.py.

Each panel sits where its gridPos puts it on Grafana's 24-column grid, in Grafana's dark
theme: a timeseries as lines (its fillOpacity, stacking and dashed thresholds honoured,
the legend from legendFormat with the calcs the panel asks for), a stat or gauge as its
last value in the panel's unit and threshold colour over its sparkline, a state timeline
as bars where a series holds, a table as a table, a row as a section heading. Nothing is
computed here that Prometheus did not answer: a target without a series says so in its
panel's legend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

WIDTH_PX = 1600
DPI = 100
UNIT_PX = 30  # one grid row (Grafana: 30 px and an 8 px margin)
GAP_PX = 8
SIDE_PX = 12
HEADER_PX = 104
FOOTER_PX = 46
BG, PANEL, BORDER = "#111217", "#181b1f", "#2c3235"
TEXT, DIM, GRID = "#d8d9e3", "#9fa1b3", "#2f343b"
# Grafana's palette-classic, in its order.
PALETTE = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A6",
           "#705DA0", "#508642", "#CCA300", "#447EBC", "#C15C17")
NAMED = {"green": "#73BF69", "orange": "#FF9830", "red": "#F2495C", "yellow": "#FADE2A",
         "blue": "#5794F2", "purple": "#B877D9", "text": TEXT, "transparent": PANEL}
CALC_NAMES = {"lastNotNull": "Last *", "last": "Last", "max": "Max", "min": "Min",
              "mean": "Mean", "sum": "Total"}
TITLE_PT, TICK_PT, LEGEND_PT = 10.5, 7.5, 7.5
LEGEND_LINE_PX = 15


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]  # (Unix s, value); NaN where Prometheus said so

    def finite(self) -> list[tuple[float, float]]:
        return [(t, v) for t, v in self.points if math.isfinite(v)]

    def last(self) -> float | None:
        found = self.finite()
        return found[-1][1] if found else None

    def calc(self, name: str) -> float | None:
        values = [v for _, v in self.finite()]
        if not values:
            return None
        if name in ("lastNotNull", "last"):
            return values[-1]
        return {"max": max, "min": min, "sum": sum}.get(name, lambda v: sum(v) / len(v))(values)


@dataclass
class PanelData:
    panel: dict[str, Any]
    series: list[Series] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # targets that returned no series

    @property
    def title(self) -> str:
        return str(self.panel.get("title", ""))

    @property
    def kind(self) -> str:
        return str(self.panel["type"])

    def unit(self, label: str | None = None) -> str:
        fc = self.panel.get("fieldConfig") or {}
        unit = str((fc.get("defaults") or {}).get("unit", "short"))
        for override in fc.get("overrides", []):
            matcher = override.get("matcher", {})
            if matcher.get("id") == "byName" and matcher.get("options") == label:
                for prop in override.get("properties", []):
                    if prop.get("id") == "unit":
                        unit = str(prop["value"])
        return unit

    def defaults(self) -> dict[str, Any]:
        return dict((self.panel.get("fieldConfig") or {}).get("defaults") or {})


# -- units ------------------------------------------------------------------------------


def _num(v: float) -> str:
    a = abs(v)
    if a >= 100 or abs(v - round(v)) < 1e-9 * max(1.0, a):
        return f"{v:.0f}"
    return f"{v:.1f}" if a >= 10 else f"{v:.2f}".rstrip("0").rstrip(".")


def fmt(v: float | None, unit: str) -> str:
    """A value as Grafana shows it in ``unit`` (s, reqps, short, percentunit, none)."""
    if v is None or not math.isfinite(v):
        return "—"
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1:
            return f"{_num(v * 1000)} ms"
        for size, name in ((86400, "day"), (3600, "hour"), (60, "min")):
            if a >= size:
                return f"{_num(v / size)} {name}"
        return f"{_num(v)} s"
    if unit == "reqps":
        return f"{_num(v)} req/s"
    if unit == "percentunit":
        return f"{_num(v * 100)}%"
    for size, name in ((1e9, " Bil"), (1e6, " Mil"), (1e3, " K")):
        if abs(v) >= size:
            return f"{_num(v / size)}{name}"
    return _num(v)


def threshold_color(defaults: dict[str, Any], v: float | None) -> str:
    steps = (defaults.get("thresholds") or {}).get("steps") or [{"color": "green", "value": None}]
    color = steps[0]["color"]
    for step in steps:
        if step.get("value") is None or (v is not None and v >= step["value"]):
            color = step["color"]
    return NAMED.get(color, color)


def value_color(data: PanelData, v: float | None) -> str:
    color = data.defaults().get("color") or {"mode": "thresholds"}
    if color.get("mode") == "fixed":
        fixed = color.get("fixedColor", "text")
        return NAMED.get(fixed, fixed)
    return threshold_color(data.defaults(), v)


def plain(s: str) -> str:
    """Text as written: two $ in a label ($instance, $__rate_interval) are not mathtext."""
    return s.replace("$", r"\$")


# -- the canvas: pixels from the top left -----------------------------------------------


class Canvas:
    def __init__(self, height_px: int) -> None:
        self.h = height_px
        self.fig: Figure = plt.figure(figsize=(WIDTH_PX / DPI, height_px / DPI), dpi=DPI,
                                      facecolor=BG)
        self.renderer = self.fig.canvas.get_renderer()  # type: ignore[attr-defined]

    def rect(self, x: float, y: float, w: float, h: float) -> list[float]:
        return [x / WIDTH_PX, 1 - (y + h) / self.h, w / WIDTH_PX, h / self.h]

    def axes(self, x: float, y: float, w: float, h: float) -> Axes:
        ax = self.fig.add_axes(self.rect(x, y, w, h), facecolor=PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.tick_params(colors=DIM, labelsize=TICK_PT, length=0, pad=3)
        return ax

    def text(self, x: float, y: float, s: str, **kw: Any) -> Any:
        kw.setdefault("color", TEXT)
        kw.setdefault("va", "top")
        return self.fig.text(x / WIDTH_PX, 1 - y / self.h, plain(s), **kw)

    def width(self, s: str, size: float, **kw: Any) -> float:
        t = self.fig.text(0, 0, plain(s), fontsize=size, **kw)
        w = float(t.get_window_extent(self.renderer).width)
        t.remove()
        return w

    def frame(self, x: float, y: float, w: float, h: float, title: str) -> None:
        self.fig.patches.append(Rectangle(
            (x / WIDTH_PX, 1 - (y + h) / self.h), w / WIDTH_PX, h / self.h,
            transform=self.fig.transFigure, facecolor=PANEL, edgecolor=BORDER, lw=0.8,
            zorder=-10))  # under the panel's axes, which the figure draws at zorder 0
        self.text(x + 10, y + 7, title, fontsize=TITLE_PT, fontweight="bold")


# -- panels -----------------------------------------------------------------------------


def legend_entries(data: PanelData, colors: Sequence[str]) -> list[tuple[str | None, str]]:
    legend = (data.panel.get("options") or {}).get("legend") or {}
    calcs = legend.get("calcs") or []
    out: list[tuple[str | None, str]] = []
    for s, color in zip(data.series, colors, strict=True):
        numbers = "  ".join(f"{CALC_NAMES.get(c, c)}: {fmt(s.calc(c), data.unit(s.label))}"
                            for c in calcs)
        out.append((color, f"{s.label}  {numbers}".strip()))
    out += [(None, f"{label or 'query'}: no series") for label in data.missing]
    return out


def flow(c: Canvas, entries: list[tuple[str | None, str]],
         width: float) -> list[list[tuple[str | None, str, float]]]:
    """Legend entries in lines no wider than ``width``, as Grafana's list legend wraps."""
    lines: list[list[tuple[str | None, str, float]]] = [[]]
    used = 0.0
    for color, label in entries:
        w = c.width(label, LEGEND_PT) + 22
        if lines[-1] and used + w > width:
            lines.append([])
            used = 0.0
        lines[-1].append((color, label, w))
        used += w + 10
    return [line for line in lines if line]


def draw_legend(c: Canvas, lines: list[list[tuple[str | None, str, float]]], x: float,
                y: float) -> None:
    for i, line in enumerate(lines):
        cx, cy = x, y + i * LEGEND_LINE_PX
        for color, label, w in line:
            if color is None:
                c.text(cx, cy, label, fontsize=LEGEND_PT, color=DIM, style="italic")
            else:
                c.fig.patches.append(Rectangle(
                    ((cx) / WIDTH_PX, 1 - (cy + 8) / c.h), 14 / WIDTH_PX, 3 / c.h,
                    transform=c.fig.transFigure, facecolor=color, edgecolor="none"))
                c.text(cx + 19, cy, label, fontsize=LEGEND_PT, color=TEXT)
            cx += w + 10


def y_limits(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if lo == hi:
        return (0.0, 1.0) if lo == 0 else (min(0.0, lo), max(0.0, hi) * 1.25)
    if lo >= 0 and lo <= 0.3 * hi:
        lo = 0.0
    pad = (hi - lo) * 0.06
    return (lo if lo == 0 else lo - pad), hi + pad


# Steps a duration axis ticks at once it spans a minute: whole minutes and hours, as
# Grafana's, not 1.33 min.
DURATION_STEPS = (15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def y_locator(unit: str, lo: float, hi: float) -> Any:
    if unit == "s" and hi - lo > 60:
        step = next((s for s in DURATION_STEPS if (hi - lo) / s <= 5), DURATION_STEPS[-1])
        return MultipleLocator(step)
    return MaxNLocator(nbins=5)


def time_axis(ax: Axes, start: float, end: float, origin: float) -> None:
    ax.set_xlim(start - origin, end - origin)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f} s"))
    ax.grid(color=GRID, lw=0.6)
    ax.set_axisbelow(True)


def timeseries(c: Canvas, box: tuple[float, float, float, float], data: PanelData,
               start: float, end: float, origin: float) -> None:
    x, y, w, h = box
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(data.series))]
    lines = flow(c, legend_entries(data, colors), w - 20)
    legend_h = len(lines) * LEGEND_LINE_PX
    ax = c.axes(x + 62, y + 30, w - 72, h - 30 - 22 - legend_h - 6)
    time_axis(ax, start, end, origin)
    custom = data.defaults().get("custom") or {}
    alpha = float(custom.get("fillOpacity", 0)) / 100
    lw = max(1.0, float(custom.get("lineWidth", 1))) * 1.1
    stacked = (custom.get("stacking") or {}).get("mode") in ("normal", "percent")
    values: list[float] = []
    if stacked and data.series:
        grid = sorted({t for s in data.series for t, _ in s.points})
        base = [0.0] * len(grid)
        for s, color in zip(data.series, colors, strict=True):
            at = dict(s.finite())
            top = [b + at.get(t, 0.0) for b, t in zip(base, grid, strict=True)]
            xs = [t - origin for t in grid]
            ax.fill_between(xs, base, top, color=color, alpha=alpha, lw=0)
            ax.plot(xs, top, color=color, lw=lw)
            base = top
        values = [*base, 0.0]
    else:
        # The first target on top (Grafana draws it under the rest): it is the panel's
        # subject, and a later one equal to it (the learnt limit) would hide it.
        for i, (s, color) in enumerate(zip(data.series, colors, strict=True)):
            pts = s.points
            xs = [t - origin for t, _ in pts]
            ys = [v if math.isfinite(v) else math.nan for _, v in pts]
            ax.plot(xs, ys, color=color, lw=lw, zorder=3 + len(data.series) - i)
            values += [v for v in ys if math.isfinite(v)]
    lo, hi = y_limits(values)
    ax.set_ylim(lo, hi)
    if alpha > 0 and not stacked:
        for s, color in zip(data.series, colors, strict=True):
            xs = [t - origin for t, _ in s.points]
            ys = [v if math.isfinite(v) else math.nan for _, v in s.points]
            ax.fill_between(xs, ys, lo, color=color, alpha=alpha, lw=0)
    if (custom.get("thresholdsStyle") or {}).get("mode") in ("dashed", "line"):
        for step in (data.defaults().get("thresholds") or {}).get("steps", []):
            if step.get("value") is not None and lo <= step["value"] <= hi:
                ax.axhline(step["value"], color=NAMED.get(step["color"], step["color"]),
                           ls="--", lw=0.9)
    unit = data.unit()
    ax.yaxis.set_major_locator(y_locator(unit, lo, hi))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v, unit)))
    if not data.series:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center",
                color=DIM, fontsize=11)
    draw_legend(c, lines, x + 10, y + h - legend_h - 5)


def stat(c: Canvas, box: tuple[float, float, float, float], data: PanelData) -> None:
    x, y, w, h = box
    options = data.panel.get("options") or {}
    cells = data.series or [Series("No data", [])]
    n = len(cells)
    across = w >= h  # Grafana's auto orientation
    top = y + 30
    body_h = h - 36
    cell_w, cell_h = (w / n, body_h) if across else (w, body_h / n)
    named = options.get("textMode") in ("value_and_name", "name") or (
        options.get("textMode", "auto") == "auto" and n > 1)
    for i, s in enumerate(cells):
        cx, cy = (x + i * cell_w, top) if across else (x, top + i * cell_h)
        v = s.last()
        color = value_color(data, v) if data.series else DIM
        pts = s.finite()
        spark = options.get("graphMode", "area") == "area" and len(pts) > 1
        if spark:
            ax = c.axes(cx + 6, cy + cell_h * 0.55, cell_w - 12, cell_h * 0.45 - 4)
            ax.set_axis_off()
            xs, ys = [t for t, _ in pts], [v for _, v in pts]
            lo, hi = y_limits(ys)
            ax.set_ylim(lo, hi)
            ax.set_xlim(xs[0], xs[-1])
            ax.fill_between(xs, ys, lo, color=color, alpha=0.18, lw=0)
            ax.plot(xs, ys, color=color, lw=1.1)
        text = fmt(v, data.unit(s.label)) if data.series else "No data"
        px = min(cell_h * (0.34 if named else 0.42), (cell_w - 20) / max(3, len(text)) * 1.6)
        mid = cy + cell_h * ((0.36 if named else 0.3) if spark else 0.5)
        if named:
            c.text(cx + cell_w / 2, mid - px * 0.75, s.label, fontsize=9, ha="center",
                   va="bottom", color=DIM)
        c.text(cx + cell_w / 2, mid, text, fontsize=px * 72 / DPI, fontweight="bold",
               ha="center", va="center", color=color)


def state_timeline(c: Canvas, box: tuple[float, float, float, float], data: PanelData,
                   start: float, end: float, origin: float) -> None:
    x, y, w, h = box
    rows = sorted(data.series, key=lambda s: s.label)
    label_w = max([c.width(s.label, LEGEND_PT) for s in rows] + [40]) + 12
    missing = [(None, f"{m or 'query'}: no series") for m in data.missing]
    lines = flow(c, missing, w - 20) if missing else []
    ax = c.axes(x + 10 + label_w, y + 30, w - 20 - label_w,
                h - 30 - 22 - len(lines) * LEGEND_LINE_PX - 4)
    time_axis(ax, start, end, origin)
    ax.grid(axis="y", visible=False)
    row_h = float((data.panel.get("options") or {}).get("rowHeight", 0.8))
    for i, s in enumerate(rows):
        for a, b, v in runs(s, origin):
            ax.broken_barh([(a, b - a)], (i - row_h / 2, row_h),
                           color=threshold_color(data.defaults(), v), alpha=0.85)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [s.label for s in rows], fontsize=LEGEND_PT, color=TEXT)
    if not rows:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", color=DIM)
    draw_legend(c, lines, x + 10, y + h - len(lines) * LEGEND_LINE_PX - 5)


def runs(s: Series, origin: float, step: float = 1.0) -> list[tuple[float, float, float]]:
    """Stretches of one value (Grafana's mergeValues), a gap ending a stretch."""
    out: list[tuple[float, float, float]] = []
    for t, v in s.finite():
        t -= origin
        if out and out[-1][2] == v and t - out[-1][1] <= step * 1.5:
            out[-1] = (out[-1][0], t + step, v)
        else:
            out.append((t, t + step, v))
    return out


def table(c: Canvas, box: tuple[float, float, float, float], data: PanelData) -> None:
    x, y, w, h = box
    ax = c.axes(x + 10, y + 30, w - 20, h - 38)
    ax.set_axis_off()
    rows = [[s.label, fmt(s.last(), data.unit(s.label))] for s in data.series] or [["No data", ""]]
    tab = ax.table(cellText=rows, colLabels=["series", "last"], loc="upper center",
                   cellLoc="left", colWidths=[0.75, 0.25])
    tab.auto_set_font_size(False)
    tab.set_fontsize(LEGEND_PT)
    for cell in tab.get_celld().values():
        cell.set_facecolor(PANEL)
        cell.set_edgecolor(BORDER)
        cell.get_text().set_color(TEXT)


# -- the dashboard ----------------------------------------------------------------------


def draw_dashboard(panels: Sequence[PanelData], path: Path, *, title: str, subtitle: str,
                   footer: str, start: float, end: float, origin: float) -> Path:
    bottom = max(p.panel["gridPos"]["y"] + p.panel["gridPos"]["h"] for p in panels)
    height = HEADER_PX + bottom * UNIT_PX + FOOTER_PX
    c = Canvas(height)
    c.text(SIDE_PX, 12, title, fontsize=15, fontweight="bold")
    c.text(SIDE_PX + c.width(title, 15, fontweight="bold") + 14, 17,
           "time axis: seconds since the run opened (Grafana would show the clock); "
           "$instance = All, $__rate_interval = 4 s, 1 s steps; a stat shows the range's "
           "last value (the run is over) over its sparkline", fontsize=8.5, color=DIM)
    lines = "\n".join(wrap(c, line, 8.5, WIDTH_PX - 2 * SIDE_PX) for line in subtitle.split("\n"))
    c.text(SIDE_PX, 40, lines, fontsize=8.5, color=DIM, linespacing=1.35)
    col = (WIDTH_PX - 2 * SIDE_PX) / 24
    for data in panels:
        g = data.panel["gridPos"]
        px, py = SIDE_PX + g["x"] * col, HEADER_PX + g["y"] * UNIT_PX
        pw, ph = g["w"] * col, g["h"] * UNIT_PX
        if data.kind == "row":
            mark = "▸ " if data.panel.get("collapsed") else ""
            c.text(px + 2, py + 6, mark + data.title, fontsize=12, fontweight="bold")
            c.fig.add_artist(plt.Line2D([px / WIDTH_PX, (px + pw) / WIDTH_PX],
                                        [1 - (py + ph) / height] * 2, color=BORDER, lw=0.8))
            continue
        box = (px + GAP_PX / 2, py + GAP_PX / 2, pw - GAP_PX, ph - GAP_PX)
        c.frame(*box, data.title)
        if data.kind == "timeseries":
            timeseries(c, box, data, start, end, origin)
        elif data.kind in ("stat", "gauge"):
            stat(c, box, data)
        elif data.kind == "state-timeline":
            state_timeline(c, box, data, start, end, origin)
        elif data.kind == "table":
            table(c, box, data)
        else:
            c.text(box[0] + box[2] / 2, box[1] + box[3] / 2, f"({data.kind} panel: not drawn)",
                   ha="center", color=DIM, fontsize=9)
    c.text(SIDE_PX, height - FOOTER_PX + 12, wrap(c, footer, 8.5, WIDTH_PX - 2 * SIDE_PX),
           fontsize=8.5, color=DIM, linespacing=1.35)
    path.parent.mkdir(parents=True, exist_ok=True)
    c.fig.savefig(path, dpi=DPI, facecolor=BG)
    plt.close(c.fig)
    return path


def wrap(c: Canvas, text: str, size: float, width: float) -> str:
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}".strip()
        if line and c.width(trial, size) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return "\n".join([*lines, line])


def summary_line(data: PanelData) -> str:
    """Title, number of series and each one's last value; empty for a row."""
    if data.kind == "row":
        return ""
    lasts = ", ".join(f"{s.label or '(no name)'}={fmt(s.last(), data.unit(s.label))}"
                      for s in data.series)
    gone = f"; no series for: {', '.join(data.missing)}" if data.missing else ""
    return f"{data.title} [{data.kind}]: {len(data.series)} series; last: {lasts or '—'}{gone}"
