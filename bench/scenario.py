"""What a benchmark run is and what it measured: Event, Target, Scenario, Result.

The maths of the table lives here too: the ideal time (N at the partner's true limit,
through its changes and pauses), the ratio, the share of 429s, how long the service took
to follow a change of the limit, and whether a row meets its scenario's target.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from matrix import DEFAULT_CELL, Cell

RATE_GAUGE = "cleanup_limiter_rate_per_second"
Sample = tuple[float, float | None, float | None]  # (s since tick, limiter rate, 429s so far)


@dataclass(frozen=True, slots=True)
class Event:
    """Something the partner does ``at_s`` seconds after the tick (via /_sandbox/control)."""

    at_s: float
    rate_per_second: float | None = None
    pause_s: float | None = None

    def control(self) -> dict[str, float]:
        body: dict[str, float] = {}
        if self.rate_per_second is not None:
            body["rate_per_second"] = self.rate_per_second
        if self.pause_s is not None:
            body["pause_seconds"] = self.pause_s
        return body


@dataclass(frozen=True, slots=True)
class Target:
    """What a row must show; None: not part of this scenario's target."""

    max_ratio: float | None = None
    max_share_429: float | None = None
    max_drop_s: float | None = None  # the rate under the new limit this soon after a drop
    max_recovery_s: float | None = None  # back to >= 90 % this soon after a recovery
    pause_reveals_only: bool = False  # requests in a pause: only those in flight at its start
    min_ops_per_s: float | None = None  # end to end, against an unlimited partner

    def describe(self) -> str:
        parts = []
        if self.max_ratio is not None:
            parts.append(f"ratio ≤ {self.max_ratio:g}")
        if self.max_share_429 is not None:
            parts.append("zero 429" if self.max_share_429 == 0
                         else f"429 share ≤ {self.max_share_429:.1%}".replace(".0%", "%"))
        if self.max_drop_s is not None:
            parts.append(f"under the new limit ≤ {self.max_drop_s:g} s after the drop")
        if self.max_recovery_s is not None:
            parts.append(f"≥ 90% of R ≤ {self.max_recovery_s:g} s after the recovery")
        if self.pause_reveals_only:
            parts.append("no request in a pause beyond those in flight when it began")
        if self.min_ops_per_s is not None:
            parts.append(f"≥ {self.min_ops_per_s:,.0f} operations per second end to end")
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    n: int
    partner_rate: float  # the partner's true limit per second; <= 0: unlimited
    ceiling: float  # the service's configured limits.rate_per_second
    target: Target = Target()
    cell: Cell = DEFAULT_CELL  # the partner's shape; matrix scenarios are run over CELLS
    matrix: bool = False
    # > 1: that many ticks against ONE partner process and ONE service data dir, the
    # service restarted (SIGTERM, same config) between them; the last tick is this
    # scenario's row, each earlier one the row of its ``tick_rows`` entry (a single-tick
    # scenario of its own name, title and target; the peers run that of tick 1, as they
    # keep nothing from one run to the next). An earlier tick without one is only a note.
    ticks: int = 1
    tick_rows: tuple[Scenario, ...] = ()
    quick: bool = False  # scaled down for a smoke run: its figures are not to be reported
    concurrency: int = 8
    events: tuple[Event, ...] = ()
    scrape: bool = False  # record the service's limiter rate every 250 ms
    celery_rate_limit: str | None = None  # default: the ceiling per second
    celery_concurrency: int | None = None
    # Budget for one tool's run before it is stopped and reported as not finished, as a
    # multiple of the ideal plus seconds. The peers' pace is steady (linear projection
    # holds), so they get a tighter one; ``cron_budget`` overrides it for the loop.
    service_budget: tuple[float, float] = (2.5, 15.0)
    peer_budget: tuple[float, float] = (0.5, 8.0)
    cron_budget: tuple[float, float] | None = None
    max_budget_s: float = 150.0
    max_peer_budget_s: float | None = None  # a tighter cap for the peers' runs
    # Service settings this scenario is run with (section, key, value), before --set.
    service_set: tuple[tuple[str, str, Any], ...] = ()
    # "infrai": the service's queue is the Infrai emulator (a process of its own), with
    # ``infrai_latency_ms`` added to every call; "redis", "rabbitmq": a queue of the run's
    # own on this machine's broker. The service alone runs these.
    queue: str = "sqlite"
    infrai_latency_ms: float = 20.0
    # About how the service reads the partner (its header dialects): no peer row.
    service_only: bool = False

    def on(self, cell: Cell) -> Scenario:
        return replace(self, cell=cell, tick_rows=tuple(t.on(cell) for t in self.tick_rows))

    def tick_specs(self) -> list[Scenario | None]:
        """Per tick, the scenario it is reported as (None: not a row; the last: this one)."""
        earlier: list[Scenario | None] = list(self.tick_rows[:self.ticks - 1])
        earlier += [None] * (self.ticks - 1 - len(earlier))
        return [*earlier, self]

    @property
    def row_names(self) -> list[str]:
        """The scenarios whose rows one run of this one gives, in tick order."""
        return [s.name for s in self.tick_specs() if s is not None]

    @property
    def peer_scenario(self) -> Scenario | None:
        """What the peers run for this scenario: itself, or its first tick's row (None:
        a multi-tick scenario without one; the peers keep nothing from a tick to the next)."""
        if self.ticks == 1:
            return self
        first = self.tick_specs()[0]
        return first if first is not None and first.ticks == 1 else None

    @property
    def unlimited(self) -> bool:
        return self.partner_rate <= 0

    @property
    def pauses(self) -> list[tuple[float, float]]:
        return [(e.at_s, e.at_s + e.pause_s) for e in self.events if e.pause_s]

    @property
    def rate_changes(self) -> list[Event]:
        return sorted((e for e in self.events if e.rate_per_second is not None),
                      key=lambda e: e.at_s)

    def limit_at(self, t: float) -> float:
        """The partner's true rate at ``t`` seconds after the tick (0 during a pause)."""
        if any(a <= t < b for a, b in self.pauses):
            return 0.0
        rate = self.partner_rate
        for e in self.rate_changes:
            if e.at_s <= t:
                rate = e.rate_per_second or 0.0
        return rate

    def ideal_s(self) -> float | None:
        """N at the partner's true limit over time: N / R, plus pauses, through changes."""
        if self.unlimited:
            return None
        marks = sorted({0.0, *(e.at_s for e in self.events), *(b for _, b in self.pauses)})
        done = 0.0
        for start, end in zip(marks, [*marks[1:], math.inf], strict=True):
            rate = self.limit_at(start)
            if rate > 0 and done + rate * (end - start) >= self.n:
                return start + (self.n - done) / rate
            done += rate * (end - start) if rate > 0 else 0.0
        raise AssertionError("unreachable: the last segment is unbounded")

    def at_rate(self, rate: float) -> Scenario:
        """The same scenario for a partner whose limit is ``rate`` where this one says R:
        every rate (R and each change) scaled by rate / R, the pauses and times unchanged."""
        if self.unlimited:
            return self
        f = rate / self.partner_rate
        return replace(self, partner_rate=rate, events=tuple(
            replace(e, rate_per_second=None if e.rate_per_second is None
                    else e.rate_per_second * f) for e in self.events))

    def oracle_s(self, rate: float) -> float | None:
        """What a client pacing at ``rate`` (the oracle's rate for R, on this machine)
        needs: the ideal with every rate scaled by rate / R, pauses added unchanged."""
        return self.at_rate(rate).ideal_s() if rate > 0 else None

    def budget_s(self, tool: str) -> float:
        ideal = self.ideal_s() or 10.0
        factor, extra = (self.service_budget if tool == "service" else
                         self.cron_budget if tool == "cron" and self.cron_budget else
                         self.peer_budget)
        cap = self.max_budget_s
        if tool != "service" and self.max_peer_budget_s is not None:
            cap = min(cap, self.max_peer_budget_s)
        return min(cap, ideal * factor + extra)

    def sandbox_args(self) -> list[str]:
        # Every tick gets recipients of its own: tick k lists IDs k*N+1 .. (k+1)*N.
        # Behind a gateway the simulator does not limit: the gateway is the limit.
        rate = 0.0 if self.cell.gateway else self.partner_rate
        return ["--recipients", str(self.n * self.ticks), "--rate", f"{rate:g}",
                *self.cell.sandbox_args()]

    def r_label(self) -> str:
        if self.unlimited:
            return "∞"
        changes = [e.rate_per_second for e in self.rate_changes]
        if changes:
            return "→".join(f"{r:g}" for r in [self.partner_rate, *changes])
        if self.cell.window == "minute" and not self.matrix:
            return f"{self.partner_rate * 60:g}/min"
        return f"{self.partner_rate:g}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scenario:
        d = dict(d)
        d["cell"] = Cell(**d["cell"]) if isinstance(d.get("cell"), dict) else DEFAULT_CELL
        d["target"] = Target(**(d.get("target") or {}))
        d["events"] = tuple(Event(**e) for e in d.get("events", ()))
        for key in ("service_budget", "peer_budget", "cron_budget"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        d["service_set"] = tuple(tuple(x) for x in d.get("service_set", ()))
        d["tick_rows"] = tuple(cls.from_dict(t) for t in d.get("tick_rows", ())
                               if isinstance(t, dict))
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class Result:
    scenario: str
    tool: str
    n: int
    r_label: str
    ideal_s: float | None
    wall_s: float | None = None  # None when it did not finish within its budget
    elapsed_s: float = 0.0  # time measured (the budget when it did not finish)
    completed: int = 0
    failed: int = 0
    requests: int = 0
    rate_limited: int = 0
    duplicates: int = 0
    requests_during_pause: int = 0
    requests_during_announced_wait: int = 0
    quota_limited: int = 0
    peak_rss_mb: float | None = None
    cell: str = ""  # the partner cell ("" for growth)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.wall_s is not None

    @property
    def errored(self) -> bool:
        return any(n.startswith("error") for n in self.notes)

    @property
    def projected_s(self) -> float | None:
        """Linear projection to N when the run was cut off at its budget."""
        if self.finished:
            return self.wall_s
        if self.completed <= 0:
            return None
        return self.elapsed_s * self.n / self.completed

    @property
    def ratio(self) -> float | None:
        t = self.projected_s
        if t is None or not self.ideal_s:
            return None
        return t / self.ideal_s

    @property
    def share_429(self) -> float | None:
        return self.rate_limited / self.requests if self.requests else None

    @property
    def oracle_ratio(self) -> float | None:
        """Wall (or its projection) against the oracle's time for this scenario and cell:
        how far from what this machine can do without a 429 (bench/oracle.py)."""
        t = self.projected_s
        oracle = self.extra.get("oracle") or {}
        oracle_s = oracle.get("s")
        if t is None or not oracle_s:
            return None
        return float(t / oracle_s)

    @property
    def oracle_rate(self) -> float | None:
        rate = (self.extra.get("oracle") or {}).get("rate")
        return None if rate is None else float(rate)

    def scenario_spec(self) -> Scenario | None:
        """The scenario this row was measured with, as saved in it."""
        spec = self.extra.get("scenario")
        return Scenario.from_dict(spec) if isinstance(spec, dict) else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(finished=self.finished, ratio=self.ratio, share_429=self.share_429,
                 projected_s=self.projected_s, oracle_ratio=self.oracle_ratio)
        return d


def new_result(sc: Scenario, tool: str) -> Result:
    r = Result(sc.name, tool, sc.n, sc.r_label(), sc.ideal_s(), cell=sc.cell.name)
    r.extra["scenario"] = sc.as_dict()
    return r


# -- following a change of the limit ----------------------------------------------------


def _trailing_counts(times: Sequence[float], grid: Sequence[float]) -> list[int]:
    """Executions in the second before each grid point, from sorted ``times``."""
    return [bisect.bisect_right(times, t) - bisect.bisect_right(times, t - 1.0) for t in grid]


LEARNT_AFTER_S = 60.0  # a long run's limit is learnt by then (the first probes' span)
TAIL = 0.01  # the last deletions, retried stragglers among them, are not the held pace


def steady_pace(r: Result, after_s: float = LEARNT_AFTER_S) -> float | None:
    """Deletions per second the partner executed from ``after_s`` until all but the
    last ``TAIL`` of them; None for a scenario that changes the limit, or unless the run
    went on for at least four times as long after ``after_s``."""
    spec = r.scenario_spec()
    if spec is not None and spec.events:
        return None
    times = sorted(r.extra.get("executions_s") or ())
    later = times[bisect.bisect_left(times, after_s):]
    later = later[:max(2, len(later) - int(TAIL * len(times)))]
    if len(later) < 2 or later[-1] - after_s < 4.0 * after_s:
        return None
    return (len(later) - 1) / (later[-1] - later[0])


def learning_s(r: Result, after_s: float = LEARNT_AFTER_S) -> float | None:
    """What finding the limit cost a long run, in seconds: its wall less N at the pace it
    held once learnt (``steady_pace``). It includes the start (the scan's first page, the
    first request) and the end (the last answers, the run noticed done), about a second;
    the rest of the gap to N / R is the held pace's own."""
    steady = steady_pace(r, after_s)
    if steady is None or r.wall_s is None:
        return None
    return r.wall_s - r.n / steady


def follow_delays(sc: Scenario, samples: Sequence[Sample],
                  executions_s: Sequence[float]) -> list[dict[str, Any]]:
    """For each change of the partner's rate: how long until the service followed it.

    A drop is followed once the rate is under the new limit, a recovery once it is back
    to 90 % of it; each measured twice: on the scraped ``cleanup_limiter_rate_per_second``
    (refreshed about once a second by the service's monitor) and on the deletions the
    partner executed in the trailing second (from its log, stepped every 50 ms). None:
    not within the run.
    """
    times = sorted(executions_s)
    end = max([*(t for t, _, _ in samples), *times[-1:], 0.0])
    out = []
    previous = sc.partner_rate
    for event in sc.rate_changes:
        new = float(event.rate_per_second or 0.0)
        drop = new < previous
        gauge = [(t, rate) for t, rate, _ in samples if rate is not None and t >= event.at_s]
        grid = [event.at_s + 0.05 * k for k in range(1, int((end - event.at_s) / 0.05) + 1)]
        counts = _trailing_counts(times, grid)
        if drop:
            g = next((t for t, rate in gauge if rate <= new + 1e-9), None)
            x = next((t for t, c in zip(grid, counts, strict=True) if c <= math.ceil(new)), None)
        else:
            g = next((t for t, rate in gauge if rate >= 0.9 * new), None)
            x = next((t for t, c in zip(grid, counts, strict=True) if c >= 0.9 * new), None)
        out.append({"at_s": event.at_s, "from": previous, "to": new,
                    "kind": "drop" if drop else "recovery",
                    "gauge_s": None if g is None else g - event.at_s,
                    "executions_s": None if x is None else x - event.at_s,
                    "gauge_seen": bool(gauge),
                    "gauge_end": gauge[-1][1] if gauge else None})
        previous = new
    return out


def follow_notes(follow: Sequence[dict[str, Any]]) -> list[str]:
    def fmt(v: float | None) -> str:
        return "not within the run" if v is None else f"{v:.1f} s"

    notes = []
    for f in follow:
        what = (f"under {f['to']:g}/s" if f["kind"] == "drop" else f"≥{0.9 * f['to']:g}/s")
        gauge = f"gauge {fmt(f['gauge_s'])}, " if f["gauge_seen"] else ""
        notes.append(f"limit {f['from']:g}→{f['to']:g} at {f['at_s']:g} s: {what} "
                     f"({gauge}executions {fmt(f['executions_s'])})")
    return notes


def follow_delay(r: Result, kind: str) -> dict[str, Any] | None:
    """The first change of ``kind`` ("drop", "recovery") and how it was followed."""
    return next((f for f in r.extra.get("follow", []) if f["kind"] == kind), None)


def gauge_applies(r: Result) -> bool:
    """The service publishes the limiter's gauge; a peer has none to scrape."""
    return r.tool == "service"


# -- targets ------------------------------------------------------------------------------


def pause_excess(r: Result, sc: Scenario) -> int:
    """Requests during pauses beyond those that reveal them (one per request in flight)."""
    in_flight = int(r.extra.get("in_flight", sc.concurrency))
    return max(0, r.requests_during_pause - in_flight * len(sc.pauses))


def misses(r: Result, sc: Scenario) -> list[str]:
    """Why ``r`` misses its scenario's target (empty: it meets it)."""
    t = sc.target
    out = []
    if r.errored:
        return ["error"]
    if t.max_ratio is not None and (r.ratio is None or r.ratio > t.max_ratio + 1e-9):
        out.append("ratio" if r.ratio is None else f"ratio {r.ratio:.3f} > {t.max_ratio:g}")
    if t.max_share_429 is not None and r.share_429 is not None \
            and r.share_429 > t.max_share_429 + 1e-12:
        out.append(f"429 share {r.share_429:.2%} > {t.max_share_429:.1%}")
    for kind, limit in (("drop", t.max_drop_s), ("recovery", t.max_recovery_s)):
        f = follow_delay(r, kind)
        if limit is None or f is None:
            continue
        measured = ["executions"]
        if gauge_applies(r):
            measured.insert(0, "gauge")
            if not f["gauge_seen"]:
                out.append(f"{kind}: gauge {RATE_GAUGE} not scraped")
                measured.remove("gauge")
        for label in measured:
            v = f[f"{label}_s"]
            if v is None or v > limit:
                out.append(f"{kind} ({label}) " + ("not seen" if v is None else f"{v:.1f} s"))
    if t.pause_reveals_only and (excess := pause_excess(r, sc)):
        out.append(f"{excess} requests in pauses beyond the in-flight ones")
    if t.min_ops_per_s is not None and r.projected_s:
        ops = r.n / r.projected_s
        if ops < t.min_ops_per_s:
            out.append(f"{ops:,.0f} ops/s < {t.min_ops_per_s:,.0f}")
    return out
